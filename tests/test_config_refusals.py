"""Malformed `--speculative-config` values: each stops start-up with a message naming the key and the fix.

These run at config validation (`parse_tree_config`, what the config route calls before vLLM builds
anything); `tests/integration/test_engine_startup.py` sends a few of them through a real engine start.
Each case names the key the message must mention and a piece of the fix it must spell out.
"""

import pytest

from vllm_tree_spec.config import TreeSpecConfig, TreeSpecError, parse_tree_config

DM = {"drafter": "draft_model", "model": "/draft"}  # a draft-model config that is valid on its own

# (id, keys besides method "tree", key named, fix spelled out)
MALFORMED = [
    ("unknown-drafter", {"drafter": "medusa"}, "drafter",
     "'suffix', 'ngram', 'draft_model', 'mtp', 'eagle3' or 'eagle'"),
    ("drafter-not-a-string", {"drafter": 3}, "drafter", "'suffix', 'ngram'"),
    ("unknown-key-typo", {"num_spec_tokens": 4}, "num_spec_tokens", "did you mean 'num_speculative_tokens'"),
    ("unknown-key", {"speculative_model": "x"}, "speculative_model",
     "valid keys: branch_min_token_prob, branch_spec_factor, budgets"),
    ("model-for-suffix", {"model": "/x"}, "model", "remove it"),
    ("model-for-ngram", {"drafter": "ngram", "model": "/x"}, "model", "remove it"),
    ("model-for-mtp", {"drafter": "mtp", "model": "/x"}, "model", "target's checkpoint"),
    ("draft-model-without-model", {"drafter": "draft_model"}, "model", "pass the draft model's path"),
    ("shape-zero-steps", {"tree": "s0_k2_d6"}, "tree", "steps >= 1"),
    ("shape-zero-topk", {"tree": "s3_k0_d6"}, "tree", "topk >= 1"),
    ("shape-no-draft-node", {"tree": "s3_k2_d1"}, "tree", "draft_tokens >= 2"),
    ("shape-incomplete", {"tree": "s3_k2"}, "tree", "e.g. 's3_k2_d6'"),
    ("tree-unknown-form", {"tree": "x3_k2_d6"}, "tree", "'chain:K'"),
    ("chain-without-k", {"tree": "chain:"}, "tree", "with an integer K"),
    ("chain-zero", {"tree": "chain:0"}, "tree", "K must be >= 1"),
    ("chain-not-int", {"tree": "chain:abc"}, "tree", "with an integer K"),
    ("paths-not-prefix-closed", {"tree": "[(0,), (0, 0, 0)]"}, "tree", "add it"),
    ("paths-duplicate", {"tree": "[(0,), (0,)]"}, "tree", "list each node once"),
    ("paths-unparsable", {"tree": "[(0,), ("}, "tree", "list of tuples"),
    ("paths-negative-rank", {"tree": [[-1]]}, "tree", "child ranks >= 0"),
    ("tree-wrong-type", {"tree": 5}, "tree", "a shape like 's3_k2_d6'"),
    ("dynamic-not-bool", {"drafter": "draft_model", "model": "/x", "dynamic": "maybe"}, "dynamic", "valid boolean"),
    ("dynamic-for-ngram", {"drafter": "ngram", "dynamic": True}, "dynamic", "remove it"),
    ("slots-zero", {"num_speculative_tokens": 0}, "num_speculative_tokens", "greater than 0"),
    ("slots-negative", {"num_speculative_tokens": -3}, "num_speculative_tokens", "greater than 0"),
    ("slots-not-int", {"num_speculative_tokens": "six"}, "num_speculative_tokens", "valid integer"),
    ("slots-below-tree", {"tree": "chain:8", "num_speculative_tokens": 4}, "num_speculative_tokens",
     "raise it to >= 8"),
    ("verification-unknown", {"verification": "typical"}, "verification", "'auto', 'greedy', 'deterministic'"),
    ("verification-greedy", {"verification": "greedy"}, "verification", "use 'auto'"),
    ("verification-sampled-on-topk", {"verification": "sampled"}, "verification", "use 'auto' (= 'deterministic')"),
    ("verification-wor-on-ngram", {"drafter": "ngram", "verification": "sampled_without_replacement"},
     "verification", "use 'auto' (= 'deterministic')"),
    ("verification-deterministic-on-iid", {**DM, "draft_sampling": "sample", "tree": "chain:4",
                                           "verification": "deterministic"}, "verification", "'auto' (= 'sampled')"),
    ("verification-sampled-on-wor", {**DM, "draft_sampling": "sample_without_replacement", "tree": "chain:4",
                                     "verification": "sampled"}, "verification", "or 'deterministic'"),
    ("draft-sampling-for-suffix", {"draft_sampling": "sample"}, "draft_sampling", "remove it"),
    ("draft-sampling-unknown", {**DM, "draft_sampling": "nucleus"}, "draft_sampling", "'topk', 'sample'"),
    ("draft-sampling-dynamic-shape", {**DM, "draft_sampling": "sample", "tree": "s3_k2_d6"}, "tree",
     "give explicit paths or 'chain:K'"),
    ("seed-without-sampling", {**DM, "seed": 3}, "seed", "remove it or set draft_sampling"),
    ("seed-not-int", {**DM, "draft_sampling": "sample", "tree": "chain:3", "seed": "abc"}, "seed", "valid integer"),
    ("budget-batch-size-zero", {"budgets": {0: 4}}, "budgets", "must be >= 1"),
    ("budget-negative", {"budgets": {4: -1}}, "budgets", "lower the budget"),
    ("budget-above-slots", {"budgets": {4: 100}}, "budgets", "raise 'num_speculative_tokens'"),
    ("budget-batch-size-not-int", {"budgets": {"four": 4}}, "budgets", "valid integer"),
    ("budgets-not-a-dict", {"budgets": [4, 2]}, "budgets", "valid dictionary"),
    ("budgets-unknown-word", {"budgets": "static"}, "budgets", 'write "auto"'),
    ("budgets-null", {"budgets": None}, "budgets", 'write "auto"'),
    ("budgets-empty-table", {"budgets": {}}, "budgets", "give at least one"),
    ("replan-with-static-table", {"budgets": {8: 4}, "replan_every": 64}, "replan_every",
     "set 'budgets' to \"auto\""),
    ("explore-with-static-table", {"budgets": {8: 4}, "explore_every": 4}, "explore_every", "remove 'explore_every'"),
    ("gate-with-static-table", {"budgets": {8: 4}, "score_gate": False}, "score_gate", "remove 'score_gate'"),
    ("replan-zero", {"replan_every": 0}, "replan_every", "greater than or equal to 1"),
    ("explore-one", {"explore_every": 1}, "explore_every", "greater than or equal to 2"),
    ("spec-factor-zero", {"max_spec_factor": 0}, "max_spec_factor", "greater than 0"),
    ("spec-factor-for-ngram", {"drafter": "ngram", "max_spec_factor": 2.0}, "max_spec_factor", "remove it"),
    ("token-prob-above-one", {"min_token_prob": 1.5}, "min_token_prob", "less than or equal to 1"),
    ("token-prob-negative", {"min_token_prob": -0.1}, "min_token_prob", "greater than or equal to 0"),
    ("branch-factor-zero", {"branch_spec_factor": 0}, "branch_spec_factor", "greater than 0"),
    ("branch-prob-above-one", {"branch_min_token_prob": 2}, "branch_min_token_prob", "less than or equal to 1"),
    ("branch-factor-for-ngram", {"drafter": "ngram", "branch_spec_factor": 2.0}, "branch_spec_factor",
     "remove it"),
    ("lookup-min-zero", {"drafter": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min",
     "greater than or equal to 1"),
    ("lookup-min-above-max", {"drafter": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min", "lower the first or raise the second"),
    ("lookup-for-suffix", {"prompt_lookup_max": 4}, "prompt_lookup_max", "remove it"),
]


def test_at_least_30_distinct_cases():
    assert len(MALFORMED) >= 30
    assert len({c[0] for c in MALFORMED}) == len(MALFORMED)
    assert len({repr(c[1]) for c in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize("keys,key,fix", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_config_names_key_and_fix(keys, key, fix):
    with pytest.raises(TreeSpecError) as info:
        parse_tree_config({"method": "tree", **keys})
    msg = str(info.value)
    assert msg.startswith("invalid tree speculative_config: "), msg
    assert f"key {key!r}" in msg, msg
    assert fix in msg, msg


@pytest.mark.parametrize("keys", [
    {},
    {"drafter": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 8},
    {"drafter": "suffix", "tree": "s3_k2_d6", "max_spec_factor": 2.0, "min_token_prob": 0.0,
     "branch_spec_factor": 3.0, "branch_min_token_prob": 0.05},
    {**DM, "tree": "s3_k2_d6", "dynamic": False},
    {**DM, "draft_sampling": "sample", "tree": "chain:4", "seed": 1, "verification": "sampled"},
    {**DM, "draft_sampling": "sample_without_replacement", "tree": "[(0,), (1,), (0, 0)]", "seed": 1,
     "verification": "deterministic"},
    {"drafter": "mtp", "tree": "chain:3", "dynamic": False},
    {"budgets": {1: 5, 8: 2, 64: 0}},
    {"budgets": "auto", "replan_every": 64, "explore_every": 4, "score_gate": False},
], ids=["defaults", "ngram", "suffix", "draft-model", "iid-sampled", "wor-deterministic", "mtp", "budgets",
        "budgets-auto"])
def test_valid_configs_still_parse_and_survive_the_worker_round_trip(keys):
    """The controls: these must pass (else the refusals above could be refusing everything), and the
    JSON dump the config route ships to the workers must validate again there."""
    cfg = parse_tree_config({"method": "tree", **keys})
    assert TreeSpecConfig(**cfg.model_dump(mode="json")) == cfg
    assert cfg.budgets == keys.get("budgets", "auto")  # the online shape policy is the default


@pytest.mark.parametrize("drafting,rule,mode", [
    ({}, "auto", "deterministic"),
    ({**DM, "draft_sampling": "sample", "tree": "chain:4"}, "auto", "sampled"),
    ({**DM, "draft_sampling": "sample_without_replacement", "tree": "chain:4"}, "auto", "sampled_without_replacement"),
    ({**DM, "draft_sampling": "sample_without_replacement", "tree": "chain:4"}, "deterministic", "deterministic"),
])
def test_verification_rule_is_the_one_used(drafting, rule, mode):
    """`verification` is honoured: the rule the runner verifies with (verification_for) is the user's."""
    cfg = parse_tree_config({"method": "tree", **drafting, "verification": rule})
    assert cfg.verification_mode == mode
    assert cfg.verification_for(cfg.children_drafting) == mode
    if rule != "auto":  # a tree drafted i.i.d. is never verified by a rule that is lossy for it
        with pytest.raises(TreeSpecError, match="lossy"):
            cfg.verification_for("sampled")
