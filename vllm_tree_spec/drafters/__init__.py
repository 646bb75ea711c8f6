"""Tree drafters: each proposes one draft tree per request per step (the interface is in `base.py`).

    base.py         DraftRequest, TreeProposal, TreeDrafter (the contract the vLLM integration
                    and the DeepSeek-V4 MTP drafter plug into) and `canonical_tree`
    policy.py       tree policies for model drafters: static top-k (optionally one Sequoia shape
                    per budget), dynamic EAGLE-2 / SGLang TreeShape, sampled children
    suffix.py       model-free trees from Arctic Inference's suffix trees
    ngram.py        model-free trees from n-gram matches in the request's own context
    draft_model.py  a small Hugging Face causal LM expanded one level per forward with tree masks
                    (and LevelTreeDrafter / LevelSession: policy-driven level-by-level building and
                    the q rows, shared with eagle3 and eagle)
    eagle3.py       an EAGLE-3 head (eagle3_head.py: the checkpoint vLLM's eagle3 loads) fed by the
                    target's auxiliary hidden states, one level per forward with tree masks (needs vLLM)
    eagle.py        an EAGLE-1 head (eagle_head.py: the checkpoint vLLM's eagle loads) fed by the
                    target's last hidden state, on eagle3.py's machinery (needs vLLM)

Importing this package imports torch and numpy, but neither vLLM, transformers
nor arctic-inference: the drafters that need those import them when built.
"""

from vllm_tree_spec.drafters.base import (
    DraftRequest,
    DrafterError,
    TreeDrafter,
    TreeProposal,
    canonical_tree,
    deterministic_mode,
)
from vllm_tree_spec.drafters.draft_model import DraftModelTreeDrafter
from vllm_tree_spec.drafters.ngram import NgramTreeDrafter
from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy, TreePolicy, parse_policy
from vllm_tree_spec.drafters.suffix import SuffixTreeDrafter

__all__ = [
    "DraftModelTreeDrafter",
    "DraftRequest",
    "DrafterError",
    "DynamicPolicy",
    "NgramTreeDrafter",
    "SampledPolicy",
    "StaticPolicy",
    "SuffixTreeDrafter",
    "TreeDrafter",
    "TreePolicy",
    "TreeProposal",
    "canonical_tree",
    "deterministic_mode",
    "parse_policy",
]
