"""What every tree model runner does the same way, whichever vLLM runner it is mixed into (V1: runner.py,
V2: v2/runner.py): refuse, once the model and its KV cache exist, what the tree path cannot compute."""

from __future__ import annotations

import torch


class TreeRunnerChecks:
    """Start-up checks shared by the runner adapters (they read only the forward context's layers)."""

    # -- checks after the model is built --------------------------------------------------------

    def tree_check_attention(self) -> None:
        """Refuse to run if any attention layer is not tree-aware (no silent causal fallback)."""
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.mamba.abstract import MambaBase
        from vllm.v1.attention.backend import AttentionType

        ctx = self.compilation_config.static_forward_context
        # the start-up gates refuse these from the model config; this catches models that do not declare them
        mamba = [name for name, layer in ctx.items() if isinstance(layer, MambaBase)]
        if mamba:
            raise RuntimeError(f"tree speculation does not support hybrid / Mamba layers ({len(mamba)} layers, e.g. "
                               f"{mamba[0]}); serve this model without --speculative-config")
        cross = [name for name, layer in ctx.items()
                 if isinstance(layer, Attention) and layer.attn_type != AttentionType.DECODER]
        if cross:
            raise RuntimeError(
                f"tree speculation masks decoder self-attention only; {cross[0]} is {ctx[cross[0]].attn_type} "
                f"attention: serve this model without --speculative-config")
        bad = [name for name, layer in ctx.items()
               if isinstance(layer, Attention) and not getattr(layer.impl, "tree_aware", False)]
        if bad:
            raise RuntimeError(
                f"tree speculation needs tree-aware attention in every layer, but {len(bad)} layers "
                f"(e.g. {bad[0]}) use {type(ctx[bad[0]].impl).__name__}; "
                f"this model/attention backend is not supported by vllm-tree-spec (GPU: use "
                f"--attention-backend FLASH_ATTN or TRITON_ATTN)")
        for layer in ctx.values():
            if isinstance(layer, Attention) and hasattr(layer.impl, "tree_check"):
                layer.impl.tree_check()  # per-layer features the tree kernel cannot compute

    def tree_check_caches(self) -> None:
        """Refuse at start-up a KV cache layout the tree path cannot read: every layer whose attention
        override has `tree_check_cache` (CPU: the ISA vLLM's metadata builder picked, against vLLM's op)."""
        for layer in self.compilation_config.static_forward_context.values():
            check = getattr(getattr(layer, "impl", None), "tree_check_cache", None)
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if check is not None and isinstance(kv, torch.Tensor) and kv.numel():
                check(layer, kv)

    def tree_check_verifier(self) -> None:
        """Refuse at start-up a verifier choice (VLLM_TREE_SPEC_VERIFY) this device cannot run, rather than at
        the first tree step."""
        from vllm_tree_spec.integration.tree_sampler import verifier

        try:
            verifier(self.device)
        except (ValueError, RuntimeError) as e:
            raise RuntimeError(f"tree speculation: {e}") from None
