"""An EAGLE-1 draft head in plain PyTorch, loaded from the checkpoint vLLM's linear `eagle` loads.

The head (Li et al., EAGLE) is Llama decoder layer(s) over the target's last hidden state, as vLLM's
`llama_eagle.EagleLlamaForCausalLM` computes it:

    x = fc(concat(embed(token), h_target))     # [T, 2H] -> [T, H]
    ... decoder layer(s), layer 0 without its input norm, with their own KV ...
    out = h + residual                          # no final norm
    logits = lm_head(out)                       # the target's LM head unless the checkpoint has one
    g_next = out                                # the head's own feature for the next depth

h_target is the target model's output (its last layer after the final norm: what vLLM's runner hands
its EAGLE proposer when no auxiliary layers are tapped). The draft vocabulary is the target's.
Checkpoint: a Llama config (`architectures` e.g. ["LlamaForCausalLM"], vLLM turns it into
EagleLlamaForCausalLM) with `fc.*` and `layers.*` tensors (an optional `model.` prefix is dropped);
`embed_tokens` and `lm_head` are the target's unless the checkpoint has its own, as in vLLM.

Same calling convention as `Eagle3Head` (`combine`, `forward`, `target_logits`), so the tree
drafter (`eagle3.py`) runs both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_tree_spec.drafters.base import DrafterError
from vllm_tree_spec.drafters.eagle3_head import (
    KV,
    Eagle3Config,
    RMSNorm,
    _Attention,
    _checkpoint_tensors,
    _MLP,
    _rope,
    shared_weight,
)


def config_from_hf(c) -> Eagle3Config:
    """The head's shapes from the PretrainedConfig vLLM's parser returns (num_aux = 1: no aux layers)."""
    if getattr(c, "eagle_aux_hidden_state_layer_ids", None) or getattr(c, "speculators_model_type", None) == "eagle3" \
            or any("Eagle3" in a for a in (getattr(c, "architectures", None) or [])):
        raise DrafterError("this head directory is an EAGLE-3 head; use drafter 'eagle3' for it")
    heads = c.num_attention_heads
    return Eagle3Config(
        hidden=c.hidden_size, target_hidden=c.hidden_size, num_aux=1, layers=c.num_hidden_layers, heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, intermediate=c.intermediate_size,
        vocab=c.vocab_size, draft_vocab=c.vocab_size, eps=c.rms_norm_eps,
        max_position=getattr(c, "max_position_embeddings", 4096), rope_parameters=getattr(c, "rope_parameters", None),
        attention_bias=bool(getattr(c, "attention_bias", False)))


class _Layer(nn.Module):
    """vLLM's LlamaDecoderLayer; layer 0 has no input norm (EAGLE's `disable_input_layernorm`)."""

    def __init__(self, cfg: Eagle3Config, index: int):
        super().__init__()
        self.index = index
        self.self_attn = _Attention(cfg, cfg.hidden)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.Identity() if index == 0 else RMSNorm(cfg.hidden, cfg.eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)

    def forward(self, h, residual, positions, rope, mask, cache, cols):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope, mask, cache, cols)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class EagleHead(nn.Module):
    """The EAGLE-1 head; `forward` as `Eagle3Head.forward` (g = the target's hidden state or g')."""

    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.fc = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg, i) for i in range(cfg.layers)])
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.vocab, dtype=torch.long))  # the target's vocabulary
        self.rope = _rope(cfg, dtype)
        self.to(dtype)

    @property
    def feature_size(self) -> int:
        return self.cfg.hidden

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last hidden state [..., H] is the feature itself."""
        return hidden

    def forward(self, tokens, g, positions, mask, cache: list[KV] | None = None, cols=None, rows=None):
        h = self.fc(torch.cat([self.embed_tokens(tokens), g], dim=-1))  # [B, n, H]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.rope, mask, None if cache is None else cache[i], cols)
        out = h + residual  # [B, n, H]
        if rows is not None:
            out = out[torch.arange(out.shape[0], device=out.device), rows]  # [B, H]
        return self.lm_head(out), out

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return draft_logits

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.vocab, device=self.d2t.device)


def load_eagle_head(path: str | Path, *, target_embedding=None, target_lm_head=None, dtype=torch.float32,
                    device="cpu") -> EagleHead:
    """Build the EAGLE-1 head from a checkpoint directory; the target's embedding / LM head [V, H] (or
    functions returning them, see `shared_weight`) fill tensors the checkpoint does not have."""
    from vllm.transformers_utils.config import get_config

    p = Path(path)
    if not (p / "config.json").exists():
        raise DrafterError(f"EAGLE head {path}: no config.json; pass the directory vLLM's eagle method loads")
    cfg = config_from_hf(get_config(str(p), trust_remote_code=False))
    head = EagleHead(cfg, dtype=dtype)
    state = {}
    for name, t in _checkpoint_tensors(p).items():
        name = name.removeprefix("model.")
        if name == "layers.0.input_layernorm.weight":
            continue  # layer 0 has no input norm (vLLM replaces it by Identity too)
        state[name] = t
    for key, shared, what in (("embed_tokens.weight", target_embedding, "embedding"),
                              ("lm_head.weight", target_lm_head, "LM head")):
        if key in state:
            continue
        if shared is None:
            raise DrafterError(f"EAGLE head {path} has no {key} and the target's {what} was not given")
        state[key] = shared_weight(shared, cfg, f"EAGLE head {path}", what)
    state["d2t"] = torch.zeros(cfg.vocab, dtype=torch.long)
    expected = set(head.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise DrafterError(f"EAGLE head {path}: missing tensors {sorted(missing)[:4]}, unexpected "
                           f"{sorted(unexpected)[:4]}; is this an EAGLE-1 Llama head?")
    head.load_state_dict(state)
    return head.to(device).eval()


__all__ = ["EagleHead", "load_eagle_head", "config_from_hf"]
