"""P10: the drafters' linear layers on vLLM's CPU GEMM (integration/cpu_gemm.py)."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's CPU GEMM dispatch")

from vllm_tree_spec.integration.cpu_gemm import use_vllm_cpu_gemm  # noqa: E402


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 320), torch.nn.SiLU(), torch.nn.Linear(320, 2048, bias=False))


@pytest.mark.parametrize("rows", [1, 2, 6, 33])
def test_routed_linears_match_torch(rows, monkeypatch):
    """Every Linear is routed, its forward calls vLLM's handler, and outputs equal F.linear up to
    float rounding, for 2-D and batched 3-D inputs."""
    net = _net(0)
    ref = _net(0)
    assert use_vllm_cpu_gemm(net) == 2
    assert all(getattr(m, "_tree_cpu_gemm", False) for m in net if isinstance(m, torch.nn.Linear))
    x = torch.randn(3, rows, 96)
    with torch.no_grad():
        got, want = net(x), ref(x)
        assert got.shape == want.shape == (3, rows, 2048)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

        # the routed forward really is vLLM's handler: F.linear is never called (and is, unrouted)
        def refuse(*a, **k):
            raise AssertionError("F.linear called on a routed layer")

        monkeypatch.setattr(torch.nn.functional, "linear", refuse)
        torch.testing.assert_close(net(x), got, atol=0, rtol=0)
        with pytest.raises(AssertionError, match="F.linear called"):
            ref(x)

def test_idempotent_and_skips_non_cpu_or_routed():
    net = _net(1)
    assert use_vllm_cpu_gemm(net) == 2
    forwards = [m.forward for m in net if isinstance(m, torch.nn.Linear)]
    assert use_vllm_cpu_gemm(net) == 0  # already routed: nothing rebuilt
    assert [m.forward for m in net if isinstance(m, torch.nn.Linear)] == forwards
    assert use_vllm_cpu_gemm(torch.nn.Sequential(torch.nn.ReLU())) == 0
