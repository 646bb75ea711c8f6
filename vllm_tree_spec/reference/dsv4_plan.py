"""Step plans: which slot every query row writes and reads, for one forward.

A forward processes R query rows from one or more requests. Each request
contributes a *segment*: its committed length P and the rows' local parent
array (row 0 follows the committed state, row i follows row parents[i]):

    prefill / decode / replay    a chain        parents = [-1, 0, 1, ..., T-2]
    tree verify                  root + tree    parents = [-1] + [p + 1 for p in tree.parents]

A row's path is the rows from row 0 down to it; its position is P + depth
(the root sits at P: it is the last sampled token, whose rows are not yet in
the cache, so a tree step is vLLM's "1 + N query tokens").

The plan turns that structure into explicit slot lists (see dsv4_cache.py for
the slot space), so the model's forward is the same code for every policy:

    per row:   kv_write, state_write      where its window K=V row / compressor rows go
               window [W]                 the rows its sliding window reads, oldest first
    per ratio m, per row completing a block ((pos + 1) % m == 0):
               gather [coff * m]          the compressor rows its entry pools
               entry_write                where the entry (and CSA indexer key) goes
    per ratio m, per row:
               entries [K]                the entries visible to it, by block index w

Three policies:

    linear   vLLM's stock behaviour: everything addressed by position in the
             persistent cache (write-before-read, overwrite-on-rollback).
             Correct for chains; used for prefill, decode and commit-by-replay.
    tree     scratch isolation: every row writes its own scratch slots; reads
             resolve a position p as "committed row p" if p < P, else "the
             scratch row of my ancestor at depth p - P"; an entry w is committed
             if w < P // m, else the scratch entry of the ancestor that completed
             it. Nothing persistent is written.
    naive    the negative control: a plain tree mask. Window rows get unique
             slots and are read along the ancestor path (standard tree
             attention), but compressor rows and entries stay position-addressed
             (siblings collide, the last row in topological order wins) and are
             read by position. Wrong as soon as two branches cross a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from vllm_tree_spec.reference.dsv4_cache import PAD_SLOT, DSV4Cache
from vllm_tree_spec.reference.dsv4_config import CSA_RATIO

Policy = Literal["linear", "tree", "naive"]


@dataclass(frozen=True)
class Segment:
    """One request's rows in a forward."""

    request: int  # b, index into the cache's batch
    start: int  # P, committed length = position of row 0
    parents: tuple[int, ...]  # local row parents, -1 for row 0 only, topological

    @staticmethod
    def chain(request: int, start: int, num_rows: int) -> "Segment":
        return Segment(request, start, tuple(range(-1, num_rows - 1)))

    @property
    def num_rows(self) -> int:
        return len(self.parents)


@dataclass
class RatioPlan:
    """Compressed-entry work of one compress ratio m in one forward."""

    emit_rows: torch.Tensor  # [E] int64 rows whose position completes a block
    gather: torch.Tensor  # [E, coff * m] per-token slots pooled by each emitted entry, oldest first
    entry_write: torch.Tensor  # [E] entry slots the emitted entries are written to
    entries: torch.Tensor  # [R, K] entry slots visible to each row in block order, PAD_SLOT after


@dataclass
class StepPlan:
    policy: Policy
    positions: torch.Tensor  # [R] int64, P + depth
    kv_write: torch.Tensor  # [R] per-token slots for the window K=V rows
    state_write: torch.Tensor  # [R] per-token slots for compressor state rows (main and indexer)
    window: torch.Tensor  # [R, W] per-token slots of positions pos-W+1 .. pos, PAD_SLOT if < 0
    ratios: dict[int, RatioPlan]

    @property
    def num_rows(self) -> int:
        return self.positions.numel()


def row_paths(parents: Sequence[int]) -> list[list[int]]:
    """paths[i] = local rows from row 0 down to row i (so depth = len - 1)."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        if (p == -1) != (i == 0) or p >= i:
            raise ValueError(f"segment parents {list(parents)}: row 0 must be the only row with parent -1 "
                             f"and every other parent must be an earlier row")
        paths.append([i] if p == -1 else paths[p] + [i])
    return paths


def _last_writer_wins(slots: list[int]) -> list[int]:
    """Keep only the last write to each persistent slot (later rows overwrite earlier ones)."""
    last = {s: r for r, s in enumerate(slots) if s != PAD_SLOT}
    return [s if s != PAD_SLOT and last[s] == r else PAD_SLOT for r, s in enumerate(slots)]


def build_plan(cache: DSV4Cache, segments: Sequence[Segment], policy: Policy) -> StepPlan:
    """Slot lists for one forward over `segments` (see module docstring)."""
    cfg = cache.config
    B, S, W = cache.batch_size, cache.max_len, cfg.sliding_window
    if len({s.request for s in segments}) != len(segments):
        raise ValueError("a request may appear in only one segment per forward")
    if policy == "linear" and any(s.parents != Segment.chain(0, 0, s.num_rows).parents for s in segments):
        raise ValueError("the linear policy addresses rows by position, so it only supports chains")

    positions, kv_write, state_write, window = [], [], [], []
    per_ratio = {m: dict(emit=[], gather=[], write=[], entries=[]) for m in cfg.ratios}
    base = 0
    for seg in segments:
        b, P = seg.request, seg.start
        if not 0 <= b < B or P != int(cache.lengths[b]):
            raise ValueError(f"segment for request {b} starts at {P} but the cache holds "
                             f"{int(cache.lengths[b]) if 0 <= b < B else 'no such request'} tokens")
        paths = row_paths(seg.parents)
        for i, path in enumerate(paths):
            r, t = base + i, P + len(path) - 1
            if t >= S:
                raise ValueError(f"position {t} exceeds the cache capacity max_len = {S}")

            def by_position(p: int) -> int:
                return b * S + p if p >= 0 else PAD_SLOT

            def along_path(p: int) -> int:
                # committed row, or the scratch row of my ancestor (or me) at position p
                if p < 0:
                    return PAD_SLOT
                return b * S + p if p < P else B * S + base + path[p - P]

            window_slot = by_position if policy == "linear" else along_path
            state_slot = along_path if policy == "tree" else by_position
            positions.append(t)
            window.append([window_slot(p) for p in range(t - W + 1, t + 1)])
            kv_write.append(b * S + t if policy == "linear" else B * S + r)
            state_write.append(B * S + r if policy == "tree" else b * S + t)

            for m, acc in per_ratio.items():
                Sm = S // m
                num_visible = (t + 1) // m  # entry w is visible iff w < floor((t + 1) / m)
                if policy == "tree":
                    committed = min(P // m, num_visible)
                    acc["entries"].append([b * Sm + w for w in range(committed)]
                                          + [B * Sm + base + path[(w + 1) * m - 1 - P]
                                             for w in range(committed, num_visible)])
                else:
                    acc["entries"].append([b * Sm + w for w in range(num_visible)])
                if (t + 1) % m == 0:
                    coff = 2 if m == CSA_RATIO else 1
                    acc["emit"].append(r)
                    acc["gather"].append([state_slot(p) for p in range(t + 1 - coff * m, t + 1)])
                    acc["write"].append(B * Sm + r if policy == "tree" else b * Sm + num_visible - 1)
        base += seg.num_rows

    if policy == "naive":  # siblings share positions: the later row's write wins
        state_write = _last_writer_wins(state_write)
        for acc in per_ratio.values():
            acc["write"] = _last_writer_wins(acc["write"])

    def as_long(x, shape_tail=()):
        return torch.tensor(x, dtype=torch.long).reshape(-1, *shape_tail)

    ratios = {}
    for m, acc in per_ratio.items():
        coff = 2 if m == CSA_RATIO else 1
        k = max([1] + [len(e) for e in acc["entries"]])
        entries = torch.full((base, k), PAD_SLOT, dtype=torch.long)
        for r, e in enumerate(acc["entries"]):
            entries[r, : len(e)] = torch.tensor(e, dtype=torch.long)
        ratios[m] = RatioPlan(as_long(acc["emit"]), as_long(acc["gather"], (coff * m,)), as_long(acc["write"]), entries)
    return StepPlan(policy, as_long(positions), as_long(kv_write), as_long(state_write), as_long(window, (W,)), ratios)
