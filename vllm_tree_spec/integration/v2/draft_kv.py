"""A model drafter's committed KV (an EAGLE head's, a draft model's) in the runner's paged KV cache (Model Runner V2).

vLLM allocates a KV cache for every attention layer registered in its forward context, out of the memory
it budgets for KV (`gpu_memory_utilization`; `VLLM_CPU_KVCACHE_SPACE` on CPU), in the same blocks as the
target's. The head is vLLM's own model (`draft_head.py`), loaded before vLLM sizes its cache, so its
`Attention` layers are registered there: vLLM counts their pages in its block budget, hands their blocks out
with the target's and keeps them in its prefix cache. vLLM's attention backend never runs on them: their
forward is the drafter's tree-masked attention over the pages (`draft_attention.py`).

Entry t of a request (the head's K/V for committed position t) lives at the cache slot of position t, where
the target keeps its own K/V of that position in its layers. A forward's rows read their requests' entries
in place, through the block ids, and keep their own K/V in a small dense buffer (a feed's new entries, a
tree's columns); a feed's entries are then written to their slots (`fed`). The tree's own KV never enters
the cache. A draft model's root entry has no slot yet when it is fed (its slot comes with the target's next
step): the step's tree session takes it from the feed's buffer.

Prefix-cache hits: the blocks vLLM reuses carry the writer's head entries. A block's entries are trusted
only where a record says who wrote them (`records`: block id -> the content key of the tokens they depend
on, and the token after the block, which the block's last entry also read): a block with no matching
record (its writer finished before its head reached it, or the block changed hands) is a hole, and a last
entry whose next token differs from the request's is dropped. Holes are masked; drafts are proposals, so
they cost acceptance, never exactness.
"""

from __future__ import annotations

from typing import Callable

import torch

from vllm_tree_spec.drafters.base import DrafterError
from vllm_tree_spec.drafters.head_kv import HeadCall, HeadKVSlots
from vllm_tree_spec.drafters.prefix_pages import PrefixStats, chain_keys
from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.v2.draft_attention import Committed, PagedLayerKV, PagedStep


class PagedHeadKV(HeadKVSlots):
    """The head's committed KV in the runner's blocks (module docstring).

    Args:
        layer_names: the head's attention layers, registered in the forward context (`draft_head.py`).
        kv_heads, head_dim, dtype, device: the head's KV as it computes it.
        block_ids: req_id -> that request's block ids in the layers' KV-cache group (host; the runner's).
    """

    paged = True

    def __init__(self, layer_names: list[str], kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_ids: Callable[[str], list[int]]):
        super().__init__(device)
        self.layer_names = layer_names
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.block_ids = block_ids
        self.req_of: dict[int, str] = {}  # slot -> request id
        self.caches: list[tuple[torch.Tensor, str, str | None]] = []  # per layer (kv_cache, layout, isa)
        self.block_size = 0  # tokens per block of the scheduler's block ids
        self.records: dict[int, tuple[bytes, int]] = {}  # block id -> (content key, token after the block)
        self.stats: PrefixStats | None = None  # set when prefix caching is on
        # the step's last feed: (slots, per-layer own K/V [B, H_kv, n, D], each row's column after its kept ones)
        self._last: tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], list[int]] | None = None

    def attach(self, forward_context: dict, block_size: int) -> None:
        """After vLLM allocated and bound the caches: each layer's cache and layout."""
        self.block_size = block_size
        self.caches = []
        for name in self.layer_names:
            layer = forward_context[name]
            kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
            layout = getattr(layer.impl, "tree_kv_layout", None)
            if layout not in ("cpu_attn", "paged") or not kv.numel():
                raise kv_layout.UnsupportedKVLayout(
                    f"EAGLE head layer {name}: {type(layer.impl).__name__} (KV cache {tuple(kv.shape)}) is not a "
                    f"layout the tree drafter reads")
            self.caches.append((kv, layout, getattr(layer, "isa", None)))

    # -- the drafter's store interface ----------------------------------------------------------
    def acquire(self, req_id=None) -> int:
        slot = super().acquire()
        self.req_of[slot] = req_id
        return slot

    def release(self, slot: int) -> None:
        self.req_of.pop(slot, None)
        super().release(slot)

    def reserve(self, cols: int) -> None:
        self._reserve_valid(self.num_slots, cols)

    def begin_step(self) -> None:
        self._last = None

    def _table(self, slots: list[int], tokens: int) -> torch.Tensor:
        """[B, nblk] int32 block ids covering positions 0..tokens-1 of each slot's request, padded past its
        blocks with its first block (read as scratch, masked)."""
        nblk = max(1, -(-tokens // self.block_size))
        table = torch.zeros(len(slots), nblk, dtype=torch.int32)
        for b, s in enumerate(slots):
            ids = self.block_ids(self.req_of[s])[:nblk]
            if ids:
                table[b] = ids[0]
                table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table.to(self.device, non_blocking=True)

    def _step(self, slots: list[int], lengths: list[int], own: int) -> PagedStep:
        """Per layer: entries 0..lengths[b]-1 in the pages, `own` dense columns; the table covers `own`
        positions past the longest request (the feed's writes, the kernel's reads of the rows' own slots)."""
        # the hole mask only where a request of this forward may have holes (else the kernel's path stays open)
        valid = self.valid_rows(slots, max(lengths)) if max(lengths) and self.holed.intersection(slots) else None
        committed = Committed(self._table(slots, max(lengths) + own), list(lengths), self.block_size, valid)
        shape = (len(slots), self.kv_heads, own, self.head_dim)

        def zeros():
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        return PagedStep(PagedLayerKV(committed, kv, layout, isa, zeros(), zeros()) for kv, layout, isa in self.caches)

    def feed(self, slots: list[int], firsts: list[int], counts: list[int]) -> HeadCall:
        """Rows for entries first .. first + count - 1: each sees its request's entries before `first` in the
        pages and the feed's rows up to itself (own columns 0..count-1)."""
        width = max(counts)
        if self.has_holes:
            self.reserve(max(f + c for f, c in zip(firsts, counts)))
            for slot, first, count in zip(slots, firsts, counts):
                self.valid[slot, first: first + count] = True
        step = self._step(slots, firsts, width)
        cols = torch.arange(width, device=self.device).expand(len(slots), width)
        mask = torch.ones(width, width, dtype=torch.bool, device=self.device).tril().expand(len(slots), -1, -1)
        return HeadCall(step, cols=cols, mask=mask)

    def fed(self, call: HeadCall, slots: list[int], spans: list[tuple[int, int]]) -> None:
        """Entries [a, b) of row i (own columns 0..b-a-1) into their slots; the feed's columns are kept for the
        step's tree session (a root the feed did not write)."""
        step: PagedStep = call.cache
        self._last = (list(slots), [(layer.k, layer.v) for layer in step], [b - a for a, b in spans])
        rows, cols, pos = [], [], []
        for i, (a, b) in enumerate(spans):
            rows += [i] * (b - a)
            cols += range(b - a)
            pos += range(a, b)
        if not rows:
            return
        r, c, p = (torch.tensor(x).to(self.device, non_blocking=True) for x in (rows, cols, pos))  # [S] each
        table = step[0].committed.block_table.long()
        bs = self.block_size
        where = table[r, p // bs] * bs + p % bs  # [S]
        for layer, (kv, layout, isa) in zip(step, self.caches):
            self._write(kv, layout, isa, where, layer.k[r, :, c], layer.v[r, :, c])  # [S, H_kv, D]

    def _write(self, cache: torch.Tensor, layout: str, isa, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        if layout == "cpu_attn":
            kv_layout.cpu_write(cache, slots, k, v, self.head_dim, isa)
        else:
            kv_layout.paged_write(cache, slots, k, v)

    def session(self, slots: list[int], lengths: list[int], cap: int, unsaved: int) -> HeadCall:
        """A tree session: each request's entries in the pages, then own columns: the `unsaved` last entries
        (a draft model's root, from the step's feed), then `cap` tree columns."""
        last = self._last
        if unsaved and (last is None or not set(slots) <= set(last[0])):
            raise DrafterError("tree session: the roots' entries are only in the step's feed, which did not hold "
                               "every request of the session")
        step = self._step(slots, [n - unsaved for n in lengths], unsaved + cap)
        if unsaved:
            rows = torch.tensor([last[0].index(s) for s in slots], device=self.device)
            kept = torch.tensor(last[2], device=self.device)[rows]  # [B] the root's column in the feed's rows
            cols = kept[:, None] + torch.arange(unsaved, device=self.device)  # [B, u]
            for layer, (k, v) in zip(step, last[1]):
                for own, fed in ((layer.k, k), (layer.v, v)):
                    own[:, :, :unsaved] = fed[rows[:, None], :, cols].transpose(1, 2)  # [B, u, H_kv, D] -> own
        base_mask = torch.ones(len(slots), unsaved, dtype=torch.bool, device=self.device)
        return HeadCall(step, base=unsaved, base_mask=base_mask)

    def grow(self, call: HeadCall, slots: list[int], cap: int) -> None:
        call.cache.widen(call.base + cap)

    # -- prefix-cache hits ------------------------------------------------------------------------
    def record(self, slot: int, tokens: list[int], length: int, keys: list[bytes], recorded: int) -> int:
        """Record the blocks whose entries this request completed (entries [0, length)); returns the count of
        blocks recorded so far. keys: the request's content keys of blocks 0.. (extended in place)."""
        bs = self.block_size
        full = length // bs  # entry (j + 1) * bs - 1 read token (j + 1) * bs: the record's next token
        if full <= recorded:
            return recorded
        keys += chain_keys(tokens[: full * bs], bs, first=len(keys), prev=keys[-1] if keys else b"")
        ids = self.block_ids(self.req_of[slot])
        for j in range(recorded, full):
            self.records[ids[j]] = (keys[j], tokens[(j + 1) * bs])
        return full

    def restore(self, slot: int, tokens: list[int], keep: int, first: int, keys: list[bytes]) -> int:
        """A prefix-cache hit: entries keep..first-1 are in the blocks vLLM reused; mark as holes those no
        record vouches for (module docstring); returns the count of holes. keys: the request's content keys
        (extended in place)."""
        bs, stats = self.block_size, self.stats
        stats.hits += 1
        j0, j1 = keep // bs, first // bs
        keys += chain_keys(tokens[: j1 * bs], bs, first=len(keys), prev=keys[-1] if keys else b"")
        ids = self.block_ids(self.req_of[slot])
        self.reserve(first + 1)
        holes = []
        restored = dropped = 0
        for j in range(j0, j1):
            lo, hi = max(keep, j * bs), (j + 1) * bs
            rec = self.records.get(ids[j])
            if rec is None or rec[0] != keys[j]:
                holes += range(lo, hi)
                continue
            drop = rec[1] != tokens[hi]  # the block's last entry read another next token
            if drop:
                holes.append(hi - 1)
                dropped += 1
            restored += hi - lo - drop
        tail = list(range(max(keep, j1 * bs), first))  # a hit shorter than whole blocks: not vLLM's
        holes += tail
        self.valid[slot, keep:first] = True
        stats.restored += restored
        stats.dropped += dropped
        stats.missing += len(holes) - dropped
        if holes:
            self.valid[slot, torch.tensor(holes, device=self.device)] = False
            self.has_holes = True
            self.holed.add(slot)
        return len(holes)


class RunnerBlocks:
    """The V2 runner's side of a drafter store in vLLM's cache: each request's block ids in the KV-cache group of
    the store's layers (host lists, kept from the scheduler's outputs as V1's request states keep them)."""

    layer_name: str  # one of the store's layers (finds its group)

    def __init__(self):
        self.blocks: dict[str, list[int]] = {}
        self.gid = 0

    def bind(self, runner) -> None:
        """After `initialize_kv_cache`: the layers' group, its block size, their caches."""
        groups = runner.kv_cache_config.kv_cache_groups
        self.gid = next(i for i, g in enumerate(groups) if self.layer_name in g.layer_names)
        self.attach(runner.compilation_config.static_forward_context, groups[self.gid].kv_cache_spec.block_size)

    def attach(self, forward_context: dict, block_size: int) -> None:
        raise NotImplementedError

    def set_blocks(self, req_id: str, block_ids) -> None:
        self.blocks[req_id] = list(block_ids[self.gid])

    def add_blocks(self, req_id: str, block_ids) -> None:
        self.blocks.setdefault(req_id, []).extend(block_ids[self.gid])

    def drop_blocks(self, req_id: str) -> None:
        self.blocks.pop(req_id, None)


class RunnerHeadKV(RunnerBlocks):
    """An EAGLE head's / a draft model's committed KV in the runner's blocks (`PagedHeadKV`)."""

    def __init__(self, runner, drafter):
        super().__init__()
        cfg = drafter.head.cfg
        self.names = drafter.head.layer_names  # vLLM's head (draft_head.py) registered its attention layers
        self.layer_name = self.names[0]
        self.store = PagedHeadKV(self.names, cfg.kv_heads, cfg.head_dim, drafter.dtype, drafter.device,
                                 lambda rid: self.blocks.get(rid, []))
        drafter.use_runner_kv(self.store)

    def attach(self, forward_context: dict, block_size: int) -> None:
        self.store.attach(forward_context, block_size)


def attach_head_kv(runner) -> RunnerBlocks | None:
    """At load: a model drafter's network gets its KV in the runner's cache: EAGLE heads and draft models their
    layers' pages, the MTP drafter the MTP layer's SWA pages (mtp_window.py); None: no such drafter."""
    drafter = getattr(runner.drafter, "drafter", None)
    if getattr(drafter, "use_window", None) is not None:
        from vllm_tree_spec.integration.v2.mtp_window import RunnerMTPWindow

        return RunnerMTPWindow(drafter)
    if getattr(drafter, "use_runner_kv", None) is None or getattr(drafter, "head", None) is None:
        return None
    return RunnerHeadKV(runner, drafter)
