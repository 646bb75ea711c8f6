"""Shared fixtures for the DeepSeek-V4 reference-model tests: one tiny float64 model per session."""

import pytest
import torch

from vllm_tree_spec.reference.dsv4 import DSV4Model
from vllm_tree_spec.reference.dsv4_config import DSV4Config


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The tensors here are tiny, so per-op threading overhead dominates: one intra-op
    # thread runs these tests several times faster and far more steadily on a shared
    # 2-core machine. Restored afterwards so other test directories are unaffected.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cfg() -> DSV4Config:
    # layers [SWA, CSA m=4, HCA m'=8, CSA m=4], window 8, indexer top-2 of 2 heads x 16
    return DSV4Config()


@pytest.fixture(scope="session")
def model(cfg) -> DSV4Model:
    return DSV4Model(cfg, torch.float64, seed=0)
