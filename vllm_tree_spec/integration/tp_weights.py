"""The target's full [V, H] vocabulary table for drafters that share it, rebuilt from tensor-parallel shards.

Touch point (recorded in integration/__init__.py):
    Why: an EAGLE / EAGLE-3 head without its own `embed_tokens` (EAGLE-1 also without `lm_head`) uses the
        target's. At TP > 1 the target's `VocabParallelEmbedding` / `ParallelLMHead` holds one vocab-parallel
        shard [V_padded / tp, H] per rank, while the tree drafter runs the whole head on every rank (every rank
        drafts the same trees; verification is broadcast from rank 0).
    What: reads the layer's sharding (`tp_size`, `tp_rank`, `shard_indices`, `num_added_embeddings`,
        `parallel_group`), all-gathers the shards along the vocabulary with the layer's own group (vLLM's TP
        group unless the layer names another) and drops the padding rows. Read-only: the target keeps its
        shards. Called from the drafters' `load_model`, which vLLM runs on every rank in lockstep (the gather
        is a collective). Layouts it cannot rebuild exactly (added / LoRA vocabulary interleaved in each
        shard, quantized or packed weights) are refused with the fix.
    Memory: each rank's head then holds a full copy of the table, V x H x (the head's dtype) bytes, as at
        TP = 1 (e.g. V = 128256, H = 4096: 1.0 GiB in bf16, 2.0 GiB in float32); EAGLE-1 sharing an untied
        embedding and LM head holds two. The gathered padded table is transient (load time only).
    Removal: an upstream way to run a drafter over vocab-parallel weights (vLLM's linear EAGLE proposers are
        themselves tensor-parallel), or a vocab-parallel tree head.
"""

from __future__ import annotations

from typing import Callable

import torch

from vllm_tree_spec.drafters.base import DrafterError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_layout(layer: torch.nn.Module, who: str, what: str) -> None:
    """Refuse a vocab-parallel layer whose shards do not concatenate, in rank order, into the padded table.

    vLLM's layout without added vocabulary: the vocabulary padded to `num_embeddings_padded` rows is split
    evenly; rank r holds rows [r * n, (r + 1) * n), real tokens first, padding (zeros) only past V."""
    fix = f"give the head its own {what} weights, or run it with TP = 1"
    tp, rank = layer.tp_size, layer.tp_rank
    if layer.num_added_embeddings:
        raise DrafterError(f"{who} shares the target's {what}, whose shards hold {layer.num_added_embeddings} "
                           f"added (LoRA) vocabulary rows after each rank's base rows, a layout the drafter does "
                           f"not rebuild; {fix}")
    n, hidden = layer.num_embeddings_per_partition, layer.embedding_dim
    w = layer.weight
    if tuple(w.shape) != (n, hidden) or w.dtype not in FLOAT_DTYPES:
        raise DrafterError(f"{who} shares the target's {what}, a tensor-parallel shard of shape {tuple(w.shape)} "
                           f"and dtype {w.dtype}, not [{n}, {hidden}] in float32 / float16 / bfloat16 (a quantized "
                           f"or packed weight?); {fix}")
    s = layer.shard_indices
    if (layer.num_embeddings_padded != n * tp or s.padded_org_vocab_start_index != rank * n
            or s.padded_org_vocab_end_index != (rank + 1) * n
            or s.org_vocab_start_index != min(rank * n, layer.org_vocab_size)):
        raise DrafterError(f"{who} shares the target's {what}, whose rank {rank} of {tp} holds padded rows "
                           f"[{s.padded_org_vocab_start_index}, {s.padded_org_vocab_end_index}) of "
                           f"{layer.num_embeddings_padded}, not an even split; {fix}")


def _group(layer: torch.nn.Module, who: str, what: str):
    """The process group the layer is sharded over (vLLM's TP group unless the layer names its own)."""
    group = getattr(layer, "parallel_group", None)
    if group is None:
        from vllm.distributed import parallel_state

        if getattr(parallel_state, "_TP", None) is None:
            raise DrafterError(
                f"{who} shares the target's {what}, a tensor-parallel shard (rank {layer.tp_rank} of {layer.tp_size}), "
                f"but no vLLM tensor-parallel group is initialized to gather the full table from; load the drafter "
                f"inside the vLLM engine (its load_model runs on every rank), or pass the full [V, H] table")
        group = parallel_state.get_tp_group()
    if group.world_size != layer.tp_size or group.rank_in_group != layer.tp_rank:
        raise DrafterError(f"{who}: the target's {what} is rank {layer.tp_rank} of {layer.tp_size}, but the gather "
                           f"group is rank {group.rank_in_group} of {group.world_size}; load the drafter on the "
                           f"target's own workers")
    return group


def full_vocab_table(layer: torch.nn.Module, who: str, what: str,
                     all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The target's [V, H] table from `layer` (a vLLM VocabParallelEmbedding / ParallelLMHead, or any module
    with a `weight`): unsharded layers are returned as they are (rows past V are padding, dropped by the head's
    loader); a vocab-parallel shard is all-gathered (a collective: every rank of the group must call this).

    all_gather: [n, H] shard -> [tp * n, H] in rank order (default: the layer's group, `all_gather(w, dim=0)`)."""
    if getattr(layer, "tp_size", 1) <= 1:
        return layer.weight.detach()
    check_layout(layer, who, what)
    if all_gather is None:
        group = _group(layer, who, what)
        all_gather = lambda w: group.all_gather(w, dim=0)  # noqa: E731
    full = all_gather(layer.weight.detach().contiguous())  # [V_padded, H]
    if tuple(full.shape) != (layer.num_embeddings_padded, layer.embedding_dim):
        raise DrafterError(f"{who}: gathering the target's {what} gave shape {tuple(full.shape)}, not "
                           f"[{layer.num_embeddings_padded}, {layer.embedding_dim}]")
    return full[: layer.org_vocab_size]  # [V, H]: padding rows dropped


__all__ = ["full_vocab_table", "check_layout"]
