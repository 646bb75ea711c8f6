"""The EAGLE-1 tree drafter on its own: the path invariant, and a head that copies the target (q = p).

Tiny random target and a tiny random EAGLE-1 head (tests/fixtures/tiny_eagle3.py, `make_tiny_eagle`);
the head's feature at position t is the target's output hidden state there (after its final norm), as
vLLM's runner hands it to its EAGLE-1 proposer.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="the EAGLE head reads its config with vLLM's parser and uses vLLM's RoPE")

from test_drafter_eagle3 import POLICIES, VOCAB, check_path_invariant, node_path, reference_logits  # noqa: E402
from tiny_eagle3 import make_copy_pair, make_tiny_eagle  # noqa: E402

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.eagle import EagleTreeDrafter  # noqa: E402
from vllm_tree_spec.drafters.eagle_head import load_eagle_head  # noqa: E402
from vllm_tree_spec.drafters.policy import StaticPolicy  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402


def last_hidden(target, tokens: list[int]) -> torch.Tensor:
    """[n, H] the target's output hidden states (after the final norm) at every position."""
    with torch.no_grad():
        return target.model(torch.tensor([tokens])).last_hidden_state[0]


def load(target_dir, head_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = load_eagle_head(head_dir, target_embedding=target.model.embed_tokens.weight,
                           target_lm_head=target.lm_head.weight)
    return target, head


@pytest.fixture(scope="module")
def setup(tiny_models):
    target_dir = tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08)
    return load(target_dir, make_tiny_eagle(tiny_models.root / "eagle1", target_dir))


@pytest.mark.parametrize("name", list(POLICIES))
def test_path_invariant(setup, name):
    """q at every expanded row == the EAGLE-1 head run sequentially along the row's path."""
    target, head = setup
    policy, temp, q_temp, floor = POLICIES[name]
    drafter = EagleTreeDrafter(head, policy, return_draft_probs=True, seed=5)
    assert check_path_invariant(drafter, head, target, last_hidden, reference_logits, temp, q_temp, floor) >= 6


def test_refuses_an_eagle3_head(tiny_models):
    from tiny_eagle3 import make_tiny_eagle3

    from vllm_tree_spec.drafters.base import DrafterError

    target_dir = tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08)
    head_dir = make_tiny_eagle3(tiny_models.root / "eagle3-for-eagle1", target_dir)
    with pytest.raises(DrafterError, match="drafter 'eagle3'"):
        load_eagle_head(head_dir, target_embedding=torch.zeros(VOCAB, 128), target_lm_head=torch.zeros(VOCAB, 128))


def test_copy_head_drafts_the_targets_greedy_path(tiny_models):
    """A head that copies the target (q = p): q rows equal the target's p, and the top-1 chain it drafts
    is the target's own greedy continuation, so greedy verification accepts every node on it."""
    target_dir, head_dir = make_copy_pair(tiny_models.root, tiny_models.tokenizer(VOCAB))
    target, head = load(target_dir, head_dir)
    drafter = EagleTreeDrafter(head, StaticPolicy.of(Tree.chain(4)), return_draft_probs=True)
    toks = torch.randint(7, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter.start_request("c", toks[:-1])
    drafter.observe_target(["c"], [list(range(len(toks)))], torch.arange(len(toks)), last_hidden(target, toks))
    prop = drafter.propose([DraftRequest("c", toks, 0.0)], 4)[0]
    path = list(node_path(prop.tree, prop.tree.num_nodes - 1))
    greedy, ctx = [], list(toks)
    with torch.no_grad():
        for row in range(len(path)):  # rows 0..3 are expanded (the leaf is not)
            logits = target(torch.tensor([ctx])).logits[0, -1]
            p = torch.softmax(logits, -1)
            torch.testing.assert_close(prop.draft_probs[row], p, atol=1e-5, rtol=1e-4)  # q = p on the path
            greedy.append(int(logits.argmax()))
            ctx.append(greedy[-1])
    assert path == greedy
