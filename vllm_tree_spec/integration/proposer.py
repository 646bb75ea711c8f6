"""The tree drafter of a tree engine, and one drafting step (runner-agnostic).

`TreeProposer(vllm_config)` owns the tree drafter the config asks for. On vLLM's V1
model runner vLLM builds it as its `custom_class` drafter (the config route rewrites
`method: "tree"` to `method: "custom_class"` with this class path), and vLLM's own chain
`propose(...)` call is never reached; on Model Runner V2 the tree speculator
(`v2/speculator.py`) builds it. Either runner adapter calls `draft` once per step with
each request's committed context and room: `draft` applies the node budget, serves
requests whose sampling parameters read drafts as a chain without drafts
(`tree_sampler.unsupported_reason`), and keeps a drafter failure from killing the
requests in flight.

Model-free drafters (suffix, n-gram) build their own trees and only take a node
budget from the `tree` layout, except `"chain:K"`: there each proposal is pruned
to its rank-0 path (the drafter's best chain), so the engine verifies chains
like vLLM's linear methods (a lossless pruning, as the shape policy's); the suffix
drafter then does not draft its branches at all (its best chain is vLLM's
linear `suffix` draft).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from vllm_tree_spec.config import TreeSpecConfig
from vllm_tree_spec.drafters.base import DraftRequest, TreeDrafter, TreeProposal

PROPOSER_PATH = "vllm_tree_spec.integration.proposer.TreeProposer"

logger = logging.getLogger(__name__)


@dataclass
class DraftInput:
    """One request's input to a drafting step, as a runner adapter reads it from its batch."""

    req_id: str
    token_ids: Sequence[int]  # [L] committed context, prompt + outputs; token_ids[-1] is the root
    state: object  # the request's state: sampling_params, prompt_token_ids
    room: int  # draft nodes that fit before max_model_len
    ready: bool  # it has a new token to draft from (False: a partial prefill, part of its context is not computed)


def make_drafter(cfg: TreeSpecConfig, vllm_config=None, runner_kv: bool = False) -> TreeDrafter:
    """The tree drafter a config asks for. runner_kv: the runner loads the drafter's network and keeps its KV
    (Model Runner V2: `integration/v2/draft_head.py`, `draft_kv.py`)."""
    depth = max(1, cfg.num_slots)
    if cfg.drafter == "suffix":
        from vllm_tree_spec.drafters.suffix import SuffixTreeDrafter

        # "chain:K" verifies the best chain only: the branches are not drafted at all
        return SuffixTreeDrafter(max_spec_factor=cfg.max_spec_factor, min_token_prob=cfg.min_token_prob,
                                 branch_spec_factor=cfg.branch_spec_factor,
                                 branch_min_token_prob=cfg.branch_min_token_prob,
                                 branches=chain_plan(cfg) is None)
    if cfg.drafter == "ngram":
        from vllm_tree_spec.drafters.ngram import NgramTreeDrafter

        return NgramTreeDrafter(min_n=cfg.prompt_lookup_min, max_n=cfg.prompt_lookup_max, max_depth=depth)
    if cfg.drafter == "draft_model":
        import torch

        from vllm_tree_spec.drafters.draft_model import DraftModelTreeDrafter

        policy = _model_policy(cfg)
        dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", torch.float32)
        device = getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu"  # the target's
        if runner_kv:
            from vllm_tree_spec.drafters.draft_model_paged import RunnerDraftModelTreeDrafter

            return RunnerDraftModelTreeDrafter(None, policy, path=cfg.model, dtype=dtype, device=device,
                                               seed=cfg.seed or 0)
        return DraftModelTreeDrafter.from_pretrained(cfg.model, policy, dtype=dtype, seed=cfg.seed or 0,
                                                     device=device)
    if cfg.drafter == "mtp":
        import torch

        from vllm_tree_spec.drafters.mtp import MTPTreeDrafter
        from vllm_tree_spec.drafters.policy import DynamicPolicy, StaticPolicy

        if vllm_config is None:
            raise ValueError("drafter 'mtp' needs the engine's vllm_config (the checkpoint holds the MTP head)")
        layout = cfg.layout()
        policy = DynamicPolicy.of(layout) if cfg.is_dynamic else StaticPolicy.of(_static_shape(layout))
        mc = vllm_config.model_config
        device = getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu"  # the target's
        return MTPTreeDrafter(policy, model_dir=mc.model, hf_config=mc.hf_config,
                              dtype=getattr(mc, "dtype", torch.bfloat16), device=device,
                              max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens)
    if cfg.drafter in ("eagle3", "eagle"):
        import torch

        from vllm_tree_spec.drafters.eagle import EagleTreeDrafter
        from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter

        dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", torch.float32)
        device = getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu"
        cls = Eagle3TreeDrafter if cfg.drafter == "eagle3" else EagleTreeDrafter
        drafter = cls(None, _model_policy(cfg), path=cfg.model, dtype=dtype, device=device, seed=cfg.seed or 0)
        cache = getattr(vllm_config, "cache_config", None)
        if getattr(cache, "enable_prefix_caching", False):
            # Prefix-cached blocks are never recomputed, so the head never sees the target's features there:
            # it restores its KV for them from content-keyed pages, as many as the target's cache holds
            # (num_gpu_blocks is set once vLLM has sized the cache, before the first step).
            drafter.enable_prefix_pages(cache.block_size, lambda: (cache.num_gpu_blocks or 0) * cache.block_size)
        return drafter
    raise NotImplementedError(f"drafter {cfg.drafter!r} is not available in this build of vllm-tree-spec")


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's parallel state is not set up)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # no model-parallel group (drafters built outside an engine)
        return 0


def chain_plan(cfg: TreeSpecConfig):
    """The rank-0 chain that proposals are pruned to: model-free drafters with `tree` "chain:K" (else None;
    model drafters draft the layout itself). Its length is the slot count: the budget sets the depth."""
    chain = isinstance(cfg.tree, str) and cfg.tree.strip().startswith("chain:")
    if cfg.drafter not in ("suffix", "ngram") or not chain:
        return None
    from vllm_tree_spec.online_policy import Plan
    from vllm_tree_spec.tree import Tree

    return Plan.of(Tree.chain(cfg.num_slots))


def _model_policy(cfg: TreeSpecConfig):
    """The tree policy of a model drafter (draft_model, eagle3, eagle) from the config."""
    from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy

    layout = cfg.layout()
    if cfg.draft_sampling != "topk":
        return SampledPolicy.of(_static_shape(layout), replacement=cfg.draft_sampling == "sample")
    if cfg.is_dynamic:
        return DynamicPolicy.of(layout)
    return StaticPolicy.of(_static_shape(layout))


def _static_shape(layout):
    """A shape-only tree for static / sampled policies (a TreeShape becomes its full k-ary expansion)."""
    from vllm_tree_spec.tree import Tree, TreeShape

    if isinstance(layout, Tree):
        return layout
    assert isinstance(layout, TreeShape)
    raise ValueError(
        f"tree {layout} is a dynamic shape; with draft_sampling != 'topk' give explicit paths or 'chain:K'")


class TreeProposer:
    def __init__(self, vllm_config, runner_kv: bool = False) -> None:
        raw = (vllm_config.additional_config or {}).get("tree_spec")
        if raw is None:
            raise RuntimeError("TreeProposer needs additional_config['tree_spec']; use method 'tree'")
        self.cfg = TreeSpecConfig(**raw)
        self.vllm_config = vllm_config
        self.drafter = make_drafter(self.cfg, vllm_config, runner_kv=runner_kv)
        # budgets "auto": the online shape policy chooses which part of each proposal is verified
        from vllm_tree_spec.integration.shape_policy import make_shape_policy

        sched = getattr(vllm_config, "scheduler_config", None)
        self.shape_policy = make_shape_policy(self.cfg, getattr(sched, "max_num_seqs", None))
        self.chain_plan = chain_plan(self.cfg)
        self.prefix_metrics = None  # the EAGLE drafters' prefix-cache restores on /metrics (metrics.py)
        if getattr(self.drafter, "prefix_stats", None) is not None and _tp_rank() == 0:
            from vllm_tree_spec.integration.metrics import PrefixCounters

            self.prefix_metrics = PrefixCounters(self.cfg.drafter)

    def load_model(self, target_model) -> None:  # vLLM calls this after loading the target
        load = getattr(self.drafter, "load_model", None)
        if load is not None:
            load(target_model)
        networks = getattr(self.drafter, "networks", None)
        if networks is not None:  # the drafter's own torch networks: vLLM's CPU GEMM (P10)
            from vllm_tree_spec.integration.cpu_gemm import use_vllm_cpu_gemm

            routed = sum(use_vllm_cpu_gemm(net) for net in networks())
            if routed:
                logger.info("drafter %r: %d linear layers on vLLM's CPU GEMM", self.cfg.drafter, routed)

    def setup_runner(self, runner) -> None:
        """After the target is loaded (the runner's load_model): drafters that read its aux hidden states; the
        EAGLE drafters' prefix-cache counters join the runner's stats."""
        runner.tree_stats.prefix = getattr(self.drafter, "prefix_stats", None)
        if getattr(self.drafter, "reads_aux_hidden_states", False):
            from vllm_tree_spec.integration.eagle3_aux import enable_aux_hidden_states

            enable_aux_hidden_states(runner, self.drafter.aux_layer_ids)

    def propose(self, *args, **kwargs):
        raise RuntimeError("TreeProposer.propose is not a chain proposer; the tree runner calls propose_trees")

    # -- the tree runner's interface ------------------------------------------------------------

    def draft(self, inputs: list[DraftInput], budget: int, *, skip_logged: set, stats,
              observe=None) -> list[TreeProposal | None]:
        """One drafting step: a tree per ready request (None for the others), each within min(budget, room)
        nodes; 0 nodes for requests whose sampling parameters read drafts as a chain (logged once per
        request: `skip_logged`). A drafter exception is logged and counted (`stats.drafter_failures`) and the
        step runs without drafts (plain decoding, lossless). observe: called once every request is started
        in the drafter and before it drafts (drafters fed by the target's hidden states take this step's
        rows there: a new request's first rows must find it started)."""
        from vllm_tree_spec.integration.tree_sampler import unsupported_reason

        t0 = time.perf_counter()
        requests, budgets = [], []
        for inp in inputs:
            nodes = min(budget, inp.room) if inp.ready else 0
            reason = unsupported_reason(inp.state.sampling_params)
            if reason is not None:
                nodes = 0
                if inp.req_id not in skip_logged:
                    skip_logged.add(inp.req_id)
                    logger.info("tree speculation off for request %s: %s", inp.req_id, reason)
            requests.append(self.make_request(inp.req_id, inp.token_ids, inp.state))
            budgets.append(max(0, nodes))
        if observe is not None:
            observe()
        ready = [i for i, inp in enumerate(inputs) if inp.ready]
        try:
            trees = dict(zip(ready, self.propose_trees([requests[i] for i in ready], [budgets[i] for i in ready])))
        except Exception:
            # A drafter bug must not kill every request in flight: this step decodes without drafts (plain
            # decoding, lossless), loudly: the traceback is logged and the worker counts it.
            logger.exception("tree drafter failed; this step runs without speculation")
            stats.drafter_failures += 1
            trees = {}
        out: list[TreeProposal | None] = []
        for i, nodes in enumerate(budgets):
            dt = trees.get(i)
            if dt is not None and dt.tree.num_nodes > nodes:
                raise RuntimeError(f"drafter returned {dt.tree.num_nodes} nodes for a budget of {nodes}")
            out.append(dt)
        if self.prefix_metrics is not None:
            self.prefix_metrics.update(self.drafter.prefix_stats)
        stats.add_time("draft", time.perf_counter() - t0)
        return out

    def make_request(self, req_id: str, token_ids: Sequence[int], state) -> DraftRequest:
        sp = state.sampling_params
        if not self.drafter.is_active(req_id):
            self.drafter.start_request(req_id, list(state.prompt_token_ids or token_ids[:1]),
                                       seed=getattr(sp, "seed", None))
        return DraftRequest(req_id, token_ids, float(sp.temperature) if sp is not None else 0.0)

    def propose_trees(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        if self.shape_policy is not None:
            out = self.shape_policy.propose(self.drafter, requests, budgets)
        else:
            out = self.drafter.propose(requests, budgets)
        if self.chain_plan is not None:
            from vllm_tree_spec.online_policy import prune_to_shape

            out = [prune_to_shape(p, self.chain_plan) for p in out]
        return out

    @property
    def observes_target(self) -> bool:
        """Whether the drafter reads the target's rows (EAGLE-3, EAGLE-1, MTP): only then does the runner
        collect them; a draft model on the runner's pages has the EAGLE drafters' methods but reads none)."""
        return hasattr(self.drafter, "observe_target") and getattr(self.drafter, "reads_features", True)

    def observe_target(self, req_ids, rows, positions, aux_hidden_states=None, hidden_states=None) -> None:
        """The target rows each request committed this step (drafters that read the target's hidden states:
        EAGLE-3 its auxiliary layers, EAGLE-1 its output hidden states)."""
        observe = getattr(self.drafter, "observe_target", None)
        if observe is None:
            return
        if getattr(self.drafter, "reads_hidden_states", False):
            observe(req_ids, rows, positions, hidden_states)
        elif getattr(self.drafter, "reads_aux_hidden_states", False):
            observe(req_ids, rows, positions, aux_hidden_states)
        else:
            observe(req_ids, rows, positions)

    def finish_request(self, req_id: str) -> None:
        if self.shape_policy is not None:
            self.shape_policy.finish_request(req_id)
        if self.drafter.is_active(req_id):
            self.drafter.finish_request(req_id)
