"""P8: min_p and logit_bias pass vLLM's request validation only for tree engines."""

import pytest

pytest.importorskip("vllm")


def _spec(method, model=None):
    from types import SimpleNamespace

    return SimpleNamespace(method=method, model=model)


@pytest.mark.parametrize("params", [dict(min_p=0.1), dict(logit_bias={5: 1.0}), dict(min_p=0.2, logit_bias={1: -2.0})])
def test_tree_engines_accept_min_p_and_logit_bias_linear_speculation_still_refuses(params):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_tree_spec.integration import install
    from vllm_tree_spec.integration.proposer import PROPOSER_PATH
    from vllm_tree_spec.integration.request_validation import is_tree_engine

    install()
    sp = SamplingParams(**params)
    tree = _spec("custom_class", PROPOSER_PATH)
    assert is_tree_engine(tree)
    sp._validate_spec_decode(tree)  # accepted
    sp._validate_spec_decode(None)  # no speculation: nothing to check
    for other in (_spec("ngram", "ngram"), _spec("eagle3", "x"), _spec("custom_class", "my.OtherProposer")):
        assert not is_tree_engine(other)
        with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
            sp._validate_spec_decode(other)
