"""Tree rows on CPU as vLLM's own decode of each path: bit-identical to decoding without speculation.

Greedy tree speculation is lossless only if every tree row computes exactly what a decode step
would compute for the same path: the same keys, at the same positions in the same blocks, through
the same kernel. vLLM's CPU attention rounds in its own order (per key block, its own max and
rescale; on AMX the softmax weights rounded to bf16 before the P·V product), so any other kernel
differs from it in the last bit of many outputs, and greedy output then differs from no speculation
at near-ties. What agrees with a one-row decode bit for bit is vLLM's own causal multi-row pass
(what its linear speculation verifies with). So each branching tree is cut into chains
(`Tree.chain_cover`: one per leaf, every row in exactly one), and each chain is one causal sequence
of vLLM's `cpu_attention_with_kv_cache`:

    chain rows  its rows, at depths d_s .. d_e (the first chain starts at the root, depth 0)
    keys        prefix 0 .. P (root at position P), then the chain's path at positions P+1 .. P+d_e
    query       the chain's rows: the last rows of the sequence, causal

vLLM's slot mapping put node i at position P+1+i of the request's own blocks, so the path a chain
needs is not where a decode step would read it. A request's first chain reads its own blocks with its
path written over the draft slots P+1 .. P+d_e (only the slots that do not hold it already); its other
chains read **scratch blocks**, block ids no request owns (reserved when the KV cache is allocated,
`TreeStep.scratch_blocks`): from the chain's first out-of-place position on, its block-table row points
at scratch blocks, the first a copy of the request's block (the prefix keys before that position), and
the path's K/V are written at the slots a decode step would read. Then all chains of the step run in one
vLLM call. Chains that find no free scratch run in later calls (waves) over the request's own blocks,
overlaid the same way; the same bits either way. After the last call every overwritten draft slot gets
its own node's K/V back, so the commit finds each node where vLLM put it. Draft slots belong to the
request alone (uncomputed positions are never in a shared prefix-cache block).

Per layer a step costs one gather of every value it will write (read before any write), the scratch
blocks' copies, one gather of the query rows, per wave one scatter of its path slots and one vLLM call
(vLLM's call has a fixed cost of about 0.1 ms on one thread, hence scratch: one call per step), one
scatter of the outputs and one restoring scatter, all on flat element indices (slots placed by the layer's ISA
layout, `kv_layout.cpu_slot_offsets`); the plan is built once per step and KV-cache group and
shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeStep


@dataclass
class PathWave:
    """One vLLM call: S chain sequences over the requests' own blocks."""

    rows: slice  # its query rows within `PathPlan.rows`
    writes: slice  # its path writes' elements within `PathPlan.src` / `dst`
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32: the request's row of vLLM's table, or a copy of it
    #                            with scratch blocks from the chain's first out-of-place position on


@dataclass
class PathPlan:
    """A step's chain sequences. Writes (the waves' path writes, then the restore, in that order) move the
    K/V of node slots to other draft slots; every source is read before the first write."""

    rows: torch.Tensor  # [M] int64 flattened query row of every chain row, wave-major
    waves: list[PathWave]
    src: torch.Tensor  # [E] int64 element index (in the layer's flattened cache) of every value written ...
    dst: torch.Tensor  # [E] int64 ... and where it goes; a slot is Hkv * 2D elements (its K and V, every head)
    restore: slice  # the elements that put every overwritten draft slot's own K/V back
    block_src: torch.Tensor  # [C] int64 request blocks copied whole, before any write, ...
    block_dst: torch.Tensor  # [C] int64 ... into these scratch blocks

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
            attend: Callable[[torch.Tensor, torch.Tensor, PathWave], None]) -> None:
        """Every chain row of the step into `output` [T, H, D]: `attend(q [m, H, D], out, wave)` is vLLM's
        causal call over the wave's sequences; kv_cache [nb, Hkv, bs, 2D] (contiguous) is left as it was."""
        flat = kv_cache.view(-1)
        values = torch.index_select(flat, 0, self.src)  # [E]
        if self.block_dst.numel():
            kv_cache.index_copy_(0, self.block_dst, torch.index_select(kv_cache, 0, self.block_src))
        q = torch.index_select(query, 0, self.rows)  # [M, H, D]
        out = output.new_empty((q.shape[0],) + tuple(output.shape[1:]))
        try:
            for wave in self.waves:
                flat.index_copy_(0, self.dst[wave.writes], values[wave.writes])
                attend(q[wave.rows], out[wave.rows], wave)
        finally:  # every node's K/V back in its own slot (the commit reads them there)
            flat.index_copy_(0, self.dst[self.restore], values[self.restore])
        output.index_copy_(0, self.rows, out)


def chain_blocks(max_depth: int, block_size: int) -> int:
    """Most scratch blocks one chain can need: the blocks its out-of-place positions span."""
    return (max_depth + block_size - 2) // block_size + 1


def scratch_blocks_for(max_num_seqs: int, max_nodes: int, block_size: int) -> int:
    """Scratch blocks that let a full batch of the largest trees run in one call: a request has at most
    max_nodes - 1 chains besides its first (a star)."""
    return max_num_seqs * max(0, max_nodes - 1) * chain_blocks(max_nodes, block_size)


def plan_paths(step: TreeStep, block_table: torch.Tensor, block_size: int, *, isa: str, num_kv_heads: int,
               head_dim: int, itemsize: int, scratch: range = range(0)) -> PathPlan:
    """The chain sequences of the step's branching trees (all requests of `step`), in waves.

    block_table [num_reqs, max_blocks] int32 is the KV group's table (vLLM's, by request index); the
    layout arguments are those of the group's caches, [num_blocks, num_kv_heads, block_size, 2 * head_dim].
    `scratch`: cache block ids no request owns (reserved at KV-cache allocation). A request's first chain
    reads its own blocks; its other chains read scratch blocks while there are enough, all in the first
    vLLM call, and otherwise run in later waves over the request's own blocks.
    """
    bt = block_table.tolist()
    bs = block_size
    waves: list[dict] = []
    restore: list[tuple[int, int]] = []  # (slot, slot): own K/V back
    blocks: list[tuple[int, int]] = []  # (own block, scratch block): copied whole before any write
    free = list(scratch)

    def wave_at(w: int) -> dict:
        while w >= len(waves):
            waves.append({"rows": [], "q_lens": [], "seq_lens": [], "tables": [], "writes": []})
        return waves[w]

    for r in step.requests:
        P, n = r.root_pos, r.num_nodes
        own = bt[r.req_index]
        holds = list(range(n + 1))  # holds[k]: the node row whose K/V position P + k has now (row k at first)
        parents = r.tree.parents.tolist()
        in_place = 0  # chains of this request that ran over its own blocks (one per wave)
        for c, chain in enumerate(r.tree.chain_cover):
            path = _path_rows(parents, chain[0] - 1) + chain[1:] if chain[0] else chain[1:]  # rows at depths 1..
            d_e = len(path)
            f = next((d for d, row in enumerate(path, start=1) if row != d), None)  # first out-of-place depth
            need = 0 if f is None else (P + d_e) // bs - (P + f) // bs + 1
            if c > 0 and f is not None and need <= len(free):  # scratch blocks, first call
                wave, table = wave_at(0), list(own)
                b0 = (P + f) // bs
                for j in range(need):
                    table[b0 + j] = free.pop(0)
                if (P + f) % bs:  # keys before P + f in that block: the prefix and in-place path nodes
                    blocks.append((own[b0], table[b0]))
                for d in range(f, d_e + 1):  # node row `row` sits at position P + row of the own blocks
                    src, dst = P + path[d - 1], P + d
                    wave["writes"].append((own[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
            else:  # the request's own blocks, overlaid with the path
                wave, table = wave_at(in_place), own
                in_place += 1
                for d, row in enumerate(path, start=1):
                    if holds[d] != row:
                        src, dst = P + row, P + d
                        wave["writes"].append((own[src // bs] * bs + src % bs, own[dst // bs] * bs + dst % bs))
                        holds[d] = row
            wave["rows"].extend(r.root_row + c for c in chain)
            wave["q_lens"].append(len(chain))
            wave["seq_lens"].append(P + 1 + d_e)
            wave["tables"].append(table)
        restore.extend(((own[(P + k) // bs] * bs + (P + k) % bs),) * 2 for k in range(1, n + 1) if holds[k] != k)
    per_slot = num_kv_heads * 2 * head_dim  # elements of one slot (K and V, every head)
    rows, pairs, out = [], [], []
    for w in waves:
        loc = [0]
        for q in w["q_lens"]:
            loc.append(loc[-1] + q)
        writes = slice(len(pairs) * per_slot, (len(pairs) + len(w["writes"])) * per_slot)
        out.append(PathWave(slice(len(rows), len(rows) + loc[-1]), writes, torch.tensor(loc, dtype=torch.int32),
                            torch.tensor(w["seq_lens"], dtype=torch.int32),
                            torch.tensor(w["tables"], dtype=block_table.dtype)))
        rows.extend(w["rows"])
        pairs.extend(w["writes"])
    restore_at = slice(len(pairs) * per_slot, (len(pairs) + len(restore)) * per_slot)
    pairs.extend(restore)
    heads = torch.arange(num_kv_heads)[None, :, None]

    def elements(slots: list[int]) -> torch.Tensor:  # [S * Hkv * 2D], slot-major
        t = torch.tensor(slots, dtype=torch.long).reshape(-1)
        cols = kv_layout.cpu_slot_offsets(isa, t % bs, head_dim, bs, itemsize)  # [S, 2D] in a (block, head) run
        return ((t[:, None, None] // bs * num_kv_heads + heads) * (bs * 2 * head_dim) + cols[:, None, :]).reshape(-1)

    def ids(i: int) -> torch.Tensor:
        return torch.tensor([b[i] for b in blocks], dtype=torch.long)

    return PathPlan(torch.tensor(rows, dtype=torch.long), out, elements([p[0] for p in pairs]),
                    elements([p[1] for p in pairs]), restore_at, ids(0), ids(1))


def _path_rows(parents: list[int], node: int) -> list[int]:
    """Rows (node + 1) from depth 1 down to `node` inclusive."""
    out = []
    while node >= 0:
        out.append(node + 1)
        node = parents[node]
    return out[::-1]
