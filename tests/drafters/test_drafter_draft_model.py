"""Draft-model tree drafter (drafters/draft_model.py) against plain full-sequence forwards.

Oracles:
* per node: the q the drafter used at a tree row equals softmax of a plain
  forward of the draft model over context + the row's path (no cache, no tree
  mask), across steps that reuse, extend, rewrite and shrink the cached context;
* per tree: top-k trees equal the `build.py` builders' trees for a drafter that
  does exactly those plain forwards;
* draft == target with greedy verification accepts the longest prefix of the
  argmax chain present in the tree (the whole depth for a static rank-0 chain).
"""

from __future__ import annotations

import pytest
import torch

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest, DrafterError
from vllm_tree_spec.drafters.draft_model import WITHOUT_REPLACEMENT_FLOOR, DraftModelTreeDrafter
from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy
from vllm_tree_spec.tree import TreeShape
from vllm_tree_spec.verify import Mode, verify_tree

from tiny_models import build_tiny_llama

VOCAB = 300
ATOL = 1e-5
STATIC_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]
SAMPLED_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.1: peaked enough that the top ranks are well separated.
    return build_tiny_llama(seed=1, vocab_size=VOCAB, num_layers=2, initializer_range=0.1)


def full_q(model, context, temperature=1.0, floor=0.0) -> torch.Tensor:
    """[V] softmax of a plain forward over the whole context (the oracle), optionally mixed with uniform."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(context)])).logits[0, -1]
    q = torch.softmax(logits.float() / temperature, dim=-1)
    return (1 - floor) * q + floor / q.shape[-1]


def row_paths(tree) -> list[list[int]]:
    return [[]] + [tree.path_tokens(i) for i in range(tree.num_nodes)]


def check_rows(model, proposal, context, temperature, floor=0.0):
    """Every row with children has the oracle's q; other rows are zero or (expanded, children
    not kept by a dynamic rerank) also the oracle's q."""
    q = proposal.draft_probs
    assert q is not None and q.shape == (proposal.num_nodes + 1, VOCAB)
    for row, path in enumerate(row_paths(proposal.tree)):
        if proposal.tree.children[row] or bool(q[row].any()):
            oracle = full_q(model, context + path, temperature, floor)
            torch.testing.assert_close(q[row], oracle, atol=ATOL, rtol=0)


def check_cache(drafter, req_id, context):
    """The committed cache holds exactly the context: no tree KV left behind."""
    assert drafter.cached_tokens(req_id) == list(context)
    assert drafter._states[req_id].cache.get_seq_length() == len(context)


def next_contexts(step, contexts, proposals):
    """Step 1 commits an accepted path + a bonus token, 2 rewrites the tail, 3 shrinks, 4 repeats."""
    out = {}
    for (rid, ctx), p in zip(contexts.items(), proposals):
        if step == 1:
            leaf = p.tree.leaves[0] if p.num_nodes else None
            path = p.tree.path_tokens(leaf)[:2] if leaf is not None else []
            out[rid] = ctx + path + [7]
        elif step == 2:
            out[rid] = ctx[:-2] + [11, 12]
        elif step == 3:
            out[rid] = ctx[:-3]
        else:
            out[rid] = list(ctx)
    return out


POLICIES = {
    "static": StaticPolicy.of(STATIC_PATHS),
    "dynamic": DynamicPolicy.of("s4_k3_d10"),
    "sampled_wor": SampledPolicy.of(SAMPLED_PATHS, replacement=False),
    "sampled_iid": SampledPolicy.of(SAMPLED_PATHS, replacement=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("batched", [False, True], ids=["one_request", "batch"])
def test_each_row_uses_the_plain_forward_distribution(model, name, batched):
    policy = POLICIES[name]
    drafter = DraftModelTreeDrafter(model, policy, return_draft_probs=True, prefill_chunk=4)
    contexts = {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13]}
    if batched:
        contexts |= {"b": [20, 21, 22], "c": list(range(30, 44))}
    for rid, ctx in contexts.items():
        drafter.start_request(rid, ctx[:2])
    temperatures = {"a": 0.7, "b": 1.0, "c": 1.3}
    budgets = {"a": 8, "b": 3, "c": 6}
    for step in range(5):
        reqs = [DraftRequest(rid, ctx, temperature=temperatures[rid]) for rid, ctx in contexts.items()]
        proposals = drafter.propose(reqs, [budgets[rid] for rid in contexts])
        for (rid, ctx), p in zip(contexts.items(), proposals):
            assert 1 <= p.num_nodes <= budgets[rid]
            sampled = name.startswith("sampled")
            floor = WITHOUT_REPLACEMENT_FLOOR if name == "sampled_wor" else 0.0
            check_rows(model, p, ctx, temperatures[rid] if sampled else 1.0, floor)
            check_cache(drafter, rid, ctx)
            if sampled:
                assert p.mode == (Mode.SAMPLED if policy.replacement else Mode.SAMPLED_WITHOUT_REPLACEMENT)
            else:
                assert p.mode == Mode.DETERMINISTIC
                # The same tree as the reference builder driving plain forwards.
                ref_draft = build.context_draft(lambda c: full_q(model, c))
                if name == "static":
                    ref = build.expand_static(ref_draft, policy.for_budget(budgets[rid]).paths, prefix=ctx)
                else:
                    ref = build.build_dynamic(ref_draft, policy.for_budget(budgets[rid]).shape, prefix=ctx)
                assert torch.equal(p.tree.parents, ref.tree.parents)
                assert torch.equal(p.tree.tokens, ref.tree.tokens)
                torch.testing.assert_close(p.scores, ref.scores, atol=1e-4, rtol=0)
        contexts = next_contexts(step + 1, contexts, proposals)


@pytest.mark.parametrize(
    "policy", [StaticPolicy.of(STATIC_PATHS), DynamicPolicy.of("s4_k2_d7")], ids=["static", "dynamic"]
)
def test_draft_equal_to_target_accepts_the_argmax_chain(model, policy):
    drafter = DraftModelTreeDrafter(model, policy)
    contexts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6]}
    for rid, ctx in contexts.items():
        drafter.start_request(rid, ctx)
    for _ in range(3):
        proposals = drafter.propose([DraftRequest(r, c, temperature=0.0) for r, c in contexts.items()], 8)
        for rid, p in zip(list(contexts), proposals):
            ctx, tree = contexts[rid], p.tree
            assert p.mode == Mode.GREEDY and p.draft_probs is None
            target = torch.stack([full_q(model, ctx + path) for path in row_paths(tree)])  # [N + 1, V] p
            accepted, nxt = verify_tree(tree.parents, tree.tokens, target, None, "greedy", None)
            chain = []  # the target's own greedy continuation
            for _ in range(tree.max_depth + 1):
                chain.append(int(full_q(model, ctx + chain).argmax()))
            paths = {tuple(path) for path in row_paths(tree)}
            longest = max(k for k in range(tree.max_depth + 1) if tuple(chain[:k]) in paths)
            assert [int(tree.tokens[i]) for i in accepted] == chain[:longest]
            assert nxt == chain[longest]
            if isinstance(policy, StaticPolicy):
                assert longest == tree.max_depth == 4  # the rank-0 chain is the argmax chain
            else:
                assert longest >= 1
            contexts[rid] = ctx + chain[: longest + 1]  # commit accepted + bonus, as the engine would
            check_cache(drafter, rid, ctx)


def test_sampled_children_are_proper_and_reproducible(model):
    wor = DraftModelTreeDrafter(model, SampledPolicy.of(SAMPLED_PATHS, replacement=False), seed=5)
    iid = DraftModelTreeDrafter(model, SampledPolicy.of([(0,), (1,), (2,), (3,), (4,), (5,)], replacement=True), seed=5)
    again = DraftModelTreeDrafter(model, SampledPolicy.of(SAMPLED_PATHS, replacement=False), seed=5)
    other = DraftModelTreeDrafter(model, SampledPolicy.of(SAMPLED_PATHS, replacement=False), seed=6)
    ctx = [4, 8, 15, 16, 23, 42]
    for d in (wor, iid, again, other):
        d.start_request("r", ctx)
    saw_duplicate, saw_difference = False, False
    for step in range(4):
        req = [DraftRequest("r", ctx + [step], temperature=0.4)]
        p, p2, p3 = wor.propose(req, 7)[0], again.propose(req, 7)[0], other.propose(req, 7)[0]
        assert p.mode == Mode.SAMPLED_WITHOUT_REPLACEMENT and p.tree.duplicate_siblings() == []
        assert torch.equal(p.tree.tokens, p2.tree.tokens) and torch.equal(p.draft_probs, p2.draft_probs)
        saw_difference |= not torch.equal(p.tree.tokens, p3.tree.tokens)
        q = p.draft_probs
        for row, kids in enumerate(p.tree.children):
            if kids:
                assert bool((q[row] >= 0).all()) and float(q[row].sum()) == pytest.approx(1.0, abs=1e-5)
                assert all(float(q[row, int(p.tree.tokens[c])]) > 0 for c in kids)
        # The verifier takes the proposal as is (its own validation included).
        target = torch.where(q.sum(-1, keepdim=True) > 0, q, torch.full_like(q, 1.0 / VOCAB))  # p := q, leaves uniform
        verify_tree(p.tree.parents, p.tree.tokens, target, q, "sampled_without_replacement", torch.Generator())
        pi = iid.propose(req, 6)[0]
        assert pi.mode == Mode.SAMPLED and pi.draft_probs is not None
        saw_duplicate |= bool(pi.tree.duplicate_siblings())  # i.i.d. draws from a peaked q repeat
    assert saw_duplicate and saw_difference


def test_without_replacement_works_at_very_low_temperature(model):
    """softmax(logits / 1e-4) underflows to ~1 token; the uniform floor still allows 3 distinct children."""
    d = DraftModelTreeDrafter(model, SampledPolicy.of([(0,), (1,), (2,), (0, 0)]))
    ctx = [7, 7, 8]
    d.start_request("r", ctx)
    p = d.propose([DraftRequest("r", ctx, temperature=1e-4)], 4)[0]
    assert p.num_nodes == 4 and p.tree.duplicate_siblings() == []
    assert int(p.tree.tokens[0]) == int(full_q(model, ctx).argmax())  # the first draw is (almost surely) the mode
    assert float(p.draft_probs[0].min()) > 0
    assert float(p.draft_probs[0].sum()) == pytest.approx(1.0, abs=1e-5)


def test_greedy_request_under_a_sampled_policy_gets_the_ranked_shape(model):
    sampled = DraftModelTreeDrafter(model, SampledPolicy.of(SAMPLED_PATHS))
    static = DraftModelTreeDrafter(model, StaticPolicy.of(SAMPLED_PATHS))
    ctx = [1, 2, 3, 4]
    sampled.start_request("r", ctx)
    static.start_request("r", ctx)
    p = sampled.propose([DraftRequest("r", ctx, temperature=0.0)], 7)[0]
    s = static.propose([DraftRequest("r", ctx, temperature=0.0)], 7)[0]
    assert p.mode == Mode.GREEDY and p.draft_probs is None
    assert torch.equal(p.tree.tokens, s.tree.tokens) and torch.equal(p.tree.parents, s.tree.parents)


def test_budgets_shrink_the_policy(model):
    ctx = [10, 20, 30, 40]
    static = DraftModelTreeDrafter(model, STATIC_PATHS)  # rank paths -> StaticPolicy
    dynamic = DraftModelTreeDrafter(model, "s4_k3_d10")  # shape string -> DynamicPolicy
    assert isinstance(static.policy, StaticPolicy) and isinstance(dynamic.policy, DynamicPolicy)
    for d in (static, dynamic):
        d.start_request("r", ctx)
        d.start_request("s", ctx)
    full, two = static.propose([DraftRequest("r", ctx), DraftRequest("s", ctx)], [8, 2])
    (zero,) = static.propose([DraftRequest("r", ctx)], [0])
    assert zero.num_nodes == 0 and full.num_nodes == 8 and two.num_nodes == 2
    assert torch.equal(two.tree.tokens, full.tree.tokens[:2])  # the shape's first two nodes
    assert torch.equal(two.tree.parents, full.tree.parents[:2])
    big, small = dynamic.propose([DraftRequest("r", ctx), DraftRequest("s", ctx)], [9, 3])
    assert big.num_nodes == 9 and small.num_nodes == 3
    ref = build.build_dynamic(build.context_draft(lambda c: full_q(model, c)), TreeShape(3, 3, 4), prefix=ctx)
    assert torch.equal(small.tree.tokens, ref.tree.tokens) and torch.equal(small.tree.parents, ref.tree.parents)
    assert DynamicPolicy.of("s4_k3_d10").for_budget(2).shape == TreeShape(2, 3, 3)
    assert DynamicPolicy.of("s4_k3_d10").for_budget(0) is None


def test_from_pretrained_with_the_local_tokenizer(tiny_models):
    from transformers import AutoTokenizer

    path = tiny_models.llama(vocab_size=512, num_layers=1, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok("def tree(node): return node.parent").input_ids
    assert prompt[0] == tok.bos_token_id == 1
    drafter = DraftModelTreeDrafter.from_pretrained(str(path), "s2_k2_d4", device="cpu")
    assert drafter.vocab_size == 512
    drafter.start_request("r", prompt)
    (p,) = drafter.propose([DraftRequest("r", prompt)], [3])
    assert p.num_nodes == 3 and int(p.tree.tokens.max()) < 512
    # Loading twice gives the same weights: the checkpoint is seeded.
    again = DraftModelTreeDrafter.from_pretrained(str(path), "s2_k2_d4")
    again.start_request("r", prompt)
    assert torch.equal(again.propose([DraftRequest("r", prompt)], [3])[0].tree.tokens, p.tree.tokens)


def test_rejects_attention_that_ignores_tree_masks(model):
    class FlashModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)
            self.config = type("Cfg", (), {"_attn_implementation": "flash_attention_2", "vocab_size": 4})()

    with pytest.raises(DrafterError, match="attn_implementation='sdpa' or 'eager'"):
        DraftModelTreeDrafter(FlashModel(), "s2_k2_d3")
    with pytest.raises(DrafterError, match="prefill_chunk"):
        DraftModelTreeDrafter(model, "s2_k2_d3", prefill_chunk=0)
