"""A draft head's acceptance profile a[d][r], measured through the server, and the trees planned on it.

    a[d][r] = P(the rank-r child of an accepted depth-(d-1) node is the accepted one)   # planner.py's table

vLLM's counters (which the tree engine fills per depth) give acceptance per depth, not per sibling rank.
The rank split is recovered from R + 1 probe servers, each a static "caterpillar" tree with the head's
top-k children:

    probe R   every node of a rank-0 spine of depth L (the root included) has its top-R children; only
              the rank-0 child continues the spine. R = 1 is the chain of L.

With P_d(R) = P(a round of probe R accepts a token at depth d) = accepted_per_pos[d - 1] / rounds:

    P_d(1) = A_d = a[1][0] * ... * a[d][0]             (the chain)
    P_d(R) = A_{d-1} * (a[d][0] + ... + a[d][R-1])     (depth d is reached through the spine only)
    =>  a[d][r] = (P_d(r + 1) - P_d(r)) / A_{d-1}

The identity assumes what Sequoia's DP assumes (acceptance depends on depth and rank, not on the path
taken), and that a child's acceptance does not depend on which siblings are drafted: true for greedy
verification (the target's argmax is matched) and for the deterministic rule at T > 0 (one draw y ~ p
per node, matched against the children), the rules top-k children are verified with. Negative
differences (noise) are clipped to 0 and a row summing above 1 is scaled to 1; the raw values are kept.

The probes run on their own prompt slice, disjoint from warm-up and every measured slice, at the
invocation's sampling setting; the planned tree for budget D is Sequoia's DP on the profile
(`build.optimal_static_trees`), with its predicted tokens per round (`build.expected_accepted_length`).
"""

from __future__ import annotations

import json
from pathlib import Path

PROFILE_FILE = "profile.json"  # under OUT/profile/
PLANNED_FILE = "planned_trees.json"  # under OUT/


def caterpillar_paths(ranks: int, depth: int) -> list[tuple[int, ...]]:
    """Child-rank paths of probe `ranks`: R children under every spine node of a depth-`depth` rank-0 spine."""
    if ranks < 1 or depth < 1:
        raise ValueError(f"ranks = {ranks}, depth = {depth}: both must be >= 1")
    return [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(ranks)]


def profile_from_probes(per_depth: dict[int, list[float]], ranks: int, depth: int) -> dict:
    """a[d][r] from the probes' per-depth acceptance {R: [P_1(R), ..., P_L(R)]} for R = 1..ranks.

    Returns {"table": a (rows = depths 1..L', clipped and normalised; trailing unreached depths
    dropped), "raw": the unclipped differences, "chain": [A_1..A_L]}.
    """
    missing = [r for r in range(1, ranks + 1) if r not in per_depth]
    if missing:
        raise ValueError(f"probe runs missing for R = {missing}")

    def p(r: int, d: int) -> float:  # P_d(R), depth d 1-based; depths never reached are 0
        v = per_depth[r]
        return float(v[d - 1]) if d - 1 < len(v) else 0.0

    raw, table, chain, prev = [], [], [], 1.0  # prev = A_{d-1}
    for d in range(1, depth + 1):
        if prev <= 0.0:
            break
        row = [(p(r + 1, d) - (p(r, d) if r else 0.0)) / prev for r in range(ranks)]
        raw.append(row)
        clipped = [min(1.0, max(0.0, x)) for x in row]
        s = sum(clipped)
        table.append([x / s for x in clipped] if s > 1.0 else clipped)
        chain.append(p(1, d))
        prev = p(1, d)
    while table and not any(table[-1]):
        table.pop()
    return {"table": table, "raw": raw, "chain": chain}


def plan(table: list[list[float]], budgets: list[int]) -> dict[int, dict]:
    """Sequoia-optimal static tree per budget D on the profile: {D: {"paths", "expected_tokens_per_round",
    "chain_expected_tokens_per_round"}} (depth <= D; the table's last row stands in for deeper levels)."""
    from vllm_tree_spec.build import expected_accepted_length, optimal_static_trees
    from vllm_tree_spec.tree import Tree

    if not table:
        raise ValueError("empty acceptance profile: no probe accepted anything (is the head the target's?)")
    out = {}
    for d in budgets:
        tree = optimal_static_trees(table, d, d)[d]
        if tree is None:
            raise ValueError(f"no {d}-node tree fits the profile's {len(table[0])} ranks")
        out[d] = {"paths": [list(p) for p in tree.to_paths()],
                  "expected_tokens_per_round": expected_accepted_length(tree, table),
                  "chain_expected_tokens_per_round": expected_accepted_length(Tree.chain(d), table)}
    return out


def paths_str(paths) -> str:
    """The `tree` key for explicit child-rank paths: "[(0,), (1,), (0, 0)]"."""
    return str([tuple(p) for p in paths])


def load_planned(out: Path | str) -> dict[int, dict] | None:
    p = Path(out) / PLANNED_FILE
    if not p.exists():
        return None
    return {int(k): v for k, v in json.loads(p.read_text())["trees"].items()}


def write_profile(out: Path | str, profile: dict, planned: dict[int, dict], source: dict) -> None:
    """OUT/profile/profile.json (table, raw, probe numbers, where it was measured), OUT/planned_trees.json
    and OUT/acceptance_profile.png."""
    out = Path(out)
    (out / "profile").mkdir(parents=True, exist_ok=True)
    (out / "profile" / PROFILE_FILE).write_text(json.dumps({**profile, "source": source}, indent=1))
    (out / PLANNED_FILE).write_text(json.dumps({
        "method": "Sequoia DP (vllm_tree_spec.build.optimal_static_trees) on profile/profile.json, depth <= D",
        "trees": {str(d): v for d, v in sorted(planned.items())}}, indent=1))
    plot_profile(profile["table"], out / "acceptance_profile.png", title=source.get("title", "acceptance profile"))


def plot_profile(table: list[list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    depths = list(range(1, len(table) + 1))
    for r in range(len(table[0]) if table else 0):
        ax.plot(depths, [row[r] for row in table], marker="o", label=f"rank {r}")
    ax.set_xticks(depths)
    ax.set_xlabel("depth d")
    ax.set_ylabel("a[d][r] = P(rank-r child accepted | parent accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
