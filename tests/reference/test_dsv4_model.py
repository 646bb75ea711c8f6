"""The stateful DeepSeek-V4 reference path equals the stateless dense oracle.

`forward_dense` builds every compressed entry by reshaping the whole sequence
into blocks and every context with boolean masks; `prefill`/`decode` go
through position-addressed cache slots and explicit slot lists. Agreement of
logits *and* of every cache buffer makes sequential decoding a trustworthy
oracle for the tree tests.
"""

import dataclasses

import pytest
import torch

from vllm_tree_spec.reference import dsv4_tree as dt
from vllm_tree_spec.reference.dsv4 import DSV4Model, attend_with_sink, rms_norm, rope, select_topk
from vllm_tree_spec.reference.dsv4_cache import DSV4Cache, buffer_layout
from vllm_tree_spec.reference.dsv4_config import DSV4Config
from vllm_tree_spec.reference.dsv4_plan import Segment, build_plan


def _tokens(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------
# Config


def test_tiny_config_layer_kinds(cfg):
    assert [cfg.layer_kind(i) for i in range(4)] == ["swa", "csa", "hca", "csa"]
    assert cfg.ratios == (4, 8)
    assert [cfg.layer_rope_theta(i) for i in range(4)] == [10000.0] + [160000.0] * 3


def test_flash_config_counts():
    cfg = DSV4Config.deepseek_v4_flash()
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    assert (kinds.count("swa"), kinds.count("csa"), kinds.count("hca")) == (2, 21, 20)
    assert len(cfg.compress_ratios) == 44 and cfg.ratios == (4, 128)


def test_from_hf_keeps_modelled_fields_and_rejects_bad_ones():
    hf = dataclasses.asdict(DSV4Config()) | {"n_routed_experts": 256, "hc_mult": 4, "compress_ratios": [0, 4, 8, 4, 0]}
    cfg = DSV4Config.from_hf(hf)
    assert cfg.compress_ratios == (0, 4, 8, 4, 0) and cfg.layer_kind(3) == "csa"
    with pytest.raises(ValueError, match="one shared K = V head"):
        DSV4Config(num_key_value_heads=2)
    with pytest.raises(ValueError, match="compress_ratios has 2 entries"):
        DSV4Config(compress_ratios=(0, 4))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        DSV4Config(qk_rope_head_dim=7)


# ---------------------------------------------------------------------------
# Building blocks


def test_rope_is_relative_and_invertible():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 16, generator=g, dtype=torch.float64)
    r = lambda x, p, inv=False: rope(x, torch.tensor(p), 1e4, 8, inverse=inv)  # noqa: E731
    assert torch.allclose(r(r(q, 11), 11, inv=True), q, atol=1e-14)
    # only the last 8 channels rotate
    assert torch.equal(r(q, 5)[:8], q[:8]) and not torch.allclose(r(q, 5)[8:], q[8:])
    assert torch.allclose(r(q, 9) @ r(k, 4), r(q, 25) @ r(k, 20), atol=1e-12)  # depends on t - s only


def test_topk_ties_go_to_older_entries_and_invalid_are_not_picked():
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True, True], [False, True, True, False]])
    cols, picked = select_topk(scores, valid, 3)
    assert cols.tolist() == [[3, 0, 1], [1, 2, 0]]
    assert picked.tolist() == [[True, True, True], [True, True, False]]


# ---------------------------------------------------------------------------
# The equations of docs/reference-model.md, written out token by token


def test_compressed_entries_follow_the_equations(cfg, model):
    """CSA: a halves of block w-1 + b halves of block w; HCA: block w; bias in the gate only; RoPE at w*m."""
    T, c = 16, cfg.head_dim
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for layer in (1, 2):  # CSA (m = 4), HCA (m' = 8)
        attn = model.blocks[layer].attn
        comp, m = attn.compressor, attn.ratio
        _, state = attn.forward_dense(h)
        C = h @ comp.wkv.weight.T  # [T, coff * c]
        Z = h @ comp.wgate.weight.T
        for w in range(T // m):
            values, logits = [], []  # one (value, logit) per pooled slot, each [c]
            if comp.coff == 2:
                for j in range((w - 1) * m, w * m):
                    if j >= 0:  # entry 0 has no previous block
                        values.append(C[j, :c])
                        logits.append(Z[j, :c] + comp.ape[j % m, :c])
                for j in range(w * m, (w + 1) * m):
                    values.append(C[j, c:])
                    logits.append(Z[j, c:] + comp.ape[j % m, c:])
            else:
                for j in range(w * m, (w + 1) * m):
                    values.append(C[j])
                    logits.append(Z[j] + comp.ape[j % m])
            gate = torch.softmax(torch.stack(logits), dim=0)  # over slots, per channel
            pooled = (gate * torch.stack(values)).sum(0)
            want = rope(rms_norm(pooled, comp.norm.weight, cfg.rms_norm_eps), torch.tensor(w * m),
                        cfg.compress_rope_theta, cfg.qk_rope_head_dim)
            assert torch.allclose(state["entries"][w], want, atol=1e-13, rtol=0), (layer, w)


def test_indexer_scores_and_sink_attention_follow_the_equations(cfg, model):
    g = torch.Generator().manual_seed(5)
    idx = model.blocks[1].attn.indexer
    nI, cI = cfg.index_n_heads, cfg.index_head_dim
    cq = torch.randn(3, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    h = torch.randn(3, cfg.hidden_size, generator=g, dtype=torch.float64)
    keys = torch.randn(3, 5, cI, generator=g, dtype=torch.float64)
    pos = torch.tensor([4, 9, 30])
    got = idx.scores(cq, h, pos, keys, cfg.compress_rope_theta)
    for t in range(3):
        q = rope((idx.wq_b.weight @ cq[t]).view(nI, cI), pos[t], cfg.compress_rope_theta, cfg.qk_rope_head_dim)
        wI = (idx.weights_proj.weight @ h[t]) * cI**-0.5 * nI**-0.5
        for w in range(5):
            want = sum(wI[i] * torch.relu(q[i] @ keys[t, w]) for i in range(nI))
            assert torch.allclose(got[t, w], want, atol=1e-13)

    H, c = cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(2, H, c, generator=g, dtype=torch.float64)
    ctx = torch.randn(2, 6, c, generator=g, dtype=torch.float64)
    valid = torch.tensor([[True] * 6, [True, False, True, False, False, True]])
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    got = attend_with_sink(q, ctx, valid, sink)
    for r in range(2):
        for i in range(H):
            e = [torch.exp(q[r, i] @ ctx[r, x] / c**0.5) for x in range(6) if valid[r, x]]
            xs = [ctx[r, x] for x in range(6) if valid[r, x]]
            want = sum(ei * x for ei, x in zip(e, xs)) / (sum(e) + torch.exp(sink[i]))  # sink: denominator only
            assert torch.allclose(got[r, i], want, atol=1e-13)


# ---------------------------------------------------------------------------
# Stateful path == dense oracle


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_chunked_prefill_and_decode_match_dense(cfg, dtype, tol):
    model = DSV4Model(cfg, dtype, seed=1)
    toks = _tokens(45, seed=1)  # crosses 11 CSA and 5 HCA boundaries, window evicts from t = 8
    want, _ = model.forward_dense(torch.tensor(toks))
    cache = DSV4Cache.empty(cfg, 1, 64, dtype)
    got = []
    for lo, hi in [(0, 3), (3, 13), (13, 14), (14, 30)]:  # prefill chunks start mid-block
        got += dt.prefill(model, cache, [toks[lo:hi]])
    got += [dt.decode(model, cache, [t]) for t in toks[30:]]
    got = torch.cat(got)
    assert got.dtype == dtype
    assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()


def test_cache_buffers_match_dense_state(cfg, model):
    toks = _tokens(37, seed=2)
    _, states = model.forward_dense(torch.tensor(toks))
    cache = DSV4Cache.empty(cfg, 1, 48)
    dt.prefill(model, cache, [toks[:17]])
    for t in toks[17:]:
        dt.decode(model, cache, [t])
    committed = cache.committed(0)
    for i, state in enumerate(states):
        assert set(state) == set(buffer_layout(cfg, i))
        for name, want in state.items():
            got = committed[(i, name)]
            assert got.shape == want.shape, (i, name)
            assert torch.allclose(got, want, atol=1e-12, rtol=0), (i, name)


def test_batched_requests_do_not_interact(cfg, model):
    prompts = [_tokens(n, seed=10 + n) for n in (21, 6, 0, 13)]
    cache = DSV4Cache.empty(cfg, 4, 32)
    together = dt.prefill(model, cache, prompts)
    for b, prompt in enumerate(prompts):
        alone = DSV4Cache.empty(cfg, 1, 32)
        want = dt.prefill(model, alone, [prompt])[0]
        assert torch.allclose(together[b], want, atol=1e-12, rtol=0)
        for key, v in alone.committed(0).items():
            assert torch.allclose(cache.committed(b)[key], v, atol=1e-12, rtol=0)
    assert cache.lengths.tolist() == [21, 6, 0, 13]


def test_every_mechanism_moves_the_logits(cfg, model):
    """Guard against vacuous equalities: top-k, position bias, sinks and entries all matter."""
    toks = torch.tensor(_tokens(40, seed=3))
    base, _ = model.forward_dense(toks)

    def changed(other: DSV4Model) -> float:
        return float((other.forward_dense(toks)[0][-8:] - base[-8:]).abs().max())

    wide = DSV4Model(dataclasses.replace(cfg, index_topk=64), seed=0)  # select every entry
    assert changed(wide) > 1e-3
    for param in ("compressor.ape", "attn_sink", "indexer.compressor.ape"):
        other = DSV4Model(cfg, seed=0)
        for name, p in other.named_parameters():
            if name.endswith(param):
                p.zero_()
        assert changed(other) > 1e-3, param
    # drop the compressed entries entirely (HCA/CSA layers see only their window)
    swa_only = DSV4Model(dataclasses.replace(cfg, sliding_window=8), seed=0)
    for blk in swa_only.blocks:
        blk.attn.compressor = None
        blk.attn.indexer = None
    assert changed(swa_only) > 1e-3


# ---------------------------------------------------------------------------
# Plans refuse what they cannot do


def test_plan_errors(cfg):
    cache = DSV4Cache.empty(cfg, 2, 16)
    cache.lengths[1] = 5
    with pytest.raises(ValueError, match="only supports chains"):
        build_plan(cache, [Segment(0, 0, (-1, 0, 0))], "linear")
    with pytest.raises(ValueError, match="starts at 3 but the cache holds 5"):
        build_plan(cache, [Segment.chain(1, 3, 2)], "tree")
    with pytest.raises(ValueError, match="capacity"):
        build_plan(cache, [Segment.chain(1, 5, 12)], "tree")
    with pytest.raises(ValueError, match="only one segment"):
        build_plan(cache, [Segment.chain(0, 0, 1), Segment.chain(0, 0, 1)], "tree")
    with pytest.raises(ValueError, match="row 0 must be the only row"):
        build_plan(cache, [Segment(0, 0, (-1, -1))], "tree")
