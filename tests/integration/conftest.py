"""vLLM engine tests on CPU: tiny local checkpoints, in-process engines.

Environment (set before vLLM is imported; see notes/cpu-test-recipe.md):
in-process engines start in ~3 s instead of ~17 s, one OpenMP thread keeps
timings stable, and a 1 GiB KV cache keeps start-up fast.
"""

import os
import pathlib
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM integration tests need vllm(-cpu)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tiny_models import tiny_models  # noqa: E402,F401  (registers the fixture)


def _register_cpu_kernel_overrides_once() -> None:
    """Test-fixture workaround (recipe §4): CpuPlatform re-registers its Triton kernel overrides at every
    worker init, which fails for the second engine in one process once numba is imported. Upstream fix:
    make `register_triton_kernel_overrides` idempotent."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.register_triton_kernel_overrides.__func__
    if getattr(original, "_once", False):
        return
    done = [False]

    def once(cls):
        if not done[0]:
            done[0] = True
            original(cls)

    once._once = True
    CpuPlatform.register_triton_kernel_overrides = classmethod(once)


_register_cpu_kernel_overrides_once()
