"""P8: min_p and logit_bias requests are accepted by tree engines.

Why: `SamplingParams._validate_spec_decode` refuses min_p and logit_bias (HTTP 400 "not yet supported
with speculative decoding") whenever a speculative config exists: vLLM's chain RejectionSampler ignores
them, and under speculation vLLM builds its Sampler without their logits processors. A tree engine never
uses either: every sampled row goes through the plugin's sampler (`tree_sampler.sample_rows` for rows
without drafts, `request_target_probs` on tree rows), which applies both, so the law is exact.
What: wraps `SamplingParams._validate_spec_decode` (main process). When the speculative config is a tree
engine's (`method == "custom_class"` with our proposer, the config `engine_config` hands vLLM) the check
is skipped; any other speculative config (ngram, EAGLE, draft models, other custom classes) is refused
exactly as before.
Removal: min_p / logit bias support in vLLM's speculative path, or a proposer capability that the
validation reads.
"""

from __future__ import annotations

import functools


def is_tree_engine(speculative_config) -> bool:
    """Whether a vLLM `SpeculativeConfig` is the one `engine_config` builds for method "tree"."""
    from vllm_tree_spec.integration.proposer import PROPOSER_PATH

    return (speculative_config is not None and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


def install() -> None:
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if getattr(original, "_tree_spec_wrapped", False):
        return

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if is_tree_engine(speculative_config):
            return None  # min_p and logit_bias are applied on every row by the tree sampler
        return original(self, speculative_config)

    _validate_spec_decode._tree_spec_wrapped = True
    SamplingParams._validate_spec_decode = _validate_spec_decode
