"""Sampled tree speculation over DeepSeek-V4 state matches sequential sampling in law.

Vocabulary 8, temperature 1. The root sits at position 6, so its children (at
7) complete a CSA and an HCA entry each, siblings with different pooling
windows. For each seed the pipeline drafts a tree from fixed draft
distributions q, runs the tree forward, verifies with `verify_tree`, commits,
and (if the round emitted one token only) runs a second round from the
committed state. The first two generated tokens (x1, x2) are compared with
their exact law p(x1) p(x2 | x1), computed by plain decoding, with a
chi-square test. The same statistic rejects the plain-tree-mask pipeline,
which shows the test has the power to see a state bug.
"""

import pytest
import torch
from scipy.stats import chisquare

from vllm_tree_spec.reference import dsv4_tree as dt
from vllm_tree_spec.reference.dsv4 import DSV4Model
from vllm_tree_spec.reference.dsv4_cache import DSV4Cache
from vllm_tree_spec.reference.dsv4_config import DSV4Config
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import verify_tree

V = 8
PROMPT = [3, 1, 4, 1, 5, 2]  # P = 6: the root is at 6, its children complete CSA w=1 and HCA w=0
ROOT = 6
PARENTS = torch.tensor([-1, -1, 0])  # round 1: two children of the root, one grandchild under the first
PARENTS_2 = torch.tensor([-1])  # round 2 only needs its first token: one child
NUM_SAMPLES = 2000  # per mode; each distinct tree costs one forward (memoised)
NUM_SAMPLES_CONTROL = 3000
ALPHA = 1e-3

pytestmark = pytest.mark.stats


class Pipeline:
    """Tree rounds for one request with memoised forwards (a forward is a function of its inputs)."""

    def __init__(self, model: DSV4Model, forward: str = "tree"):
        self.model, self.forward = model, forward
        self.base = DSV4Cache.empty(model.cfg, 1, 16)
        dt.prefill(model, self.base, [PROMPT])
        g = torch.Generator().manual_seed(99)
        self.q_root = torch.softmax(1.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
        self.q_child = torch.softmax(1.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
        self._probs: dict = {}
        self._after_root: DSV4Cache | None = None

    def draft(self, mode: str, g: torch.Generator, parents: torch.Tensor = PARENTS) -> Tree:
        """Children of the root from q_root; the child of node 0 (if any) from q_child."""
        n_kids = int((parents == -1).sum())
        if mode == "deterministic":  # top-k children, no randomness (q := 1 at verification)
            kids = torch.topk(self.q_root, n_kids).indices.tolist()
            rest = [int(self.q_child.argmax())] * (len(parents) - n_kids)
        else:
            kids = torch.multinomial(self.q_root, n_kids, replacement=mode == "sampled", generator=g).tolist()
            rest = [int(torch.multinomial(self.q_child, 1, generator=g)) for _ in range(len(parents) - n_kids)]
        return Tree(parents, torch.tensor(kids + rest))

    def draft_probs(self, tree: Tree) -> torch.Tensor:
        """[N + 1, V]: row 0 (the root's children) q_root, every node's children q_child."""
        return torch.stack([self.q_root] + [self.q_child] * tree.num_nodes)

    def tree_round(self, cache: DSV4Cache, key, root: int, tree: Tree):
        k = (key, root, tuple(tree.tokens.tolist()))
        if k not in self._probs:
            work = cache.clone()
            if self.forward == "tree":
                step = dt.tree_forward(self.model, work, [root], [tree])
                logits = step.request_logits(0)
            else:
                step, logits = None, dt.naive_tree_forward(self.model, work, [root], [tree])
            self._probs[k] = (torch.softmax(logits, -1), step)
        return self._probs[k]

    def root_committed(self, step: dt.TreeStep | None) -> DSV4Cache:
        """State after a round that accepted nothing: only the root committed (same for every tree)."""
        if self._after_root is None:
            cache = self.base.clone()
            if step is not None:
                dt.commit(cache, step, [[]])
            else:  # the control pipeline has no scratch: commit the root by decoding it
                dt.decode(self.model, cache, [ROOT])
            self._after_root = cache
        return self._after_root

    def first_two(self, mode: str, seed: int) -> tuple[int, int]:
        g = torch.Generator().manual_seed(seed)
        sampled = mode.startswith("sampled")
        tree = self.draft(mode, g)
        probs, step = self.tree_round(self.base, "base", ROOT, tree)
        acc, nxt = verify_tree(tree.parents, tree.tokens, probs, self.draft_probs(tree) if sampled else None, mode, g)
        emitted = [int(tree.tokens[a]) for a in acc] + [nxt]
        if len(emitted) >= 2:
            return emitted[0], emitted[1]
        x1 = emitted[0]
        cache = self.root_committed(step)
        tree2 = self.draft(mode, g, PARENTS_2)
        probs2, _ = self.tree_round(cache, x1, x1, tree2)
        acc2, nxt2 = verify_tree(tree2.parents, tree2.tokens, probs2, self.draft_probs(tree2) if sampled else None,
                                 mode, g)
        return x1, (int(tree2.tokens[acc2[0]]) if acc2 else nxt2)


@pytest.fixture(scope="module")
def small_model() -> DSV4Model:
    model = DSV4Model(DSV4Config(vocab_size=V), torch.float64, seed=3)
    # A sharper target (logits x 2) makes the control's wrong entries move the law enough
    # (TV ~ 0.02 on the first two tokens) for NUM_SAMPLES draws to see it.
    model.lm_head.weight.mul_(2.0)
    return model


@pytest.fixture(scope="module")
def exact_joint(small_model) -> torch.Tensor:
    """[V, V] p(x1, x2) by plain decoding: p(x1 | prompt, root) p(x2 | prompt, root, x1)."""
    cache = DSV4Cache.empty(small_model.cfg, 1, 16)
    dt.prefill(small_model, cache, [PROMPT])
    p1 = torch.softmax(dt.decode(small_model, cache, [ROOT])[0], -1)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for x1 in range(V):
        p2 = torch.softmax(dt.decode(small_model, cache.clone(), [x1])[0], -1)
        joint[x1] = p1[x1] * p2
    return joint


def chi_square_pvalue(samples: list[tuple[int, int]], joint: torch.Tensor) -> float:
    counts = torch.zeros(V * V, dtype=torch.float64)
    for x1, x2 in samples:
        counts[x1 * V + x2] += 1
    expected = joint.flatten() * len(samples)
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat((counts[~small], counts[small].sum().view(1)))
    exp = torch.cat((expected[~small], expected[small].sum().view(1)))
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


# The served engines' sampling-law tests cover every mode in the default run (tests/integration/test_engine_sampling.py,
# tests/integration_dsv4/test_dsv4_sampling.py); on the reference model the rejection-sampling modes (~3-6 min each on
# 2 cores: every sampled tree is a distinct forward) are in the extended set.
@pytest.mark.parametrize("mode", [pytest.param("sampled", marks=pytest.mark.extended),
                                  pytest.param("sampled_without_replacement", marks=pytest.mark.extended),
                                  "deterministic"])
def test_first_two_tokens_follow_the_target_law(small_model, exact_joint, mode):
    pipe = Pipeline(small_model)
    samples = [pipe.first_two(mode, seed) for seed in range(NUM_SAMPLES)]
    assert chi_square_pvalue(samples, exact_joint) > ALPHA


def test_plain_tree_mask_pipeline_is_rejected(small_model, exact_joint):
    pipe = Pipeline(small_model, forward="naive")
    samples = [pipe.first_two("deterministic", seed) for seed in range(NUM_SAMPLES_CONTROL)]
    assert chi_square_pvalue(samples, exact_joint) < ALPHA
