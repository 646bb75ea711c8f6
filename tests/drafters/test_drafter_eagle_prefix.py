"""The EAGLE tree drafters under vLLM's prefix caching: the head's KV for prefix-cached positions.

A prefix-cache hit hands the drafter target rows from N only (N a multiple of the block size). The
drafter restores its committed KV for positions < N from the content-keyed pages earlier requests
archived (`drafters/prefix_pages.py`); what no page holds is a hole the head masks. Checked here against
the head run sequentially over the whole context (holes masked out of every row), with the tiny target
and head of test_drafter_eagle3.py.
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the EAGLE-3 head reads its config with vLLM's parser and uses vLLM's RoPE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_drafter_eagle3 import VOCAB, aux_states, setup  # noqa: E402,F401  (setup: the module fixture)

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter  # noqa: E402
from vllm_tree_spec.drafters.eagle3_head import load_head  # noqa: E402
from vllm_tree_spec.drafters.policy import StaticPolicy  # noqa: E402
from vllm_tree_spec.drafters.prefix_pages import PrefixPages, chain_keys, page_tokens_for  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402

BLOCK = 16
SHAPE = Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


def root_q_reference(head, tokens: list[int], aux: torch.Tensor, holes: range = range(0)) -> torch.Tensor:
    """q [V] at the root: the head over entries 0..n-2 in one causal pass, hole columns masked from every row
    (a hole row still sees itself, so no row is empty; hole rows' outputs are not used)."""
    n = len(tokens)
    mask = torch.tril(torch.ones(n - 1, n - 1, dtype=torch.bool))
    keep = torch.ones(n - 1, dtype=torch.bool)
    keep[list(holes)] = False
    mask = (mask & keep) | torch.eye(n - 1, dtype=torch.bool)
    with torch.no_grad():
        feats = head.combine(aux[: n - 1])[None]
        logits, _ = head(torch.tensor([tokens[1:]]), feats, torch.arange(n - 1)[None], mask[None])
    return torch.softmax(head.target_logits(logits[0, -1]).float(), -1)


def make_drafter(setup, capacity_tokens: int = 4096) -> tuple:
    _, target, heads = setup
    head = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    drafter = Eagle3TreeDrafter(head, StaticPolicy.of(SHAPE), return_draft_probs=True)
    drafter.enable_prefix_pages(BLOCK, capacity_tokens)
    return target, head, drafter


def serve(drafter, target, rid: str, tokens: list[int], hit: int = 0):
    """Start `rid` on tokens (the last one: the token the target just sampled), the target computing rows
    hit..n-2 only (a prefix-cache hit of `hit` tokens), and draft once."""
    drafter.start_request(rid, tokens[:-1])
    aux = aux_states(target, tokens)
    drafter.observe_target([rid], [list(range(hit, len(tokens) - 1))], torch.arange(len(tokens)), aux)
    return aux, drafter.propose([DraftRequest(rid, tokens, 0.0)], SHAPE.num_nodes)[0]


def kv_columns(drafter, rid: str, cols: slice) -> list[torch.Tensor]:
    slot = drafter._states[rid].slot
    return [t[slot, :, cols].clone() for layer in drafter.store.layers for t in layer]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(7, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hit_restores_the_archived_kv_bit_for_bit(setup):
    """Request b repeats request a's 41 tokens with a 32-token hit: entries 0..31 come back from a's pages
    (bitwise), b drafts a's tree, and its root q equals the head over the whole context."""
    target, head, drafter = make_drafter(setup)
    toks = tokens(0, 41)
    _, prop_a = serve(drafter, target, "a", toks)
    assert drafter.prefix_stats.archived_pages == 2  # entries 0..39: pages 0 and 1 are whole
    aux, prop_b = serve(drafter, target, "b", toks, hit=32)
    s = drafter.prefix_stats
    assert (s.hits, s.restored, s.dropped, s.missing) == (1, 32, 0, 0), s
    for got, want in zip(kv_columns(drafter, "b", slice(0, 32)), kv_columns(drafter, "a", slice(0, 32))):
        assert torch.equal(got, want)
    assert prop_b.tree.tokens.tolist() == prop_a.tree.tokens.tolist()
    torch.testing.assert_close(prop_b.draft_probs[0], root_q_reference(head, toks, aux), atol=1e-5, rtol=1e-4)
    assert drafter.cached_tokens("b") == toks[1:]


def test_hit_whose_next_token_differs_drops_one_entry(setup):
    """Request c shares a's first 32 tokens only: the hit's last entry (31) read a's token 32, not c's, so
    it is dropped (a hole), and c's root q equals the head with column 31 masked; c archives its own pages
    past the hit (a one-layer head: a hole does not reach later entries' KV)."""
    target, head, drafter = make_drafter(setup)
    a = tokens(1, 41)
    serve(drafter, target, "a", a)
    c = a[:32] + tokens(2, 17)
    aux, prop = serve(drafter, target, "c", c, hit=32)
    s = drafter.prefix_stats
    assert (s.restored, s.dropped, s.missing) == (31, 1, 0), s
    torch.testing.assert_close(prop.draft_probs[0], root_q_reference(head, c, aux, holes=range(31, 32)),
                               atol=1e-5, rtol=1e-4)
    assert s.archived_pages == 3  # a's pages 0, 1 and c's page 2 (entries 32..47)
    d = c[:48] + tokens(3, 5)
    # d's 48-token hit: pages 0, 1 from a (page 1's last entry read a's token 32: dropped), page 2 from c
    # (its last entry read c's token 48, d's differs: dropped)
    aux, prop = serve(drafter, target, "d", d, hit=48)
    assert (s.restored, s.dropped, s.missing) == (31 + 46, 1 + 2, 0), s
    torch.testing.assert_close(prop.draft_probs[0], root_q_reference(head, d, aux, holes=[31, 47]),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["never_archived", "evicted"])
def test_missing_pages_are_masked_holes(setup, case):
    """No page for the hit (its writer never reached it, or it was evicted): the entries are holes, the
    head drafts from the rest with exactly those columns masked, and nothing fails."""
    cap = 4096 if case == "never_archived" else 2 * BLOCK  # two pages: a's are evicted by e's
    target, head, drafter = make_drafter(setup, capacity_tokens=cap)
    a = tokens(4, 41)
    if case == "evicted":
        serve(drafter, target, "a", a)
        serve(drafter, target, "e", tokens(5, 41))
        assert drafter.prefix_stats.evicted_pages == 2
    aux, prop = serve(drafter, target, "b", a, hit=32)
    s = drafter.prefix_stats
    assert (s.restored, s.missing) == (0, 32), s
    torch.testing.assert_close(prop.draft_probs[0], root_q_reference(head, a, aux, holes=range(32)),
                               atol=1e-5, rtol=1e-4)
    # the next step drafts on: the accepted rows are fed, the holes stay masked
    a2 = a + tokens(6, 3)
    aux2 = aux_states(target, a2)
    drafter.observe_target(["b"], [list(range(len(a) - 1, len(a2) - 1))], torch.arange(len(a2)), aux2)
    prop = drafter.propose([DraftRequest("b", a2, 0.0)], SHAPE.num_nodes)[0]
    torch.testing.assert_close(prop.draft_probs[0], root_q_reference(head, a2, aux2, holes=range(32)),
                               atol=1e-5, rtol=1e-4)
    drafter.finish_request("b")  # the slot's holes go with it
    assert bool(drafter.store.valid.all())


def test_partial_hit_and_finished_slots(setup):
    """A 16-token hit restores page 0 only; a request reusing a finished request's slot starts clean."""
    target, head, drafter = make_drafter(setup)
    a = tokens(7, 41)
    serve(drafter, target, "a", a)
    drafter.finish_request("a")
    aux, prop = serve(drafter, target, "f", a, hit=16)
    s = drafter.prefix_stats
    assert (s.restored, s.dropped, s.missing) == (16, 0, 0), s
    torch.testing.assert_close(prop.draft_probs[0], root_q_reference(head, a, aux), atol=1e-5, rtol=1e-4)


def test_pages_are_content_keyed_and_lru_bounded():
    """Keys chain the whole prefix (equal page contents under other prefixes differ); the pool holds at most
    `capacity` pages and evicts the least recently used."""
    k1 = chain_keys(list(range(48)), 16)
    k2 = chain_keys([99] + list(range(1, 48)), 16)
    assert len(k1) == 3 and all(a != b for a, b in zip(k1, k2))  # one token differs: every later key differs
    assert chain_keys(list(range(48)), 16, first=1, prev=k1[0]) == k1[1:]
    assert page_tokens_for(128) == 16 and page_tokens_for(16) == 16 and page_tokens_for(24) == 24
    pages = PrefixPages(1, 2, 4, torch.float32, page=16, capacity=2)
    kv = [(torch.full((2, 16, 4), 1.0), torch.full((2, 16, 4), 2.0))]
    for i, key in enumerate(k1):
        pages.put(key, kv, next_token=i)
        if i == 1:
            assert pages.get(k1[0]) is not None  # page 0 is now the most recently used: page 1 goes next
    assert k1[0] in pages and k1[1] not in pages and k1[2] in pages and pages.stats.evicted_pages == 1
    page, nxt = pages.get(k1[2])
    assert nxt == 2 and torch.equal(page[0, 1], kv[0][1])
    assert PrefixPages(1, 2, 4, torch.float32, page=16, capacity=0).get(k1[0]) is None
