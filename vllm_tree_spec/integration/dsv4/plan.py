"""One tree verify step of DeepSeek-V4, as index arithmetic: who reads and writes which slot.

Notation (docs/reference-model.md, docs/dsv4.md): a request's root
(last sampled token) sits at position P and flattened row `root_row`; draft
node i sits at row `root_row + 1 + i` and position P + depth(i). vLLM gave
every row its own slot in every position-addressed store (SWA window KV,
compressor state rows), so those rows are already branch-private scratch; what
the stock CPU path gets wrong is *reading* them by position and the
query-order slots of compressed entries and indexer keys. The plan fixes both:

    ancestor rows   anc_rows[m, k] = row of node m's ancestor at depth k (k = 0: the root; k = depth: itself)
    window reads    a local position q >= P read by tree row m comes from row anc_rows[m, q - P]
                    (SWA window in attention; the compressor's pooling window, by state slot)
    entry writes    node m emits entry w = (p+1)/r - 1 iff (p + 1) % r == 0 and depth >= 1; it writes to
                    its own scratch slot, every other tree row writes nothing (slot -1). The root
                    emits to the canonical slot (it is always committed), as in the stock path.
    entry reads     entry w of tree row m: canonical if it completed at a position <= P, else the
                    scratch slot of the ancestor at depth (w + 1) r - 1 - P
    indexer (long context)  per tree row: seq_len = (p + 1) // 4 entries and a virtual page-table row,
                    canonical pages with the path's keys overlaid in scratch pages (shared by rows
                    whose deepest emitting ancestor is the same)

Nothing here touches caches; `patches.py` applies the plan inside the layers,
`adapter.py` builds it and commits the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CSA_RATIO = 4


@dataclass
class EntryPlan:
    """Branch-private compressed entries (and, for ratio 4, indexer keys) of one compress ratio."""

    ratio: int
    entries_per_block: int
    emit_rows: torch.Tensor  # [E] flattened rows of emitting nodes
    emit_slots: torch.Tensor  # [E] their scratch slots (same id in every layer of this ratio)
    emit_w: torch.Tensor  # [E] entry index each one completes
    slot_by_row: torch.Tensor  # [T] scratch slot of the row's own entry, -1 if it emits none

    @property
    def num_emitters(self) -> int:
        return int(self.emit_rows.numel())


@dataclass
class IndexerRows:
    """Per-row inputs of the CSA indexer's decode kernel for tree rows (long context only)."""

    rows: torch.Tensor  # [M'] tree rows whose seq_len / page-table row change
    seq_lens: torch.Tensor  # [M'] compressed entries visible to each row
    # page-table overrides: row rows_bt[j] reads its block index blk_idx[j] from scratch block vblock[j]
    rows_bt: torch.Tensor
    blk_idx: torch.Tensor
    vblock: torch.Tensor
    # per layer, before the indexer runs: copy canonical page copy_src[v] -> copy_dst[v], then key rows
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    key_src_slots: torch.Tensor  # scratch key slots
    key_dst_slots: torch.Tensor  # slots inside the virtual pages


@dataclass
class DSV4TreePlan:
    num_tokens: int
    rows: torch.Tensor  # [M] flattened rows of draft nodes (roots excluded), all tree requests
    pos: torch.Tensor  # [M] their depth positions
    root_pos: torch.Tensor  # [M] P of each row's request
    depth: torch.Tensor  # [M]
    anc_rows: torch.Tensor  # [M, Dmax + 1] ancestor rows by depth (-1 past the row's depth)
    req_of_row: torch.Tensor  # [M] index of the row's request in `requests`
    entries: dict[int, EntryPlan] = field(default_factory=dict)
    indexer: IndexerRows | None = None
    scratch_blocks_used: int = 0

    def ancestor_rows(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tree rows' local positions [M, w]: (use_tree [M, w] bool, source row [M, w]).

        use_tree marks positions q with P <= q <= p (the path above the committed prefix);
        other positions keep the stock resolution through the block table.
        """
        d = local - self.root_pos[:, None]
        use = (d >= 0) & (local <= self.pos[:, None])
        rows = self.anc_rows.gather(1, d.clamp(0, self.anc_rows.shape[1] - 1))
        return use & (rows >= 0), rows

    def remap_window_slots(self, slots: torch.Tensor, local_all: torch.Tensor, row_slot: torch.Tensor) -> None:
        """In place: slots[tree row, j] <- row_slot[ancestor row] where local position j is on the path.

        slots / local_all: [T, w] for all tokens; row_slot: [T] the store's slot of every flattened row.
        """
        if self.rows.numel() == 0:
            return
        local = local_all[self.rows]
        use, src = self.ancestor_rows(local)
        new = torch.where(use, row_slot[src.clamp(min=0)].to(slots.dtype), slots[self.rows])
        slots[self.rows] = new

    def remap_entry_slots(self, slots: torch.Tensor, local_ids: torch.Tensor, ratio: int) -> None:
        """In place: compressed slots of tree rows for entries completed inside the tree -> scratch.

        slots / local_ids: [T, K] resolved slots and the local entry ids they came from.
        """
        ep = self.entries.get(ratio)
        if ep is None or self.rows.numel() == 0 or ep.num_emitters == 0:
            return
        w = local_ids[self.rows].to(torch.long)  # [M, K]
        d = (w + 1) * ratio - 1 - self.root_pos[:, None]  # depth of the completing ancestor
        use = (w >= 0) & (d >= 1) & (d <= self.depth[:, None])
        src_row = self.anc_rows.gather(1, d.clamp(0, self.anc_rows.shape[1] - 1))
        scratch = ep.slot_by_row[src_row.clamp(min=0)]
        use = use & (scratch >= 0)
        slots[self.rows] = torch.where(use, scratch.to(slots.dtype), slots[self.rows])


def build_plan(requests, num_tokens: int, ratios: list[int], entries_per_block: dict[int, int],
               take_blocks, block_table_c, long_context: bool, indexer_block: int | None = None) -> DSV4TreePlan:
    """The plan of one step.

    Args:
        requests: the step's `TreeRequestStep`s (root_row, root_pos, tree with parents/depth, req_index).
        num_tokens: flattened rows in the step.
        ratios: distinct compress ratios > 1 of the model's layers.
        entries_per_block: ratio -> entries per block of the compressed-entry group.
        take_blocks: callable n -> list of n scratch block ids.
        block_table_c: [num_reqs, max_blocks] the compressed-entry group's block table (canonical pages).
        long_context: the CSA indexer runs its top-k kernel this step (virtual rows needed).
        indexer_block: entries per indexer page (= entries_per_block[4]).
    """
    rows, pos, root_pos, depth, anc, req_of = [], [], [], [], [], []
    dmax = max([int(r.tree.depth.max()) for r in requests if r.num_nodes] + [0])
    for ri, r in enumerate(requests):
        n = r.num_nodes
        if n == 0:
            continue
        parents = r.tree.parents.tolist()
        dep = r.tree.depth.tolist()
        for i in range(n):
            chain = []
            j = i
            while j >= 0:
                chain.append(r.root_row + 1 + j)
                j = parents[j]
            chain.append(r.root_row)
            chain.reverse()  # depth 0 (root) .. depth(i) (itself)
            anc.append(chain + [-1] * (dmax + 1 - len(chain)))
            rows.append(r.root_row + 1 + i)
            pos.append(r.root_pos + dep[i])
            root_pos.append(r.root_pos)
            depth.append(dep[i])
            req_of.append(ri)
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    plan = DSV4TreePlan(num_tokens, lt(rows), lt(pos), lt(root_pos), lt(depth),
                        lt(anc).view(len(rows), dmax + 1), lt(req_of))
    for ratio in ratios:
        epb = entries_per_block[ratio]
        emit = [(m, (p + 1) // ratio - 1) for m, (p, d) in enumerate(zip(pos, depth))
                if d >= 1 and (p + 1) % ratio == 0]
        blocks = take_blocks(-(-len(emit) // epb)) if emit else []
        slot_by_row = torch.full((num_tokens,), -1, dtype=torch.long)
        emit_rows, emit_slots, emit_w = [], [], []
        for k, (m, w) in enumerate(emit):
            s = blocks[k // epb] * epb + k % epb
            slot_by_row[rows[m]] = s
            emit_rows.append(rows[m])
            emit_slots.append(s)
            emit_w.append(w)
        plan.entries[ratio] = EntryPlan(ratio, epb, lt(emit_rows), lt(emit_slots), lt(emit_w), slot_by_row)
    if long_context and CSA_RATIO in plan.entries:
        plan.indexer = _indexer_rows(plan, requests, take_blocks, block_table_c, indexer_block)
    return plan


def _indexer_rows(plan: DSV4TreePlan, requests, take_blocks, block_table_c, epb: int) -> IndexerRows:
    ep = plan.entries[CSA_RATIO]
    row_list = plan.rows.tolist()
    seq_lens, rows_bt, blk_idx, vblock = [], [], [], []
    copy_src, copy_dst, key_src, key_dst = [], [], [], []
    virtual: dict[tuple[int, int], int] = {}  # (deepest emitting ancestor row, block index) -> scratch block
    for m, row in enumerate(row_list):
        p, P, d = int(plan.pos[m]), int(plan.root_pos[m]), int(plan.depth[m])
        seq_lens.append((p + 1) // CSA_RATIO)
        # emitting ancestors-or-self at depth >= 1, shallow to deep
        path = [(int(plan.anc_rows[m, k]), (P + k + 1) // CSA_RATIO - 1) for k in range(1, d + 1)
                if (P + k + 1) % CSA_RATIO == 0]
        if not path:
            continue  # sees committed (and root) entries only: the canonical row is right
        deepest = path[-1][0]
        req = requests[int(plan.req_of_row[m])]
        for b in sorted({w // epb for _, w in path}):
            key = (deepest, b)
            if key not in virtual:
                vb = take_blocks(1)[0]
                virtual[key] = vb
                copy_src.append(int(block_table_c[req.req_index, b]))
                copy_dst.append(vb)
                for a_row, w in path:
                    if w // epb == b:
                        key_src.append(int(ep.slot_by_row[a_row]))
                        key_dst.append(vb * epb + w % epb)
            rows_bt.append(row)
            blk_idx.append(b)
            vblock.append(virtual[key])
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return IndexerRows(plan.rows.clone(), lt(seq_lens), lt(rows_bt), lt(blk_idx), lt(vblock),
                       lt(copy_src), lt(copy_dst), lt(key_src), lt(key_dst))
