"""vLLM engine tests on CPU: tiny local checkpoints, in-process engines.

Environment (set before vLLM is imported):
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
from vllm_cpu import register_cpu_kernel_overrides_once  # noqa: E402

register_cpu_kernel_overrides_once()
