"""The EAGLE tree heads as vLLM's own models on Model Runner V2 (patch record P18).

vLLM's linear `eagle3` / `eagle` load their head with `load_eagle_model` (`v1/worker/gpu/spec_decode/eagle/
utils.py`): `Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM` built from an `eagle3` / `eagle` speculative
config, weights through vLLM's loader (tensor-parallel shards on every rank), the target's embedding and LM
head shared as modules where the head has none. The tree drafters load the same way (`load_vllm_head`), so
their head is vLLM's class with vLLM's parallel linear layers, norms, RoPE and logits processor; only its
attention differs: a tree level needs an ancestor mask, which vLLM's draft attention cannot express.

The head's `Attention` layers are vLLM's (registered by the model, so vLLM counts and allocates their pages
with the target's: `draft_kv.py` reads and writes them). Each one's forward is replaced on the instance by
the drafter's masked attention (`eagle3_head.attend`) over the request's entries gathered from those pages
plus the tree's columns: each rank attends with its own heads over its own shard of the KV, and the row-
parallel output projection sums the ranks, as in vLLM's forward.

`VllmEagleHead` gives the drafters (`drafters/eagle3.py`, `drafters/eagle.py`) the interface of the plugin's
PyTorch heads (`eagle3_head.Eagle3Head`, `eagle_head.EagleHead`, which the V1 runner keeps): `cfg` (heads
and KV heads: this rank's), `combine`, `forward(tokens, g, positions, mask, cache, cols, rows)`,
`target_ids`.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from vllm_tree_spec.drafters import eagle_head
from vllm_tree_spec.drafters.eagle3_head import Eagle3Config, attend, to_target_vocab

METHODS = ("eagle3", "eagle")  # the drafter keys whose heads are vLLM's classes on V2 (vLLM's method names)


def head_view(vllm_config, method: str, path: str, num_speculative_tokens: int):
    """The runner's config as vLLM's EAGLE loader expects it: an `eagle3` / `eagle` speculative config for the head
    (vLLM builds the head's model config, dtype and parallel config), and a cache config of full attention
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


def load_vllm_head(runner) -> bool:
    """At load: an EAGLE-3 / EAGLE tree drafter gets vLLM's head (False: no such drafter)."""
    drafter = getattr(runner.drafter, "drafter", None)
    if getattr(drafter, "key", None) not in METHODS or drafter.head is not None:
        return False
    drafter.set_head(load_vllm_eagle_head(runner, drafter.key, drafter.path))
    return True


def load_vllm_eagle_head(runner, method: str, path: str) -> "VllmEagleHead":
    """vLLM's `method` head for the runner's target, loaded by vLLM's EAGLE loader (shards per rank)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    view = head_view(runner.vllm_config, method, path, runner.vllm_config.speculative_config.num_speculative_tokens)
    with set_current_vllm_config(view):
        model = load_eagle_model(runner.get_model(), view)
    return VllmEagleHead(model, method)


class VllmEagleHead(nn.Module):
    """vLLM's `Eagle3LlamaForCausalLM` / `EagleLlamaForCausalLM` behind the drafters' head interface (module
    docstring)."""

    def __init__(self, model: nn.Module, method: str):
        super().__init__()
        self.model = model
        model.model.do_not_compile = True  # drafting runs eagerly: a tree level's shapes vary every step
        self.attns = [layer.self_attn.attn for layer in model.model.layers]
        a = self.attns[0]
        cfg = Eagle3Config.from_hf(model.config) if method == "eagle3" else eagle_head.config_from_hf(model.config)
        self.cfg: Eagle3Config = replace(cfg, heads=a.num_heads, kv_heads=a.num_kv_heads)
        self.layer_names = [attn.layer_name for attn in self.attns]
        self._call = None  # (mask, cache, cols, B, n) of the forward in progress
        for i, attn in enumerate(self.attns):
            attn.tree_draft_kv = True  # the target's commit leaves its slots alone (commit.py)
            attn.forward = self._attention(i)
        d2t = getattr(model, "draft_id_to_target_id", None)
        d2t = torch.zeros(self.cfg.draft_vocab, dtype=torch.long) if d2t is None else d2t.detach().clone()
        self.register_buffer("d2t", d2t.to(next(model.parameters()).device))

    def _attention(self, i: int):
        attn = self.attns[i]

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            mask, cache, cols, bsz, n = self._call  # q [B*n, H*D], k / v [B*n, H_kv*D], roped by vLLM
            d = attn.head_size
            out = attend(q.view(bsz, n, attn.num_heads, d), k.view(bsz, n, attn.num_kv_heads, d),
                         v.view(bsz, n, attn.num_kv_heads, d), mask, None if cache is None else cache[i], cols)
            return out.reshape(bsz * n, -1)

        return forward

    @property
    def feature_size(self) -> int:
        return self.cfg.num_aux * self.cfg.target_hidden

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V] over the target vocabulary (-inf outside the draft vocabulary)."""
        return to_target_vocab(draft_logits, self.target_ids, self.cfg.vocab, float("-inf"))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features -> g: EAGLE-3 [..., num_aux * H_target] -> [..., H] (vLLM's
        `combine_hidden_states`); EAGLE-1: the target's hidden state is the feature."""
        combine = getattr(self.model, "combine_hidden_states", None)
        if combine is None:
            return aux
        return combine(aux.reshape(-1, aux.shape[-1])).view(*aux.shape[:-1], -1)

    def forward(self, tokens, g, positions, mask, cache=None, cols=None, rows=None):
        """As `Eagle3Head.forward`: (draft logits [B, n, V_draft], g' [B, n, H]), or [B, ...] with rows."""
        bsz, n = tokens.shape
        self._call = (mask, cache, cols, bsz, n)
        try:
            h, g_next = self.model(tokens.reshape(-1), positions.reshape(-1), g.reshape(bsz * n, -1))
        finally:
            self._call = None
        h, g_next = h.view(bsz, n, -1), g_next.view(bsz, n, -1)
        if rows is not None:
            b = torch.arange(bsz, device=h.device)
            h, g_next = h[b, rows], g_next[b, rows]  # [B, H]
        logits = self.model.logits_processor(self.model.lm_head, h.reshape(-1, h.shape[-1]))
        return logits.view(*h.shape[:-1], -1), g_next
