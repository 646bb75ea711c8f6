"""DeepSeek-V4 engine tests on CPU: the tiny random checkpoint and the test-only workarounds.

vLLM 0.32's DeepSeek-V4 CPU path needs Triton's interpreter and a fake Triton
CPU backend (vllm_tree_spec/integration/dsv4/cpu_env.py). The fake backend makes
vLLM treat Triton as available for the rest of the process, which the other
engine suites (tests/integration, Llama on stock vllm-cpu) must not see. So:

* collected alone (`pytest tests/integration_dsv4`): the prerequisites are switched
  on after collection, before the first test, and the tests run here;
* collected with other vLLM suites (`pytest tests`): every test here is skipped in
  this process and test_dsv4_suite_gate.py runs this directory in a fresh interpreter.

Test-only workarounds (production ones live in vllm_tree_spec/integration/dsv4):
  * in-process engines, one OpenMP thread, a 1 GiB KV cache (as tests/integration);
  * CpuPlatform.register_triton_kernel_overrides once per process (tests/fixtures/vllm_cpu.py),
    so several engines can start in one process;
  * baseline engines without speculation get the tile-scheduler fix (D3) class-wide while they run
    (dsv4_harness.stock_tile_scheduler_fix); tree engines apply it themselves;
  * the torch ports of the metadata kernels (D5) serve every engine of the session, baselines
    included, so baseline and tree engines run the same metadata code (test_dsv4_cpu_kernels.py
    checks the ports against the interpreted Triton kernels).
The CUDA torchvision/torchaudio wheels are not installed in this venv (the Makefile removes them).

vLLM-cpu 0.32 ships its DeepSeek-V4 CPU kernels (`fused_qnorm_rope_kv_insert_cpu`, the mHC ops, ...)
only in `vllm._C`, the library it loads on x86 CPUs with AVX-512 and AVX512-BF16; other x86 CPUs
(AVX2 only, or AVX-512 without BF16: `vllm._C_AVX2` / `_C_AVX512`) cannot run DeepSeek-V4 at all.
There every test that needs those kernels is skipped with that reason; the rest (metadata-kernel
ports, cache-comparison and MTP unit tests) still runs.
"""

import os
import pathlib
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # prompt_logprobs: inductor wants a real Triton driver

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="DeepSeek-V4 engine tests need vllm-cpu")

HERE = pathlib.Path(__file__).resolve().parent
GATE = "test_dsv4_suite_gate.py"
sys.path.insert(0, str(HERE))

_mode: dict = {"run": None, "why": ""}  # run: "here" | "gate"


def _register_cpu_kernel_overrides_once() -> None:
    sys.path.insert(0, str(HERE.parent / "fixtures"))
    from vllm_cpu import register_cpu_kernel_overrides_once

    register_cpu_kernel_overrides_once()


def _activate() -> None:
    from vllm_tree_spec.integration import install
    from vllm_tree_spec.integration.dsv4 import cpu_kernels
    from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter

    enable_triton_interpreter()  # raises if this process already committed to Triton-less vLLM
    _register_cpu_kernel_overrides_once()
    cpu_kernels.install()
    install()  # the config route (in-process engines: the plugin entry point may not have run)


_DSV4_OPS = ("fused_qnorm_rope_kv_insert_cpu", "compress_norm_rope_store_cpu", "hc_pre_fused_cpu")


def _missing_dsv4_kernels() -> str:
    """'' when vLLM's DeepSeek-V4 CPU kernels are loaded, else why this CPU has none."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the kernel library vLLM picks for this CPU)

    missing = [op for op in _DSV4_OPS if not hasattr(torch.ops._C, op)]
    if not missing:
        return ""
    return (f"vLLM-cpu's DeepSeek-V4 CPU kernels are missing ({', '.join(missing)}): vLLM ships them only in "
            f"vllm._C, which it loads on x86 CPUs with AVX-512 and AVX512-BF16 "
            f"(this CPU: avx512 {torch.cpu._is_avx512_supported()}, "
            f"avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}); vLLM cannot run DeepSeek-V4 here")


def _mine(item) -> bool:
    return pathlib.Path(str(item.fspath)).resolve().parent == HERE


def _choose_mode(items) -> None:
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
    no_kernels = _missing_dsv4_kernels() if _mode["run"] == "here" else ""
    for item in mine:
        is_gate = pathlib.Path(str(item.fspath)).name == GATE
        if _mode["run"] == "gate" and not is_gate:
            item.add_marker(pytest.mark.skip(reason=f"run in a fresh interpreter by {GATE} ({_mode['why']})"))
        elif _mode["run"] == "here" and is_gate:
            item.add_marker(pytest.mark.skip(reason="this process runs the DeepSeek-V4 tests itself"))
        elif no_kernels and item.get_closest_marker("vllm") is not None \
                and getattr(getattr(item, "module", None), "NEEDS_VLLM_DSV4_KERNELS", True):
            item.add_marker(pytest.mark.skip(reason=no_kernels))


_selected: list[str] = []  # node ids the gate passes to its child (empty: the whole directory)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Choose where the tests run; in gate mode the gate runs what this process selects.

    The gate is kept out of pytest's own selection (`-m`, `-k`) and put back exactly when some
    DeepSeek-V4 test remains selected; it hands those tests' node ids to the child. So `-m amx` runs
    the gate only if a test here carries `amx`, and the child runs just those. Collected without any
    other test of this directory (the gate file alone), the gate is selected as any test."""
    _choose_mode(items)
    gate = next((i for i in items if _mine(i) and pathlib.Path(str(i.fspath)).name == GATE), None)
    others = [i for i in items if _mine(i) and i is not gate]
    if _mode["run"] != "gate" or gate is None or not others:
        return (yield)
    items.remove(gate)
    result = yield
    selected = [i for i in items if _mine(i)]
    if selected:
        _selected[:] = [] if len(selected) == len(others) else [i.nodeid for i in selected]
        items.insert(items.index(selected[-1]) + 1, gate)
    else:
        config.hook.pytest_deselected(items=[gate])
    return result


@pytest.fixture
def dsv4_selected() -> list[str]:
    """Node ids of the DeepSeek-V4 tests this process selected for the gate's child (empty: all of them)."""
    return list(_selected)


@pytest.fixture(scope="session")
def dsv4_model(tmp_path_factory) -> str:
    """The tiny random DeepSeek-V4 checkpoint with one MTP layer, decisive (tiny_dsv4.DECISIVE_BIGRAM;
    built once per session, ~5 s)."""
    from tiny_dsv4 import DECISIVE_BIGRAM, make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("tiny_dsv4") / "dsv4-s0", bigram=DECISIVE_BIGRAM))


@pytest.fixture(scope="session")
def dsv4_flat_model(tmp_path_factory) -> str:
    """The same checkpoint without the decisive successor vote (bigram 0): near-ties within bf16 rounding
    at a few positions per prompt, and greedy output that every attention error reaches."""
    from tiny_dsv4 import make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("tiny_dsv4_flat") / "dsv4-flat", bigram=0.0))
