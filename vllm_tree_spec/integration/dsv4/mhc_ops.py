"""The target's mHC ops for the MTP tree drafter (drafters/mtp.py), whichever of vLLM's DeepSeek-V4 layer classes
the target was built from.

The MTP layer mixes its hc streams with the same mHC pre / post and hc_head operations as the target's layers;
the drafter calls the target's own, so mixing follows vLLM's kernels on every platform (and falls back to its
PyTorch versions without a target):

    CPU layers     the op instances vLLM's CPU model holds: `layers[i].mhc_pre` / `.mhc_post` (MHCPreOp /
                   MHCPostOp) and `model.hc_head_op` (HCHeadOp)
    NVIDIA layers  the fused kernels vLLM's NVIDIA model calls, looked up where that model looks them up (its
                   module globals `mhc_pre_tilelang`, `mhc_post_tilelang`, `hc_head_fused_kernel_tilelang`),
                   whose positional parameters are the op instances'

Touch point (records N8 in integration/dsv4/nvidia/__init__.py for the NVIDIA lookup; the CPU instances are
read-only attribute reads): nothing is patched. Removal: an mHC op interface vLLM exposes for drafters (its own
NVIDIA MTP module calls the same kernels).
"""

from __future__ import annotations

import sys

NVIDIA_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
NVIDIA_MHC = ("mhc_pre_tilelang", "mhc_post_tilelang", "hc_head_fused_kernel_tilelang")


def target_mhc_ops(target_model) -> dict:
    """{"mhc_pre", "mhc_post", "hc_head"} callables of the target's layers ({} when it has none)."""
    inner = getattr(target_model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers):
        return {}
    first = layers[getattr(inner, "start_layer", 0)]
    if hasattr(first, "mhc_pre") and hasattr(inner, "hc_head_op"):  # vLLM's CPU layers
        return dict(mhc_pre=first.mhc_pre, mhc_post=first.mhc_post, hc_head=inner.hc_head_op)
    module = sys.modules.get(type(inner).__module__)
    if module is not None and module.__name__ == NVIDIA_MODEL_MODULE:
        pre, post, head = (getattr(module, n) for n in NVIDIA_MHC)
        return dict(mhc_pre=pre, mhc_post=post, hc_head=head)
    return {}
