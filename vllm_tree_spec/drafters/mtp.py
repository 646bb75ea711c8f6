"""DeepSeek-V4's MTP head as a tree drafter.

The MTP module (`mtp.{k}.*` in DeepSeek-V4 checkpoints) is one SWA-only
decoder block fed the target's pre-`hc_head` residual h_p (hc_mult streams)
and the embedding of the next token: the row at position p reads
(token_{p+1}, h_p) and predicts token_{p+2} (vLLM's `nvidia/mtp.py`):

    x   = h_proj(hnorm(h_p)) + e_proj(enorm(embed(token_{p+1})))     [hc, H], embedding zeroed at p = 0
    x   = block(x, p)        mHC pre -> SWA attention (window W, sink) -> mHC post -> mHC pre -> MoE -> post
    q   = softmax(head(norm(hc_head(x))))                            next-next token distribution

Chained drafting re-feeds the block's own output x as the next row's h. A tree
does the same per node: node n at depth d sits in MTP row position
root_pos - 1 + d, reads (token_n, x_parent) and attends to the committed MTP
rows of the window plus its ancestors' rows (tree mask). Children are chosen
by the policy (`policy.py`: static top-k shapes or the EAGLE-2 dynamic
rerank) through the builders in `build.py`, exactly as for the draft-model
drafter: one MTP forward per tree level.

State per request: the committed MTP K = V rows of the last W positions (its
window store: `FloatWindow`, the drafter's own float rows, or on Model Runner V2
vLLM's paged SWA cache of the MTP layer, `integration/v2/mtp_window.py`) and
the output (x, logits) of the last committed row. After every target step the
runner hands over the rows it committed (`observe_target`: prefill rows, or
the tree's root and accepted nodes); the drafter runs them through the block
with the target's true hidden states (catch-up), so tree rows never enter the
committed state and nothing needs rolling back.

vLLM's own MTP path raises NotImplementedError on CPU (`cpu/mtp.py`); this
drafter drives the same module's weights directly in PyTorch and reuses the
target's mHC ops (vLLM's CPU layers: `MHCPreOp`, `MHCPostOp`, `HCHeadOp`; its
NVIDIA layers: the fused mHC kernels; integration/dsv4/mhc_ops.py), so mixing
follows vLLM's kernels on every platform. Differences to vLLM's MTP kernels, all
harmless for a drafter (verification is exact whatever the drafts): the
window KV is kept in float (`FloatWindow`) instead of vLLM's fp8 cache, and the
MoE runs as plain per-expert matmuls. Weights: bf16/fp32, or FP8 with 128x128 block
scales (dequantised at load); MXFP4 experts are refused.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
import torch.nn.functional as F

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest, DrafterError, TreeDrafter, TreeProposal, deterministic_mode
from vllm_tree_spec.drafters.policy import DynamicPolicy, StaticPolicy, TreePolicy, parse_policy
from vllm_tree_spec.drafters.suffix import as_int_list
from vllm_tree_spec.reference.dsv4 import attend_with_sink, rope

FP8_BLOCK = 128


# ---------------------------------------------------------------------------
# Weights


def load_checkpoint_tensors(model_dir: str, prefixes: Sequence[str]) -> dict[str, torch.Tensor]:
    """Tensors whose names start with any of `prefixes`, from the safetensors files of a checkpoint."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(model_dir, v) for k, v in weight_map.items() if k.startswith(tuple(prefixes))})
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(tuple(prefixes)):
                    out[name] = f.get_tensor(name)
    return out


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        if w.dtype in (torch.int8, torch.uint8):
            raise DrafterError("MTP drafter: packed (MXFP4) weights are not supported; use an FP8/BF16 checkpoint")
        return w.to(dtype)
    s = scale.float()
    m, k = w.shape
    s = s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:m, :k]
    return (w.float() * s).to(dtype)


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if w is None else y * w.float()).to(x.dtype)


@dataclass
class MTPConfig:
    hidden: int
    hc: int
    heads: int
    head_dim: int
    rope_dim: int
    o_groups: int
    window: int
    rope_theta: float
    eps: float
    hc_eps: float
    sinkhorn: int
    topk_experts: int
    routed_scale: float
    swiglu_limit: float | None
    vocab: int

    @staticmethod
    def from_hf(c: Any) -> "MTPConfig":
        g = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        return MTPConfig(
            hidden=g("hidden_size"), hc=g("hc_mult"), heads=g("num_attention_heads"), head_dim=g("head_dim"),
            rope_dim=g("qk_rope_head_dim"), o_groups=g("o_groups"), window=g("sliding_window"),
            rope_theta=float(g("rope_theta", 10000.0)), eps=float(g("rms_norm_eps", 1e-6)),
            hc_eps=float(g("hc_eps", 1e-6)), sinkhorn=int(g("hc_sinkhorn_iters", 20)),
            topk_experts=g("num_experts_per_tok"), routed_scale=float(g("routed_scaling_factor", 1.0)),
            swiglu_limit=g("swiglu_limit"), vocab=g("vocab_size"))


class MTPHead:
    """One DeepSeek-V4 MTP layer in PyTorch (see the module docstring for the maths).

    Args:
        tensors: checkpoint tensors with the layer's prefix stripped (`enorm.weight`, `attn.wq_a.weight`, ...),
            plus `embed.weight` and (if the layer has none of its own) `head.weight`.
        cfg: MTPConfig.
        mhc_pre, mhc_post, hc_head: callables with vLLM's MHCPreOp / MHCPostOp / HCHeadOp signatures
            (the target's op instances), or None for the PyTorch fallbacks `mhc_pre_torch` etc.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: MTPConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", mhc_pre=None, mhc_post=None, hc_head=None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        scales = {k[: -len(".scale")]: v for k, v in tensors.items() if k.endswith(".scale")}

        def w(name: str, dt: torch.dtype | None = None) -> torch.Tensor:
            if name not in tensors:
                raise DrafterError(f"MTP drafter: checkpoint tensor {name!r} is missing")
            t = tensors[name]
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            t = _dequant(t, scales.get(base), dt or dtype) if t.dim() == 2 and base in scales else t.to(dt or dtype)
            return t.to(self.device)

        f32 = torch.float32
        self.embed = w("embed.weight")
        self.head = w("head.weight")
        self.enorm, self.hnorm, self.norm = w("enorm.weight", f32), w("hnorm.weight", f32), w("norm.weight", f32)
        self.e_proj, self.h_proj = w("e_proj.weight"), w("h_proj.weight")
        self.hc_head_w = [w("hc_head_fn", f32), w("hc_head_scale", f32), w("hc_head_base", f32)]
        self.hc_attn = [w("hc_attn_fn", f32), w("hc_attn_scale", f32), w("hc_attn_base", f32)]
        self.hc_ffn = [w("hc_ffn_fn", f32), w("hc_ffn_scale", f32), w("hc_ffn_base", f32)]
        self.attn_norm, self.ffn_norm = w("attn_norm.weight", f32), w("ffn_norm.weight", f32)
        a = "attn."
        self.wq_a, self.wkv, self.wq_b = w(a + "wq_a.weight"), w(a + "wkv.weight"), w(a + "wq_b.weight")
        self.q_norm, self.kv_norm = w(a + "q_norm.weight", f32), w(a + "kv_norm.weight", f32)
        wo_a = w(a + "wo_a.weight")
        self.wo_a = wo_a.view(cfg.o_groups, -1, wo_a.shape[1])  # [G, o_lora, H/G * c]
        self.wo_b = w(a + "wo_b.weight")
        self.sink = w(a + "attn_sink", f32)
        fn = "ffn."
        self.gate = w(fn + "gate.weight", f32)
        bias = tensors.get(fn + "gate.bias")
        self.gate_bias = None if bias is None else bias.to(f32).to(self.device)
        n_exp = self.gate.shape[0]
        self.w13 = torch.stack([torch.cat([w(f"{fn}experts.{e}.w1.weight"), w(f"{fn}experts.{e}.w3.weight")])
                                for e in range(n_exp)])  # [E, 2I, H]
        self.w2 = torch.stack([w(f"{fn}experts.{e}.w2.weight") for e in range(n_exp)])  # [E, H, I]
        self.shared13 = (torch.cat([w(fn + "shared_experts.w1.weight"), w(fn + "shared_experts.w3.weight")])
                         if fn + "shared_experts.w1.weight" in tensors else None)
        self.shared2 = w(fn + "shared_experts.w2.weight") if self.shared13 is not None else None
        self._mhc_pre = mhc_pre or mhc_pre_torch
        self._mhc_post = mhc_post or mhc_post_torch
        self._hc_head = hc_head or hc_head_torch

    # -- pieces ------------------------------------------------------------------------------------

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        d = gu.shape[-1] // 2
        g, u = gu[..., :d].float(), gu[..., d:].float()
        lim = self.cfg.swiglu_limit
        if lim is not None:
            g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        return (F.silu(g) * u).to(gu.dtype)

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: sqrt(softplus) routing, bias-steered top-k, renormalised, scaled; + shared."""
        c = self.cfg
        logits = x.float() @ self.gate.t()  # [T, E]
        scores = torch.sqrt(F.softplus(logits))
        sel = scores + self.gate_bias if self.gate_bias is not None else scores
        ids = torch.topk(sel, c.topk_experts, dim=-1).indices  # [T, k]
        wts = scores.gather(1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * c.routed_scale
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            h = self._swiglu(F.linear(x[rows], self.w13[e]))
            out.index_add_(0, rows, F.linear(h, self.w2[e]).float() * wts[rows, slot, None])
        if self.shared13 is not None:
            out += F.linear(self._swiglu(F.linear(x, self.shared13)), self.shared2).float()
        return out.to(x.dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, heads, c] (per-head unit RMS, RoPE), kv [T, c] (RoPE), float32."""
        c = self.cfg
        qr = _rms(F.linear(x, self.wq_a), self.q_norm, c.eps)
        kv = _rms(F.linear(x, self.wkv), self.kv_norm, c.eps).float()
        q = F.linear(qr, self.wq_b).view(-1, c.heads, c.head_dim).float()
        q = rope(_rms(q, None, c.eps), positions, c.rope_theta, c.rope_dim)
        return q, rope(kv, positions, c.rope_theta, c.rope_dim)

    def attn_out(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        o = rope(o, positions, c.rope_theta, c.rope_dim, inverse=True).to(self.dtype)  # [T, heads, c]
        o = o.reshape(o.shape[0], c.o_groups, -1)  # [T, G, heads/G * c]
        z = torch.einsum("tgi,goi->tgo", o, self.wo_a).flatten(1)
        return F.linear(z, self.wo_b)

    # -- one row set ----------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor, context_fn,
                window=None, slots: torch.Tensor | None = None):
        """Rows (token_{p+1}, h_p) at positions p.

        tokens [T], positions [T], prev [T, hc, H] (target residual or an earlier MTP output).
        context_fn(kv [T, c]) -> (ctx [T, K, c], valid [T, K]): each row's window, its own kv included.
        window, slots: the drafter's window store and, for committed rows, their slots in it (a paged store
            keeps rows as its head writes them: vLLM's MTP model only); this head's rows stay float.
        Returns (x [T, hc, H] the row outputs, kv [T, c] their K = V rows, logits [T, V]).
        """
        if getattr(window, "paged", False):
            raise DrafterError("the PyTorch MTP head keeps its window in float rows; it cannot write a paged cache")
        c = self.cfg
        e = F.embedding(tokens, self.embed)
        e = torch.where((positions == 0)[:, None], torch.zeros_like(e), e)
        e = _rms(e, self.enorm, c.eps)
        h = _rms(prev.to(self.dtype), self.hnorm, c.eps)
        x = F.linear(h, self.h_proj) + F.linear(e, self.e_proj).unsqueeze(-2)  # [T, hc, H]
        residual = x
        post, comb, li = self._pre(x, self.hc_attn)
        q, kv = self.project(_rms(li, self.attn_norm, c.eps), positions)
        ctx, valid = context_fn(kv)
        o = attend_with_sink(q, ctx, valid, self.sink)
        x = self._mhc_post(self.attn_out(o, positions), residual, post, comb)
        residual = x
        post, comb, li = self._pre(x, self.hc_ffn)
        x = self._mhc_post(self.moe(_rms(li, self.ffn_norm, c.eps)), residual, post, comb)
        return x, kv, self.logits(x)

    def _pre(self, x, w):
        c = self.cfg
        return self._mhc_pre(residual=x, fn=w[0], hc_scale=w[1], hc_base=w[2], rms_eps=c.eps, hc_pre_eps=c.hc_eps,
                             hc_sinkhorn_eps=c.hc_eps, hc_post_mult_value=2.0, sinkhorn_repeat=c.sinkhorn)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        y = self._hc_head(x, self.hc_head_w[0], self.hc_head_w[1], self.hc_head_w[2], c.eps, c.hc_eps)
        return F.linear(_rms(y, self.norm, c.eps), self.head).float()  # [T, V]


# ---------------------------------------------------------------------------
# PyTorch fallbacks of vLLM's mHC ops (DeepSeek-V4 reference semantics), used when no target ops are given


def _split_sinkhorn(mixes, scale, base, hc, iters, eps):
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * torch.sigmoid(mixes[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = mixes[..., 2 * hc:].view(*mixes.shape[:-1], hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def mhc_pre_torch(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                  sinkhorn_repeat, **_):
    x = residual.flatten(-2).float()  # [T, hc * H]
    mixes = (x @ fn.t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    hc = residual.shape[-2]
    pre, post, comb = _split_sinkhorn(mixes, hc_scale, hc_base, hc, sinkhorn_repeat, hc_sinkhorn_eps)
    post = (post * hc_post_mult_value / 2.0).unsqueeze(-1)  # [T, hc, 1], as vLLM's op returns it
    y = (pre.unsqueeze(-1) * residual.float()).sum(-2)
    return post, comb, y.to(residual.dtype)


def mhc_post_torch(x, residual, post, comb):
    """out_j = post_j * x + sum_i comb_ij * residual_i; post [T, hc, 1], comb [T, hc, hc]."""
    y = post * x.float().unsqueeze(-2) + (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return y.to(x.dtype)


def hc_head_torch(x, fn, scale, base, rms_eps, hc_eps):
    xf = x.flatten(-2).float()
    mixes = (xf @ fn.t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)
    gate = torch.sigmoid(mixes * scale[0] + base) + hc_eps
    return (gate.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


# ---------------------------------------------------------------------------
# The drafter


@dataclass
class _State:
    req_id: Hashable = None
    kv_pos0: int = 0  # the first committed MTP row the window may read (a history gap restarts it)
    next_pos: int = 0  # one past the last committed MTP row
    kv: torch.Tensor | None = None  # FloatWindow: [n, c] the committed rows at positions next_pos - n ..
    pending: list = field(default_factory=list)  # [(positions [m], target hidden [m, hc, H])] not yet caught up
    root_x: torch.Tensor | None = None  # [hc, H] output of the last committed row
    root_logits: torch.Tensor | None = None  # [V]

    @property
    def root_pos(self) -> int:
        """Position of the tree root: one past the last committed MTP row (meaningful once root_x is set)."""
        return self.next_pos


class FloatWindow:
    """The committed MTP rows in the drafter's own float store: the last W rows per request (`_State.kv`).

    A window store's interface (also `integration/v2/mtp_window.PagedMTPWindow`): `rows_many` reads committed
    rows, `slots` says where a catch-up forward writes its rows (None: the head does not write), `commit` keeps
    a catch-up's rows, `restart` forgets a request's rows after a history gap, `retained_from` says which rows
    survive (a paged store loses the blocks vLLM's sliding-window manager frees)."""

    paged = False

    def __init__(self, window: int, dim: int):
        self.window, self.dim = window, dim

    def rows_many(self, spans: list[tuple[_State, int, int]]) -> list[torch.Tensor]:
        """[hi - lo, c] the committed rows of positions [lo, hi) of each (state, lo, hi)."""
        out = []
        for st, lo, hi in spans:
            if st.kv is None or hi <= lo:
                out.append(torch.zeros(0, self.dim))
                continue
            first = st.next_pos - st.kv.shape[0]
            out.append(st.kv[lo - first: hi - first])
        return out

    def slots(self, runs: list[tuple[_State, torch.Tensor]]) -> None:
        return None

    def commit(self, st: _State, new: torch.Tensor) -> None:
        """new [m, c]: the rows of positions next_pos .. next_pos + m - 1 (their catch-up's K = V rows)."""
        allk = new if st.kv is None else torch.cat([st.kv, new])
        st.kv = allk[max(0, allk.shape[0] - self.window):]

    def restart(self, st: _State) -> None:
        st.kv = None

    def retained_from(self, computed: int) -> int:
        """The first position whose row the store still holds when the target's step began at `computed`."""
        return 0


class _Session:
    """`build.DraftFn` over the MTP head: q at tree rows, one MTP forward per builder call."""

    def __init__(self, drafter: "MTPTreeDrafter", states: list[_State]):
        self.d, self.states = drafter, states
        self.nodes: list[dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in states]
        self._window: dict[int, tuple[int, torch.Tensor]] = {}  # id(state) -> (first position, committed rows)

    def _committed(self, st: _State) -> tuple[int, torch.Tensor]:
        """The committed rows a depth-1 row reads ([first, root_pos)), read from the store once per session for
        every state (deeper rows read a suffix of them)."""
        if id(st) not in self._window:
            spans = [(s, max(s.kv_pos0, s.root_pos - self.d.head.cfg.window + 1), s.next_pos) for s in self.states]
            for (s, lo, _), rows in zip(spans, self.d.window.rows_many(spans)):
                self._window[id(s)] = (lo, rows)
        return self._window[id(st)]

    def __call__(self, queries: Sequence[build.DraftQuery]) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(queries)
        rows = []
        for qi, qr in enumerate(queries):
            st = self.states[qr.request]
            if not qr.path:
                out[qi] = torch.softmax(st.root_logits, -1)
            else:
                rows.append((qi, qr.request, tuple(qr.path)))
        if rows:
            self._level(rows, out)
        return torch.stack(out)

    def _level(self, rows, out) -> None:
        d = self.d
        tokens, positions, prev, ctx_rows = [], [], [], []
        for qi, b, path in rows:
            st = self.states[b]
            parent = path[:-1]
            if parent and parent not in self.nodes[b]:
                raise DrafterError(f"tree row {path} queried before its parent row {parent}")
            px = st.root_x if not parent else self.nodes[b][parent][0]
            tokens.append(path[-1])
            positions.append(st.root_pos - 1 + len(path))
            prev.append(px)
            anc = [self.nodes[b][path[:k]][1] for k in range(1, len(path))]
            ctx_rows.append((st, anc))
        pos = torch.tensor(positions, device=d.device)

        def context_fn(kv_new):
            ctxs = []
            for j, (st, anc) in enumerate(ctx_rows):
                lo = max(st.kv_pos0, positions[j] - d.head.cfg.window + 1)
                first, committed = self._committed(st)
                ctxs.append(torch.cat([committed[lo - first:]] + [a[None] for a in anc] + [kv_new[j: j + 1]]))
            return _pad(ctxs)

        x, kv, logits = d.head.forward(torch.tensor(tokens, device=d.device), pos, torch.stack(prev), context_fn,
                                       window=d.window)
        for j, (qi, b, path) in enumerate(rows):
            self.nodes[b][path] = (x[j], kv[j])
            out[qi] = torch.softmax(logits[j], -1)


def _banded_window(old: torch.Tensor | None, new: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The W-row windows of a run of consecutive rows: old [o, c] the committed rows just before the run (o <= W),
    new [m, c] the run's rows -> (ctx [m, W, c] row j's window ending at itself, valid [m, W]). A strided view
    of the rows, so a long prefill costs m x W, not m x (o + m)."""
    allk = new if old is None else torch.cat([old, new])
    o = allk.shape[0] - new.shape[0]
    allk = allk[max(0, o - window + 1):]
    pad = max(0, window - 1 - o)
    if pad:
        allk = torch.cat([allk.new_zeros(pad, allk.shape[1]), allk])
    ctx = allk.unfold(0, window, 1).transpose(1, 2)  # [m, W, c]
    j = torch.arange(new.shape[0], device=new.device)[:, None]
    valid = (j + torch.arange(window, device=new.device)[None]) >= pad
    return ctx, valid


def _pad(ctxs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    k = max(c.shape[0] for c in ctxs)
    ctx = ctxs[0].new_zeros(len(ctxs), k, ctxs[0].shape[-1])
    valid = torch.zeros(len(ctxs), k, dtype=torch.bool, device=ctx.device)
    for i, c in enumerate(ctxs):
        ctx[i, : c.shape[0]] = c
        valid[i, : c.shape[0]] = True
    return ctx, valid


class MTPTreeDrafter(TreeDrafter):
    """Tree drafts from DeepSeek-V4's MTP head (static top-k shapes or EAGLE-2 dynamic trees).

    Args:
        policy: StaticPolicy / DynamicPolicy (or anything `parse_policy` accepts).
        model_dir: the DeepSeek-V4 checkpoint directory (reads `mtp.{layer}.*`, `embed.weight`, `head.weight`).
        hf_config: the checkpoint's config (dict or object).
        layer: which MTP layer drives the drafts (0; DeepSeek-V4 ships one).
        head: a ready `MTPHead` (tests), instead of model_dir / hf_config.
    """

    def __init__(self, policy: TreePolicy | Any, *, model_dir: str | None = None, hf_config: Any = None,
                 layer: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 max_num_batched_tokens: int = 8192, head: MTPHead | None = None, validate_proposals: bool = True):
        super().__init__(validate_proposals=validate_proposals)
        self.policy = parse_policy(policy)
        if not isinstance(self.policy, (StaticPolicy, DynamicPolicy)):
            raise DrafterError("the MTP drafter builds top-k trees (static paths or a dynamic s{steps}_k{topk}_d{n})")
        self.model_dir, self.hf_config, self.layer = model_dir, hf_config, layer
        self.dtype, self.device = dtype, torch.device(device)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.head, self.vocab_size = None, None
        self.window = None  # the committed rows' store (set with the head)
        self._states: dict[Hashable, _State] = {}
        self._hidden_source = None  # callable -> [T, hc * H] target residual rows of the last step
        if head is not None:
            self.set_head(head)

    # -- loading ------------------------------------------------------------------------------------

    key = "mtp"  # the config's drafter key

    def set_head(self, head) -> None:
        """The head to draft with: an `MTPHead`, or one with its interface (`cfg`, `forward`): vLLM's MTP model on
        Model Runner V2 (`integration/v2/mtp_head.py`)."""
        self.head = head
        self.vocab_size = head.cfg.vocab
        if self.window is None:
            self.window = FloatWindow(head.cfg.window, head.cfg.head_dim)

    def use_window(self, window) -> None:
        """Keep the committed rows in another store: vLLM's paged cache of the MTP layer (Model Runner V2)."""
        self.window = window

    def load_model(self, target_model=None) -> None:
        """Load the MTP layer unless a head is set; with a vLLM DeepSeek-V4 target, mix with its mHC ops and make it
        keep its residual rows (the MTP layer's input)."""
        cfg = self.head.cfg if self.head is not None else MTPConfig.from_hf(self.hf_config)
        ops = {}
        if target_model is not None:
            from vllm_tree_spec.integration.dsv4.mhc_ops import target_mhc_ops

            inner = getattr(target_model, "model", None)
            ops = target_mhc_ops(target_model)
            if ops:
                if getattr(inner, "_mtp_hidden_buffer", None) is None:
                    # the target stashes its pre-hc_head residual here every forward (only allocated by vLLM
                    # for its own EAGLE/MTP methods)
                    inner._mtp_hidden_buffer = torch.empty(
                        self.max_num_batched_tokens, cfg.hc * cfg.hidden, dtype=self.dtype, device=self.device)
                self._hidden_source = target_model.get_mtp_target_hidden_states
        if self.head is not None:
            return
        prefix = f"mtp.{self.layer}."
        raw = load_checkpoint_tensors(self.model_dir, [prefix, "embed.", "head."])
        if not any(k.startswith(prefix) for k in raw):
            raise DrafterError(f"{self.model_dir}: no MTP layer {self.layer} tensors ({prefix}*) in the checkpoint")
        tensors = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
        tensors.setdefault("embed.weight", raw["embed.weight"])
        tensors.setdefault("head.weight", raw["head.weight"])
        self.set_head(MTPHead(tensors, cfg, dtype=self.dtype, device=self.device, **ops))

    # -- lifecycle ----------------------------------------------------------------------------------

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        self._states[req_id] = _State(req_id)

    def _finish(self, req_id: Hashable) -> None:
        self._states.pop(req_id, None)

    def observe_target(self, req_ids: Sequence[Hashable], rows: Sequence[Sequence[int]], positions: torch.Tensor,
                       hidden: torch.Tensor | None = None) -> None:
        """The target rows committed this step, per request: flattened row indices into `positions` / `hidden`.

        hidden: [T, hc * H] the target's pre-hc_head residual rows (default: read from the target model).
        """
        if hidden is None and self._hidden_source is not None:
            hidden = self._hidden_source()
        if hidden is None:
            raise DrafterError("MTP drafter: no target hidden states; load_model(target) first")
        c = self.head.cfg
        live = [(st, list(r)) for st, r in ((self._states.get(rid), r) for rid, r in zip(req_ids, rows))
                if st is not None and len(r)]
        if not live:
            return
        # one host copy of the positions and one gather of the rows per step, whatever the batch
        pos_host = positions.to(torch.long).cpu()
        flat = torch.as_tensor([i for _, r in live for i in r], dtype=torch.long)
        rows_h = hidden.index_select(0, flat.to(hidden.device)).view(-1, c.hc, c.hidden).to(self.dtype)
        start = 0
        for st, r in live:
            st.pending.append((pos_host[flat[start: start + len(r)]], rows_h[start: start + len(r)]))
            start += len(r)

    # -- catch-up: committed rows through the MTP head -------------------------------------------------

    def _catch_up(self, st: _State, tokens: list[int]) -> None:
        self._catch_up_all([(st, tokens)])

    def _catch_up_all(self, items: list[tuple[_State, list[int]]]) -> None:
        """Every request's pending committed rows through the MTP head, in one forward for the batch.

        Each request's rows are one run of consecutive positions (its pending chunks joined; a gap, from a
        preemption or a skipped step, restarts its window at the chunk after it), and each row attends to
        the W rows ending at itself: the request's committed window, then the run's own rows."""
        c = self.head.cfg
        runs = []  # (state, positions [m] host, target rows [m, hc, H], the tokens after them)
        for st, tokens in items:
            pos_parts, hid_parts, restart, nxt = [], [], False, st.next_pos
            computed = None  # the first position the target computed in the latest step
            for pos, hid in st.pending:
                computed = int(pos[0])
                m = int((pos + 1 < len(tokens)).sum())  # rows whose next token is known (all, after a step)
                if m == 0:
                    continue
                pos, hid = pos[:m], hid[:m]  # positions ascend within a chunk
                if int(pos[0]) != nxt:  # history missing: restart the window here
                    pos_parts, hid_parts, restart = [], [], True
                pos_parts.append(pos)
                hid_parts.append(hid)
                nxt = int(pos[-1]) + 1
            st.pending.clear()
            if not pos_parts:
                continue
            pos = torch.cat(pos_parts)
            if restart or st.next_pos == 0:
                self.window.restart(st)
                st.kv_pos0 = st.next_pos = int(pos[0])
            st.kv_pos0 = max(st.kv_pos0, self.window.retained_from(computed))  # rows the store still holds
            runs.append((st, pos, torch.cat(hid_parts), [tokens[p + 1] for p in pos.tolist()]))
        if not runs:
            return
        sizes = [len(r[1]) for r in runs]
        # the committed rows before each run that its first row's window reaches
        olds = self.window.rows_many([(st, max(st.kv_pos0, int(pos[0]) - c.window + 1), int(pos[0]))
                                      for st, pos, _, _ in runs])

        def context_fn(kv_new):  # [R, c] the rows as the store keeps them -> their windows ([R, W, c], [R, W])
            ctxs, valids, start = [], [], 0
            for old, m in zip(olds, sizes):
                ctx, valid = _banded_window(old.to(kv_new) if len(old) else None, kv_new[start: start + m], c.window)
                ctxs.append(ctx)
                valids.append(valid)
                start += m
            return torch.cat(ctxs), torch.cat(valids)

        tokens = torch.tensor([t for r in runs for t in r[3]], device=self.device)
        positions = torch.cat([r[1] for r in runs]).to(self.device)
        # a paged store: where vLLM's MTP model writes the rows as it runs them
        slots = self.window.slots([(st, pos) for st, pos, _, _ in runs])
        x, kv, logits = self.head.forward(tokens, positions, torch.cat([r[2] for r in runs]), context_fn,
                                          window=self.window, slots=slots)
        start = 0
        for (st, pos, _, _), m in zip(runs, sizes):
            self.window.commit(st, kv[start: start + m])
            st.next_pos = int(pos[-1]) + 1
            st.kv_pos0 = max(st.kv_pos0, st.next_pos - c.window)
            end = start + m - 1
            st.root_x, st.root_logits = x[end], logits[end]
            start += m

    # -- drafting -------------------------------------------------------------------------------------

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        out: list[TreeProposal | None] = [None] * len(requests)
        groups: dict[Any, list[int]] = {}
        token_lists = [as_int_list(req.token_ids) for req in requests]
        with torch.no_grad():
            self._catch_up_all([(self._states[req.req_id], t) for req, t in zip(requests, token_lists)])
        for i, (req, b) in enumerate(zip(requests, budgets)):
            st = self._states[req.req_id]
            tokens = token_lists[i]
            mode = deterministic_mode(req.temperature)
            policy = self.policy.for_budget(b) if b > 0 else None
            if (policy is None or not policy.max_nodes or st.root_logits is None
                    or st.root_pos != len(tokens) - 1):  # no fresh MTP state for this root: no tree
                out[i] = TreeProposal.empty(mode)
                continue
            groups.setdefault(policy, []).append(i)
        for policy, idx in groups.items():
            states = [self._states[requests[i].req_id] for i in idx]
            session = _Session(self, states)
            prefixes = [()] * len(states)
            with torch.no_grad():
                if isinstance(policy, StaticPolicy):
                    trees = build.expand_static_batch(session, list(policy.paths), prefixes)
                else:
                    trees = build.build_dynamic_batch(session, policy.shape, prefixes)
            for i, dt in zip(idx, trees):
                out[i] = TreeProposal(dt.tree, deterministic_mode(requests[i].temperature), scores=dt.scores)
        return out  # type: ignore[return-value]


def mtp_layer_count(hf_config) -> int:
    n = hf_config.get("num_nextn_predict_layers", 0) if isinstance(hf_config, dict) else \
        getattr(hf_config, "num_nextn_predict_layers", 0)
    return int(n or 0)

