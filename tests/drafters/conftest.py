"""Drafter tests: make tests/fixtures importable, register its `tiny_models` fixture, pin one torch thread."""

import sys
from pathlib import Path

import pytest
import torch

_FIXTURES = str(Path(__file__).resolve().parents[1] / "fixtures")
if _FIXTURES not in sys.path:
    sys.path.insert(0, _FIXTURES)

from tiny_models import tiny_models  # noqa: E402,F401  (a session fixture, registered by import)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core runner OpenMP
    spin-waiting made these tests ~4x slower with 2 threads. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
