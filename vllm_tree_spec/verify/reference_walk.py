"""The reference walk: one request, a Python loop over the rows it visits; the entry point outside checks call.

From the root, at each visited row `node_step` applies the mode's rule (`rules.py`) to the row's
children: it either accepts one child and the walk descends, or stops and emits a recovered
(correction) token; at a leaf the last token is a bonus token drawn from the full p. Every step
emits one token distributed exactly as p at its row, so by the chain rule the whole round is
lossless. `verify_tree` validates its inputs and reads fresh coins from a generator;
`verify_tree_with_coins` reads given coins, which is how the batch verifier and the kernels are
checked against this walk token for token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify.coins import CoinSource, GeneratorCoins, TensorCoins, VerifyCoins
from vllm_tree_spec.verify.rules import Mode, _truncate, _validate, residual, row_sum


def node_step(
    p: torch.Tensor,
    q: torch.Tensor | None,
    child_tokens: Sequence[int],
    mode: Mode,
    coins: CoinSource,
    depth: int,
) -> tuple[int | None, int]:
    """One visited row: returns (rank of the accepted child or None, token emitted here).

    p [V] is the target at the row, q [V] the draft the children were drawn from
    (sampled modes only). The emitted token is distributed exactly as p.
    """
    if mode in (Mode.GREEDY, Mode.DETERMINISTIC):
        y = int(p.argmax()) if mode == Mode.GREEDY else coins.draw(p, depth)
        rank = next((j for j, x in enumerate(child_tokens) if x == y), None)
        return rank, y
    for rank, x in enumerate(child_tokens):
        ratio = float(p[x] / q[x]) if float(q[x]) > 0 else 0.0  # q(x) = 0: reject; in p's dtype, as the batch
        if coins.accept(ratio, depth, rank):
            return rank, x
        p = residual(p, q)
        if mode == Mode.SAMPLED_WITHOUT_REPLACEMENT:
            q = q.clone()
            q[x] = 0  # the next child was drawn from q without x
            q = q / row_sum(q)
    return None, coins.draw(p, depth)


def walk(
    tree: Tree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    mode: Mode,
    coins: CoinSource,
) -> tuple[list[int], int]:
    """The reference walk (no validation, no truncation). Returns (accepted nodes, next token)."""
    tokens = tree.tokens.tolist() if tree.num_nodes else []
    row, depth, accepted = 0, 0, []
    while True:
        children = tree.children[row]
        q = None if draft_probs is None else draft_probs[row]
        rank, y = node_step(target_probs[row], q, [tokens[c] for c in children], mode, coins, depth)
        if rank is None:
            return accepted, y
        accepted.append(children[rank])
        row, depth = children[rank] + 1, depth + 1


def verify_tree(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    mode: str,
    generator: torch.Generator | None,
    *,
    eos_token_id: "int | Sequence[int] | None" = None,
    max_tokens: int | None = None,
) -> tuple[list[int], int]:
    """Verify one request's draft tree (reference implementation).

    Args:
        parents: [N] int64 parent indices in topological order (-1 = child of the root).
        tokens: [N] int64 draft tokens.
        target_probs: [N + 1, V] p per row (row 0 at the root, row i + 1 after node i's
            path), already transformed by the request's sampling parameters.
        draft_probs: [N + 1, V] or None; row r = the q node r's children were drawn from
            (required by the two sampled modes).
        mode: "greedy" | "deterministic" | "sampled" | "sampled_without_replacement".
        generator: torch.Generator supplying the coins (None: the default RNG).
        eos_token_id: if given (an id or a collection of stop ids), the round ends at the first
            emitted one.
        max_tokens: if given (>= 1), at most this many tokens are emitted.

    Returns:
        (accepted, next_token): accepted node indices from the first level down
        (root excluded) and the token emitted after them -- the recovered token,
        or the bonus token if the walk ended at a leaf. Emitted tokens are
        [tokens[a] for a in accepted] + [next_token]. If EOS or max_tokens cut
        the round, next_token is the last emitted token and accepted the nodes
        before it.
    """
    return _verify_tree(parents, tokens, target_probs, draft_probs, mode, GeneratorCoins(generator),
                        eos_token_id=eos_token_id, max_tokens=max_tokens)


def verify_tree_with_coins(
    parents, tokens, target_probs, draft_probs, mode, coins: VerifyCoins | CoinSource, *, b: int = 0,
    eos_token_id: "int | Sequence[int] | None" = None, max_tokens: int | None = None,
) -> tuple[list[int], int]:
    """`verify_tree` reading explicit coins (request b of a `VerifyCoins`, or any `CoinSource`)."""
    source = TensorCoins(coins, b) if isinstance(coins, VerifyCoins) else coins
    return _verify_tree(parents, tokens, target_probs, draft_probs, mode, source,
                        eos_token_id=eos_token_id, max_tokens=max_tokens)


def _verify_tree(parents, tokens, target_probs, draft_probs, mode, coins, *, eos_token_id, max_tokens):
    mode = Mode.parse(mode)
    parents = torch.as_tensor(parents, dtype=torch.long)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if parents.dim() != 1 or tokens.dim() != 1:
        raise ValueError("parents and tokens must be 1-D tensors over the N draft nodes")
    tree = Tree(parents, tokens)
    _validate(tree, target_probs, draft_probs, mode)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens} must be >= 1 (a round always emits a token)")
    accepted, nxt = walk(tree, target_probs, draft_probs, mode, coins)
    return _truncate(accepted, nxt, tokens.tolist(), eos_token_id, max_tokens)
