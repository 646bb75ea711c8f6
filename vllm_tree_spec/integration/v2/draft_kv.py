"""A model drafter's committed KV (an EAGLE head's, a draft model's) in the runner's paged KV cache (Model Runner V2).

vLLM allocates a KV cache for every attention layer registered in its forward context, out of the memory
it budgets for KV (`gpu_memory_utilization`; `VLLM_CPU_KVCACHE_SPACE` on CPU), in the same blocks as the
target's. The head is vLLM's own model (`draft_head.py`), loaded before vLLM sizes its cache, so its
`Attention` layers are registered there: vLLM counts their pages in its block budget, hands their blocks out
with the target's and keeps them in its prefix cache. vLLM's attention backend never runs on them: their
forward is the drafter's tree-masked attention (`drafters/eagle3_head.attend`) over what this store gathers.

Entry t of a request (the head's K/V for committed position t) lives at the cache slot of position t, where
the target keeps its own K/V of that position in its layers. A request's entries are read per step into
`[B, H_kv, cols, D]` (one gather per layer from its block ids, shared by the step's feed of new entries and
its tree levels), the tree's columns appended after them; the entries a forward computed are written to
their slots (`write_back`). The tree's own KV never enters the cache.

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

from vllm_tree_spec.drafters.head_kv import HeadKVSlots
from vllm_tree_spec.drafters.prefix_pages import PrefixStats, chain_keys
from vllm_tree_spec.integration import kv_layout

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
        self._last: tuple[list[int], list] | None = None  # the batch last written back: (slots, per-layer K/V)
        self.reused = False  # the last `batch` was the one last written back

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

    def _slots(self, slots: list[int], cols: int) -> torch.Tensor:
        """[B, cols] cache slot of positions 0..cols-1 of each request (past its blocks: its last block's,
        read as scratch and masked)."""
        bs = self.block_size
        nblk = -(-cols // bs)
        table = torch.zeros(len(slots), nblk, dtype=torch.long)
        for b, s in enumerate(slots):
            ids = self.block_ids(self.req_of[s])[:nblk]
            if ids:
                table[b, : len(ids)] = torch.tensor(ids)
                table[b, len(ids):] = ids[-1]
        table = table.to(self.device, non_blocking=True)
        pos = torch.arange(cols, device=self.device)
        return table[:, pos // bs] * bs + pos % bs

    def _read(self, cache: torch.Tensor, layout: str, isa, slots: torch.Tensor):
        if layout == "cpu_attn":
            return kv_layout.cpu_gather(cache, slots, self.head_dim, isa)
        return kv_layout.paged_gather(cache, slots, self.head_dim)

    def _write(self, cache: torch.Tensor, layout: str, isa, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        if layout == "cpu_attn":
            kv_layout.cpu_write(cache, slots, k, v, self.head_dim, isa)
        else:
            kv_layout.paged_write(cache, slots, k, v)

    def begin_step(self) -> None:
        self._last = None

    def batch(self, slots: list[int], cols: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """Per layer KV [B, H_kv, cols, D] of these slots' positions 0..cols-1, gathered from the cache (a
        copy: write new entries back with `write_back`). A step's tree sessions ask for rows of the batch its
        feed wrote back: those rows are reused (they equal the pages, and hold what a drafter does not write
        to them yet: a draft model's roots), widened with zero columns. Sessions of one step hold disjoint
        requests and write only past their requests' entries, so the batch stays good for the step."""
        self.reserve(cols)
        last = self._last
        self.reused = last is not None and set(slots) <= set(last[0])
        if self.reused:
            rows = None if last[0] == slots else torch.tensor([last[0].index(s) for s in slots], device=self.device)
            return [tuple(self._widen(t if rows is None else t[rows], cols) for t in kv) for kv in last[1]], False
        where = self._slots(slots, cols).flatten()  # [B * cols]
        out = []
        for cache, layout, isa in self.caches:
            k, v = self._read(cache, layout, isa, where)  # [B * cols, H_kv, D]
            out.append(tuple(t.view(len(slots), cols, self.kv_heads, self.head_dim).transpose(1, 2)
                             .to(self.dtype).contiguous() for t in (k, v)))
        return out, False

    @staticmethod
    def _widen(t: torch.Tensor, cols: int) -> torch.Tensor:
        """[B, H, n, D] -> [B, H, cols, D]: the first cols columns, zero columns past n."""
        n = t.shape[2]
        if n >= cols:
            return t[:, :, :cols]
        return torch.cat([t, t.new_zeros(*t.shape[:2], cols - n, t.shape[3])], 2)

    def write_back(self, cache, slots: list[int], spans: list[tuple[int, int]]) -> None:
        """Columns [a, b) of batch row i (entries a..b-1 of slot slots[i]) into the cache; the batch is kept
        for the tree session that usually follows (`batch`)."""
        self._last = (list(slots), cache)
        rows, cols = [], []
        for i, (a, b) in enumerate(spans):
            rows += [i] * (b - a)
            cols += range(a, b)
        if not rows:
            return
        r, c = (torch.tensor(x).to(self.device, non_blocking=True) for x in (rows, cols))  # [S] each
        where = self._slots(slots, max(b for _, b in spans))[r, c]  # [S]
        for (k, v), (kv, layout, isa) in zip(cache, self.caches):
            self._write(kv, layout, isa, where, k[r, :, c], v[r, :, c])  # [S, H_kv, D]

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
