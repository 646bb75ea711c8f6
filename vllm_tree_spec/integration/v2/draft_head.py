"""The model drafters' networks as vLLM's own models on Model Runner V2 (patch record P18).

vLLM's linear `eagle3` / `eagle` load their head with `load_eagle_model` (`v1/worker/gpu/spec_decode/eagle/
utils.py`): `Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM` built from an `eagle3` / `eagle` speculative
config, weights through vLLM's loader (tensor-parallel shards on every rank), the target's embedding and LM
head shared as modules where the head has none. Its standalone draft-model speculator loads a draft
checkpoint with `get_model` under the draft's model and parallel configs, layers named under "draft_model".
The tree drafters load the same way (`load_network`, which V2's runner calls through the tree speculator, a
`DraftModelSpeculator`: speculator.py), so their network is vLLM's model with vLLM's parallel
linear layers, norms, RoPE and logits processor; only its attention differs: a tree level needs an ancestor
mask, which vLLM's draft attention cannot express.

The network's `Attention` layers are vLLM's (registered by the model, so vLLM counts and allocates their
pages with the target's: `draft_kv.py` reads and writes them). Each one's forward is replaced on the
instance by the drafter's masked attention (`eagle3_head.attend`): the request's entries read in place from
those pages, plus the step's own columns (`draft_attention.py`). Each rank attends with its own heads over
its own shard of the KV, and the row-parallel output projection sums the ranks, as in vLLM's forward.

`VllmEagleHead` and `VllmDraftModel` give the drafters (`drafters/eagle3.py`, `drafters/eagle.py`,
`drafters/draft_model_paged.py`) the interface of the plugin's PyTorch heads (`eagle3_head.Eagle3Head`,
`eagle_head.EagleHead`, which the V1 runner keeps): `cfg` (heads and KV heads: this rank's), `combine`,
`forward(tokens, g, positions, mask, cache, cols, rows)`, `target_ids`.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from vllm_tree_spec.drafters import eagle_head
from vllm_tree_spec.drafters.eagle3_head import Eagle3Config, attend, to_target_vocab

METHODS = ("eagle3", "eagle", "draft_model", "mtp")  # drafter keys whose networks are vLLM's on V2 (vLLM's methods)


def head_view(vllm_config, method: str, path: str, num_speculative_tokens: int):
    """The runner's config as vLLM's loaders expect it: an `eagle3` / `eagle` / `draft_model` speculative config
    for the checkpoint (vLLM builds its model config, dtype and parallel config), and a cache config of full attention
    in the model's dtype (never the target's sliding window: vLLM would free blocks the head still reads;
    never a quantized KV dtype: the head writes its K/V as computed). The compilation config is the
    runner's, so the head's layers join its forward context."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(method=method, model=path, num_speculative_tokens=num_speculative_tokens,
                             target_model_config=vllm_config.model_config,
                             target_parallel_config=vllm_config.parallel_config)
    view = copy.copy(vllm_config)
    view.speculative_config = spec
    view.cache_config = copy.copy(vllm_config.cache_config)
    view.cache_config.cache_dtype = "auto"
    view.cache_config.sliding_window = None
    return view


def load_network(vllm_config, target_model, drafter) -> nn.Module:
    """At load, for the tree speculator (`TreeDraftModelSpeculator.load_draft_model`, called by V2's runner): an
    EAGLE-3 / EAGLE / draft-model / MTP drafter gets vLLM's network as its head; returns vLLM's model (the
    runner's `get_draft_model`)."""
    key = drafter.key
    if key not in METHODS:
        raise ValueError(f"drafter {key!r} has no network for vLLM to load")
    if key == "mtp":
        from vllm_tree_spec.integration.v2.mtp_head import load_vllm_mtp_head

        head = load_vllm_mtp_head(vllm_config, target_model)
    elif key == "draft_model":
        head = load_vllm_draft_model(vllm_config, drafter.path)
    else:
        head = load_vllm_eagle_head(vllm_config, target_model, key, drafter.path)
    drafter.set_head(head)
    return head.model


def load_vllm_eagle_head(vllm_config, target_model, method: str, path: str) -> "VllmEagleHead":
    """vLLM's `method` head for the runner's target, loaded by vLLM's EAGLE loader (shards per rank)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    view = head_view(vllm_config, method, path, vllm_config.speculative_config.num_speculative_tokens)
    try:
        with set_current_vllm_config(view):
            model = load_eagle_model(target_model, view)
    except (ValueError, KeyError, RuntimeError) as e:
        raise ValueError(
            f"speculative_config.model {path!r}: on Model Runner V2 the {method} tree drafter loads its head with "
            f"vLLM's own {method} loader (as vLLM's linear {method!r} method does), which refused it: {e}. Use a "
            f"head vLLM's {method!r} method serves, or the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), whose "
            f"PyTorch head loads it") from e
    head = VllmEagleHead(model, method)
    head.model_config = view.speculative_config.draft_model_config
    return head


def load_vllm_draft_model(vc, path: str) -> "VllmDraftModel":
    """vLLM's model for a draft checkpoint, loaded as vLLM's standalone draft-model speculator loads it
    (`StandaloneARSpeculator.load_draft_model`: the draft's model and parallel configs, no quantization,
    layer names under "draft_model"), with the head view's cache config (`head_view`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    view = head_view(vc, "draft_model", path, vc.speculative_config.num_speculative_tokens)
    spec = view.speculative_config
    draft = replace(view, model_config=spec.draft_model_config, quant_config=None,
                    parallel_config=replace(spec.draft_parallel_config, rank=vc.parallel_config.rank))
    with set_current_vllm_config(draft):
        model = get_model(vllm_config=draft, prefix="draft_model")
    net = VllmDraftModel(model)
    net.model_config = spec.draft_model_config
    return net


class _VllmTreeNetwork(nn.Module):
    """A vLLM model whose attention layers run the drafter's tree-masked attention (`eagle3_head.attend`) over
    the K/V the drafter hands each forward (`cache`: per layer, the paged store's `PagedLayerKV`, or [B, H_kv, C, D])
    instead of vLLM's backend; each rank attends with its own heads."""

    loaded_by_runner = True  # on the runner's device and dtype, sharing modules with the target: never cast
    model_config = None  # the network's vLLM ModelConfig (its speculative config's draft_model_config)
    before_forward = None  # (rows) -> None before each forward: the speculator's EPLB hook (speculator.py)

    def __init__(self, model: nn.Module, attns: list):
        super().__init__()
        self.model = model
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "do_not_compile"):
            inner.do_not_compile = True  # drafting runs eagerly: a tree level's shapes vary every step
        self.attns = attns
        self.layer_names = [attn.layer_name for attn in attns]
        self._call = None  # (mask, cache, cols, B, n) of the forward in progress
        for i, attn in enumerate(attns):
            attn.tree_draft_kv = True  # the target's commit leaves its slots alone (commit.py)
            attn.forward = self._attention(i)

    def _attention(self, i: int):
        attn = self.attns[i]
        scale = getattr(attn.impl, "scale", None)

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            mask, cache, cols, bsz, n = self._call  # q [B*n, H*D], k / v [B*n, H_kv*D], roped by vLLM
            d = attn.head_size
            out = attend(q.view(bsz, n, attn.num_heads, d), k.view(bsz, n, attn.num_kv_heads, d),
                         v.view(bsz, n, attn.num_kv_heads, d), mask, None if cache is None else cache[i], cols,
                         scale=scale)
            return out.reshape(bsz * n, -1)

        return forward

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V] over the target vocabulary (-inf outside the draft vocabulary)."""
        return to_target_vocab(draft_logits, self.target_ids, self.cfg.vocab, float("-inf"))

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, g: torch.Tensor | None):
        """vLLM's forward on T flat rows: (hidden [T, H] for the logits, g' [T, H])."""
        raise NotImplementedError

    def forward(self, tokens, g, positions, mask, cache=None, cols=None, rows=None):
        """As `Eagle3Head.forward`: (draft logits [B, n, V_draft], g' [B, n, H]), or [B, ...] with rows."""
        bsz, n = tokens.shape
        if self.before_forward is not None:
            self.before_forward(bsz * n)
        self._call = (mask, cache, cols, bsz, n)
        try:
            h, g_next = self._run(tokens.reshape(-1), positions.reshape(-1),
                                  None if g is None else g.reshape(bsz * n, -1))
        finally:
            self._call = None
        h, g_next = h.view(bsz, n, -1), g_next.view(bsz, n, -1)
        if rows is not None:
            b = torch.arange(bsz, device=h.device)
            h, g_next = h[b, rows], g_next[b, rows]  # [B, H]
        logits = self.model.logits_processor(self.model.lm_head, h.reshape(-1, h.shape[-1]))
        return logits.view(*h.shape[:-1], -1), g_next


class VllmEagleHead(_VllmTreeNetwork):
    """vLLM's `Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM` behind the drafters' head interface (module
    docstring)."""

    def __init__(self, model: nn.Module, method: str):
        super().__init__(model, [layer.self_attn.attn for layer in model.model.layers])
        a = self.attns[0]
        cfg = Eagle3Config.from_hf(model.config) if method == "eagle3" else eagle_head.config_from_hf(model.config)
        self.cfg: Eagle3Config = replace(cfg, heads=a.num_heads, kv_heads=a.num_kv_heads)
        d2t = getattr(model, "draft_id_to_target_id", None)
        d2t = torch.zeros(self.cfg.draft_vocab, dtype=torch.long) if d2t is None else d2t.detach().clone()
        self.register_buffer("d2t", d2t.to(next(model.parameters()).device))

    @property
    def feature_size(self) -> int:
        return self.cfg.num_aux * self.cfg.target_hidden

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features -> g: EAGLE-3 [..., num_aux * H_target] -> [..., H] (vLLM's
        `combine_hidden_states`); EAGLE-1: the target's hidden state is the feature."""
        combine = getattr(self.model, "combine_hidden_states", None)
        if combine is None:
            return aux
        return combine(aux.reshape(-1, aux.shape[-1])).view(*aux.shape[:-1], -1)

    def _run(self, tokens, positions, g):
        return self.model(tokens, positions, g)


class VllmDraftModel(_VllmTreeNetwork):
    """vLLM's model of a draft checkpoint (any decoder whose layers are vLLM `Attention` layers without a sliding
    window, logit cap, ALiBi or sinks) behind the drafters' head interface: no features, the target's vocabulary
    (same tokenizer), g' = the final hidden state (unused)."""

    feature_size = 0

    def __init__(self, model: nn.Module):
        from vllm.model_executor.layers.attention import Attention

        attns = [m for m in model.modules() if isinstance(m, Attention)]
        if not attns:
            raise ValueError(f"draft model {type(model).__name__}: no vLLM Attention layers to draft trees with")
        for a in attns:
            extra = ["sliding_window"] if a.sliding_window is not None else []
            extra += [f for f in ("alibi_slopes", "sinks") if getattr(a.impl, f, None) is not None]
            extra += ["logits_soft_cap"] if getattr(a.impl, "logits_soft_cap", None) else []
            if extra:
                raise ValueError(f"draft model {type(model).__name__}: layer {a.layer_name} uses {extra}, which "
                                 f"the tree drafter's attention does not apply; use a draft model without them")
        super().__init__(model, attns)
        hf, a = model.config, attns[0]
        vocab = int(model.logits_processor.org_vocab_size if hasattr(model.logits_processor, "org_vocab_size")
                    else hf.vocab_size)
        self.cfg = Eagle3Config(hidden=hf.hidden_size, target_hidden=hf.hidden_size, num_aux=0, layers=len(attns),
                                heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_size, intermediate=0,
                                vocab=vocab, draft_vocab=vocab, eps=0.0, max_position=0, rope_parameters=None)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long, device=next(model.parameters()).device))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def _run(self, tokens, positions, g):
        h = self.model(input_ids=tokens, positions=positions)
        return h, h
