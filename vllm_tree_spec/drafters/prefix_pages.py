"""The EAGLE heads' committed KV by content: what a prefix-cache hit restores instead of recomputing.

With vLLM's prefix caching a request starts with its first N prompt tokens already in the target's
cache (N a multiple of the cache's block size), and the target computes rows N.. only. The head's entry
t = (x_{t+1}, g_t) needs the target's features g_t, so entries 0..N-1 cannot be recomputed. vLLM's
linear EAGLE keeps the head's KV in the same paged pool, so the hit carries it; the tree drafters keep
the head's KV next to the model, and this archive carries it instead:

* **Pages by content.** Entries jP .. jP + P - 1 of a request (P tokens, a divisor of the cache's block
  size) are archived once the head has computed them, keyed by a hash chain over the tokens
  x_0 .. x_{(j+1)P-1} (what vLLM's block hashes cover). Entry t also reads x_{t+1}, so the page's last
  entry depends on the next page's first token: the page stores that token, and a restore drops that one
  entry where the request's next token differs (pages of one hit may come from different writers).
  Keys are content, so a page is right for every request with that prefix, whoever wrote it, and a
  rewind or an evicted vLLM block cannot leave a stale page behind.
* **Holes, not errors.** A page that was never written (its request finished before the head caught
  up) or was evicted leaves its entries without KV: the head masks those columns and drafts from the
  rest. Drafts are only proposals, so this costs acceptance, never exactness; `stats` counts it.
* **Bounded.** At most `capacity` pages (the target cache's token capacity / P: the prefix cache never
  holds more), least recently used first out, in one pool grown by doubling, in host memory
  (pinned where the head runs on a GPU; copies are stream-ordered).

Per page: layers x 2 x H_kv x P x D elements of the head's dtype (EAGLE-3 heads: one layer).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PrefixPages", "PrefixStats", "chain_keys", "page_tokens_for"]

PAGE_TOKENS = 16  # preferred page size; the cache's block size must be a multiple (else the block size)


def page_tokens_for(block_size: int) -> int:
    """Page size P for a cache block size: 16 if it divides the block size (prefix hits are whole blocks),
    else the block size itself."""
    return PAGE_TOKENS if block_size % PAGE_TOKENS == 0 else block_size


def chain_keys(tokens, page: int, first: int = 0, prev: bytes = b"") -> list[bytes]:
    """Keys of pages first, first + 1, ... (every whole page of `tokens`): key_j = H(key_{j-1}, page j's tokens).

    prev: key of page first - 1 (b"" for page 0)."""
    arr = np.asarray(tokens, dtype=np.int64)
    keys = []
    for j in range(first, len(arr) // page):
        prev = hashlib.blake2b(prev + arr[j * page: (j + 1) * page].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class PrefixStats:
    """Entries of prefix-cache hits: restored from pages, dropped (a page's last entry whose next token
    differs from the request's) and missing (no page); dropped and missing entries are masked holes."""

    hits: int = 0  # restores: requests whose target rows began past the head's entries (prefix-cache hits)
    restored: int = 0
    dropped: int = 0
    missing: int = 0
    archived_pages: int = 0
    evicted_pages: int = 0
    resident_pages: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PrefixPages:
    """Content-keyed pages of the head's committed KV (see the module docstring).

    Args:
        layers, kv_heads, head_dim, dtype: the head's KV.
        page: tokens per page (P).
        capacity: the most pages held (0: archive nothing; every hit is then missing).
        pin: allocate the pool in pinned memory (the head runs on a GPU).
        stats: the counters to update (the drafter's; default: new ones).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page: int, capacity: int,
                 pin: bool = False, stats: PrefixStats | None = None):
        self.page, self.capacity, self.pin = page, capacity, pin
        self.shape = (layers, 2, kv_heads, page, head_dim)
        self.dtype = dtype
        self.pool = torch.empty(0, *self.shape, dtype=dtype)  # [pages, layers, 2, H_kv, P, D]
        self.next_token = torch.empty(0, dtype=torch.long)  # [pages] x_{(j+1)P} the page's last entry read
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> pool row, least recently used first
        self.stats = stats if stats is not None else PrefixStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def _row(self) -> int | None:
        used = len(self.index)  # rows 0..used-1 are taken (pages are only ever replaced, never dropped)
        if used < self.pool.shape[0]:
            return used
        if used < self.capacity:
            rows = min(self.capacity, max(2 * self.pool.shape[0], 64))
            if self.pin:  # the host copy below reads pages whose device-to-host copies may still be queued
                torch.cuda.current_stream().synchronize()
            pool = torch.empty(rows, *self.shape, dtype=self.dtype, pin_memory=self.pin)
            pool[: self.pool.shape[0]] = self.pool
            nxt = torch.empty(rows, dtype=torch.long)
            nxt[: self.next_token.shape[0]] = self.next_token
            self.pool, self.next_token = pool, nxt
            return used
        if not self.index:
            return None  # capacity 0
        _, row = self.index.popitem(last=False)  # evict the least recently used page
        self.stats.evicted_pages += 1
        return row

    def put(self, key: bytes, kv: list[tuple[torch.Tensor, torch.Tensor]], next_token: int) -> None:
        """Archive one page: kv per layer (keys, values) [H_kv, P, D] (any device), its last entry's next token."""
        if key in self.index:
            self.index.move_to_end(key)
            return
        row = self._row()
        if row is None:
            return
        dst = self.pool[row]
        for layer, (k, v) in enumerate(kv):
            dst[layer, 0].copy_(k, non_blocking=self.pin)
            dst[layer, 1].copy_(v, non_blocking=self.pin)
        self.next_token[row] = next_token
        self.index[key] = row
        self.stats.archived_pages += 1
        self.stats.resident_pages = len(self.index)

    def get(self, key: bytes) -> tuple[torch.Tensor, int] | None:
        """(page [layers, 2, H_kv, P, D], next token) or None; a hit makes the page most recently used. Pinned
        pages may still be in flight: copy them to the device (stream-ordered), do not read them on the host."""
        row = self.index.get(key)
        if row is None:
            return None
        self.index.move_to_end(key)
        return self.pool[row], int(self.next_token[row])
