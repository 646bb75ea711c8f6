"""Scratch memory of DeepSeek-V4 tree verification next to the persistent decode state.

Per layer kind, per request:

    persistent, fixed       what a request keeps whatever its length: the last W
                            window KV rows and the last coff*m compressor state
                            rows (main, and the indexer's for CSA)
    persistent, per 1k      compressed entries (one per m tokens) and indexer
                            keys (one per 4 tokens), growing with context
    scratch rows / node     one window KV row + one compressor state row pair
                            (+ indexer pair) per tree row; commit copies exactly
                            these for each accepted token
    scratch entry / node    one entry (+ indexer key) for a node whose position
                            completes a block; about 1 in m nodes needs it

Buffer widths come from the reference model's own layout
(`vllm_tree_spec.reference.dsv4_cache.buffer_layout`), so the accounting and
the implementation cannot drift apart. Byte formats per row:

    fp32      every buffer fp32 (the reference model in float32)
    vllm      vLLM 0.32: window KV / entries fp8_ds_mla = (c - r) fp8 + r bf16 + 8 B scale
              (584 B at c = 512, r = 64); indexer keys c_I fp8 + 4 B scale (132 B);
              compressor state rows fp32

Run:  python benchmarks/reference/memory_accounting.py [--nodes 8] [--format fp32|vllm]
"""

from __future__ import annotations

import argparse

from vllm_tree_spec.reference.dsv4_cache import buffer_layout, live_rows
from vllm_tree_spec.reference.dsv4_config import DSV4Config

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def row_bytes(cfg: DSV4Config, name: str, width: int, fmt: str) -> int:
    if fmt == "fp32" or "state" in name:
        return 4 * width
    if name in ("kv", "entries"):
        r = cfg.qk_rope_head_dim
        return (width - r) + 2 * r + 8  # fp8_ds_mla
    if name == "idx_keys":
        return width + 4
    raise ValueError(name)


def layer_bytes(cfg: DSV4Config, layer: int, fmt: str) -> dict[str, int]:
    """Bytes per request for one layer, split as in the module docstring."""
    out = dict(fixed=0, per_1k=0, node_rows=0, node_entry=0)
    for name, spec in buffer_layout(cfg, layer).items():
        b = row_bytes(cfg, name, spec.width, fmt)
        if spec.per == "entry":
            out["per_1k"] += b * 1000 // spec.ratio
            out["node_entry"] += b
        else:
            out["fixed"] += b * live_rows(cfg, layer, name, context_len=10**9)
            out["node_rows"] += b
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(title: str, cfg: DSV4Config, fmt: str, nodes: int, contexts: list[int]) -> None:
    kinds: dict[str, list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        kinds.setdefault(cfg.layer_kind(i), []).append(i)
    print(f"\n### {title} ({fmt} rows; W = {cfg.sliding_window}, c = {cfg.head_dim}, "
          f"ratios {cfg.ratios}, indexer {cfg.index_n_heads} x {cfg.index_head_dim})\n")
    print("| layer kind | layers | persistent fixed / request | persistent per 1k tokens "
          "| scratch rows / node | scratch entry / block-completing node |")
    print("|---|---|---|---|---|---|")
    totals = dict(fixed=0, per_1k=0, node_rows=0, node_entry=0, expected_entries=0.0)
    for kind in ("swa", "csa", "hca"):
        if kind not in kinds:
            continue
        b = layer_bytes(cfg, kinds[kind][0], fmt)
        n = len(kinds[kind])
        m = cfg.compress_ratio(kinds[kind][0])
        print(f"| {kind.upper()}{f' (m = {m})' if m > 1 else ''} | {n} | {fmt_bytes(b['fixed'])} "
              f"| {fmt_bytes(b['per_1k'])} | {fmt_bytes(b['node_rows'])} | {fmt_bytes(b['node_entry'])} |")
        for k in ("fixed", "per_1k", "node_rows", "node_entry"):
            totals[k] += n * b[k]
        totals["expected_entries"] += n * b["node_entry"] * (nodes + 1) / m if m > 1 else 0
    rows = nodes + 1  # the root + N draft nodes are all computed into scratch
    print(f"\nWhole model, one request, tree of {nodes} nodes (+ root):")
    print(f"- scratch rows: {fmt_bytes(rows * totals['node_rows'])} "
          f"({fmt_bytes(totals['node_rows'])} per row); commit copies {fmt_bytes(totals['node_rows'])} "
          f"per accepted token plus its entries")
    print(f"- scratch entries: {fmt_bytes(totals['expected_entries'])} expected (1 in m rows completes a block), "
          f"{fmt_bytes(rows * totals['node_entry'])} if every row completed one")
    for ctx in contexts:
        persistent = totals["fixed"] + totals["per_1k"] * ctx / 1000
        scratch = rows * totals["node_rows"] + totals["expected_entries"]
        print(f"- persistent state at {ctx:>9,} tokens: {fmt_bytes(persistent)}; "
              f"scratch / persistent = {100 * scratch / persistent:.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes per tree (the root is added)")
    ap.add_argument("--format", choices=["fp32", "vllm"], default=None,
                    help="row format for both configs (default: fp32 for tiny, vllm for V4-Flash)")
    args = ap.parse_args()
    report("tiny test config", DSV4Config(), args.format or "fp32", args.nodes, [64, 1024])
    report("DeepSeek-V4-Flash", DSV4Config.deepseek_v4_flash(), args.format or "vllm", args.nodes,
           [8192, 65536, 1_048_576])


if __name__ == "__main__":
    main()
