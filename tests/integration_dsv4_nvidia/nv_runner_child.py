"""Child process: the emulated NVIDIA DeepSeek-V4 engine (nvidia_emulation) on one of vLLM's runners, with and
without tree speculation, and what a test compares (tests/test_v2_dsv4_nvidia.py).

    python nv_runner_child.py REQUEST.json OUT.json

REQUEST: {"runner": "V1" | "V2", "model", "prompts", "max_tokens", "spec", "oracle": {"seed", "p_full"} or false
(the configured drafter instead), "plant": null | "no-refresh" | "no-isolation", "stock_only": bool,
"mtp_head_check": bool (mtp_head_check.py inside the engine), "also": {name: {"spec", "oracle", "plant",
"mtp_head_check"}} further tree engines compared with the same stock run (results under "also")}. Model
Runner V2 needs Triton's interpreter with the test-only V2 shims (tests/fixtures/v2_cpu.py) before vLLM is
imported, and the NVIDIA emulation rebinds vLLM process-wide: hence a child. It runs the stock engine (recording
each request's stores after every step), then the tree engine, by default with the oracle drafter hiding that
engine's greedy continuation in random trees (recording the stores after every refresh), and writes both
outputs, the stores that differ (nv_tree_harness.snapshot_mismatches), and the adapter's and the runner's
counters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "integration_dsv4"), str(HERE.parent / "fixtures")]


def _snapshot(runner, req_index: int, length: int):
    import nv_tree_harness as T

    return T.snapshot_any(runner, req_index, length)


def _runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _record_stock(llm, store: dict) -> None:
    """After every step of the engine without speculation: each request's stores, keyed (request, rows in the
    cache)."""
    runner = _runner(llm)
    if getattr(runner, "block_tables", None) is None:
        import nv_tree_harness as T

        T.record_base_snapshots(store)(llm)
        return
    orig = runner.sample

    def sample(hidden_states, input_batch, grammar_output):
        out = orig(hidden_states, input_batch, grammar_output)
        for i, rid in enumerate(input_batch.req_ids[: input_batch.num_reqs]):
            length = int(input_batch.num_computed_tokens_np[i] + input_batch.num_scheduled_tokens[i])
            store[(int(rid.split("-")[0]), length)] = _snapshot(runner, i, length)
        return out

    runner.sample = sample


def _record_refreshes(llm, store: dict, plant: str | None) -> None:
    """After every refresh of the tree engine: each tree request's stores (its accepted path committed)."""
    runner = _runner(llm)
    adapter = runner.tree_adapter
    orig = adapter.commit

    def commit(rnr, step, result):
        n = 0 if plant == "no-refresh" else orig(rnr, step, result)
        if plant == "no-refresh":
            adapter.plan = None
        for req, acc, k in zip(step.requests, result.accepted_nodes.tolist(), result.num_accepted.tolist()):
            length = req.root_pos + 1 + k
            store[(int(req.req_id.split("-")[0]), length)] = _snapshot(rnr, req.req_index, length)
        return n

    adapter.commit = commit
    if plant == "no-isolation":  # negative control: vLLM's own index lists and compressor fetch on tree rows
        adapter.isolation = False


def _tree_run(model, prompts, params, truth, stock_snaps, run: dict) -> dict:
    """One tree engine (run: "spec", "oracle", "plant", "mtp_head_check") and what it is compared by."""
    import nv_tree_harness as T
    import nvidia_harness as H
    from dsv4_harness import OracleTreeDrafter
    from speculator_report import speculator_report

    oracle = run.get("oracle") or {}
    tree_snaps: dict = {}
    factory = None if run.get("oracle") is False else (  # False: the configured drafter itself
        lambda cfg: OracleTreeDrafter(truth, "random", seed=oracle.get("seed", 11), p_full=oracle.get("p_full", 0.7)))
    with T.drafter(factory), H.nvidia_engine(model, speculative_config=run["spec"]) as llm:
        _record_refreshes(llm, tree_snaps, run.get("plant"))
        tree = H.generate(llm, prompts, params)
        r = _runner(llm)
        adapter = {"class": type(r.tree_adapter).__name__, "view": type(r.tree_adapter.view).__name__,
                   "stats": {k: v for k, v in r.tree_adapter.stats.items() if not k.endswith("_s")}}
        tree_runner = next(c.__module__ for c in type(r).__mro__ if c.__module__.startswith("vllm."))
        tree_stats = r.tree_stats.as_dict()
        drafter_head = type(getattr(getattr(r.drafter, "drafter", None), "head", None)).__name__
        speculator = speculator_report(r)
        window = getattr(getattr(r.drafter, "drafter", None), "window", None)
        # bytes the drafter wrote into vLLM's page of the MTP layer (its committed window on V2), before the check
        page_nonzero = int((window.cache != 0).sum()) if getattr(window, "paged", False) else None
        head_check = None
        if run.get("mtp_head_check"):
            import mtp_head_check

            head_check = mtp_head_check.check(r.drafter.drafter, r.get_model())
    compared = [k for k in tree_snaps if k in stock_snaps]
    # stores the stock engine has no layer for: vLLM's page of the MTP layer vLLM loads as the drafter's head
    # (integration/v2/mtp_head.py), the drafter's committed window (mtp_window.py)
    tree_only = sorted({n for k in compared for n in tree_snaps[k] if n not in stock_snaps[k]})
    bad = {f"{k[0]}@{k[1]}": sorted(T.snapshot_mismatches(
        {n: v for n, v in tree_snaps[k].items() if n in stock_snaps[k]}, stock_snaps[k])) for k in compared}
    return {"tree_runner": tree_runner, "adapter": adapter, "tree_stats": tree_stats,
            "drafter_head": drafter_head, "speculator": speculator, "mtp_head_check": head_check, "mtp_page_nonzero": page_nonzero,
            "tree": {"outputs": tree.outputs, "logprobs": tree.logprobs},
            "stores_compared": len(compared), "stores_refreshed": len(tree_snaps), "tree_only_stores": tree_only,
            "store_mismatches": {k: v for k, v in bad.items() if v}}


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "TOKENIZERS_PARALLELISM": "false", "TORCHDYNAMO_DISABLE": "1"}.items():
        os.environ.setdefault(k, v)
    if request["runner"] == "V2":
        import v2_cpu

        v2_cpu.install_emulation()
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm_cpu import register_cpu_kernel_overrides_once

    from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter

    enable_triton_interpreter()
    register_cpu_kernel_overrides_once()
    import nvidia_emulation

    nvidia_emulation.install(fast=True)
    import nvidia_harness as H
    from vllm import SamplingParams

    model, prompts = request["model"], request["prompts"]
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, logprobs=1, ignore_eos=True)
    stock_snaps: dict = {}
    with H.nvidia_engine(model) as llm:
        _record_stock(llm, stock_snaps)
        stock = H.generate(llm, prompts, params)
        stock_runner = type(_runner(llm)).__module__
    if request.get("stock_only"):
        out.write_text(json.dumps({"stock_runner": stock_runner,
                                   "stock": {"outputs": stock.outputs, "logprobs": stock.logprobs}}))
        return 0
    truth = {tuple(p): o for p, o in zip(prompts, stock.outputs)}
    result = {"stock_runner": stock_runner, "stock": {"outputs": stock.outputs, "logprobs": stock.logprobs}}
    result.update(_tree_run(model, prompts, params, truth, stock_snaps, request))
    # further tree engines against the same stock run: {name: {"spec", "oracle", "plant", "mtp_head_check"}}
    result["also"] = {name: _tree_run(model, prompts, params, truth, stock_snaps, run)
                      for name, run in (request.get("also") or {}).items()}
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
