"""Tree speculation for DeepSeek-V4 on vLLM's NVIDIA model path (`vllm/models/deepseek_v4/nvidia/`): vLLM 0.32 on
its V1 runner, vLLM 0.34 on Model Runner V2.

Modules: `caches.py` (the caches by role), `plan.py` (a step's plan, host half), `device_plan.py` (its device
half: the lists written into vLLM's metadata), `hooks.py` (the layer overrides that apply it), `adapter.py`
(the runner-facing adapter: isolation + refresh), `refusals.py` (what is refused and why), `runner_view.py`
(what the adapter reads from a model runner). Kernels: `kernels/dsv4_tree_meta*` (index lists),
`kernels/dsv4_refresh*` (slot-row copies: refresh, compressor windows, virtual indexer pages).
Design and status: docs/dsv4.md, "vLLM's NVIDIA path".

Every touch point of vLLM internals, applied only by the tree worker of an engine whose model is vLLM's NVIDIA
DeepSeek-V4 model (selected by `is_nvidia_model` in integration/adapters.py):

    N1  scratch blocks: the worker's copy of the KV cache config gets extra blocks at the end of the pooled
        allocation (as D1 of the CPU path, integration/dsv4/layout.py).
        Why: branch entries, indexer keys and virtual indexer pages need slots of the tensors FlashMLA and
             DeepGEMM read, which the scheduler never hands out.  Removal: a scratch-block API in vLLM.
    N2  `vllm.models.deepseek_v4.nvidia.flashmla.compute_global_topk_indices_and_lens` (the caller's module
        global, process-wide, a pass-through without a tree plan in the forward context)
        Why: the C4 list maps local entry ids through the block table; entries completed inside the tree
             live in the completing ancestor's scratch slot.  What: `tree_topk_slots` for tree steps.
        Removal: a per-row entry-slot hook in FlashMLA's DeepSeek-V4 decode metadata.
    N3  `DeepseekCompressor.forward` per instance (hooks.py)
        Why: vLLM's compress kernels fetch the pooling window by position through the state block table.
        What: vLLM's forward unchanged, then again on virtual tokens whose windows are scratch copies of the
             draft nodes' windows along their ancestor paths.  Removal: an explicit gather list argument.
    N4  `DeepseekV4Attention._sparse_indexer_and_attn` per instance: virtual indexer pages before the indexer.
        Removal: per-row page tables built by the indexer builder for tree rows.
    N5  `DeepseekV4FlashMLAAttention.forward_mqa` per instance: records the layer applied the plan (no silent
        causal fallback).  Removal: with N2-N4.
    N6  `DeepseekV32IndexerMetadataBuilder.use_flattening = True` on this engine's builder instances
        Why: SM90's native multi-row decode (next_n in {1, 2, 4}) gives a request one page-table row and
             query-order lengths; tree rows need one row each.  Removal: a per-row decode mode for trees.
    N7  metadata edits after vLLM builds a tree step's metadata (adapter.on_metadata / device_plan.py):
        `decode_swa_indices` / `decode_swa_lens`, entry write slot mappings (draft nodes -> -1),
        `c128a_global_decode_topk_indices` / lens, the indexer's decode `seq_lens`, page-table rows and
        DeepGEMM schedule.  Why: vLLM derives them from query order or positions through the block table.
        Removal: tree-aware metadata builders.
    N8  the MTP tree drafter mixes with the NVIDIA model's fused mHC kernels (`mhc_pre_tilelang`,
        `mhc_post_tilelang`, `hc_head_fused_kernel_tilelang`, read from `vllm.models.deepseek_v4.nvidia.model`
        where the model reads them; integration/dsv4/mhc_ops.py) and reads the residual rows the model stashes
        for MTP (`_mtp_hidden_buffer`, allocated by the drafter when vLLM did not).  Why: the drafter is the
        plugin's PyTorch MTP layer, vLLM's MTP module drafts chains.  Nothing is patched.
        Removal: an mHC op interface for drafters in vLLM.
"""


def is_nvidia_model(model) -> bool:
    """True when `model` is built from vLLM's NVIDIA DeepSeek-V4 layers (the FlashMLA sparse attention class)."""
    try:
        from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    except ImportError:
        return False
    return any(isinstance(m, DeepseekV4Attention) and type(m).__module__.startswith("vllm.models.deepseek_v4.nvidia")
               for m in model.modules())
