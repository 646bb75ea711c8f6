"""The n-gram drafter's per-request index (serving path) proposes exactly the stateless scan's trees."""

import random

import numpy as np
import pytest
import torch

from vllm_tree_spec.drafters.base import DraftRequest
from vllm_tree_spec.drafters.ngram import NgramTreeDrafter


def _same(a, b):
    assert torch.equal(a.tree.parents, b.tree.parents) and torch.equal(a.tree.tokens, b.tree.tokens)
    assert (a.scores is None) == (b.scores is None) and (a.scores is None or torch.equal(a.scores, b.scores))


@pytest.mark.parametrize("seed", range(8))
def test_incremental_index_equals_the_full_scan(seed):
    rng = random.Random(seed)
    kw = dict(min_n=rng.randint(1, 2), max_depth=rng.randint(1, 6), max_matches=rng.choice([1, 3, 64]),
              length_weight=rng.choice([1, 4]), window=rng.choice([None, 2, 7, 30]))
    kw["max_n"] = kw["min_n"] + rng.randint(0, 3)
    drafter = NgramTreeDrafter(**kw)
    vocab = rng.choice([2, 4, 9])
    ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    drafter.start_request("a", ctx)
    for step in range(40):
        budget = rng.choice([0, 1, 5, 12])
        arr = np.array(ctx, dtype=np.int64)  # vLLM hands a numpy view of token_ids_cpu
        got = drafter.propose([DraftRequest("a", arr if step % 2 else list(ctx), 0.0)], budget)[0]
        _same(got, drafter.draft(ctx, budget))
        ctx += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]  # accepted tokens + bonus
    drafter.finish_request("a")


def test_a_changed_context_rebuilds_the_index():
    drafter = NgramTreeDrafter(min_n=1, max_n=3)
    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter.start_request("a", ctx)
    drafter.propose([DraftRequest("a", ctx, 0.0)], 4)
    other = [5, 6, 5, 6, 5, 6, 5, 6, 5]  # not an extension of what the index saw
    _same(drafter.propose([DraftRequest("a", other, 0.0)], 4)[0], drafter.draft(other, 4))
    drafter.finish_request("a")
    assert not drafter._index
