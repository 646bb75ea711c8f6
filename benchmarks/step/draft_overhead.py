"""The draft stage alone, tree vs vLLM's linear proposer (suffix or n-gram): host ms per step on replayed outputs.

Under greedy decoding the output does not depend on the drafts (suffix_replay.py), so the draft stage can be
driven without a model: B requests decode in lockstep through their stored greedy outputs; each step every
request drafts, accepts the longest drafted path that matches its output plus the bonus token, and a finished
request is replaced by the next prompt (continuous batching). Two drafting stacks per `--drafter`:

    tree     the served tree engine's drafting: `TreeProposer` (the suffix or n-gram drafter, `budgets: "auto"`
             online policy with its score gate), called as the runner calls it (`make_request` per request,
             `propose_trees`, the drafts as token lists)
    linear   vLLM's `SuffixDecodingProposer.propose` / `NgramProposer.propose` on a minimal input batch (what
             `method: "suffix"` / `"ngram"` run; n-gram: prompt lookup 1..3, as in the serving benchmark)

The policy's clock is wall time plus a modelled forward (`--cost-line C0,S`: C0 + S x rows ms per step), so it
plans as it would in serving; the draft stage itself is measured, in process CPU time, per step. Each stack
runs `--repeats` times, interleaved; the report gives the median per-step ms of each run, and a cProfile of
one tree run (`--profile`) names where the tree's time goes.

    .venv/bin/python benchmarks/step/draft_overhead.py --outputs runs/step/suffix_replay/greedy_outputs.json \\
        --batch 4 --out runs/step/draft_overhead     # ~1 min (the outputs: suffix_replay.py writes them)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
D = 6  # num_speculative_tokens, as in the serving protocol


class Walk:
    """B request slots replaying greedy outputs; `drafts -> accept` advances them."""

    def __init__(self, data: list[dict], batch: int, max_len: int):
        self.data, self.batch, self.max_len = data, batch, max_len
        self.next, self.slots = 0, []
        self.tokens = np.zeros((batch, max_len), dtype=np.int32)  # vLLM's token_ids_cpu
        self.started, self.finished = [], []
        for _ in range(batch):
            self._admit()

    def _admit(self) -> None:
        if self.next >= len(self.data):
            return
        d = self.data[self.next]
        rid = f"req-{self.next}"
        self.next += 1
        n = len(d["prompt"]) + 1  # the prefill's sampled token: the first output token
        self.slots.append(dict(rid=rid, prompt=d["prompt"], truth=d["prompt"] + d["output"], n=n, new=[d["output"][0]]))
        self.started.append(rid)

    def rows(self) -> list[dict]:
        for i, s in enumerate(self.slots):
            self.tokens[i, : s["n"]] = s["truth"][: s["n"]]
        return self.slots

    def accept(self, drafts: list[tuple[list[int], list[int]]]) -> int:
        """drafts[i]: (parents, tokens) of slot i's tree. Returns the tokens emitted this step."""
        emitted, keep = 0, []
        for s, (parents, toks) in zip(self.slots, drafts):
            truth, n, row, new = s["truth"], s["n"], -1, []
            while n + len(new) < len(truth):
                want = truth[n + len(new)]
                nxt = next((i for i, (p, t) in enumerate(zip(parents, toks)) if p == row and t == want), None)
                new.append(want)  # an accepted draft, or the bonus token
                if nxt is None:
                    break
                row = nxt
            s["n"], s["new"] = n + len(new), new
            emitted += len(new)
            if s["n"] >= len(truth):
                self.finished.append(s["rid"])
            else:
                keep.append(s)
        self.slots = keep
        while len(self.slots) < self.batch and self.next < len(self.data):
            self._admit()
        return emitted


LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}


def tree_stack(drafter: str, batch: int, cost_line: tuple[float, float]):
    from vllm_tree_spec.integration.proposer import TreeProposer

    spec = {"method": "tree", "drafter": drafter, "num_speculative_tokens": D, **(LOOKUP if drafter == "ngram" else {})}
    cfg = SimpleNamespace(additional_config={"tree_spec": spec},
                          scheduler_config=SimpleNamespace(max_num_seqs=batch))
    prop = TreeProposer(cfg)
    pol = prop.shape_policy.policy
    modelled = [0.0]
    pol.clock = lambda: time.perf_counter() + modelled[0]
    params = SimpleNamespace(temperature=0.0, seed=None)

    def step(walk: Walk) -> list[tuple[list[int], list[int]]]:
        for rid in walk.finished:
            prop.finish_request(rid)
        walk.finished.clear()
        slots = walk.rows()
        reqs = [prop.make_request(s["rid"], walk.tokens[i, : s["n"]],
                                  SimpleNamespace(sampling_params=params, prompt_token_ids=s["prompt"]))
                for i, s in enumerate(slots)]
        props = prop.propose_trees(reqs, [D] * len(reqs))
        out = [(p.tree.parents.tolist(), p.tree.tokens.tolist()) for p in props]
        modelled[0] += (cost_line[0] + cost_line[1] * sum(1 + len(t) for _, t in out)) / 1e3
        return out

    return step


def linear_stack(drafter: str, batch: int, cost_line: tuple[float, float]):
    if drafter == "ngram":
        return ngram_stack(batch)
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    spec = SimpleNamespace(num_speculative_tokens=D, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1,
                           suffix_decoding_max_cached_requests=10000)
    prop = SuffixDecodingProposer(SimpleNamespace(speculative_config=spec,
                                                  model_config=SimpleNamespace(max_model_len=1 << 20)))

    def step(walk: Walk) -> list[tuple[list[int], list[int]]]:
        walk.finished.clear()
        slots = walk.rows()
        ids = [s["rid"] for s in slots]
        ib = SimpleNamespace(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             num_tokens_no_spec=np.array([s["n"] for s in slots]),
                             num_prompt_tokens=np.array([len(s["prompt"]) for s in slots]), token_ids_cpu=walk.tokens)
        drafts = prop.propose(D, ib, [s["new"] for s in slots])
        return [(list(range(-1, len(d) - 1)), list(d)) for d in drafts]

    return step


def ngram_stack(batch: int):
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    spec = SimpleNamespace(num_speculative_tokens=D, **LOOKUP)
    prop = NgramProposer(SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(max_model_len=4096),
                                         scheduler_config=SimpleNamespace(max_num_seqs=batch),
                                         parallel_config=SimpleNamespace(tensor_parallel_size=1)))

    def step(walk: Walk) -> list[tuple[list[int], list[int]]]:
        walk.finished.clear()
        slots = walk.rows()
        drafts = prop.propose(D, [s["new"] for s in slots], np.array([s["n"] for s in slots]), walk.tokens)
        return [(list(range(-1, len(d) - 1)), list(d)) for d in drafts]

    return step


def run(name: str, data, batch: int, cost_line, profile: cProfile.Profile | None = None,
        drafter: str = "suffix") -> dict:
    step = (tree_stack if name == "tree" else linear_stack)(drafter, batch, cost_line)
    walk = Walk(data, batch, max(len(d["prompt"]) + len(d["output"]) for d in data) + D + 2)
    times, full, tokens, steps = [], [], 0, 0
    while walk.slots:
        n = len(walk.slots)
        t0 = time.process_time()
        if profile is not None:
            profile.enable()
        drafts = step(walk)
        if profile is not None:
            profile.disable()
        dt = (time.process_time() - t0) * 1e3
        if n == batch:
            full.append(dt)
        times.append(dt)
        tokens += walk.accept(drafts)
        steps += 1
    return dict(engine=name, drafter=drafter, steps=steps, tokens=tokens, tok_per_step=tokens / steps,
                median_ms=statistics.median(full or times), mean_ms=statistics.fmean(full or times),
                full_steps=len(full))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", required=True, help="greedy outputs JSON (suffix_replay.py --out DIR writes one)")
    ap.add_argument("--drafter", choices=("suffix", "ngram"), default="suffix")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-line", default="40,0.6", help="C0,S: modelled forward ms = C0 + S x rows")
    ap.add_argument("--profile", action="store_true", help="cProfile one more tree run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = json.loads(Path(args.outputs).read_text())
    cost = tuple(float(x) for x in args.cost_line.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(args.repeats):
        for name in ("linear", "tree"):  # interleaved
            r = dict(run(name, data, args.batch, cost, drafter=args.drafter), repeat=rep)
            runs.append(r)
            print(json.dumps(r), flush=True)
    med = {e: statistics.median(r["median_ms"] for r in runs if r["engine"] == e) for e in ("tree", "linear")}
    lines = [f"{args.drafter} draft stage, batch {args.batch}, {len(data)} prompts, {args.repeats} interleaved repeats "
             f"(process CPU ms per full-batch step, median of run medians)", "",
             "| engine | ms/step | tokens/step |", "|---|---|---|"]
    for e in ("linear", "tree"):
        tps = statistics.median(r["tok_per_step"] for r in runs if r["engine"] == e)
        lines.append(f"| {e} | {med[e]:.3f} | {tps:.3f} |")
    lines.append(f"\ntree - linear: {med['tree'] - med['linear']:.3f} ms/step")
    if args.profile:
        prof = cProfile.Profile()
        run("tree", data, args.batch, cost, prof, drafter=args.drafter)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        (out / "tree_profile.txt").write_text(s.getvalue())
    (out / "draft_overhead.json").write_text(json.dumps(dict(args=vars(args), runs=runs, median_ms=med), indent=1))
    (out / "draft_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
