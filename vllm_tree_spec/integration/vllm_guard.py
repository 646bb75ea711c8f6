"""Start-up guard: the installed vLLM is a tested version, and every vLLM method we override still exists.

The plugin overrides private vLLM methods (patch records P1-P4, D2-D5 in
`integration/__init__.py`); a vLLM release that renames or re-signs one would
otherwise fail deep inside a request, or silently skip a hook. Both checks run
when an engine is configured with `"method": "tree"` (the config route, P1), and
only then: other engines sharing the venv are untouched.

    check_version()   refuse an untested vLLM, naming the supported versions;
                      VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM=1 turns the refusal into a warning
    check_api(...)    every override / patch target exists upstream with the parameters it had
                      in the tested version (a mismatch is refused even with the variable set:
                      that hook would be wrong, not merely untested)

The list of overrides is derived from our classes, not written out: every method
defined on a tree subclass whose name does not start with `tree_` / `_tree_` is an
override of the vLLM base it is mixed into (`overrides()`). `SIGNATURES` records
those methods' parameter names in vLLM 0.32.0; `tests/test_vllm_guard.py` checks
that every derived override has a record, so the two cannot drift apart.
Removal: none needed while the hooks are private; upstream tree hooks would shrink the list.
"""

from __future__ import annotations

import importlib
import inspect
import os

from vllm_tree_spec.config import TreeSpecError

SUPPORTED_VLLM = ("0.32.0",)
ALLOW_ENV = "VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM"

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

# Parameter names (self first) of every vLLM method we override or patch, as of vLLM 0.32.0, keyed by the
# vLLM class our subclass (or per-instance patch) sits on.
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
    "vllm.v1.worker.gpu_worker.Worker._make_model_runner": ("self",),
    "vllm.v1.worker.gpu_worker.Worker.load_model": ("self", "load_dummy_weights"),
    # P2: attention overrides
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_impl_cls": (),
    "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend.get_impl_cls": (),
    "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward": _FORWARD,
    "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend.get_impl_cls": (),
    # D2 / D3: DeepSeek-V4 per-instance overrides (dsv4/patches.py)
    "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention.forward_mqa": (
        "self", "q", "kv", "positions", "output"),
    "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention._sparse_indexer_and_attn": (
        "self", "hidden_states", "index_q", "index_q_scale", "index_weights", "q", "kv", "positions", "out"),
    "vllm.models.deepseek_v4.cpu.cpu_compressor.DeepseekV4CPUCompressor.forward": (
        "self", "kv_score", "positions", "rotary_emb"),
    "vllm.models.deepseek_v4.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler": (
        "self", "num_decode_tokens"),
}

# Methods patched at class level rather than overridden by a subclass of ours (P1, P8).
PATCHED_METHODS = [("vllm.engine.arg_utils.EngineArgs", "create_speculative_config"),
                   ("vllm.sampling_params.SamplingParams", "_validate_spec_decode")]

# Module attributes we rebind or rely on (P1 route, P2 registry, P3, D5): existence only.
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
    "dsv4": (
        "vllm.v1.attention.ops.metadata.compute_token_to_req_indices",
        "vllm.v1.attention.backends.mla.sparse_swa.compute_token_to_req_indices",
        "vllm.v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL",
        "vllm.v1.attention.backends.mla.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL",
        "vllm.v1.attention.backends.mla.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
        "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
        "vllm.v1.sample.rejection_sampler.apply_top_k_top_p",
    ),
}

DSV4_METHODS = {  # class path -> methods bound per instance by patches.py
    "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention": ("forward_mqa", "_sparse_indexer_and_attn"),
    "vllm.models.deepseek_v4.cpu.cpu_compressor.DeepseekV4CPUCompressor": ("forward",),
    "vllm.models.deepseek_v4.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder": ("build_tile_scheduler",),
}


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_version(version: str | None = None) -> None:
    """Refuse an untested vLLM (the local build tag, e.g. '+cpu', is ignored)."""
    from packaging.version import InvalidVersion, Version

    version = version or installed_version()
    try:
        public = Version(version).public
    except InvalidVersion:
        public = version
    if public in SUPPORTED_VLLM:
        return
    msg = (f"vllm-tree-spec is tested with vLLM {', '.join(SUPPORTED_VLLM)} only; this is vLLM {version}. "
           f"Install a supported version (pip install -e '.[cpu]' or '.[gpu]'), or set {ALLOW_ENV}=1 to run "
           f"untested at your own risk")
    if os.environ.get(ALLOW_ENV) == "1":
        from vllm.logger import init_logger

        init_logger(__name__).warning("%s=1: %s", ALLOW_ENV, msg.split(". Install")[0])
        return
    raise TreeSpecError(msg)


def _is_ours(name: str) -> bool:
    return name.startswith(("tree_", "_tree_")) or (name.startswith("__") and name != "__init__")


def overrides(*, platform: str = "cpu", dsv4: bool = False) -> list[tuple[str, str]]:
    """(vLLM base class path, method) of every method our tree classes override, for one platform.

    Derived from the classes: any callable in a tree class body that is not `tree_`-prefixed. The method
    is looked up on the vLLM class we subclass (inherited or not), as our `super()` calls see it.
    """
    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    pairs: list[tuple[type, tuple[str, ...]]] = []
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
        out += [(cls, m) for cls, methods in DSV4_METHODS.items() for m in methods]
    return out


def _resolve(path: str):
    """Import `a.b.C.attr` (module prefix, then attributes); raises LookupError naming what is missing."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[: i + j + 1])} does not exist")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"module of {path} cannot be imported")


def api_problems(*, platform: str = "cpu", dsv4: bool = False) -> list[str]:
    """Every override / patch target that is missing or re-signed in the installed vLLM."""
    problems = []
    try:
        targets = overrides(platform=platform, dsv4=dsv4)
    except ImportError as e:
        return [f"a vLLM module the tree classes build on cannot be imported ({e})"]
    targets += PATCHED_METHODS
    for cls_path, name in targets:
        path = f"{cls_path}.{name}"
        try:
            fn = _resolve(path)
        except LookupError as e:
            problems.append(f"{path}: {e}")
            continue
        expected = SIGNATURES.get(path)
        if expected is None:
            continue  # an override without a record: existence checked; tests/test_vllm_guard.py asks for one
        fn = inspect.unwrap(fn)
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if got != expected:
            problems.append(f"{path}: parameters {got}, expected {expected}")
    for key in ("common", platform) + (("dsv4",) if dsv4 else ()):
        for path in ATTRIBUTES.get(key, ()):
            try:
                _resolve(path)
            except LookupError as e:
                problems.append(f"{path}: {e}")
    return problems


def check_api(*, platform: str = "cpu", dsv4: bool = False) -> None:
    problems = api_problems(platform=platform, dsv4=dsv4)
    if problems:
        raise TreeSpecError(
            f"vLLM {installed_version()} does not have the internals tree speculation hooks into "
            f"({len(problems)} problems: {'; '.join(problems)}); install vLLM {', '.join(SUPPORTED_VLLM)}")
