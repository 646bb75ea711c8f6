"""The MTP tree drafter's committed window in vLLM's paged cache of the MTP layer (Model Runner V2, patch record P20).

vLLM's MTP layer is a sliding-window attention layer whose `DeepseekV4SWACache` vLLM registers when it loads the
model (mtp_head.py): vLLM counts its pages in the KV budget and hands its blocks out with the target's, as for
its linear MTP. The drafter keeps its committed rows there. The catch-up forward (the target's committed rows
through the MTP layer) writes each row at its position's slot with the kernel vLLM's layer calls
(`torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`: GPT-J RoPE, UE8M0 FP8, fp8_ds_mla page), and
windows are read back with the gather vLLM's prefill calls (`dequantize_and_gather_k_cache`). Drafts therefore
read the FP8 rows vLLM's linear MTP reads.

Tree rows never enter vLLM's page: a level's rows go through the same kernel into a private scratch page and
are read back the same way, so an ancestor reads exactly as it would from the cache on a chain (the path
invariant: a tree row equals the model run one row at a time along its path).

Rows vLLM has freed are never read: vLLM's sliding-window manager keeps every block holding one of the W - 1
positions before the first position a step computes (`retained_from`); older rows are masked like a history
gap. Prefix-cache hits restart the window at the hit, as in the float store.

Removal: vLLM's attention over the MTP layer's paged cache taking per-row tree masks.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from vllm_tree_spec.integration.v2.draft_kv import RunnerBlocks
from vllm_tree_spec.reference.dsv4_gpu_ops.layout import HEAD_DIM, ROW_BYTES, page_bytes  # the fp8_ds_mla row


def _insert_op():
    return torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert


def _gather_op():
    # the name vLLM's NVIDIA attention calls it by (its prefill's SWA gather)
    from vllm.models.deepseek_v4.nvidia import flashmla

    return flashmla.dequantize_and_gather_k_cache


def read_slots(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, 512] the dequantized rows at slots of a fp8_ds_mla cache [num_blocks, block_size, 584], one call of
    vLLM's gather: row i reads the last position (slot % block_size) of a one-block table (slot // block_size)."""
    n = slots.shape[0]
    out = torch.empty(n, 1, HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    if n:
        slots = slots.to(torch.int64)
        _gather_op()(out, cache, seq_lens=(slots % block_size + 1).to(torch.int32),
                     gather_lens=torch.ones(n, dtype=torch.int32, device=cache.device),
                     block_table=(slots // block_size).to(torch.int32)[:, None], block_size=block_size, offset=0)
    return out[:, 0]


class PagedMTPWindow:
    """The committed MTP rows in vLLM's page of the MTP layer (module docstring); the drafter's window-store
    interface (`drafters/mtp.FloatWindow`) plus the head's side, `run_insert`.

    Args:
        window: W, the layer's sliding window.
        block_ids: req_id -> that request's block ids in the layer's KV-cache group (host; the runner's).
    """

    paged = True

    def __init__(self, window: int, block_ids: Callable[[Hashable], list[int]]):
        self.window, self.block_ids = window, block_ids
        self.cache: torch.Tensor | None = None  # [num_blocks, block_size, 584] uint8 (vLLM's page view)
        self.block_size = 0
        self._scratch: torch.Tensor | None = None  # [pages, block_size, 584] uint8, the tree rows' page

    def attach(self, cache: torch.Tensor, block_size: int, layer_name: str) -> None:
        if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != ROW_BYTES:
            raise ValueError(f"{layer_name}: the MTP layer's SWA cache is {cache.dtype} {tuple(cache.shape)}; the MTP "
                             f"tree drafter reads the fp8_ds_mla cache ([blocks, {block_size}, {ROW_BYTES}] uint8): "
                             f"serve with --kv-cache-dtype auto")
        self.cache, self.block_size = cache, block_size

    # -- the drafter's store interface ----------------------------------------------------------
    def _slots(self, st, positions: torch.Tensor) -> torch.Tensor:
        """[m] host int64 cache slots of a request's positions."""
        ids = self.block_ids(st.req_id)
        blk = positions.to(torch.int64) // self.block_size
        if len(positions) and int(blk.max()) >= len(ids):
            raise RuntimeError(f"MTP window: position {int(positions.max())} of request {st.req_id} lies past its "
                               f"{len(ids)} blocks")
        return torch.as_tensor(ids, dtype=torch.int64)[blk] * self.block_size + positions % self.block_size

    def slots(self, runs: list) -> torch.Tensor:
        """[sum m] the cache slots of each (state, positions [m] host) run, one upload."""
        return torch.cat([self._slots(st, pos) for st, pos in runs]).to(self.cache.device, non_blocking=True)

    def rows_many(self, spans: list) -> list[torch.Tensor]:
        """[hi - lo, 512] the committed rows of positions [lo, hi) of each (state, lo, hi): one gather."""
        if not spans:
            return []
        parts = [self._slots(st, torch.arange(lo, max(lo, hi))) for st, lo, hi in spans]
        rows = read_slots(self.cache, torch.cat(parts).to(self.cache.device, non_blocking=True), self.block_size)
        return list(rows.float().split([len(p) for p in parts]))

    def commit(self, st, new: torch.Tensor) -> None:
        return None  # the catch-up forward wrote them (run_insert)

    def restart(self, st) -> None:
        return None

    def retained_from(self, computed: int) -> int:
        """The first row of the oldest block vLLM keeps when a step computes from position `computed`."""
        return max(0, computed - self.window + 1) // self.block_size * self.block_size

    # -- the head's side -------------------------------------------------------------------------
    def _scratch_page(self, rows: int) -> torch.Tensor:
        pages = -(-rows // self.block_size)
        if self._scratch is None or self._scratch.shape[0] < pages:
            bs = self.block_size
            stride = page_bytes(bs)  # vLLM's padded page, as its kernels see it
            buf = torch.zeros(pages * stride, dtype=torch.uint8, device=self.cache.device)
            self._scratch = buf.as_strided((pages, bs, ROW_BYTES), (stride, ROW_BYTES, 1))
        return self._scratch

    def run_insert(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
                   cos_sin_cache: torch.Tensor, padded_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's insert kernel over a forward's rows: q [T, n, 512] (per-head RMSNorm + RoPE, padded as vLLM pads
        it) and kv [T, 512] (RoPE, FP8 into the page). slots: the committed rows' cache slots, or None for tree
        rows (the scratch page). Returns (q [T, padded, 512] bf16, the rows as the window reads them [T, 512])."""
        t = q.shape[0]
        cache = self.cache if slots is not None else self._scratch_page(t)
        if slots is None:
            slots = torch.arange(t, dtype=torch.int64, device=q.device)
        q_pad = _insert_op()(q.contiguous(), kv.contiguous(), cache.view(cache.shape[0], -1), slots,
                             positions.to(torch.int64), cos_sin_cache, padded_heads, eps, self.block_size)
        return q_pad, read_slots(cache, slots, self.block_size).float()


class RunnerMTPWindow(RunnerBlocks):
    """The V2 runner's side: the MTP layer's SWA cache and each request's blocks in its group."""

    def __init__(self, drafter):
        super().__init__()
        head = drafter.head
        self.layer_name = head.attn.swa_cache_layer.prefix  # registered in the forward context by vLLM's load
        self.store = PagedMTPWindow(head.cfg.window, lambda rid: self.blocks.get(rid, []))
        drafter.use_window(self.store)

    def attach(self, forward_context: dict, block_size: int) -> None:
        layer = forward_context[self.layer_name]
        self.store.attach(layer.kv_cache, block_size, self.layer_name)
