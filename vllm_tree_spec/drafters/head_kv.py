"""Where an EAGLE head keeps its committed KV: the stores `eagle3.py` drafts from.

A request owns a slot for its life; its entries are columns [0, length) of that slot. A store sets up each
forward of the head: a feed of new entries (`feed`, then `fed` to keep what it wrote) or a tree session
(`session`): the per-layer keys the head attends over, the rows' columns in them and the mask. Entries a
prefix-cache hit could not supply are holes, masked out of the head's attention (`valid`, read only once a
hole exists).

    DenseHeadKV   per layer keys/values [slots, H_kv, capacity, D] beside the model (any runner); a forward
                  runs on a batch of them (a view, or a gathered copy written back), the tree's columns after
                  every request's committed ones
    PagedHeadKV   the runner's paged KV cache: entry t at the cache slot of position t, in vLLM's blocks and
                  memory budget, read in place (Model Runner V2: `integration/v2/draft_kv.py`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class HeadCall:
    """One forward's keys: `cache` the head's per-layer keys (dense K/V pairs, or the paged store's layers), the
    rows' columns in them, and the mask over them. A session's tree columns start at `base`; every tree row sees
    the columns before it where `base_mask` [B, base] is True."""

    cache: Any
    is_view: bool = False
    cols: torch.Tensor | None = None  # [B, n] (a feed)
    mask: torch.Tensor | None = None  # [B, n, L] (a feed)
    base: int = 0
    base_mask: torch.Tensor | None = None  # [B, base] (a session)


def widen_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, cols, D] (cols >= n): zero columns appended."""
    return torch.cat([t, t.new_zeros(*t.shape[:2], cols - t.shape[2], t.shape[3])], 2)


class HeadKVSlots:
    """Slot bookkeeping and the hole mask, shared by the stores."""

    paged = False  # True: entries live in the runner's blocks (prefix-cache hits find them there)

    def __init__(self, device: torch.device):
        self.device = device
        self.free: list[int] = []
        self.num_slots = 0
        self.valid = torch.ones(0, 0, dtype=torch.bool, device=device)  # [rows, capacity] False: a hole
        self.has_holes = False
        self.holed: set[int] = set()  # slots that may hold holes (host; kept until the slot is released)

    def begin_step(self) -> None:
        """A drafting step starts (the paged store forgets the previous step's batch)."""

    def acquire(self, req_id=None) -> int:
        if self.free:
            return self.free.pop()
        self.num_slots += 1
        return self.num_slots - 1

    def release(self, slot: int) -> None:
        if slot < self.valid.shape[0]:
            self.valid[slot] = True
        self.holed.discard(slot)
        self.free.append(slot)
        self.free.sort(reverse=True)  # lowest slot first: active requests stay packed at the front

    def _reserve_valid(self, rows: int, cols: int) -> None:
        if self.valid.shape[0] >= rows and self.valid.shape[1] >= cols:
            return
        rows, cols = max(rows, self.valid.shape[0]), max(cols, self.valid.shape[1])
        valid = torch.ones(rows, cols, dtype=torch.bool, device=self.device)
        valid[: self.valid.shape[0], : self.valid.shape[1]] = self.valid
        self.valid = valid

    def valid_rows(self, slots: list[int], cols: int) -> torch.Tensor | None:
        """[B, cols] False at hole columns of these slots (None while no slot has holes)."""
        if not self.has_holes:
            return None
        self._reserve_valid(self.num_slots, cols)
        return self.valid[torch.tensor(slots, device=self.device), :cols]


class DenseHeadKV(HeadKVSlots):
    """Committed head KV of every request: per layer keys/values [slots, H_kv, capacity, D].

    Columns past a request's length are scratch: catch-up padding and a step's tree KV land there, so a
    batch whose requests hold consecutive slots runs on a view of the store with no copy at all.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(device)
        self.shape = (kv_heads, head_dim)
        self.dtype = dtype
        self.layers: list[list[torch.Tensor]] = [[self._empty(0, 0), self._empty(0, 0)] for _ in range(layers)]

    def _empty(self, slots: int, cols: int) -> torch.Tensor:
        return torch.zeros(slots, self.shape[0], cols, self.shape[1], dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.layers[0][0].shape[2]

    def reserve(self, cols: int) -> None:
        """Make room for num_slots rows and `cols` columns (doubling; existing content kept)."""
        rows, cap = self.layers[0][0].shape[0], self.capacity
        if rows >= self.num_slots and cap >= cols:
            return
        rows, cap = max(rows, self.num_slots), max(cap, cols) if cap >= cols else max(2 * cap, cols, 64)
        for layer in self.layers:
            for j, old in enumerate(layer):
                new = self._empty(rows, cap)
                new[: old.shape[0], :, : old.shape[2]] = old
                layer[j] = new
        self._reserve_valid(rows, cap)

    def batch(self, slots: list[int], cols: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """Per layer KV [B, H_kv, >= cols, D] of these slots in this order: a view if they are consecutive
        (writes go to the store), else a copy (write back with `write_back`)."""
        self.reserve(cols)
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):
            return [(k[s0: s0 + len(slots)], v[s0: s0 + len(slots)]) for k, v in self.layers], True
        idx = torch.tensor(slots, device=self.device)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.layers], False

    def write_back(self, cache, slots: list[int], spans: list[tuple[int, int]]) -> None:
        """Copy columns [a, b) of batch row i back to slot slots[i] (after a forward on a copy)."""
        for (k, v), layer in zip(cache, self.layers):
            for i, (slot, (a, b)) in enumerate(zip(slots, spans)):
                layer[0][slot, :, a:b] = k[i, :, a:b]
                layer[1][slot, :, a:b] = v[i, :, a:b]

    # -- a forward's keys: a batch of the store (`batch`, then `write_back` unless a view) -----------
    def feed(self, slots: list[int], firsts: list[int], counts: list[int]) -> HeadCall:
        """New entries first .. first + count - 1 of each slot: rows at their own columns, each seeing its
        slot's entries before it (holes masked) and itself."""
        device, width = self.device, max(counts)
        cols = torch.tensor(firsts, device=device)[:, None] + torch.arange(width, device=device)  # [B, n]
        n_cols = max(firsts) + width  # padding rows write scratch columns
        mask = torch.arange(n_cols, device=device) <= cols[..., None]  # [B, n, L] own prefix, causal
        cache, is_view = self.batch(slots, n_cols)
        valid = self.valid_rows(slots, n_cols)
        if valid is not None:
            for b, (slot, first, count) in enumerate(zip(slots, firsts, counts)):
                valid[b, first:] = True  # columns this feed writes (padding rows: scratch)
                self.valid[slot, first: first + count] = True
            mask = mask & valid[:, None]
        return HeadCall(cache, is_view, cols=cols, mask=mask)

    def fed(self, call: HeadCall, slots: list[int], spans: list[tuple[int, int]]) -> None:
        """After a feed: entries [a, b) of slot i are kept."""
        if not call.is_view:
            self.write_back(call.cache, slots, spans)

    def session(self, slots: list[int], lengths: list[int], cap: int, unsaved: int) -> HeadCall:
        """A tree session over these slots' entries: room for `cap` tree columns after the longest request's.
        unsaved: entries at each request's end that only the step's feed holds (none in a dense store)."""
        if unsaved:
            raise RuntimeError(f"{type(self).__name__} keeps every entry it is fed; unsaved entries need a paged store")
        l_max = max(lengths)
        cache, is_view = self.batch(slots, l_max + cap)
        committed = torch.arange(l_max, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]
        valid = self.valid_rows(slots, l_max)
        if valid is not None:
            committed = committed & valid
        return HeadCall(cache, is_view, base=l_max, base_mask=committed)

    def grow(self, call: HeadCall, slots: list[int], cap: int) -> None:
        """Room for `cap` tree columns in a session (rare: a tree wider than the reserve)."""
        cols = call.base + cap
        if call.is_view:
            call.cache, _ = self.batch(slots, cols)
        else:
            call.cache = [tuple(widen_cols(t, cols) for t in kv) for kv in call.cache]
