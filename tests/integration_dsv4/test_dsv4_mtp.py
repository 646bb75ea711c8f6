"""The MTP tree drafter: DeepSeek-V4's MTP head expanded into a tree, on vLLM's CPU path.

* Unit (no engine, small random MTP layer): the tree session's q at every node
  equals the MTP head run as a chain along the node's path (tree mask, depth
  positions, re-fed hidden states); catch-up in pieces equals catch-up at once,
  batched over requests equals one request at a time, and its banded windows
  attend as the dense window; the PyTorch mHC fallbacks match vLLM's CPU mHC ops.
* Engine: with the tiny checkpoint's MTP layer, static and dynamic (EAGLE-2
  s3_k2_d6) MTP trees give output identical to no speculation, and the drafter
  really drafts (vLLM's own MTP raises NotImplementedError on CPU).
"""

import pytest
import torch
from dsv4_harness import dsv4_oracle, random_prompts, run_dsv4

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest
from vllm_tree_spec.drafters.mtp import MTPConfig, MTPHead, MTPTreeDrafter, _Session, _State

SMALL = MTPConfig(hidden=32, hc=2, heads=4, head_dim=16, rope_dim=8, o_groups=2, window=6, rope_theta=1e4,
                  eps=1e-6, hc_eps=1e-6, sinkhorn=5, topk_experts=2, routed_scale=1.5, swiglu_limit=10.0, vocab=40)


def small_head(seed: int = 0, dtype=torch.float32, **ops) -> MTPHead:
    """A small random MTP layer; ops: the mHC callables to mix with (default the drafter's PyTorch fallbacks)."""
    c = SMALL
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    mix = (2 + c.hc) * c.hc
    t = {"embed.weight": r(c.vocab, c.hidden, std=1.0), "head.weight": r(c.vocab, c.hidden),
         "enorm.weight": torch.ones(c.hidden), "hnorm.weight": torch.ones(c.hidden), "norm.weight": torch.ones(c.hidden),
         "e_proj.weight": r(c.hidden, c.hidden), "h_proj.weight": r(c.hidden, c.hidden),
         "hc_head_fn": r(c.hc, c.hc * c.hidden, std=0.1), "hc_head_scale": torch.ones(1),
         "hc_head_base": torch.zeros(c.hc),
         "attn_norm.weight": torch.ones(c.hidden), "ffn_norm.weight": torch.ones(c.hidden),
         "attn.wq_a.weight": r(16, c.hidden), "attn.q_norm.weight": torch.ones(16),
         "attn.wq_b.weight": r(c.heads * c.head_dim, 16), "attn.wkv.weight": r(c.head_dim, c.hidden),
         "attn.kv_norm.weight": torch.ones(c.head_dim),
         "attn.wo_a.weight": r(c.o_groups * 8, c.heads * c.head_dim // c.o_groups),
         "attn.wo_b.weight": r(c.hidden, c.o_groups * 8), "attn.attn_sink": r(c.heads, std=0.5),
         "ffn.gate.weight": r(4, c.hidden), "ffn.gate.bias": r(4, std=0.1)}
    for part in ("attn", "ffn"):
        t[f"hc_{part}_fn"] = r(mix, c.hc * c.hidden, std=0.1)
        t[f"hc_{part}_scale"] = torch.ones(3)
        t[f"hc_{part}_base"] = torch.zeros(mix)
    for e in list(range(4)) + ["s"]:
        base = f"ffn.experts.{e}." if e != "s" else "ffn.shared_experts."
        t[base + "w1.weight"], t[base + "w3.weight"] = r(12, c.hidden), r(12, c.hidden)
        t[base + "w2.weight"] = r(c.hidden, 12)
    return MTPHead(t, c, dtype=dtype, **ops)


def _drafter(policy, seed=0):
    d = MTPTreeDrafter(policy, head=small_head(seed), dtype=torch.float32)
    return d


def _caught_up(d: MTPTreeDrafter, tokens, pieces):
    """Start a request and feed its committed rows (positions 0 .. len - 2) in `pieces` chunks (random target
    residuals, the same for every drafter whose head has the same width)."""
    g = torch.Generator().manual_seed(1)
    n = len(tokens) - 1
    c = d.head.cfg
    hidden = torch.randn(n, c.hc * c.hidden, generator=g).to(d.device)
    positions = torch.arange(n)
    d.start_request("r", tokens[:3])
    bounds = [round(i * n / pieces) for i in range(pieces + 1)]
    for a, b in zip(bounds, bounds[1:]):
        d.observe_target(["r"], [list(range(a, b))], positions, hidden)
        d._catch_up(d._states["r"], tokens)
    return d._states["r"], hidden


def _chain_q(d: MTPTreeDrafter, st: _State, path):
    """q after the path's last node, running the head one row at a time over the committed window and the path
    (the oracle; any head with the drafter's head interface)."""
    h = d.head
    committed = d.window.rows_many([(st, st.kv_pos0, st.next_pos)])[0]  # the store's rows, as the drafter reads them
    kv_list = [committed[i].to(st.root_x.device) for i in range(committed.shape[0])]
    kv_pos = list(range(st.kv_pos0, st.next_pos))
    x, logits = st.root_x, st.root_logits
    for depth, tok in enumerate(path, start=1):
        p = st.root_pos - 1 + depth

        def ctx_fn(kv_new, p=p):
            keep = [k for k, kp in zip(kv_list, kv_pos) if kp > p - h.cfg.window]
            ctx = torch.stack(keep + [kv_new[0]])[None]
            return ctx, torch.ones(1, ctx.shape[1], dtype=torch.bool, device=ctx.device)

        xo, kv, lg = h.forward(torch.tensor([tok], device=d.device), torch.tensor([p], device=d.device), x[None],
                               ctx_fn, window=d.window)
        kv_list.append(kv[0])
        kv_pos.append(p)
        x, logits = xo[0], lg[0]
    return torch.softmax(logits.float(), -1)


@pytest.mark.parametrize("shape", ["s3_k2_d6", "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"])
def test_tree_rows_equal_chained_mtp(shape):
    d = _drafter(shape)
    tokens = [int(t) for t in torch.randint(0, SMALL.vocab, (14,), generator=torch.Generator().manual_seed(2))]
    st, _ = _caught_up(d, tokens, pieces=3)
    session = _Session(d, [st])
    policy = d.policy
    with torch.no_grad():
        if hasattr(policy, "paths"):
            tree = build.expand_static_batch(session, list(policy.paths), [()])[0].tree
        else:
            tree = build.build_dynamic_batch(session, policy.shape, [()])[0].tree
        assert tree.num_nodes >= 5
        expanded = session.nodes[0]  # every tree row the builder asked q for (rows with children)
        assert len(expanded) >= 2
        for path, (x, _) in expanded.items():
            got = torch.softmax(d.head.logits(x[None])[0], -1)
            ref = _chain_q(d, st, path)
            assert torch.allclose(got, ref, atol=1e-5), (path, float((got - ref).abs().max()))


def test_catch_up_in_pieces_equals_at_once():
    tokens = [int(t) for t in torch.randint(0, SMALL.vocab, (17,), generator=torch.Generator().manual_seed(3))]
    a, _ = _caught_up(_drafter("s2_k2_d4"), tokens, pieces=1)
    b, _ = _caught_up(_drafter("s2_k2_d4"), tokens, pieces=5)
    assert a.root_pos == b.root_pos == len(tokens) - 1 and a.kv_pos0 == b.kv_pos0
    assert torch.allclose(a.kv, b.kv, atol=1e-5) and torch.allclose(a.root_logits, b.root_logits, atol=1e-5)
    assert a.kv.shape[0] == SMALL.window  # only the window is kept


def test_banded_window_attends_as_the_dense_window():
    """A run's banded windows (a strided view, m x W) give the attention of the dense context (every committed and
    run row, masked by position), for runs after no, a short and a full committed window."""
    from vllm_tree_spec.drafters.mtp import _banded_window
    from vllm_tree_spec.reference.dsv4 import attend_with_sink

    g = torch.Generator().manual_seed(5)
    W, c = SMALL.window, 8
    for o, m in ((0, 3), (2, 9), (W, 4), (W, 1)):
        old = torch.randn(o, c, generator=g) if o else None
        new = torch.randn(m, c, generator=g)
        q, sink = torch.randn(m, 2, c, generator=g), torch.randn(2, generator=g)
        ctx, valid = _banded_window(old, new, W)
        allk = new if old is None else torch.cat([old, new])
        kpos, p = torch.arange(o + m)[None], torch.arange(o, o + m)[:, None]
        dense = attend_with_sink(q, allk[None].expand(m, -1, -1), (kpos <= p) & (kpos > p - W), sink)
        assert ctx.shape == (m, W, c) and torch.allclose(attend_with_sink(q, ctx, valid, sink), dense, atol=1e-6)


def test_catch_up_batched_over_requests_equals_one_at_a_time():
    """One MTP forward for the whole batch's committed rows (_catch_up_all) leaves every request's window, root
    row and logits as catching it up alone does: requests of different lengths, one past the window, one whose
    history has a gap (its window restarts), one with nothing pending."""
    lengths = {"a": 5, "b": 17, "c": 11, "d": 4}

    def fed(d):
        toks = {r: [int(t) for t in torch.randint(0, SMALL.vocab, (n,), generator=torch.Generator().manual_seed(n))]
                for r, n in lengths.items()}
        hidden = torch.randn(64, SMALL.hc * SMALL.hidden, generator=torch.Generator().manual_seed(9))
        positions = torch.arange(64) % 32
        for r, t in toks.items():
            d.start_request(r, t[:2])
        d.observe_target(["a", "b"], [list(range(0, 4)), list(range(4, 20))], positions, hidden)  # b: 4 .. 19
        d.observe_target(["c"], [list(range(32, 36))], positions, hidden)  # c: 0 .. 3
        d.observe_target(["c"], [list(range(38, 42))], positions, hidden)  # c: 6 .. 9 (a gap: restart)
        return toks

    one, batch = _drafter("s2_k2_d4"), _drafter("s2_k2_d4")
    toks = fed(one)
    fed(batch)
    for r in lengths:
        one._catch_up(one._states[r], toks[r])
    batch._catch_up_all([(batch._states[r], toks[r]) for r in lengths])
    for r in ("a", "b", "c"):
        x, y = one._states[r], batch._states[r]
        assert (x.root_pos, x.kv_pos0) == (y.root_pos, y.kv_pos0) and x.kv.shape == y.kv.shape, r
        assert torch.allclose(x.kv, y.kv, atol=1e-5) and torch.allclose(x.root_logits, y.root_logits, atol=1e-5), r
    assert batch._states["b"].kv.shape[0] == SMALL.window and batch._states["c"].kv_pos0 == 6
    assert batch._states["d"].root_logits is None


def test_propose_returns_valid_trees_and_needs_fresh_state():
    d = _drafter("s3_k2_d6")
    tokens = [int(t) for t in torch.randint(0, SMALL.vocab, (9,), generator=torch.Generator().manual_seed(4))]
    _caught_up(d, tokens, pieces=2)
    (prop,) = d.propose([DraftRequest("r", tokens, 0.0)], [5])
    assert prop.num_nodes == 5 and prop.mode.name == "GREEDY"
    # a root the drafter has not caught up to (missing hidden rows) gets no tree instead of a stale one
    (stale,) = d.propose([DraftRequest("r", tokens + [1], 0.0)], [5])
    assert stale.num_nodes == 0


@pytest.mark.vllm
def test_mhc_fallbacks_match_vllm_cpu_ops():
    from vllm.model_executor.layers.mhc import HCHeadOp, MHCPostOp, MHCPreOp

    from vllm_tree_spec.drafters.mtp import hc_head_torch, mhc_post_torch, mhc_pre_torch

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # CustomOps pick their platform method at construction
        pre, post, head = MHCPreOp(), MHCPostOp(), HCHeadOp()
    g = torch.Generator().manual_seed(0)
    hc, hid = 4, 256
    x = (torch.randn(5, hc, hid, generator=g) * 2).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * hid, generator=g) * 0.01
    scale, base = torch.ones(3), torch.zeros((2 + hc) * hc)
    kw = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6, hc_post_mult_value=2.0, sinkhorn_repeat=20)
    a = pre(residual=x, fn=fn, hc_scale=scale, hc_base=base, **kw)
    b = mhc_pre_torch(residual=x, fn=fn, hc_scale=scale, hc_base=base, **kw)
    for u, v in zip(a, b):
        assert torch.allclose(u.float(), v.float(), atol=2e-2, rtol=2e-2)
    y = torch.randn(5, hid, generator=g).to(torch.bfloat16)
    assert torch.allclose(post(y, x, a[0], a[1]).float(), mhc_post_torch(y, x, a[0], a[1]).float(), atol=5e-2)
    hfn = torch.randn(hc, hc * hid, generator=g) * 0.01
    assert torch.allclose(head(x, hfn, torch.ones(1), torch.zeros(hc), 1e-6, 1e-6).float(),
                          hc_head_torch(x, hfn, torch.ones(1), torch.zeros(hc), 1e-6, 1e-6).float(), atol=5e-2)


# ---------------------------------------------------------------------------
# Engine


@pytest.fixture(scope="module")
def setup(dsv4_model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = random_prompts((70, 250), seed=4)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return raw, prompts, params, run_dsv4(dsv4_model, prompts, params), dsv4_oracle(dsv4_model, raw, params)


@pytest.mark.vllm
@pytest.mark.parametrize("tree", ["s3_k2_d6", "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"], ids=["dynamic", "static"])
def test_mtp_trees_identical_to_no_speculation(dsv4_model, setup, tree):
    raw, prompts, params, base, oracle = setup
    # a static budget: every round drafts the full shape (the online policy's pruning depends on timings)
    run = run_dsv4(dsv4_model, prompts, params, {"method": "tree", "drafter": "mtp", "tree": tree, "budgets": {64: 5}})
    for line in oracle.check(raw, base.outputs, run.outputs).lines():  # the greedy-identity oracle
        print(line)
    st = run.tree_stats
    assert st["rounds"] >= 40 and st["nodes"] >= 4 * st["rounds"] and st["branching_rounds"] > 0, st
