"""The device half of a tree step's plan (plan.py): one upload, then the lists written into vLLM's metadata.

Launches per step (all asynchronous, no device-to-host copy):

    SWA window lists      1 per SWA group (`tree_window_slots`, into `decode_swa_indices` / `decode_swa_lens`)
    entry write slots     per ratio: 1 copy + 1 scatter (scratch slots of block-completing nodes), 1 fill of
                          -1 per metadata object that writes entries (C4, C128, indexer keys)
    C128 list             1 (`tree_entry_slots` dense, into `c128a_global_decode_topk_indices` / lens)
    C4 lists              1 (`tree_entry_slots`: per-row committed count and path tail; each CSA layer then
                          maps its top-k ids with one `tree_topk_slots`)
    compressor windows    per ratio with block-completing nodes: 1 (`tree_window_slots`, position aligned)
                          + 1 gather of the window sources
    indexer (long ctx)    seq_lens, page-table columns, DeepGEMM schedule, canonical page ids: 4
    refresh tables        gathers of the rows' slots per slot space, stacked: ~2 per space
"""

from __future__ import annotations

import torch

from vllm_tree_spec.integration.dsv4.nvidia.caches import CSA, HCA, Dsv4NvidiaCaches
from vllm_tree_spec.integration.dsv4.nvidia.plan import (GpuTreePlan, HostPlan, IndexerPages, RefreshTables,
                                                         VirtualCompress, upload_int64)


def _kernels():
    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    from vllm_tree_spec.kernels import dsv4_tree_meta_launch as meta

    return meta


def refresh_spaces(caches: Dsv4NvidiaCaches) -> list[str]:
    """The slot spaces of the refresh, in table order."""
    return ([f"swa:{g.gid}" for g in caches.swa] + [f"state:{m}" for m in sorted(caches.state)]
            + [f"entries:{m}" for m in caches.ratios])


def refresh_copy_plan(caches: Dsv4NvidiaCaches):
    """The refresh's copy plan (built once, after allocation): every byte plane of every cache, by slot space
    (fp8_ds_mla data + scales of the SWA and entry caches, fp32 compressor state rows, indexer key values +
    scales), in vLLM's pooled, padded layout."""
    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    from vllm_tree_spec.kernels import dsv4_refresh_launch as r

    planes = []
    for i, space in enumerate(refresh_spaces(caches)):
        kind, key = space.split(":")
        if kind == "swa":
            group = next(g for g in caches.swa if g.gid == int(key))
            planes += [(p, p, i) for cache in group.caches for p in r.fp8_ds_mla_planes(cache)]
        elif kind == "state":
            planes += [(r.state_plane(cache), r.state_plane(cache), i) for cache in caches.state[int(key)].caches]
        else:
            m = int(key)
            planes += [(p, p, i) for cache in caches.entry_caches[m] for p in r.fp8_ds_mla_planes(cache)]
            if m == CSA:
                planes += [(p, p, i) for cache in caches.key_caches for p in r.index_key_planes(cache)]
    return r.build_copy_plan(planes, caches.swa[0].caches[0].device)


def device_plan(hp: HostPlan, step, md: dict, caches: Dsv4NvidiaCaches, device, *, long_context: bool,
                num_sms: int | None, schedule_fn=None) -> GpuTreePlan:
    meta = _kernels()
    rd = hp.num_rows
    pos = hp.positions
    arrays = {"row_req": hp.row_req, "parent": hp.parent, "depth": hp.depth, "start": hp.start, "cu": hp.cu,
              "node_rows": hp.node_rows, "tree_rows": hp.tree_rows, "tree_dst_rows": hp.tree_dst_rows,
              "tree_req": hp.tree_req}
    for m, em in hp.emitters.items():
        arrays[f"em_rows{m}"] = em.rows
        arrays[f"em_slots{m}"] = em.slots
        arrays[f"tree_emit{m}"] = hp.tree_emit[m]
        arrays[f"tree_w{m}"] = hp.tree_emit_w[m]
    for m, vc in hp.compress.items():
        if len(vc.cos_src):
            for k in ("vpos", "t2r", "vbt", "vslot", "kslot", "kv_rows", "fill_rows", "fill_cols", "fill_dst",
                      "cos_dst", "cos_src"):
                arrays[f"vc{m}_{k}"] = getattr(vc, k)
    ix = hp.indexer if long_context else None
    if ix is not None:
        arrays["nv4"] = (pos + 1) // CSA  # every decode row's visible C4 entries at its own (depth) position
    if ix is not None and len(ix.rows_bt):
        for k in ("rows_bt", "blk_idx", "vblock", "page_req", "page_idx", "page_dst", "key_src", "key_dst"):
            arrays[f"ix_{k}"] = getattr(ix, k)
    names = list(arrays)
    dev = dict(zip(names, upload_int64([arrays[k] for k in names], device)))

    rows = meta.DSV4TreeRows(dev["row_req"], dev["parent"], dev["depth"], dev["start"], dev["cu"], hp.max_depth)

    # SWA window lists along the ancestor paths, straight into vLLM's decode buffers
    for g in caches.swa:
        m_ = md[g.layers[0]]
        _check_rows(m_, rd, f"SWA group {g.gid}")
        meta.tree_window_slots_triton(rows, m_.slot_mapping[:rd], m_.block_table, m_.block_size,
                                      m_.decode_swa_width, align="left",
                                      out=(m_.decode_swa_indices[:, 0, :], m_.decode_swa_lens))

    # entry write slots: draft nodes write nothing through vLLM's compress launch (their entries come from the
    # virtual launch, into scratch); the entry lists resolve path entries to those scratch slots
    entries = {}
    writers = {m: md[caches.metadata_keys[f"entries{m}"]] for m in caches.ratios}
    if CSA in caches.ratios and "indexer" in caches.metadata_keys:
        writers_extra = [md[caches.metadata_keys["indexer"]]]
    else:
        writers_extra = []
    own = {}
    for m, w_md in writers.items():
        slots = w_md.slot_mapping[:rd].clone()
        if len(hp.emitters[m].rows):
            slots[dev[f"em_rows{m}"]] = dev[f"em_slots{m}"].to(slots.dtype)
        own[m] = slots
    if len(hp.node_rows):
        for w_md in {id(x): x for x in [*writers.values(), *writers_extra]}.values():
            w_md.slot_mapping.index_fill_(0, dev["node_rows"], -1)
    if HCA in writers:
        c = writers[HCA]
        dense = c.c128a_global_decode_topk_indices
        if dense is not None and rd:
            _check_rows(c, rd, "C128 list", dense.shape[0])
            entries[HCA] = meta.tree_entry_slots_triton(
                rows, own[HCA], c.block_table, caches.entries_per_block[HCA], HCA, root_committed=True,
                dense_width=dense.shape[-1], dense_out=dense[:, 0, :], lens_out=c.c128a_decode_topk_lens)
    if CSA in writers:
        entries[CSA] = meta.tree_entry_slots_triton(rows, own[CSA], writers[CSA].block_table,
                                                    caches.entries_per_block[CSA], CSA, root_committed=True)

    compress = {}
    for m, vc in hp.compress.items():
        if not len(vc.cos_src):
            continue
        state_md = md[caches.state[m].layers[0]]
        gather, _ = meta.tree_window_slots_triton(rows, state_md.slot_mapping[:rd], state_md.block_table,
                                                  state_md.block_size, vc.window, align="position",
                                                  out_dtype=torch.int64)
        g = lambda k: dev[f"vc{m}_{k}"]  # noqa: E731
        compress[m] = VirtualCompress(
            m, vc.window, vc.state_block, len(vc.cos_src), g("vpos"), g("t2r").to(torch.int32),
            g("vbt").to(torch.int32), g("vslot"), g("kslot"), g("kv_rows"), gather[g("fill_rows"), g("fill_cols")],
            g("fill_dst"), g("cos_dst"), g("cos_src"), vc.num_blocks, int(vc.cos_dst.max()) + 1)

    indexer = None
    if ix is not None:
        # Past the short-context bypass every decode row needs its own length (vLLM's flattened lengths follow
        # query order, which overshoots a row's depth), and the schedule must be rebuilt for them; rows that
        # see entries completed inside the tree also read virtual pages (the path's keys).
        i_md = md[caches.metadata_keys["indexer"]]
        dec = i_md.decode
        if dec is None or dec.block_table.shape[0] != i_md.num_decode_tokens or i_md.num_decode_tokens != rd:
            raise RuntimeError("DeepSeek-V4 tree rows need the indexer's flattened decode path (one row per query "
                               "token); this step's indexer metadata used the native multi-row decode")
        seq = dec.seq_lens.view(-1)
        seq[:rd].copy_(dev["nv4"])
        if len(ix.rows_bt):
            dec.block_table[dev["ix_rows_bt"], dev["ix_blk_idx"]] = dev["ix_vblock"].to(dec.block_table.dtype)
        if schedule_fn is not None:
            sched = schedule_fn(dec.seq_lens, KEYS_PER_BLOCK, num_sms)
            dec.schedule_metadata.copy_(sched)
        if len(ix.rows_bt):
            page_src = i_md.block_table[dev["ix_page_req"], dev["ix_page_idx"]].to(torch.int64)
            indexer = IndexerPages(page_src, dev["ix_page_dst"], dev["ix_key_src"], dev["ix_key_dst"],
                                   len(ix.rows_bt))

    refresh = _refresh_tables(hp, dev, md, caches)
    return GpuTreePlan(rows, rd, entries, compress, indexer, refresh, step, hp)


KEYS_PER_BLOCK = 64


def _check_rows(m_, rd: int, what: str, n: int | None = None) -> None:
    n = m_.num_decode_tokens if n is None else n
    if n != rd:
        raise RuntimeError(f"DeepSeek-V4 tree step: {what} has {n} decode rows, the step's plan {rd} (vLLM's "
                           f"decode split must agree across the SWA, FlashMLA and indexer metadata)")


def _refresh_tables(hp: HostPlan, dev: dict, md: dict, caches: Dsv4NvidiaCaches) -> RefreshTables:
    src, dst, spaces = [], [], []
    tr, td = dev["tree_rows"], dev["tree_dst_rows"]
    for g in caches.swa:
        sm = md[g.layers[0]].slot_mapping
        src.append(sm[tr].to(torch.int64))
        dst.append(sm[td].to(torch.int64))
        spaces.append(f"swa:{g.gid}")
    for m in sorted(caches.state):
        sm = md[caches.state[m].layers[0]].slot_mapping
        src.append(sm[tr].to(torch.int64))
        dst.append(sm[td].to(torch.int64))
        spaces.append(f"state:{m}")
    for m in caches.ratios:
        bt = md[caches.metadata_keys[f"entries{m}"]].block_table
        epb = caches.entries_per_block[m]
        s = dev[f"tree_emit{m}"]
        w = dev[f"tree_w{m}"]
        canon = bt[dev["tree_req"], w // epb].to(torch.int64) * epb + w % epb
        src.append(s)
        dst.append(torch.where(s >= 0, canon, torch.full_like(canon, -1)))
        spaces.append(f"entries:{m}")
    return RefreshTables(torch.stack(src), torch.stack(dst), spaces)


__all__ = ["device_plan", "refresh_copy_plan", "refresh_spaces"]
