"""Training-script tests: the engine environment of tests/integration (set before vLLM is imported)."""

import os
import pathlib
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="the training script generates responses with vLLM")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "integration"))
from tiny_models import tiny_models  # noqa: E402,F401  (registers the fixture)
from vllm_cpu import register_cpu_kernel_overrides_once  # noqa: E402

register_cpu_kernel_overrides_once()
