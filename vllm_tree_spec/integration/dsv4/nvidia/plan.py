"""One tree verify step on vLLM's NVIDIA DeepSeek-V4 path: who reads and writes which slot.

Rows. vLLM classifies a verify step's requests as decodes (query length <= 1 + draft slots) and puts them
first; flattened decode row r of request b is its root (the last sampled token, position P_b = committed
length) or a draft node at P_b + depth. Every decode request is described as a tree, the ones without drafts
(or vLLM's own linear rows) as chains, so one `DSV4TreeRows` (kernels/dsv4_tree_meta_reference.py) covers
all decode rows and every list below is written for all of them in one launch, straight into vLLM's buffers.

What differs from vLLM's lists (all derived from query order or positions through the block table there):

    SWA window list        position p >= P of row r's window is the row slot of r's ancestor-or-self at
                           depth p - P (`tree_window_slots`, left aligned, into `decode_swa_indices`)
    entry write slots      a draft node whose position completes a block (`(t + 1) % m == 0`) owns a scratch
                           entry slot; vLLM's compress launch writes nothing for draft nodes (slot -1);
                           the root keeps its canonical slot (always committed)
    C128 entry list        entries completed inside the tree -> the completing ancestor's scratch slot
                           (`tree_entry_slots` dense, into `c128a_global_decode_topk_indices`)
    C4 list                the indexer's local ids -> global slots through the same rule
                           (`tree_topk_slots`, per CSA layer, in place of `compute_global_topk_indices_and_lens`)
    compressor window      a block-completing draft node pools its ancestors' state rows: its window is
                           copied into scratch state blocks addressed by a virtual block table at virtual
                           positions, and vLLM's own compress kernel runs on those virtual tokens
                           (`VirtualCompress`), so the entry has vLLM's numerics
    indexer (long context) per row `seq_len = (t + 1) // 4` compressed entries; rows with entries completed
                           inside the tree read virtual pages: the canonical page with the path's keys overlaid
                           (shared by rows whose deepest emitting ancestor is the same); the DeepGEMM schedule is
                           rebuilt from the new lengths

Refresh tables (`RefreshTables`): per slot space (each SWA group, each compressor state group, C4 entries +
indexer keys, C128 entries), the source and destination slot of every tree row if it is accepted at its
depth k: per-token rows move to the slot of linear row root + k, entries from scratch to the canonical slot of
entry (t + 1) / m - 1.

The host part (`host_plan`) is numpy over the step's rows (no device data, no sync); the device part
(`device_plan`) is one upload and a fixed sequence of launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tree_spec.integration.dsv4.nvidia.caches import CSA, HCA

KEYS_PER_PAGE = 64  # FP8 indexer keys per entry-group block (256 tokens / 4)
PAD_TO = 8  # virtual token counts are padded to a multiple of 8 (the CuTeDSL kernels' int64 alignment)


# ---------------------------------------------------------------------------------------------------------------
# Host plan


@dataclass
class HostEmitters:
    """Draft nodes whose depth position completes a block of ratio m."""

    rows: np.ndarray  # [E] decode rows
    pos: np.ndarray  # [E] their positions t
    req: np.ndarray  # [E] request (batch index)
    slots: np.ndarray  # [E] scratch entry slots (entry group)


@dataclass
class HostCompress:
    """The virtual compress launch of one ratio (see `VirtualCompress`)."""

    window: int  # coff * m
    state_block: int
    vpos: np.ndarray  # [E'] virtual positions (padded)
    t2r: np.ndarray  # [E'] virtual request of each virtual token
    vbt: np.ndarray  # [1 + n_short, ncols] virtual block table (scratch state block ids)
    vslot: np.ndarray  # [E'] state slot of each virtual token's own row (-1 = padding)
    kslot: np.ndarray  # [E'] entry slot it writes (-1 = padding)
    kv_rows: np.ndarray  # [E'] step rows whose kv / score projections the virtual tokens reuse
    fill_rows: np.ndarray  # [K] decode row whose window column is copied
    fill_cols: np.ndarray  # [K] column of that row's position-aligned window list
    fill_dst: np.ndarray  # [K] scratch state slot
    cos_dst: np.ndarray  # [E] virtual cos/sin rows
    cos_src: np.ndarray  # [E] true rows (t // m) * m
    num_blocks: int  # scratch state blocks


@dataclass
class HostIndexer:
    """Long-context indexer rows: virtual pages."""

    rows_bt: np.ndarray  # [M] decode rows whose page-table column changes
    blk_idx: np.ndarray  # [M] the column (page index)
    vblock: np.ndarray  # [M] the virtual page (entry-group block id)
    page_req: np.ndarray  # [V] request whose canonical page is copied
    page_idx: np.ndarray  # [V] its page index
    page_dst: np.ndarray  # [V] virtual page block id
    key_src: np.ndarray  # [K] scratch key slots
    key_dst: np.ndarray  # [K] slots inside the virtual pages


@dataclass
class HostPlan:
    num_rows: int  # decode rows Rd
    num_reqs: int  # decode requests Bd
    parent: np.ndarray  # [Rd]
    depth: np.ndarray  # [Rd]
    row_req: np.ndarray  # [Rd]
    start: np.ndarray  # [Bd] P
    cu: np.ndarray  # [Bd + 1]
    max_depth: int
    node_rows: np.ndarray  # [T] decode rows of draft nodes (every tree request)
    emitters: dict[int, HostEmitters]
    compress: dict[int, HostCompress]
    indexer: HostIndexer | None
    # tree rows in the step's order (TreeStepMeta): decode row, row of its depth-k destination, request
    tree_rows: np.ndarray  # [R]
    tree_dst_rows: np.ndarray  # [R] decode row root + depth
    tree_emit: dict[int, np.ndarray]  # ratio -> [R] scratch entry slot of the row, -1 if it emits none
    tree_emit_w: dict[int, np.ndarray]  # ratio -> [R] entry index it completes (0 if none)
    tree_req: np.ndarray  # [R] request (batch index)
    entry_blocks: list[int] = field(default_factory=list)
    page_blocks: list[int] = field(default_factory=list)

    @property
    def positions(self) -> np.ndarray:
        return self.start[self.row_req] + self.depth


def _pad(a: np.ndarray, n: int, value: int) -> np.ndarray:
    return np.concatenate([a, np.full(n - len(a), value, dtype=a.dtype)]) if n > len(a) else a


def host_plan(step, qsl: np.ndarray, start: np.ndarray, num_rows: int, ratios: list[int],
              entries_per_block: dict[int, int], state_block: dict[int, int], take_blocks,
              long_context: bool) -> HostPlan:
    """The host half of a step's plan.

    step: the runner's `TreeStep` (requests in batch order, with `meta`); qsl [Bd + 1] / start [Bd]: query start
    locations and committed lengths of the step's decode requests; num_rows: decode rows Rd = qsl[Bd];
    take_blocks(n): n reserved entry-group block ids for this step.
    """
    bd = len(start)
    cu = qsl[: bd + 1].astype(np.int64)
    start = start.astype(np.int64)
    qlen = np.diff(cu)
    row_req = np.repeat(np.arange(bd, dtype=np.int64), qlen)
    ar = np.arange(num_rows, dtype=np.int64)
    depth = ar - cu[row_req]
    parent = np.where(depth > 0, ar - 1, -1)
    host = step.meta.batch.host
    roots = np.array([r.root_row for r in step.requests], dtype=np.int64)
    for r in step.requests:
        if r.root_row >= num_rows or r.root_row + 1 + r.num_nodes + r.num_pads > cu[r.req_index + 1]:
            raise RuntimeError(f"request {r.req_id}: its tree rows are not decode rows of this step (decode rows "
                               f"< {num_rows}); vLLM's decode threshold must cover 1 + num_speculative_tokens")
        if int(start[r.req_index]) != r.root_pos:
            raise RuntimeError(f"request {r.req_id}: root position {r.root_pos} != committed length "
                               f"{int(start[r.req_index])}")
    num_nodes = np.asarray(host.num_nodes, dtype=np.int64)
    cu_nodes = np.asarray(host.cu_num_nodes, dtype=np.int64)
    t_req = np.repeat(np.arange(len(roots)), num_nodes)
    local = np.arange(int(cu_nodes[-1]), dtype=np.int64) - cu_nodes[t_req]
    node_rows = roots[t_req] + 1 + local
    parents = np.asarray(host.parents, dtype=np.int64)
    parent[node_rows] = np.where(parents >= 0, roots[t_req] + 1 + parents, roots[t_req])
    depth[node_rows] = np.asarray(host.depth, dtype=np.int64)
    for b, r in enumerate(step.requests):  # pad rows (Model Runner V2): children of the root, no entries
        if r.num_pads:
            pads = np.arange(r.root_row + 1 + r.num_nodes, r.root_row + 1 + r.num_nodes + r.num_pads)
            parent[pads] = r.root_row
            depth[pads] = 1
    pos = start[row_req] + depth
    is_node = np.zeros(num_rows, dtype=bool)
    is_node[node_rows] = True

    emit_mask = {m: is_node & ((pos + 1) % m == 0) for m in ratios}
    counts = {m: int(emit_mask[m].sum()) for m in ratios}
    n_entry_blocks = max([-(-counts[m] // entries_per_block[m]) for m in ratios] + [0])
    entry_blocks = take_blocks(n_entry_blocks) if n_entry_blocks else []
    eb = np.asarray(entry_blocks, dtype=np.int64)
    emitters = {}
    for m in ratios:
        rows = np.nonzero(emit_mask[m])[0]
        k = np.arange(len(rows))
        epb = entries_per_block[m]
        slots = eb[k // epb] * epb + k % epb if len(rows) else np.zeros(0, dtype=np.int64)
        emitters[m] = HostEmitters(rows, pos[rows], row_req[rows], slots)

    compress = {m: _host_compress(emitters[m], m, state_block[m]) for m in ratios}

    indexer, page_blocks = None, []
    if long_context and CSA in emitters:
        indexer, page_blocks = _host_indexer(emitters[CSA], node_rows, parent, depth, start, row_req, pos,
                                             take_blocks)

    tree_rows = np.concatenate([np.arange(r.root_row, r.root_row + 1 + r.num_nodes) for r in step.requests])
    tree_req = np.repeat(np.array([r.req_index for r in step.requests], dtype=np.int64),
                         [1 + r.num_nodes for r in step.requests])
    tree_root = np.repeat(roots, [1 + r.num_nodes for r in step.requests])
    tree_dst_rows = tree_root + depth[tree_rows]
    tree_emit, tree_emit_w = {}, {}
    for m in ratios:
        slot_of = np.full(num_rows, -1, dtype=np.int64)
        slot_of[emitters[m].rows] = emitters[m].slots
        tree_emit[m] = slot_of[tree_rows]
        tree_emit_w[m] = np.where(tree_emit[m] >= 0, (pos[tree_rows] + 1) // m - 1, 0)
    return HostPlan(num_rows, bd, parent, depth, row_req, start, cu, int(depth.max(initial=0)), node_rows, emitters,
                    compress, indexer, tree_rows, tree_dst_rows, tree_emit, tree_emit_w, tree_req, entry_blocks,
                    page_blocks)


def _host_compress(em: HostEmitters, m: int, state_block: int) -> HostCompress:
    """Virtual tokens of one ratio: emitter e with a full window (t >= w - 1) sits at virtual position
    e * w + w - 1 (window = virtual positions e * w .. e * w + w - 1 = scratch blocks e * w / bs ..); an
    emitter whose window starts before position 0 keeps its true position and gets its own virtual request row
    (so the kernel masks the negative positions as it does for the stock path)."""
    w = 2 * m if m == CSA else m
    bs = state_block
    assert w % bs == 0 and w % m == 0
    t = em.pos
    normal = t >= w - 1
    order = np.concatenate([np.nonzero(normal)[0], np.nonzero(~normal)[0]])
    t = t[order]
    rows = em.rows[order]
    kslot = em.slots[order]
    e_norm = int(normal.sum())
    n_short = len(order) - e_norm
    per = w // bs
    vpos = np.concatenate([np.arange(e_norm) * w + w - 1, t[e_norm:]]).astype(np.int64)
    t2r = np.concatenate([np.zeros(e_norm, dtype=np.int64), 1 + np.arange(n_short)])
    short_blocks = [(int(x) // bs) + 1 for x in t[e_norm:]]
    short_base = e_norm * per + np.concatenate([[0], np.cumsum(short_blocks)[:-1]]).astype(np.int64) \
        if n_short else np.zeros(0, dtype=np.int64)
    num_blocks = e_norm * per + int(sum(short_blocks))
    ncols = max([e_norm * per] + short_blocks + [1])
    vbt = np.zeros((1 + n_short, ncols), dtype=np.int64)
    vbt[0, : e_norm * per] = np.arange(e_norm * per)
    for i in range(n_short):
        vbt[1 + i, : short_blocks[i]] = short_base[i] + np.arange(short_blocks[i])
    vslot = np.concatenate([np.arange(e_norm) * w + w - 1, short_base * bs + t[e_norm:]]).astype(np.int64)
    # window columns j (position t - w + 1 + j) of each emitter -> scratch slot
    fr, fc, fd = [], [], []
    if e_norm:
        j = np.tile(np.arange(w), e_norm)
        e = np.repeat(np.arange(e_norm), w)
        fr.append(rows[e])
        fc.append(j)
        fd.append(e * w + j)
    for i in range(n_short):
        e = e_norm + i
        q = np.arange(int(t[e]) + 1)
        fr.append(np.full(len(q), rows[e]))
        fc.append(q - int(t[e]) + w - 1)
        fd.append(short_base[i] * bs + q)
    cat = lambda x: np.concatenate(x).astype(np.int64) if x else np.zeros(0, dtype=np.int64)  # noqa: E731
    n = len(order)
    padded = -(-n // PAD_TO) * PAD_TO
    return HostCompress(w, bs, _pad(vpos, padded, 0), _pad(t2r, padded, 0), vbt, _pad(vslot, padded, -1),
                        _pad(kslot, padded, -1), _pad(rows, padded, 0), cat(fr), cat(fc), cat(fd),
                        (vpos // m) * m, (t // m) * m, num_blocks)


def _host_indexer(em4: HostEmitters, node_rows, parent, depth, start, row_req, pos, take_blocks):
    """Virtual pages for rows whose visible entries include entries completed inside the tree."""
    slot_of = {int(r): int(s) for r, s in zip(em4.rows, em4.slots)}
    rows_bt, blk_idx, vblock = [], [], []
    page_req, page_idx, page_dst, key_src, key_dst = [], [], [], [], []
    virtual: dict[tuple[int, int], int] = {}
    blocks: list[int] = []
    for r in node_rows.tolist():
        path = []  # (emitting ancestor-or-self row, entry index), deepest first
        a = r
        while depth[a] >= 1:
            if a in slot_of:
                path.append((a, int((pos[a] + 1) // CSA - 1)))
            a = int(parent[a])
        if not path:
            continue  # every visible entry is committed (or the root's): the canonical row is right
        deepest = path[0][0]
        b = int(row_req[r])
        for page in sorted({w // KEYS_PER_PAGE for _, w in path}):
            key = (deepest, page)
            if key not in virtual:
                vb = take_blocks(1)[0]
                blocks.append(vb)
                virtual[key] = vb
                page_req.append(b)
                page_idx.append(page)
                page_dst.append(vb)
                for a_row, w in path:
                    if w // KEYS_PER_PAGE == page:
                        key_src.append(slot_of[a_row])
                        key_dst.append(vb * KEYS_PER_PAGE + w % KEYS_PER_PAGE)
            rows_bt.append(r)
            blk_idx.append(page)
            vblock.append(virtual[key])
    a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return HostIndexer(a(rows_bt), a(blk_idx), a(vblock), a(page_req), a(page_idx), a(page_dst), a(key_src),
                       a(key_dst)), blocks


# ---------------------------------------------------------------------------------------------------------------
# Device plan


@dataclass
class VirtualCompress:
    """Inputs of vLLM's compress kernel for one ratio's block-completing draft nodes (device).

    The kernel fetches a token's pooling window by position through `block_table[token_to_req[t]]`; the
    virtual tokens' windows are the scratch state blocks `vbt` points at, filled (per layer) with the rows
    of the node's window along its ancestor path: committed rows through the block table, path rows from the
    ancestors' own slots (`fill_src` -> `fill_dst`). RoPE reads `cos_sin[(vpos // m) * m]`, a gathered
    table with the true rows there; `vpos % m == t % m`, so the partial-state save adds the same position
    bias. Output slots: the nodes' scratch entries.
    """

    ratio: int
    window: int
    state_block: int
    num: int  # real virtual tokens E (the tensors are padded to a multiple of 8)
    vpos: torch.Tensor  # [E'] int64
    t2r: torch.Tensor  # [E'] int32
    vbt: torch.Tensor  # [1 + n_short, ncols] int32
    vslot: torch.Tensor  # [E'] int64
    kslot: torch.Tensor  # [E'] int64
    kv_rows: torch.Tensor  # [E'] int64
    fill_src: torch.Tensor  # [K] int64 state slots (group slot space; -1 = masked position)
    fill_dst: torch.Tensor  # [K] int64 scratch slots
    cos_dst: torch.Tensor  # [E] int64
    cos_src: torch.Tensor  # [E] int64
    num_blocks: int
    cos_rows: int  # rows of the virtual cos/sin table
    cos_tables: dict = field(default_factory=dict)  # data_ptr of a layer's cos_sin_cache -> virtual table (step)


@dataclass
class IndexerPages:
    page_src: torch.Tensor  # [V] canonical page ids (device gather)
    page_dst: torch.Tensor  # [V]
    key_src: torch.Tensor  # [K]
    key_dst: torch.Tensor  # [K]
    num_rows: int  # rows pointed at virtual pages


@dataclass
class RefreshTables:
    src: torch.Tensor  # [S, R] int64
    dst: torch.Tensor  # [S, R] int64
    spaces: list[str]


@dataclass
class GpuTreePlan:
    """A tree step's plan on the device; attached to every metadata object as `md.dsv4_tree_nv`."""

    rows: object  # DSV4TreeRows over the decode rows
    num_rows: int
    entries: dict  # ratio -> TreeEntrySlots (C4: tail / committed for the top-k mapping)
    compress: dict[int, VirtualCompress]
    indexer: IndexerPages | None
    refresh: RefreshTables | None
    step: object  # the runner's TreeStep
    host: HostPlan
    topk_calls: int = 0  # C4 layers whose top-k ids were mapped along the tree this forward


def upload_int64(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Host int arrays -> int64 device tensors in one transfer (views of one packed buffer)."""
    flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) if arrays else \
        np.zeros(0, dtype=np.int64)
    t = torch.from_numpy(flat)
    if torch.device(device).type != "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    out, o = [], 0
    for a in arrays:
        n = int(np.asarray(a).size)
        out.append(t[o: o + n].view(np.asarray(a).shape))
        o += n
    return out
