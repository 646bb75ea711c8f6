"""DeepSeek-V4 attention in plain PyTorch: the reference model.

This is a small, readable model with DeepSeek-V4's attention and decode-state
semantics (docs/reference-model.md), meant as the oracle for tree
verification over compressed attention. Per layer:

    cQ_t      = RMSNorm(W_qa h_t)
    q_{t,i}   = RoPE_t(unitRMS((W_qb cQ_t)_i))               H query heads of width c
    k_t       = RoPE_t(RMSNorm(W_kv h_t))                    one shared K = V head (MQA)

    compressor (CSA: m = 4, windows of 2m with a/b halves; HCA: m', no overlap)
    C_j, Z_j  = W_KV h_j, W_Z h_j + ape[j mod m]             the position bias only enters the gate
    kC_w      = RoPE_{w m}(RMSNorm(sum_slots softmax_slots(Z) * C))   per channel

    lightning indexer (CSA): its own compressor at width c_I gives keys KI_w;
    I_{t,w}   = sum_h wI_{t,h} ReLU(qI_{t,h} . KI_w),  top-k over visible w

    context(t) = window {k_s : t-W < s <= t}
               + compressed {kC_w : w < floor((t+1)/m)}   (CSA: only the indexer's top-k)
    o_{t,i}   = softmax over context + a per-head sink logit (denominator only), V = K
    out_t     = W_ob concat_g(W_oa^g concat_{i in g} RoPE_{-t}(o_{t,i}))

The rest of the block (mHC, MoE, quantisation) is per token and is replaced
by a pre-norm residual block with a dense SwiGLU MLP. The Hadamard rotation
of the indexer is orthonormal on both sides, so it is omitted (it only
matters together with FP4 simulation).

Two forwards share the per-token maths but not the context logic:

* `forward_dense(tokens)` is stateless: it computes every entry by reshaping
  the whole sequence into blocks and every context with boolean masks. It is
  the textbook oracle the stateful path is checked against.
* `forward_rows(tokens, plan, cache, scratch)` is how decoding works: each
  query row writes its rows to the slots its `StepPlan` names and reads its
  context through explicit slot lists (dsv4_plan.py), as vLLM's sparse
  kernels do. Prefill, decode, tree verification and the tree-mask negative
  control differ only in the plan.

Index ties in the indexer's top-k (e.g. several scores exactly 0 after the
ReLU) go to the older entry, so the selection is a function of the scores
alone, not of tensor layout.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from vllm_tree_spec.reference.dsv4_cache import PAD_SLOT, DSV4Cache, LayerBuffers, gather_slots, write_slots
from vllm_tree_spec.reference.dsv4_config import CSA_RATIO, DSV4Config
from vllm_tree_spec.reference.dsv4_plan import RatioPlan, StepPlan

# ---------------------------------------------------------------------------
# Per-token maths


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


@lru_cache(maxsize=None)
def _inv_freq(theta: float, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return theta ** (-torch.arange(0, rope_dim, 2, dtype=dtype) / rope_dim)  # [r/2]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dim` channels of x by position (interleaved GPT-J pairs).

    x [..., D]; positions broadcastable to x.shape[:-1] after right-padding
    with singleton dims (e.g. [R] for x [R, H, D]). inverse=True applies RoPE_{-t}.
    """
    pos = positions.to(x.dtype)
    while pos.dim() < x.dim() - 1:
        pos = pos.unsqueeze(-1)
    angle = pos.unsqueeze(-1) * _inv_freq(theta, rope_dim, x.dtype)  # [..., r/2]
    cos, sin = angle.cos(), angle.sin()
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    even, odd = rot[..., 0::2], rot[..., 1::2]  # [..., r/2] pairs (2i, 2i+1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def attend_with_sink(q: torch.Tensor, ctx: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """One softmax over a per-query context plus a per-head sink logit.

    q [R, H, c], ctx [R, K, c] (key and value), valid [R, K], sink [H] -> o [R, H, c].
    The sink only adds exp(sink) to the denominator; it has no value.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = torch.einsum("rhc,rkc->rhk", q, ctx) * scale  # [R, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.view(1, -1, 1).expand(q.shape[0], -1, 1)  # [R, H, 1]
    probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("rhk,rkc->rhc", probs, ctx)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k columns per row among valid ones; ties go to the lower column (older entry).

    scores, valid [R, K] -> (columns [R, k'], picked [R, k']) with k' = min(k, K);
    picked is False where fewer than k' columns were valid.
    """
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # [R, k']
    return order, valid.gather(1, order)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------------
# Compressor and indexer


class Compressor(nn.Module):
    """Softmax-gated pooling of m tokens (HCA) or 2m overlapped tokens (CSA) into one entry.

    Per token it produces one state row pair (C_j, Z_j + ape[j mod m]), each of
    width coff * d (coff = 2 for CSA: [a | b] halves). The entry of block w
    pools, per channel:
        CSA  slots 0..m-1: a halves of block w-1 (w = 0: masked), slots m..2m-1: b halves of block w
        HCA  slots 0..m-1: block w
    """

    def __init__(self, dim: int, head_dim: int, ratio: int, rope_dim: int, eps: float):
        super().__init__()
        self.ratio, self.head_dim, self.rope_dim = ratio, head_dim, rope_dim
        self.coff = 2 if ratio == CSA_RATIO else 1
        self.wkv = nn.Linear(dim, self.coff * head_dim, bias=False)
        self.wgate = nn.Linear(dim, self.coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, self.coff * head_dim))  # position bias B
        self.norm = RMSNorm(head_dim, eps)

    def rows(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [R, D], positions [R] -> state rows kv, score [R, coff * d]."""
        return self.wkv(h), self.wgate(h) + self.ape[positions % self.ratio]

    def pool(
        self, kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor, block_start: torch.Tensor, theta: float
    ) -> torch.Tensor:
        """Entries from their pooling windows.

        kv, score [E, coff * m, coff * d] rows of the window, oldest first;
        valid [E, coff * m]; block_start [E] = w * m (the entry's RoPE position).
        Returns [E, d].
        """
        m, d = self.ratio, self.head_dim
        if self.coff == 2:  # a halves of the previous block, b halves of the own block
            values = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)  # [E, 2m, d]
            logits = torch.cat((score[:, :m, :d], score[:, m:, d:]), dim=1)
        else:
            values, logits = kv, score  # [E, m, d]
        logits = logits.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        weights = torch.softmax(logits, dim=1)  # over tokens, separately per channel
        pooled = (weights * values).sum(dim=1)  # [E, d]
        return rope(self.norm(pooled), block_start, theta, self.rope_dim)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor plus per-head ReLU scores."""

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, CSA_RATIO, self.rope_dim, cfg.rms_norm_eps)

    def scores(
        self, cq: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, theta: float
    ) -> torch.Tensor:
        """cQ [R, q_lora], h [R, D], positions [R], keys [R, K, c_I] -> I [R, K]."""
        q = self.wq_b(cq).view(-1, self.n_heads, self.head_dim)  # [R, nI, cI]
        q = rope(q, positions, theta, self.rope_dim)
        w = self.weights_proj(h) * (self.head_dim**-0.5 * self.n_heads**-0.5)  # [R, nI]
        dots = torch.einsum("rhc,rkc->rhk", q, keys)  # [R, nI, K]
        return torch.einsum("rh,rhk->rk", w, dots.relu())


# ---------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int):
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratio(layer)
        self.theta = cfg.layer_rope_theta(layer)
        H, c, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.n_heads, self.head_dim, self.rope_dim = H, c, cfg.qk_rope_head_dim
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * c, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, c, bias=False)
        self.kv_norm = RMSNorm(c, eps)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        G = cfg.o_groups
        self.wo_a = nn.Parameter(torch.zeros(G, cfg.o_lora_rank, H // G * c))  # per-group low rank
        self.wo_b = nn.Linear(G * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.compressor = None if self.kind == "swa" else Compressor(cfg.hidden_size, c, self.ratio, self.rope_dim, eps)
        self.indexer = Indexer(cfg) if self.kind == "csa" else None

    # -- per-token parts -----------------------------------------------------

    def project(self, h: torch.Tensor, positions: torch.Tensor):
        """h [R, D] -> q [R, H, c], k [R, c], cQ [R, q_lora]."""
        cq = self.q_norm(self.wq_a(h))
        q = self.wq_b(cq).view(-1, self.n_heads, self.head_dim)
        q = rope(rms_norm(q, None, self.cfg.rms_norm_eps), positions, self.theta, self.rope_dim)
        k = rope(self.kv_norm(self.wkv(h)), positions, self.theta, self.rope_dim)
        return q, k, cq

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [R, H, c] -> [R, D]: undo the values' RoPE at the query position, grouped low-rank out."""
        o = rope(o, positions, self.theta, self.rope_dim, inverse=True)
        G = self.wo_a.shape[0]
        o = o.reshape(o.shape[0], G, -1)  # [R, G, H/G * c]
        return self.wo_b(torch.einsum("rgi,goi->rgo", o, self.wo_a).flatten(1))

    # -- stateful forward over planned rows -----------------------------------

    def forward_rows(self, h: torch.Tensor, plan: StepPlan, cache: LayerBuffers, scratch: LayerBuffers) -> torch.Tensor:
        """h [R, D] -> [R, D]. Writes this layer's rows, then reads contexts (write-before-read)."""
        pos = plan.positions
        q, k, cq = self.project(h, pos)
        write_slots(cache.kv, scratch.kv, plan.kv_write, k)
        ctx, valid = gather_slots(cache.kv, scratch.kv, plan.window)  # [R, W, c], [R, W]
        if self.compressor is not None:
            rp = plan.ratios[self.ratio]
            # The indexer's compressor runs first, then the main one (vLLM's order; independent here).
            if self.indexer is not None:
                self._compress(self.indexer.compressor, h, pos, plan, rp, cache, scratch, "idx_")
            self._compress(self.compressor, h, pos, plan, rp, cache, scratch, "")
            slots = rp.entries  # [R, K]
            if self.indexer is not None:
                keys, kvalid = gather_slots(cache.idx_keys, scratch.idx_keys, slots)  # [R, K, cI]
                scores = self.indexer.scores(cq, h, pos, keys, self.theta)
                cols, picked = select_topk(scores, kvalid, self.cfg.index_topk)
                slots = torch.where(picked, slots.gather(1, cols), PAD_SLOT)  # [R, k']
            entries, evalid = gather_slots(cache.entries, scratch.entries, slots)  # [R, k', c]
            ctx, valid = torch.cat((ctx, entries), dim=1), torch.cat((valid, evalid), dim=1)
        o = attend_with_sink(q, ctx, valid, self.attn_sink)
        return self.output(o, pos)

    def _compress(self, comp: Compressor, h, pos, plan: StepPlan, rp: RatioPlan, cache, scratch, prefix: str) -> None:
        """Write every row's compressor state rows, then pool and write the entries completed here."""
        kv_name, score_name = prefix + "state_kv", prefix + "state_score"
        entry_name = "idx_keys" if prefix else "entries"
        kv, score = comp.rows(h, pos)  # [R, coff * d] each
        write_slots(cache.tensors[kv_name], scratch.tensors[kv_name], plan.state_write, kv)
        write_slots(cache.tensors[score_name], scratch.tensors[score_name], plan.state_write, score)
        if rp.emit_rows.numel() == 0:
            return
        win_kv, valid = gather_slots(cache.tensors[kv_name], scratch.tensors[kv_name], rp.gather)  # [E, coff*m, coff*d]
        win_score, _ = gather_slots(cache.tensors[score_name], scratch.tensors[score_name], rp.gather)
        block_start = pos[rp.emit_rows] + 1 - comp.ratio  # w * m
        entries = comp.pool(win_kv, win_score, valid, block_start, self.theta)
        write_slots(cache.tensors[entry_name], scratch.tensors[entry_name], rp.entry_write, entries)

    # -- stateless oracle ----------------------------------------------------

    def forward_dense(self, h: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h [T, D] for positions 0..T-1 -> ([T, D], the state buffers a cache would hold)."""
        T = h.shape[0]
        pos = torch.arange(T)
        q, k, cq = self.project(h, pos)
        state = {"kv": k}
        t, s = pos.view(-1, 1), pos.view(1, -1)
        ctx, valid = k, (s <= t) & (s > t - self.cfg.sliding_window)  # [T, c], [T, T]
        if self.compressor is not None:
            m = self.ratio
            visible = torch.arange(T // m).view(1, -1) < (t + 1) // m  # [T, T // m]: w < floor((t+1)/m)
            if self.indexer is not None:
                ikeys = self._dense_entries(self.indexer.compressor, h, pos, state, "idx_")
                scores = self.indexer.scores(cq, h, pos, ikeys.expand(T, -1, -1), self.theta)
                cols, picked = select_topk(scores, visible, self.cfg.index_topk)
                selected = torch.zeros_like(visible).scatter_(1, cols, picked)
                visible = visible & selected
            entries = self._dense_entries(self.compressor, h, pos, state, "")
            ctx, valid = torch.cat((ctx, entries)), torch.cat((valid, visible), dim=1)
        o = attend_with_sink(q, ctx.expand(T, -1, -1), valid, self.attn_sink)
        return self.output(o, pos), state

    def _dense_entries(self, comp: Compressor, h, pos, state: dict, prefix: str) -> torch.Tensor:
        """All complete blocks' entries [T // m, d] by reshaping the sequence into blocks."""
        kv, score = comp.rows(h, pos)  # [T, coff * d]
        state[prefix + "state_kv"], state[prefix + "state_score"] = kv, score
        m, nb = comp.ratio, h.shape[0] // comp.ratio
        kv_b = kv[: nb * m].view(nb, m, -1)  # [nb, m, coff * d]
        score_b = score[: nb * m].view(nb, m, -1)
        valid = torch.ones(nb, comp.coff * m, dtype=torch.bool)
        if comp.coff == 2:  # prepend block w-1 (a zero block before w = 0, masked out)
            kv_b = torch.cat((torch.cat((torch.zeros_like(kv_b[:1]), kv_b[:-1])), kv_b), dim=1)
            score_b = torch.cat((torch.cat((torch.zeros_like(score_b[:1]), score_b[:-1])), score_b), dim=1)
            valid[0, :m] = False
        entries = comp.pool(kv_b, score_b, valid, torch.arange(nb) * m, self.theta)
        state["idx_keys" if prefix else "entries"] = entries
        return entries


# ---------------------------------------------------------------------------
# Model


class Block(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps)
        self.attn = Attention(cfg, layer)
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffn_norm(x)
        return self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class DSV4Model(nn.Module):
    """Embedding, blocks with DeepSeek-V4 attention, final norm and LM head."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype = torch.float64, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)
        self.requires_grad_(False)
        self._init_random(seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _init_random(self, seed: int) -> None:
        """Random weights that keep activations O(1) and make every mechanism matter.

        Linear maps ~ N(0, 1/fan_in); norm weights ~ 1 + 0.1 N(0, 1); position
        biases, sinks and the embedding ~ N(0, 1), so the gate bias, the sink
        and the compressed entries all move the logits.
        """
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("wo_a"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1]))
            elif p.dim() == 2 and not name.endswith(("ape", "embed.weight")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward_rows(
        self, tokens: torch.Tensor, plan: StepPlan, cache: DSV4Cache, scratch: list[LayerBuffers]
    ) -> torch.Tensor:
        """tokens [R] -> logits [R, V]; reads and writes exactly the slots the plan names."""
        x = self.embed(tokens)  # [R, D]
        for block, layer_cache, layer_scratch in zip(self.blocks, cache.layers, scratch):
            x = x + block.attn.forward_rows(block.attn_norm(x), plan, layer_cache, layer_scratch)
            x = x + block.mlp(x)
        return self.lm_head(self.norm(x))

    def forward_dense(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Stateless teacher-forced forward: tokens [T] at positions 0..T-1 -> (logits [T, V], per-layer state)."""
        x = self.embed(tokens)
        states = []
        for block in self.blocks:
            a, state = block.attn.forward_dense(block.attn_norm(x))
            x = x + a
            x = x + block.mlp(x)
            states.append(state)
        return self.lm_head(self.norm(x)), states
