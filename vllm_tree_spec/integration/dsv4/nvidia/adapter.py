"""The DeepSeek-V4 tree adapter for vLLM's NVIDIA model path (FlashMLA sparse, CuTeDSL / Triton compressors,
DeepGEMM indexer): branch isolation during a verify step, accepted-path refresh after it, on the device.

Hooks (called by the runner adapter: `runner.py` for V1, `v2/runner.py` for Model Runner V2; runner_view.py holds
what each runner provides):

    check(runner)                after model load: refusals (refusals.py), bind the layer overrides (hooks.py)
    kv_cache_config(runner, cfg) before allocation: reserve scratch blocks in the compressed-entry group
    on_kv_cache(runner)          after allocation: caches by role (caches.py), refresh descriptors, the
                                 indexer builders' flattened decode path (N6)
    on_metadata(runner, step, md) after vLLM built the step's metadata: the plan (plan.py host half, one
                                 upload, device_plan.py launches), attached to every metadata object
    commit(runner, step, result) after verification, from the verifier's device tensors: one refresh launch
                                 (kernels/dsv4_refresh.py) over every SWA row, compressor state row, C4 / C128
                                 entry and indexer key of the accepted paths, in vLLM's pooled, padded layout

No host synchronisation per request per step: the plan's host half is numpy over data the runner already
holds on the host (trees, query start locations, committed lengths); block tables, slot mappings and the
verifier's accepted paths are read only by device launches.

Scratch: branch entries and indexer keys of block-completing draft nodes, and virtual indexer pages, live in
`R` reserved blocks at the end of the pooled KV allocation (vLLM packs DeepSeek-V4 caches block-outermost,
so no existing address moves; the scheduler keeps its own num_blocks and never hands them out):
`R = ceil(B N / 2)` (entries: 64 C4 entries, 64 keys and 2 C128 entries per block, shared) `+ 2 B N` (virtual
pages, only when max_model_len // 4 > index_topk) `+ 1`, for B = max_num_seqs, N draft slots. Scratch
compressor state blocks are separate small tensors (state_plane copies), reused by every layer in turn.
"""

from __future__ import annotations

import time

from vllm_tree_spec.integration.dsv4 import layout
from vllm_tree_spec.integration.dsv4.nvidia import hooks, refusals
from vllm_tree_spec.integration.dsv4.nvidia.caches import CSA, find_caches
from vllm_tree_spec.integration.dsv4.nvidia.device_plan import device_plan, refresh_copy_plan
from vllm_tree_spec.integration.dsv4.nvidia.plan import GpuTreePlan, host_plan
from vllm_tree_spec.integration.dsv4.nvidia.runner_view import V1RunnerView

INDEXER_BUILDER = "DeepseekV32IndexerMetadataBuilder"


def _kernels():
    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    from vllm_tree_spec.kernels import dsv4_refresh_launch

    return dsv4_refresh_launch


def scratch_blocks_needed(max_num_seqs: int, num_slots: int, long_context: bool) -> int:
    bn = max_num_seqs * num_slots
    return -(-bn // 2) + (2 * bn if long_context else 0) + 1


class DeepseekV4NvidiaTreeAdapter:
    name = "deepseek-v4-nvidia"
    device_commit = True  # commit(runner, step, result): the verifier's device tensors

    def __init__(self, runner, view_cls=V1RunnerView) -> None:
        self.view = view_cls(runner)
        self.isolation = True  # False = the negative control: vLLM's own lists with tree positions
        self.plan: GpuTreePlan | None = None
        self.caches = None
        self.scratch: layout.ScratchBlocks | None = None
        self.state_scratch = hooks.StateScratch()
        self.refresh_plan = None
        self.indexer_builders: list = []
        self.index_topk = 0
        self.layer_names: set[str] = set()
        self.long_context_possible = False
        self.stats = {"steps": 0, "plan_s": 0.0, "refresh_s": 0.0, "emitters_c4": 0, "emitters_c128": 0,
                      "virtual_pages": 0, "scratch_blocks_peak": 0, "decode_rows": 0}

    # -- start-up ---------------------------------------------------------------------------------

    def check(self, runner) -> None:
        vllm_config = self.view.vllm_config
        model = self.view.model
        refusals.check_runtime(vllm_config, model, builders=())
        hf = vllm_config.model_config.hf_config
        self.index_topk = int(getattr(hf, "index_topk", 0) or 0)
        self.long_context_possible = vllm_config.model_config.max_model_len // CSA > self.index_topk
        hooks.install_module_hooks()  # N2
        counts = hooks.patch_model(model, self.state_scratch)  # N3-N5
        from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

        self.layer_names = {m.prefix for m in model.modules() if isinstance(m, DeepseekV4FlashMLAAttention)}
        if not counts["attention"] or not self.layer_names:
            raise RuntimeError(f"{type(model).__name__}: no NVIDIA DeepSeek-V4 attention layers found")

    def kv_cache_config(self, runner, kv_cache_config):
        need = scratch_blocks_needed(self.view.vllm_config.scheduler_config.max_num_seqs, runner.tree_cfg.num_slots,
                                     self.long_context_possible)
        cfg = layout.extend_kv_cache_config(kv_cache_config, need)
        self.scratch = layout.ScratchBlocks(kv_cache_config.num_blocks, need)
        return cfg

    def on_kv_cache(self, runner) -> None:
        self.caches = find_caches(self.view.forward_context, self.view.kv_cache_config, self.view.model)
        builders = list(self.view.metadata_builders())
        refusals.check_runtime(self.view.vllm_config, self.view.model, builders)
        self.indexer_builders = [b for b in builders if type(b).__name__ == INDEXER_BUILDER]
        for b in self.indexer_builders:
            b.use_flattening = True  # N6: one indexer row per query token (tree rows need their own lengths)
        self.refresh_plan = self._build_refresh_plan()

    def _build_refresh_plan(self):
        return refresh_copy_plan(self.caches)

    def tree_layers(self, runner) -> set[str]:
        """Every layer that must apply this step's plan (checked after the forward)."""
        plan = self.plan
        if plan is None:
            return set()
        names = set(self.layer_names)
        for comp in self.caches.compressors:
            if comp.compress_ratio in plan.compress:
                names.add(comp.prefix)
        if plan.indexer is not None:
            names |= {layer.indexer.k_cache.prefix for layer in self.caches.attention.values()
                      if getattr(layer, "indexer", None) is not None}
        return names

    # -- a verify step -------------------------------------------------------------------------------

    def prepare(self, runner, step) -> None:
        return None  # the plan needs vLLM's metadata: on_metadata

    def on_metadata(self, runner, step, attn_metadata) -> None:
        self.plan = None
        if not self.isolation:
            return
        if not isinstance(attn_metadata, dict):
            raise RuntimeError("DeepSeek-V4 tree speculation does not support micro-batched metadata")
        t0 = time.perf_counter()
        c = self.caches
        swa_md = attn_metadata[c.swa[0].layers[0]]
        rd, bd = swa_md.num_decode_tokens, swa_md.num_decodes
        qsl, start = self.view.decode_batch(bd)
        long_ctx = False
        if "indexer" in c.metadata_keys:
            i_md = attn_metadata[c.metadata_keys["indexer"]]
            long_ctx = i_md.max_seq_len // CSA > self.index_topk
        self.scratch.reset()
        hp = host_plan(step, qsl, start, rd, c.ratios, c.entries_per_block,
                       {m: c.state[m].block_size for m in c.ratios}, self.scratch.take, long_ctx)
        sched, sms = self._schedule()
        plan = device_plan(hp, step, attn_metadata, c, swa_md.slot_mapping.device, long_context=long_ctx,
                           num_sms=sms, schedule_fn=sched)
        for md in {id(m): m for m in attn_metadata.values()}.values():
            setattr(md, hooks.PLAN_ATTR, plan)
        self.plan = plan
        s = self.stats
        s["steps"] += 1
        s["plan_s"] += time.perf_counter() - t0
        s["decode_rows"] += rd
        s["emitters_c4"] += len(hp.emitters[CSA].rows) if CSA in hp.emitters else 0
        s["emitters_c128"] += len(hp.emitters[128].rows) if 128 in hp.emitters else 0
        s["virtual_pages"] += len(hp.indexer.page_dst) if hp.indexer is not None else 0
        s["scratch_blocks_peak"] = max(s["scratch_blocks_peak"], self.scratch.used)

    def _schedule(self):
        """DeepGEMM's paged-MQA-logits scheduler, as vLLM's indexer builder calls it (None off CUDA / DeepGEMM)."""
        if not self.indexer_builders:
            return None, None
        import vllm.v1.attention.backends.mla.indexer as ix

        if not (ix.current_platform.is_cuda() and ix.has_deep_gemm()):
            return None, None
        b = self.indexer_builders[0]
        return (lambda seq_lens, _bs, sms: ix.get_paged_mqa_logits_metadata(seq_lens, b.kv_cache_spec.num_states,
                                                                              sms)), b.num_sms

    # -- refresh ---------------------------------------------------------------------------------------

    def commit(self, runner, step, result) -> int:
        plan, self.plan = self.plan, None
        if plan is None:  # isolation off (negative control): nothing to refresh from
            return 0
        t0 = time.perf_counter()
        r = _kernels()
        r.refresh_triton(self.refresh_plan, plan.refresh.src, plan.refresh.dst, step.meta.cu_num_rows,
                         result.accepted_nodes, result.num_accepted)
        self.stats["refresh_s"] += time.perf_counter() - t0
        return 0
