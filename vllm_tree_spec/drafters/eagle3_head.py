"""An EAGLE-3 draft head in plain PyTorch, loaded from the checkpoint vLLM's linear `eagle3` loads.

The head (Li et al., EAGLE-3) is one or more Llama decoder layers on top of
the target model's features:

    g = fc(concat(aux_1, aux_2, aux_3))        # [T, 3 * H_target] -> [T, H]: the target's features
    x = concat(norm_in(embed(token)), norm_h(g))  # layer 0 only: [T, 2H] into q/k/v
    ... decoder layer(s) with their own KV ...
    logits_draft = lm_head(norm(out))          # [T, V_draft]; token ids via d2t
    g_next = out + residual (pre-norm)          # the head's own feature for the next depth

At depth 1 the feature g comes from the target (aux hidden states of the
committed token's predecessor); at deeper tree levels it is the head's own
pre-norm output at the parent node, exactly as vLLM's EAGLE proposer chains
its draft steps (`Eagle3LlamaForCausalLM.forward` returns (normed, pre-norm)).

Checkpoints: the EAGLE-3 Hugging Face layout (`midlayer.*`) and the
speculators format (`layers.0.*`, a `speculators_config` block) are read
with vLLM's own config parser (`vllm.transformers_utils.config.get_config`),
so every flag means what it means to vLLM (norm_before_residual, norm_before_fc,
fc_norm, norm_output, target_hidden_size, draft_vocab_size,
eagle_aux_hidden_state_layer_ids). Weight names follow vLLM's mapping
(`midlayer.` -> `layers.0.`; `d2t` -> draft_id_to_target_id, target id =
draft id + d2t[draft id]; `t2d` unused). A head without `embed_tokens` shares
the target's input embedding, as in vLLM.

Attention is written out here (SDPA over an explicit boolean mask) because
tree drafting needs a mask vLLM's draft attention cannot express; RoPE is
vLLM's own `get_rope`. `tests/drafters/test_drafter_eagle3.py` checks the
logits against vLLM's `Eagle3LlamaForCausalLM` on the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_tree_spec.drafters.base import DrafterError

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, H_kv, C, D]


@dataclass(frozen=True)
class Eagle3Config:
    hidden: int
    target_hidden: int
    num_aux: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's
    draft_vocab: int
    eps: float
    max_position: int
    rope_parameters: dict | None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    aux_layer_ids: tuple[int, ...] | None = None  # None: vLLM's default for the target
    attention_bias: bool = False

    @staticmethod
    def from_hf(c) -> "Eagle3Config":
        """From the PretrainedConfig vLLM's parser returns for the head directory."""
        eagle = getattr(c, "eagle_config", None) or {}
        ids = getattr(c, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
        if eagle.get("use_aux_hidden_state") is False:
            raise DrafterError("head config sets eagle_config.use_aux_hidden_state = false (an EAGLE-1 head); "
                               "drafter 'eagle3' needs an EAGLE-3 head")
        num_aux = getattr(c, "num_aux_hidden_states", None) or (len(ids) if ids else 3)
        heads = c.num_attention_heads
        return Eagle3Config(
            hidden=c.hidden_size,
            target_hidden=getattr(c, "target_hidden_size", None) or c.hidden_size,
            num_aux=num_aux,
            layers=c.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            draft_vocab=getattr(c, "draft_vocab_size", None) or c.vocab_size,
            eps=c.rms_norm_eps,
            max_position=getattr(c, "max_position_embeddings", 4096),
            rope_parameters=getattr(c, "rope_parameters", None),
            norm_before_residual=bool(getattr(c, "norm_before_residual", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", getattr(c, "norm_before_fc", False))),
            fc_norm=bool(getattr(c, "fc_norm", False)),
            norm_output=bool(getattr(c, "norm_output", False)),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            attention_bias=bool(getattr(c, "attention_bias", False)),
        )


def _rope(cfg: Eagle3Config, dtype: torch.dtype):
    """vLLM's rotary embedding for the head (a CustomOp: built under a vLLM config, the engine's if any)."""
    from contextlib import nullcontext

    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    ctx = nullcontext() if get_current_vllm_config_or_none() is not None else set_current_vllm_config(VllmConfig())
    with ctx:
        return get_rope(cfg.head_dim, max_position=cfg.max_position, is_neox_style=True,
                        rope_parameters=cfg.rope_parameters, dtype=dtype)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm semantics: float32 statistics; with a residual, norm(x + residual) and the sum."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_size: int):
        super().__init__()
        self.cfg = cfg
        b = cfg.attention_bias
        self.q_proj = nn.Linear(in_size, cfg.heads * cfg.head_dim, bias=b)
        self.k_proj = nn.Linear(in_size, cfg.kv_heads * cfg.head_dim, bias=b)
        self.v_proj = nn.Linear(in_size, cfg.kv_heads * cfg.head_dim, bias=b)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, positions, rope, mask, cache: KV | None, cols):
        """x [B, n, in], positions [B, n]; mask, cache, cols: see `attend`."""
        c = self.cfg
        bsz, n, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)  # [B, n, H*D], [B, n, Hkv*D]
        q, k = rope.forward_native(positions.reshape(-1), q.reshape(bsz * n, -1), k.reshape(bsz * n, -1))
        out = attend(q.view(bsz, n, c.heads, c.head_dim), k.view(bsz, n, c.kv_heads, c.head_dim),
                     self.v_proj(x).view(bsz, n, c.kv_heads, c.head_dim), mask, cache, cols)
        return self.o_proj(out)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, cache: KV | None,
           cols: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """The head's attention for rows of B requests: q [B, n, H, D], k / v [B, n, Hkv, D] (roped), mask
    [B, n, L] bool over the attended columns. Returns [B, n, H * D].

    cache: keys / values [B, Hkv, C, D]; the rows' own keys / values are written in place at columns
    cols [B, n] and the rows attend over columns [0, L). None: the rows attend to each other (L = n).
    A layer of the runner's paged store (`integration/v2/draft_attention.PagedLayerKV`) attends itself:
    the committed entries in place, the mask over its own columns.
    scale: of the scores (None: 1 / sqrt(D)).
    """
    if hasattr(cache, "attend"):
        return cache.attend(q, k, v, mask, cols, scale)
    bsz, n, heads, _ = q.shape
    if cache is None:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, n, D]
    else:
        b = torch.arange(bsz, device=q.device)[:, None]
        cache[0][b, :, cols] = k  # advanced indices first: [B, n, Hkv, D]
        cache[1][b, :, cols] = v
        cols_l = mask.shape[-1]
        keys, values = cache[0][:, :, :cols_l], cache[1][:, :, :cols_l]  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=heads != k.shape[2])  # [B, H, n, D]
    return out.transpose(1, 2).reshape(bsz, n, -1)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, index: int):
        super().__init__()
        self.index = index
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = _Attention(cfg, 2 * cfg.hidden if index == 0 else cfg.hidden)
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        if index == 0:
            self.hidden_norm = RMSNorm(cfg.hidden, cfg.eps)

    def forward(self, embeds, h, residual, positions, rope, mask, cache, cols):
        if self.index == 0:  # vLLM's llama_eagle3.LlamaDecoderLayer.forward, layer 0
            embeds = self.input_layernorm(embeds)
            if self.norm_before_residual:
                h = self.hidden_norm(h)
                residual = h
            else:
                residual = h
                h = self.hidden_norm(h)
            h = torch.cat([embeds, h], dim=-1)  # [B, n, 2H]
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope, mask, cache, cols)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    """The EAGLE-3 head. `forward` runs any rows with an explicit mask over the caller's KV.

    Rows of one call: request b's n rows (batch-padded), each with a token, an
    input feature g (already through `combine` for target features) and a
    position; they attend to `past` (the caller's KV for the request) and to
    each other as `mask` allows.
    """

    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList([_Layer(cfg, i) for i in range(cfg.layers)])
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden, cfg.hidden, bias=False)
        self.input_norm = RMSNorm(cfg.num_aux * cfg.target_hidden, cfg.eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(cfg.target_hidden, cfg.eps) for _ in range(cfg.num_aux)])
                        if cfg.fc_norm else None)
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.rope = _rope(cfg, dtype)
        self.to(dtype)

    @property
    def feature_size(self) -> int:
        """Width of the target features `combine` takes (the aux layers concatenated)."""
        return self.cfg.num_aux * self.cfg.target_hidden

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features: aux [..., num_aux * H_target] (layers concatenated) -> g [..., H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(a) for n, a in zip(self.fc_norm, aux.chunk(self.cfg.num_aux, dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, tokens, g, positions, mask, cache: list[KV] | None = None, cols=None, rows=None):
        """tokens [B, n], g [B, n, H], positions [B, n], mask [B, n, L] bool.

        cache / cols: per layer KV [B, Hkv, C, D] written in place at columns cols [B, n] (see
        `_Attention.forward`); None: the rows attend to each other under `mask` [B, n, n].
        rows: [B] the one row per batch entry whose outputs are wanted (None: all rows); the LM head
        runs on those rows only.

        Returns (draft logits [B, n, V_draft], next feature g' [B, n, H]), or [B, V_draft], [B, H] with rows.
        """
        embeds = self.embed_tokens(tokens)  # [B, n, H]
        h, residual = g, None
        for i, layer in enumerate(self.layers):
            h, residual = layer(embeds, h, residual, positions, self.rope, mask,
                                None if cache is None else cache[i], cols)
        if rows is not None:
            b = torch.arange(h.shape[0], device=h.device)
            h, residual = h[b, rows], residual[b, rows]  # [B, H]
        normed, prenorm = self.norm(h, residual)
        return self.lm_head(normed), (normed if self.cfg.norm_output else prenorm)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V] over the target vocabulary (-inf outside the draft vocabulary)."""
        return to_target_vocab(draft_logits, self.target_ids, self.cfg.vocab, float("-inf"))

    @property
    def target_ids(self) -> torch.Tensor:
        """[V_draft] the target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t


def to_target_vocab(x: torch.Tensor, target_ids: torch.Tensor, vocab: int, fill: float) -> torch.Tensor:
    """[..., V_draft] rows over the draft vocabulary -> [..., V] over the target's (`fill` elsewhere)."""
    if x.shape[-1] == vocab:
        return x
    out = x.new_full((*x.shape[:-1], vocab), fill)
    out[..., target_ids] = x
    return out


# ---------------------------------------------------------------------------
# Loading


def read_config(path: str | Path) -> Eagle3Config:
    """The head's config through vLLM's parser (EAGLE-3 HF layout or speculators format)."""
    from vllm.transformers_utils.config import get_config

    p = Path(path)
    if not (p / "config.json").exists():
        raise DrafterError(f"EAGLE-3 head {path}: no config.json; pass the directory vLLM's eagle3 method loads")
    return Eagle3Config.from_hf(get_config(str(p), trust_remote_code=False))


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return out
    raise DrafterError(f"EAGLE-3 head {path}: no *.safetensors or pytorch_model*.bin weights")


def hf_name(name: str) -> str | None:
    """A checkpoint tensor name in this module's names (vLLM's mapping), or None to skip it."""
    name = name.removeprefix("model.")
    if "t2d" in name or name.startswith("verifier_") or "mask_hidden" in name:
        return None
    return name.replace("midlayer.", "layers.0.")


def shared_weight(w, cfg: Eagle3Config, who: str, what: str) -> torch.Tensor:
    """The target's [V, H] embedding / LM head for the head. `w` is the table or a function that returns it
    (called only when the checkpoint lacks the tensor: the drafters gather tensor-parallel shards there, a
    collective every rank runs alike). vLLM pads vocabularies to a multiple of 64 (the rows past V are padding
    and dropped); fewer rows is a tensor-parallel shard that was not gathered (refused)."""
    if not isinstance(w, torch.Tensor):
        w = w()
    if w.dim() != 2 or w.shape[1] != cfg.hidden or w.shape[0] < cfg.vocab:
        raise DrafterError(f"{who} shares the target's {what}, but it has shape {tuple(w.shape)}, not "
                           f"[vocab {cfg.vocab}, hidden {cfg.hidden}] (a tensor-parallel shard?); the EAGLE tree "
                           f"drafters gather the target's shards when vLLM loads them on every rank "
                           f"(drafter.load_model(target) inside the engine); outside an engine pass the full table")
    return w.detach()[: cfg.vocab].to("cpu")


def load_head(path: str | Path, *, target_embedding=None, dtype=torch.float32, device="cpu") -> Eagle3Head:
    """Build the head from a checkpoint directory; `target_embedding` [V, H] (or a function returning it,
    see `shared_weight`) fills a missing embed_tokens."""
    p = Path(path)
    cfg = read_config(p)
    head = Eagle3Head(cfg, dtype=dtype)
    state = {}
    for name, t in _checkpoint_tensors(p).items():
        mapped = hf_name(name)
        if mapped is not None:
            state[mapped] = t
    if "embed_tokens.weight" not in state:
        if target_embedding is None:
            raise DrafterError(f"EAGLE-3 head {path} has no embed_tokens and no target embedding was given")
        state["embed_tokens.weight"] = shared_weight(target_embedding, cfg, f"EAGLE-3 head {path}", "embedding")
    if "d2t" not in state and cfg.draft_vocab != cfg.vocab:
        raise DrafterError(f"EAGLE-3 head {path}: draft_vocab_size {cfg.draft_vocab} != vocab_size {cfg.vocab} "
                           f"but the checkpoint has no d2t map")
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
    expected = set(head.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise DrafterError(f"EAGLE-3 head {path}: missing tensors {sorted(missing)[:4]}, unexpected "
                           f"{sorted(unexpected)[:4]}; is this an EAGLE-3 Llama head?")
    head.load_state_dict({k: v.to(torch.long) if k == "d2t" else v for k, v in state.items()})
    return head.to(device).eval()
