"""User-facing configuration: the keys of `--speculative-config '{"method": "tree", ...}'`.

Validated once, at engine start-up, by a frozen pydantic model; every error
names the key and the fix. Example:

    vllm serve MODEL --speculative-config '{"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6"}'

Keys (see README for the table):
    drafter            "suffix" | "ngram" | "draft_model" | "mtp" | "eagle3" | "eagle"
    model              draft model path (drafter "draft_model"), EAGLE-3 / EAGLE-1 head directory
                       (drafters "eagle3" / "eagle")
    tree               node layout: a shape "s{steps}_k{topk}_d{tokens}", explicit child-rank paths
                       "[(0,), (1,), (0, 0)]", or "chain:K"
    dynamic            draft_model, eagle3, eagle: EAGLE-2 rerank of a shape by draft scores (default True for shapes)
    num_speculative_tokens   vLLM's per-request draft slot count; defaults to the largest tree
    verification       the lossless rule: "auto" (the one that matches how the drafter chooses children), or
                       "deterministic" for draft_sampling "sample_without_replacement" (one draw y ~ p per
                       node instead of rejection sampling against q); rules that would be lossy are refused
    draft_sampling     draft_model, eagle3, eagle: "topk" (deterministic children) | "sample" |
                       "sample_without_replacement"
    budgets            "auto" (default): the online shape policy re-plans the drafted tree (a tree, a chain or
                       no speculation) per batch-size bucket from measured acceptance and step costs
                       (online_policy/, docs/planner.md section 4); or a static table {"batch size": max
                       nodes}: the node budget for batches up to that size (0 switches speculation off there)
    replan_every, explore_every   budgets "auto": steps between re-plans (256), base period of the
                       unpruned exploration steps (16)
    suffix / ngram knobs: max_spec_factor, min_token_prob (the best chain's caps, as vLLM's linear
                       `suffix`), branch_spec_factor, branch_min_token_prob (the branches' caps; default:
                       the node budget alone), prompt_lookup_min, prompt_lookup_max
                       (a knob of another drafter is refused rather than ignored)
    seed               draft_model with draft_sampling != "topk": seed of the draft's own sampling
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_tree_spec.tree import Tree, TreeError, TreeShape

TREE_METHOD = "tree"
MODEL_DRAFTERS = ("draft_model", "eagle3", "eagle")  # drafters with a q: dynamic trees and sampled children apply


# How a drafter chooses children -> the verification rules that are lossless for them (first: 'auto').
# Deterministic verification draws y ~ p and ignores q, so it is lossless for any set of *distinct* children
# (draws without replacement are distinct; i.i.d. draws may repeat a token). Using the draft's real q for
# children it did not sample (top-k, n-gram, suffix) would be lossy.
LOSSLESS_RULES: dict[str, tuple[str, ...]] = {
    "deterministic": ("deterministic",),
    "sampled": ("sampled",),
    "sampled_without_replacement": ("sampled_without_replacement", "deterministic"),
}


DRAFTER_KEYS: dict[str, tuple[str, ...]] = {  # keys that only one drafter family reads
    "prompt_lookup_min": ("ngram",),
    "prompt_lookup_max": ("ngram",),
    "max_spec_factor": ("suffix",),
    "min_token_prob": ("suffix",),
    "branch_spec_factor": ("suffix",),
    "branch_min_token_prob": ("suffix",),
    "dynamic": ("draft_model", "mtp", "eagle3", "eagle"),
    "seed": MODEL_DRAFTERS,
}


class TreeSpecError(ValueError):
    """A bad tree-speculation configuration (raised at start-up)."""


class TreeSpecConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["tree"] = "tree"
    drafter: Literal["suffix", "ngram", "draft_model", "mtp", "eagle3", "eagle"] = Field(
        "suffix", description="Who proposes the tree.")
    model: str | None = Field(None, description="Draft model path (drafter 'draft_model') or EAGLE head "
                              "directory (drafters 'eagle3', 'eagle').")
    tree: str | list[list[int]] | None = Field(
        None, description="Tree layout: shape string, explicit rank paths, or 'chain:K'. Model-free drafters "
        "only use its node count, except 'chain:K' (their best chain only); default: 's3_k2_d6', or "
        "num_speculative_tokens nodes for suffix/ngram.")
    dynamic: bool | None = Field(None, description="EAGLE-2 rerank (draft_model with a shape).")
    num_speculative_tokens: int | None = Field(None, gt=0, description="Draft slots per request.")
    verification: Literal["auto", "greedy", "deterministic", "sampled", "sampled_without_replacement"] = Field(
        "auto", description="The lossless rule: 'auto' or one of LOSSLESS_RULES[how children are drafted] "
        "('greedy' is refused: temperature-0 requests are verified greedily anyway).")
    draft_sampling: Literal["topk", "sample", "sample_without_replacement"] = "topk"
    budgets: dict[int, int] | Literal["auto"] = Field(
        "auto", description="'auto' (online shape policy) or max draft nodes per batch-size bucket.")
    replan_every: int = Field(256, ge=1, description="budgets 'auto': steps between re-plans.")
    explore_every: int = Field(16, ge=2, description="budgets 'auto': base period of unpruned exploration steps.")
    score_gate: bool = Field(True, description="budgets 'auto': drop draft nodes whose calibrated acceptance at "
                             "their drafter score is below the break-even of one more verified row.")
    max_spec_factor: float = Field(1.0, gt=0, description="Suffix drafter: tokens per matched token.")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="Suffix drafter: min continuation frequency.")
    branch_spec_factor: float | None = Field(None, gt=0, description="Suffix drafter: max_spec_factor of the "
                                             "tree's branches (None: the node budget alone caps them).")
    branch_min_token_prob: float = Field(0.0, ge=0, le=1, description="Suffix drafter: min_token_prob of the "
                                         "tree's branches.")
    prompt_lookup_min: int = Field(1, ge=1, description="N-gram drafter: shortest suffix to match.")
    prompt_lookup_max: int = Field(3, ge=1, description="N-gram drafter: longest suffix to match.")
    seed: int | None = Field(None, description="Seed of the drafter's own sampling (draft_sampling != 'topk').")

    @field_validator("tree", mode="before")
    @classmethod
    def _tree_text(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [list(p) if isinstance(p, (list, tuple)) else [p] for p in v]
        return v

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets_text(cls, v: Any) -> Any:
        if v is None:
            raise ValueError("key 'budgets' = None: write \"auto\" (the default: the online shape policy) or a "
                             "table {batch size: nodes}, e.g. {\"8\": 6, \"64\": 0}")
        if isinstance(v, str) and v != "auto":
            raise ValueError(f"key 'budgets' = {v!r}: write \"auto\" (the default: the online shape policy) or "
                             f"a table {{batch size: nodes}}, e.g. {{\"8\": 6, \"64\": 0}}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TreeSpecConfig":
        try:
            self.layout()
        except TreeError as e:
            raise ValueError(f"key 'tree': {e}") from None
        n = self.max_nodes
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < n:
            raise ValueError(
                f"key 'num_speculative_tokens' = {self.num_speculative_tokens} is smaller than the tree's "
                f"{n} draft nodes; raise it to >= {n} or omit it"
            )
        if self.drafter == "draft_model" and not self.model:
            raise ValueError("key 'model' is required for drafter 'draft_model': pass the draft model's path")
        if self.drafter in ("eagle3", "eagle") and not self.model:
            raise ValueError(f"key 'model' is required for drafter {self.drafter!r}: pass the head's directory "
                             f"(the one vLLM's {{\"method\": \"{self.drafter}\", \"model\": ...}} loads)")
        if self.drafter not in MODEL_DRAFTERS and self.model:
            why = " (the MTP head is read from the target's checkpoint)" if self.drafter == "mtp" else ""
            raise ValueError(f"key 'model' is not used by drafter {self.drafter!r}; remove it{why}")
        for key, drafters in DRAFTER_KEYS.items():  # knobs of another drafter would be ignored silently
            if self.drafter not in drafters and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(f"key {key!r} applies to drafter {' / '.join(map(repr, drafters))} only, not "
                                 f"{self.drafter!r}; remove it")
        if self.seed is not None and self.draft_sampling == "topk" and self.drafter in MODEL_DRAFTERS:
            raise ValueError("key 'seed' seeds the draft model's own sampling, which draft_sampling 'topk' does not "
                             "do; remove it or set draft_sampling")
        if self.drafter not in MODEL_DRAFTERS and self.draft_sampling != "topk":
            raise ValueError("key 'draft_sampling' applies to drafters 'draft_model', 'eagle3' and 'eagle' only; "
                             "remove it")
        if self.draft_sampling != "topk" and isinstance(self.layout(), TreeShape):
            raise ValueError(
                f"key 'tree' = {self.tree!r} is a dynamic shape, but draft_sampling = {self.draft_sampling!r} "
                f"samples a fixed shape; give explicit paths or 'chain:K'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"key 'prompt_lookup_min' = {self.prompt_lookup_min} is larger than "
                             f"'prompt_lookup_max' = {self.prompt_lookup_max}; lower the first or raise the second")
        if self.budgets != "auto":
            for key in ("replan_every", "explore_every", "score_gate"):  # knobs of the policy a static table switches off
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f"key {key!r} tunes budgets \"auto\", but 'budgets' is a static table; "
                                     f"remove {key!r} or set 'budgets' to \"auto\"")
            if not self.budgets:
                raise ValueError("key 'budgets' = {}: give at least one {batch size: nodes} entry, or \"auto\"")
        for bs, nodes in ({} if self.budgets == "auto" else self.budgets).items():
            if bs < 1:
                raise ValueError(f"key 'budgets': batch size {bs} must be >= 1")
            if nodes < 0 or nodes > self.num_slots:
                raise ValueError(
                    f"key 'budgets': {nodes} nodes at batch size {bs} is outside [0, num_speculative_tokens = "
                    f"{self.num_slots}]; lower the budget or raise 'num_speculative_tokens'"
                )
        if self.verification == "greedy":
            raise ValueError(
                "key 'verification' = 'greedy': temperature-0 requests are always verified greedily, and for "
                "sampled requests the greedy rule is lossy; use 'auto'")
        drafted = self.children_drafting
        if self.verification != "auto" and self.verification not in LOSSLESS_RULES[drafted]:
            raise ValueError(
                f"key 'verification' = {self.verification!r} is lossy for children drafted as {drafted!r}; use "
                f"'auto' (= {drafted!r})" + "".join(f" or {r!r}" for r in LOSSLESS_RULES[drafted][1:]))
        return self

    # -- derived ------------------------------------------------------------

    def layout(self) -> Tree | TreeShape:
        """The static tree (shape-only `Tree`) or a `TreeShape` for dynamic trees (parsed once per config:
        the runner asks for the node budget every step)."""
        t = self.tree
        return _layout(self.drafter, tuple(tuple(p) for p in t) if isinstance(t, list) else t,
                       self.num_speculative_tokens)

    @property
    def max_nodes(self) -> int:
        lay = self.layout()
        return lay.num_nodes if isinstance(lay, TreeShape) else lay.num_nodes

    @property
    def num_slots(self) -> int:
        return self.num_speculative_tokens or self.max_nodes

    @property
    def children_drafting(self) -> str:
        """How the drafter chooses children, which fixes the lossless rule."""
        if self.drafter in MODEL_DRAFTERS and self.draft_sampling == "sample":
            return "sampled"
        if self.drafter in MODEL_DRAFTERS and self.draft_sampling == "sample_without_replacement":
            return "sampled_without_replacement"
        return "deterministic"

    @property
    def verification_mode(self) -> str:
        """The rule trees are verified with (temperature-0 requests are verified greedily regardless)."""
        return self.verification_for(self.children_drafting)

    def verification_for(self, drafted: str) -> str:
        """The rule for a tree whose children were drafted as `drafted` (a `LOSSLESS_RULES` key)."""
        if self.verification == "auto":
            return drafted
        if self.verification not in LOSSLESS_RULES.get(drafted, ()):
            raise TreeSpecError(f"verification {self.verification!r} is lossy for a tree drafted as {drafted!r}")
        return self.verification

    @property
    def is_dynamic(self) -> bool:
        if self.dynamic is not None:
            return self.dynamic
        return isinstance(self.layout(), TreeShape)

    def budget_for(self, batch_size: int) -> int:
        """Max draft nodes per request at this batch size."""
        if self.budgets == "auto":  # the online shape policy prunes below this (online_policy/)
            return self.max_nodes
        for bs in sorted(self.budgets):
            if batch_size <= bs:
                return self.budgets[bs]
        return self.budgets[max(self.budgets)]


@functools.lru_cache(maxsize=64)
def _layout(drafter: str, tree: str | tuple | None, num_speculative_tokens: int | None) -> Tree | TreeShape:
    """`TreeSpecConfig.layout` for hashable inputs (tree paths as a tuple of tuples); errors are not cached."""
    t = tree
    if t is None:
        if drafter in ("suffix", "ngram") and num_speculative_tokens:
            return Tree.chain(num_speculative_tokens)  # only the node budget matters
        t = "s3_k2_d6"
    if isinstance(t, tuple):
        return Tree.from_paths(list(t))
    t = t.strip()
    if t.startswith("chain:"):
        try:
            k = int(t.split(":", 1)[1])
        except ValueError:
            raise TreeError(f"{t!r}: write 'chain:K' with an integer K") from None
        if k < 1:
            raise TreeError(f"{t!r}: K must be >= 1")
        return Tree.chain(k)
    if t.startswith("s"):
        return TreeShape.parse(t)
    if not t.startswith(("[", "(")):
        raise TreeError(f"{t!r} is not a tree layout; write {TREE_FORMS}")
    return Tree.from_paths(t)


TREE_FORMS = "a shape like 's3_k2_d6', explicit child-rank paths like '[(0,), (1,), (0, 0)]', or 'chain:K'"


def parse_tree_config(raw: dict[str, Any]) -> TreeSpecConfig:
    """Validate user keys; raise TreeSpecError with every problem spelled out (key, value, fix)."""
    if not isinstance(raw, dict):
        raise TreeSpecError(f"invalid tree speculative_config: expected a JSON object of keys, got {raw!r}")
    try:
        return TreeSpecConfig(**raw)
    except ValidationError as e:
        msgs: dict[str, str] = {}  # one message per top-level key (a union type reports once per member)
        for err in e.errors():
            key = str(err["loc"][0]) if err["loc"] else ""
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, TreeSpecConfig.model_fields, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                msg = f"key {key!r} is unknown; {hint}valid keys: {', '.join(sorted(TreeSpecConfig.model_fields))}"
            elif not msg.startswith("key "):
                if key == "tree":
                    msg = f"key 'tree' must be {TREE_FORMS}; got {err['input']!r}"
                else:
                    where = "".join(f"[{x!r}]" for x in err["loc"][1:] if x != "[key]")
                    what = " (a batch size)" if err["loc"][-1] == "[key]" else ""
                    msg = f"key {key!r}{where}{what}: {msg[:1].lower()}{msg[1:]}; got {err['input']!r}"
            msgs.setdefault(key, msg)
        raise TreeSpecError("invalid tree speculative_config: " + "; ".join(msgs.values())) from None
