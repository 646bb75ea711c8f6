"""Tree / linear per measurement window, from a bench_serve.py output folder.

    python benchmarks/serve/window_ratios.py runs/serve/protocol-suffix

One line per (pair, load): the medians of the per-window ratios that `summary.json`'s comparisons hold
(tokens per round, tokens per verify step, output tok/s, tok per server CPU-second) and each window's
tok/s ratio (a window = one repeat of both configurations, interleaved), which shows how much of a median
is the machine's noise. A folder with several tree configurations names the pair at the end of each line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(folder: str | Path) -> list[str]:
    s = json.loads((Path(folder) / "summary.json").read_text())
    rows = {(r["config"], r["key"]): r for r in s["rows"]}
    out = []
    trees = {c["tree"] for c in s["comparisons"] if c["linear"] is not None}
    for c in s["comparisons"]:
        if c["linear"] is None:
            continue
        t, lin = rows[(c["tree"], c["key"])], rows[(c["linear"], c["key"])]
        pt, pl = t.get("per_repeat") or {}, lin.get("per_repeat") or {}
        win = [pt[i]["output_tok_s"] / pl[i]["output_tok_s"] for i in sorted(pt) if i in pl]
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}x"  # noqa: E731
        out.append(f"{c['family']:7s} {c['key']:4s} tok/round {fmt(c['accepted_length_ratio'])} "
                   f"tok/step {fmt(c['tokens_per_step_ratio'])} tok/s {fmt(c['throughput_ratio_vs_linear'])} "
                   f"({', '.join(f'{w:.3f}' for w in win)}) per CPU-s {fmt(c['cpu_efficiency_ratio_vs_linear'])}"
                   + (f"  [{c['tree']} / {c['linear']}]" if len(trees) > 1 else ""))  # several trees: name them
    return out


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        print("\n".join(lines(folder)))
