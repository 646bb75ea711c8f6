"""Lossless tree verification: walk the draft tree with the target's distributions.

Vocabulary (Leviathan et al., arXiv 2211.17192; vLLM's `RejectionSampler`):
p is the target's distribution at a tree row (after the request's sampling
transforms, see `sampling.py`), q the draft's. Rows are numbered as in
`tree.py`: row 0 is the root (the last committed token), row i + 1 follows
draft node i. A round walks from the root; at each visited row it either
**accepts** one child and descends, or stops and emits a **recovered**
(correction) token; if the walk ends at a leaf the last token is a **bonus**
token drawn from the full p. Output tokens = accepted + one recovered-or-bonus
token (`next_token`).

Every node-level step emits one token distributed exactly as p_row; the chain
rule then makes the whole round lossless (SpecInfer/Sequoia argument). Which
step is exact depends on how the children were drafted, hence four modes:

    greedy                        y = argmax p; accept the child whose token is y
    deterministic                 children chosen without randomness (top-k, n-gram,
                                  suffix trees): draw y ~ p, accept the child equal to y
                                  (sample-and-match; q := 1, the real q would be lossy)
    sampled                       children drawn i.i.d. from q: for each child x in order,
                                  accept if u < p(x) / q(x), else p <- norm(max(0, p - q));
                                  q unchanged, duplicate siblings processed in turn
    sampled_without_replacement   children drawn without replacement (in draw order): as
                                  above, and after rejecting x also q[x] <- 0, q <- norm(q)

Comparisons are strict (`u < ratio`, u in [0, 1)), so a token with p(x) = 0 is
never accepted (SGLang #35771). An EOS token or the request's remaining token
budget ends the round early: the emitted sequence is cut there, which does not
change the law of the tokens that are emitted.

Randomness is indexed by (request, depth), since the walk visits at most one row
per depth: passing the same `VerifyCoins` makes the reference walk, the
vectorised batch verifier and a kernel agree token for token.

The package, one concern per module (every name below is importable from
`vllm_tree_spec.verify`):

    rules.py            `Mode`, the fixed-point `row_sum` and `residual` the sampled rules
                        share, input validation, and the EOS / max_tokens cut
    coins.py            `VerifyCoins` (eager or lazy, per-request streams), `race`,
                        `exponential`, and the `CoinSource`s the reference walk reads
    reference_walk.py   `verify_tree` / `verify_tree_with_coins`: one request, a Python walk
                        (`node_step` per visited row); the reference outside checks call
    batch.py            `verify_batch`: B requests with different trees, vectorised over
                        nodes and requests; `verify_greedy_host` (CPU, all-greedy batches on
                        host lists, the same outputs); `sync_free` and `upload` for the
                        accelerator path without data-dependent host syncs
"""

# _as_modes and _exponential_rows: kernels/tree_verify_launch.py and integration/tree_sampler.py import them from here
from vllm_tree_spec.verify.batch import TreeVerifyOutput, _as_modes, sync_free, upload, verify_batch, verify_greedy_host
from vllm_tree_spec.verify.coins import (
    CoinSource,
    GeneratorCoins,
    TensorCoins,
    VerifyCoins,
    _exponential_rows,
    exponential,
    race,
)
from vllm_tree_spec.verify.reference_walk import node_step, verify_tree, verify_tree_with_coins, walk
from vllm_tree_spec.verify.rules import FIXED_POINT_BITS, Mode, residual, row_sum

__all__ = [
    "FIXED_POINT_BITS",
    "CoinSource",
    "GeneratorCoins",
    "Mode",
    "TensorCoins",
    "TreeVerifyOutput",
    "VerifyCoins",
    "exponential",
    "node_step",
    "race",
    "residual",
    "row_sum",
    "sync_free",
    "upload",
    "verify_batch",
    "verify_greedy_host",
    "verify_tree",
    "verify_tree_with_coins",
    "walk",
]
