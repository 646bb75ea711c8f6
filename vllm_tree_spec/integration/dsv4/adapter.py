"""The DeepSeek-V4 tree adapter: branch isolation during a verify step, accepted-path refresh after it.

Hooks (called by `TreeRunnerMixin`, see runner.py):

    check(runner)                 after model load: CPU DeepSeek-V4 only; bind the layer overrides (patches.py)
    tree_layers(runner)           the attention layers that must mark the step as tree-masked (runner check)
    kv_cache_config(runner, cfg)  before KV cache allocation: reserve scratch blocks (layout.py)
    on_kv_cache(runner)           after allocation: find the caches by role; fix the tile scheduler (D3)
    on_metadata(runner, step, md) after vLLM built the step's metadata: build the plan (plan.py), send tree
                                  nodes' compressed entries / indexer keys to scratch slots, give tree rows
                                  their indexer seq_lens and virtual page rows, attach the plan to every
                                  metadata object (the layer overrides read it there, never from a global)
    commit(runner, reqs, paths)   after verification: refresh the persistent caches from the accepted path

Refresh (what makes vLLM's rollback see an ordinary accepted chain). For the
accepted nodes n_1 < ... < n_a (node n_k at depth k, position P + k):

    rows     every SWA window row and every compressor state row (CSA main, CSA indexer, HCA): the
             node's row slot -> the slot of linear row root + k (vLLM's slot for position P + k)
    C4       nodes whose position completes a CSA block: scratch entry -> canonical entry slot in every
             CSA layer, and scratch indexer key -> canonical key slot
    C128     the same for HCA entries
    (C4 and C128 are refreshed separately and skipped when no accepted node completed such a block;
    row refresh is skipped for rows already in place, so a fully accepted chain copies no rows.)

Rejected rows stay above the committed length, where vLLM's overwrite-before-read argument covers them;
the scratch blocks are reused by the next step.
"""

from __future__ import annotations

import time

import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.dsv4 import cpu_kernels, layout, patches
from vllm_tree_spec.integration.dsv4.plan import CSA_RATIO, DSV4TreePlan, build_plan


class DeepseekV4TreeAdapter:
    name = "deepseek-v4"

    def __init__(self, runner) -> None:
        self.isolation = True  # False = the negative control: stock DeepSeek-V4 path with tree positions
        self.plan: DSV4TreePlan | None = None
        self.scratch: layout.ScratchBlocks | None = None
        self.row_groups: list[tuple[int, list[torch.Tensor]]] = []
        self.entry_caches: dict[int, list[torch.Tensor]] = {}
        self.entry_layers: list[tuple[str, int]] = []  # (metadata key, ratio) of compressed-entry writers
        self.indexer_layers: list[str] = []
        self.entry_group: int | None = None
        self.entries_per_block: dict[int, int] = {}
        self.ratios: list[int] = []
        self.index_topk = 0
        self.layer_names: set[str] = set()  # attention layers that apply the tree plan (patches.py)
        self.stats = {"steps": 0, "refresh_rows": 0, "refresh_c4": 0, "refresh_c128": 0, "refresh_skipped": 0,
                      "refresh_s": 0.0, "plan_s": 0.0, "scratch_blocks_peak": 0, "virtual_pages": 0}

    # -- start-up ---------------------------------------------------------------------------------

    def check(self, runner) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise RuntimeError("the DeepSeek-V4 tree adapter runs on vLLM's CPU path only (see docs/dsv4.md)")
        hf = runner.model_config.hf_config
        self.index_topk = int(getattr(hf, "index_topk", 0) or 0)
        cpu_kernels.install()  # D5
        counts = patches.patch_model(runner.model)
        self.layer_names = patches.attention_layer_names(runner.model)
        if counts["attention"] == 0 or not self.layer_names:
            raise RuntimeError(
                f"{type(runner.model).__name__}: no DeepSeek-V4 CPU attention layers found; the tree adapter "
                f"supports vLLM 0.32's CPU DeepSeek-V4 model only")
        layout.self_test()
        next_n = runner.tree_cfg.num_slots + 1
        if next_n <= 2 and runner.max_model_len // CSA_RATIO > self.index_topk:
            raise RuntimeError(
                "DeepSeek-V4 with max_model_len > 4 * index_topk needs at least 2 draft slots per request "
                "(vLLM's CPU indexer only handles flattened speculative rows); raise num_speculative_tokens")

    def kv_cache_config(self, runner, kv_cache_config):
        """Reserve scratch blocks at the end of the worker's KV cache allocation."""
        b = runner.scheduler_config.max_num_seqs
        n = runner.tree_cfg.num_slots
        # compressed-entry group pages: C4 entries (64 per page), C128 entries (2 per page), and up to two
        # virtual indexer pages per block-completing node (long context)
        need = -(-b * n // 64) + -(-b * n // 2) + 2 * b * n + 2
        cfg = layout.extend_kv_cache_config(kv_cache_config, need)
        self.scratch = layout.ScratchBlocks(kv_cache_config.num_blocks, need)
        return cfg

    def on_kv_cache(self, runner) -> None:
        from vllm.models.deepseek_v4.compressor import CompressorStateCache
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

        patches.patch_builders(runner)
        ctx = runner.compilation_config.static_forward_context
        self.row_groups, self.entry_caches, self.entry_layers, self.indexer_layers = [], {}, [], []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            rows, seen = [], set()
            for name in group.layer_names:
                layer = ctx.get(name)
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, (list, tuple)):
                    kv = kv[0]
                if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                    continue
                cls = type(layer).__name__
                if cls == "DeepseekV4SWACache" or isinstance(layer, CompressorStateCache):
                    if kv.data_ptr() not in seen:
                        seen.add(kv.data_ptr())
                        rows.append(kv)
                elif isinstance(layer, DeepseekV4CPUAttention) and layer.compress_ratio > 1:
                    r = layer.compress_ratio
                    self.entry_caches.setdefault(r, []).append(kv)
                    self.entry_layers.append((name, r))
                    self._entry_group(gid, group, r)
                elif "IndexerCache" in cls:
                    self.entry_caches.setdefault(CSA_RATIO, []).append(kv)
                    self.entry_layers.append((name, CSA_RATIO))
                    self.indexer_layers.append(name)
                    self._entry_group(gid, group, CSA_RATIO)
                else:
                    raise RuntimeError(f"DeepSeek-V4 tree adapter: cache layer {name} ({cls}) has no tree role")
            if rows:
                self.row_groups.append((gid, rows))
        self.ratios = sorted(self.entry_caches)

    def _entry_group(self, gid: int, group, ratio: int) -> None:
        if self.entry_group not in (None, gid):
            raise RuntimeError("DeepSeek-V4 tree adapter: compressed entries live in more than one cache group")
        self.entry_group = gid
        self.entries_per_block[ratio] = group.kv_cache_spec.block_size // ratio

    def tree_layers(self, runner) -> set[str]:
        """Every patched attention layer must apply the step's plan. Without a plan (isolation off: the
        negative control, the stock path with tree positions) no layer can, and none is expected to."""
        return self.layer_names if self.plan is not None else set()

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
        num_tokens = next(md.slot_mapping.shape[0] for name, md in attn_metadata.items()
                          if hasattr(md, "slot_mapping") and md.slot_mapping is not None)
        long_ctx = any(attn_metadata[n].max_seq_len // CSA_RATIO > self.index_topk
                       for n in self.indexer_layers if n in attn_metadata)
        self.scratch.reset()
        block_table_c = runner.input_batch.block_table[self.entry_group].block_table.gpu
        plan = build_plan(step.requests, num_tokens, self.ratios, self.entries_per_block, self.scratch.take,
                          block_table_c, long_ctx, self.entries_per_block.get(CSA_RATIO))
        rows = plan.rows
        done: set[int] = set()
        for name, ratio in self.entry_layers:  # tree nodes' entries / keys -> their scratch slots
            md = attn_metadata.get(name)
            if md is None or id(md) in done:
                continue
            done.add(id(md))
            md.slot_mapping[rows] = plan.entries[ratio].slot_by_row[rows].to(md.slot_mapping.dtype)
        if plan.indexer is not None:
            self._indexer_metadata(attn_metadata, plan)
        for md in {id(m): m for m in attn_metadata.values()}.values():
            md.dsv4_tree = plan
        plan.scratch_blocks_used = self.scratch.used
        self.plan = plan
        self.stats["steps"] += 1
        self.stats["plan_s"] += time.perf_counter() - t0
        self.stats["scratch_blocks_peak"] = max(self.stats["scratch_blocks_peak"], self.scratch.used)
        if plan.indexer is not None:
            self.stats["virtual_pages"] += int(plan.indexer.copy_dst.numel())

    def _indexer_metadata(self, attn_metadata, plan: DSV4TreePlan) -> None:
        ix = plan.indexer
        for md in {id(attn_metadata[n]): attn_metadata[n] for n in self.indexer_layers}.values():
            dec = md.decode
            if dec is None or ix.rows.numel() and int(ix.rows.max()) >= md.num_decode_tokens:
                raise RuntimeError("DeepSeek-V4 tree rows must be decode rows of the indexer metadata")
            if dec.block_table.shape[0] != md.num_decode_tokens:
                raise RuntimeError(
                    "DeepSeek-V4 tree speculation needs the indexer's flattened decode path (one row per query "
                    "token); this vLLM build chose the native multi-token decode")
            seq = dec.seq_lens.view(-1) if dec.seq_lens.dim() == 2 and dec.seq_lens.shape[1] == 1 else dec.seq_lens
            seq[ix.rows] = ix.seq_lens.to(seq.dtype)
            dec.block_table[ix.rows_bt, ix.blk_idx] = ix.vblock.to(dec.block_table.dtype)

    # -- refresh ---------------------------------------------------------------------------------------

    def commit(self, runner, reqs, paths) -> int:
        t0 = time.perf_counter()
        plan, self.plan = self.plan, None
        moved = 0
        for gid, caches in self.row_groups:
            src, dst = [], []
            for req, path in zip(reqs, paths):
                for s, d in kv_layout.compaction_pairs(req.row_slots[gid], path):
                    src.append(s)
                    dst.append(d)
            if not src:
                continue
            s, d = torch.tensor(src), torch.tensor(dst)
            for cache in caches:
                layout.copy_rows(cache, s, d)
            moved = max(moved, len(src))
        self.stats["refresh_rows"] += moved
        if plan is not None:
            block_table_c = runner.input_batch.block_table[self.entry_group].block_table.gpu
            for ratio in self.ratios:
                n = self._refresh_entries(plan, ratio, reqs, paths, block_table_c)
                self.stats["refresh_c4" if ratio == CSA_RATIO else "refresh_c128"] += n
                if n == 0:
                    self.stats["refresh_skipped"] += 1
        self.stats["refresh_s"] += time.perf_counter() - t0
        return moved

    def _refresh_entries(self, plan: DSV4TreePlan, ratio: int, reqs, paths, block_table_c) -> int:
        ep = plan.entries.get(ratio)
        if ep is None or ep.num_emitters == 0:
            return 0
        epb = self.entries_per_block[ratio]
        src, dst = [], []
        for req, path in zip(reqs, paths):
            for k, node in enumerate(path, start=1):
                p = req.root_pos + k
                if (p + 1) % ratio:
                    continue
                s = int(ep.slot_by_row[req.root_row + 1 + node])
                assert s >= 0, (req.req_id, node, p)
                w = (p + 1) // ratio - 1
                src.append(s)
                dst.append(int(block_table_c[req.req_index, w // epb]) * epb + w % epb)
        if not src:
            return 0
        s, d = torch.tensor(src), torch.tensor(dst)
        for cache in self.entry_caches[ratio]:
            layout.copy_rows(cache, s, d)
        return len(src)
