"""Tree attention over vLLM's paged KV cache: the math, a PyTorch reference, an oracle and dispatch.

One verification step scores, for every request b of a batch, a draft tree
(see `vllm_tree_spec.tree`) against the target model. vLLM allocates the tree
rows like ordinary new tokens, so their K/V sit in the paged cache at linear
slots right after the committed prefix:

    slot:      0 .. C-1             C        C+1 .. C+N
    content:   committed prefix     root     draft nodes 0 .. N-1
    position:  0 .. C-1             C        C + depth[i]

where C = context_len (tokens before the root), N = the request's draft nodes,
and seq_len = C + 1 + N is what vLLM's `seq_lens` holds. More generally a
request has q_len >= N + 1 query rows (the last q_len cache slots): the LAST N
rows are draft nodes and every earlier row (the root, plus any prefill rows
before it) is an ordinary causal row. With `start = seq_len - N` (slot of
node 0), query row r at slot `first + r` (`first = seq_len - q_len`) attends
to key slot k iff

    k <= first + r  and  (k < start  or  node(r) has node (k - start) as ancestor-or-self)

i.e. the whole committed prefix, the root and its own root-to-node path. With
a sliding window W (counted in positions, so it is depth-aware), additionally
`pos(k) > pos(r) - W`, with pos(slot k < start) = k and pos(node j) = start - 1 + depth[j].

Per query head h (kv head h // G for G = H_q / H_kv query heads per kv head):

    s_k = scale * <q_r, K_k>                              (q, K come pre-roped)
    s_k = softcap * tanh(s_k / softcap)                   (optional logit cap)
    out_r = sum_k exp(s_k) V_k / (sum_k exp(s_k) + exp(sink_h))   over visible k
                                                          (sink term optional)

Three implementations, all on the same inputs:

* `tree_attention_reference`: per request gather K/V through the block table,
  build the explicit boolean mask (`tree_attention_mask`), softmax in fp32 or
  fp64. The PyTorch twin of the Triton kernel.
* `tree_attention_path_oracle`: the metamorphic check. A node's root-to-node
  path is an ordinary contiguous sequence (positions 0 .. C + depth), so each
  node's output must equal plain causal attention (`causal_attention`) over
  the gathered path keys; it uses the `Tree` parent arrays, not the packed mask.
* `vllm_tree_spec.kernels.tree_attention_launch.tree_attention_triton`: the
  Triton kernel (streams the prefix with online softmax, masks only the tail).

`tree_attention(...)` dispatches between the kernel and the reference. This
module imports neither Triton nor vLLM at import time.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from vllm_tree_spec.tree import Tree, TreeBatch, unpack_mask

Backend = Literal["auto", "triton", "torch"]


# ---------------------------------------------------------------------------
# Metadata helpers


def tree_batch_kernel_inputs(batch: TreeBatch, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The tree tensors the kernel reads, in kernel dtypes.

    Returns {"cu_num_nodes": [B + 1] int32, "packed_mask": [T_nodes, W] int32,
    "depth": [T_nodes] int32} on `device`.
    """
    return {
        "cu_num_nodes": batch.cu_num_nodes.to(device=device, dtype=torch.int32),
        "packed_mask": batch.packed_mask.to(device=device, dtype=torch.int32).contiguous(),
        "depth": batch.depth.to(device=device, dtype=torch.int32),
    }


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table_row: torch.Tensor,  # [max_blocks]
    slots: torch.Tensor,  # [L] linear slots of one request
) -> torch.Tensor:  # [L, H_kv, D]
    """Read linear slots of one request out of a paged cache (vLLM GPU layout)."""
    block_size = cache.shape[1]
    blocks = block_table_row.long()[slots // block_size]
    return cache[blocks, slots % block_size]


def tree_attention_mask(
    q_len: int,
    seq_len: int,
    node_mask: torch.Tensor,  # [N, N] bool ancestor-or-self over the request's nodes
    depth: torch.Tensor | None = None,  # [N] node depths (needed with sliding_window)
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, seq_len] bool
    """Explicit mask of one request: row r may attend to key slot k (see module docstring)."""
    n = node_mask.shape[0]
    if q_len < n + 1:
        raise ValueError(f"q_len = {q_len} but the request has {n} draft nodes; need q_len >= N + 1 (root + nodes)")
    if seq_len < q_len:
        raise ValueError(f"seq_len = {seq_len} < q_len = {q_len}: the query tokens must already be in the cache")
    start = seq_len - n
    first = seq_len - q_len
    k = torch.arange(seq_len)
    r_slot = first + torch.arange(q_len)
    mask = k[None, :] <= r_slot[:, None]
    if n:
        tree = torch.zeros(q_len, n, dtype=torch.bool)
        tree[q_len - n :] = node_mask.bool()
        mask[:, start:] &= tree
    if sliding_window is not None:
        pos_q = r_slot.clone()
        pos_k = k.clone()
        if n:
            if depth is None:
                raise ValueError("sliding_window with draft nodes needs the node depths")
            node_pos = start - 1 + depth.long().cpu()
            pos_q[q_len - n :] = node_pos
            pos_k[start:] = node_pos
        mask &= pos_k[None, :] > pos_q[:, None] - sliding_window
    return mask


# ---------------------------------------------------------------------------
# Plain attention (shared by the reference and the oracle)


def _attend(
    q: torch.Tensor,  # [M, H_q, D]
    k: torch.Tensor,  # [L, H_kv, D]
    v: torch.Tensor,  # [L, H_kv, D]
    mask: torch.Tensor,  # [M, L] bool
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H_q]
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, H_q, D] in `dtype`
    g = q.shape[1] // k.shape[1]
    kk = k.to(dtype).repeat_interleave(g, dim=1)  # [L, H_q, D]
    vv = v.to(dtype).repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.to(dtype), kk) * scale  # [H_q, M, L]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[None].to(s.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(dtype)[:, None, None].expand(-1, s.shape[1], 1)  # [H_q, M, 1]
        s = torch.cat([s, sink_col], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hml,lhd->mhd", p, vv)


def causal_attention(
    q: torch.Tensor,  # [M, H_q, D] the last M tokens of the sequence
    k: torch.Tensor,  # [L, H_kv, D] the whole contiguous sequence, positions 0 .. L-1
    v: torch.Tensor,  # [L, H_kv, D]
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H_q]
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [M, H_q, D] in `dtype`
    """Plain causal (bottom-right aligned) attention over one contiguous sequence.

    Query i sits at position L - M + i and sees keys at positions p with
    p <= L - M + i and, with a window W, p > L - M + i - W.
    """
    m, length = q.shape[0], k.shape[0]
    qpos = torch.arange(length - m, length)
    kpos = torch.arange(length)
    mask = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        mask &= kpos[None, :] > qpos[:, None] - sliding_window
    return _attend(q, k, v, mask, scale, softcap, sinks, dtype)


# ---------------------------------------------------------------------------
# Reference and oracle


def _check_common(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, sinks):
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"expected q [T, H_q, D] and key/value caches [num_blocks, block_size, H_kv, D] of one shape; "
            f"got q {tuple(q.shape)}, key_cache {tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}"
        )
    hq, hkv = q.shape[1], key_cache.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if q.shape[2] != key_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {key_cache.shape[3]}")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1 or block_table.shape[0] < b:
        raise ValueError(
            f"batch of {b} requests (seq_lens) needs query_start_loc [{b + 1}] and block_table [>= {b}, max_blocks]; "
            f"got {tuple(query_start_loc.shape)} and {tuple(block_table.shape)}"
        )
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [H_q] = [{hq}], got {tuple(sinks.shape)}")


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return float(q.shape[-1]) ** -0.5 if scale is None else float(scale)


def tree_attention_reference(
    q: torch.Tensor,  # [T_q, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    cu_num_nodes: torch.Tensor,  # [B + 1]
    packed_mask: torch.Tensor,  # [T_nodes, W] int32
    depth: torch.Tensor | None = None,  # [T_nodes]
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H_q]
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [T_q, H_q, D] q.dtype
    """PyTorch reference of the Triton kernel: gather, explicit mask, softmax in `compute_dtype`.

    Rows of q beyond query_start_loc[-1] are returned as zeros.
    """
    _check_common(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, sinks)
    scale = _default_scale(q, scale)
    out = torch.zeros_like(q)
    qsl = query_start_loc.long().cpu().tolist()
    sls = seq_lens.long().cpu().tolist()
    cun = cu_num_nodes.long().cpu().tolist()
    for b, seq_len in enumerate(sls):
        q0, q1 = qsl[b], qsl[b + 1]
        n0, n1 = cun[b], cun[b + 1]
        n = n1 - n0
        node_mask = unpack_mask(packed_mask[n0:n1].cpu(), n) if n else torch.zeros(0, 0, dtype=torch.bool)
        d = None if depth is None else depth[n0:n1]
        mask = tree_attention_mask(q1 - q0, seq_len, node_mask, d, sliding_window)
        slots = torch.arange(seq_len, device=key_cache.device)
        k = gather_kv(key_cache, block_table[b], slots)
        v = gather_kv(value_cache, block_table[b], slots)
        o = _attend(q[q0:q1], k, v, mask, scale, softcap, sinks, compute_dtype)
        out[q0:q1] = o.to(q.dtype)
    return out


def tree_attention_path_oracle(
    q: torch.Tensor,  # [T_q, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    trees: Sequence[Tree],
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H_q]
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [T_q, H_q, D] in `dtype`
    """Metamorphic oracle: each row equals causal attention over its own linear history.

    A causal row at slot s attends causally over slots 0 .. s. Draft node i
    attends over the path prefix (slots 0 .. C, root included) + the slots of
    its ancestors + its own slot, in root-to-node order; that path is a plain
    contiguous sequence whose positions are exactly 0 .. C + depth[i], so the
    row is the last query of `causal_attention` over it. Independent of the
    packed mask, the depth array and the kernel's position arithmetic.
    """
    _check_common(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, sinks)
    if len(trees) != seq_lens.shape[0]:
        raise ValueError(f"{len(trees)} trees for {seq_lens.shape[0]} requests")
    scale = _default_scale(q, scale)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    qsl = query_start_loc.long().cpu().tolist()
    sls = seq_lens.long().cpu().tolist()
    kw = dict(scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, dtype=dtype)
    for b, (tree, seq_len) in enumerate(zip(trees, sls)):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len, n = q1 - q0, tree.num_nodes
        start, first = seq_len - n, seq_len - (q1 - q0)
        for r in range(q_len):
            if r < q_len - n:
                path = list(range(first + r + 1))
            else:
                path = list(range(start)) + [start + j for j in tree.path_to(r - (q_len - n))]
            slots = torch.tensor(path, device=key_cache.device)
            k = gather_kv(key_cache, block_table[b], slots)
            v = gather_kv(value_cache, block_table[b], slots)
            out[q0 + r] = causal_attention(q[q0 + r : q0 + r + 1], k, v, **kw)[0]
    return out


# ---------------------------------------------------------------------------
# Dispatch


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def load_kernels_package():
    """Import `vllm_tree_spec.kernels`, also from a source checkout that was not pip-installed.

    The repository keeps the kernels in a top-level `kernels/` directory that
    setuptools installs as `vllm_tree_spec.kernels` (see pyproject.toml). When
    the package is used straight from a checkout (tests, benchmarks, no
    `pip install -e .`), register that directory under the same name.
    """
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    try:
        return importlib.import_module("vllm_tree_spec.kernels")
    except ModuleNotFoundError:
        pass
    import vllm_tree_spec

    kdir = Path(vllm_tree_spec.__file__).resolve().parent.parent / "kernels"
    if not (kdir / "__init__.py").is_file():
        raise ModuleNotFoundError("vllm_tree_spec.kernels is not installed and no source kernels/ directory was found")
    spec = importlib.util.spec_from_file_location(
        "vllm_tree_spec.kernels", kdir / "__init__.py", submodule_search_locations=[str(kdir)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_tree_spec.kernels"] = mod
    spec.loader.exec_module(mod)
    vllm_tree_spec.kernels = mod
    return mod


def load_triton_launcher():
    """`tree_attention_triton` (imports Triton)."""
    load_kernels_package()
    from vllm_tree_spec.kernels.tree_attention_launch import tree_attention_triton

    return tree_attention_triton


def tree_attention(
    q: torch.Tensor,  # [T_q, H_q, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    cu_num_nodes: torch.Tensor,  # [B + 1]
    packed_mask: torch.Tensor,  # [T_nodes, W] int32
    depth: torch.Tensor | None = None,  # [T_nodes]
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H_q] fp32
    backend: Backend = "auto",
    **kernel_kwargs,
) -> torch.Tensor:  # [T_q, H_q, D]
    """Tree attention (math in the module docstring) on the chosen backend.

    backend="auto" runs the Triton kernel for CUDA tensors and the PyTorch
    reference for CPU tensors (a documented device choice, not a fallback:
    unsupported inputs raise on either path). "triton" / "torch" force one.
    `kernel_kwargs` (out, max_query_len, max_seq_len, num_splits, config) go
    to the Triton launcher.
    """
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, cu_num_nodes, packed_mask, depth)
    kw = dict(scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if backend == "torch":
        if kernel_kwargs:
            raise ValueError(f"options {sorted(kernel_kwargs)} apply to the Triton backend only")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 position, got {sliding_window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {softcap}")
        return tree_attention_reference(*args, **kw)
    if backend == "triton":
        return load_triton_launcher()(*args, **kw, **kernel_kwargs)
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
