"""Tree speculation on the emulated NVIDIA DeepSeek-V4 engine at tensor parallelism 2 (extended set), on the V1
runner and (the MTP drafter on vLLM's own MTP model) on Model Runner V2.

vLLM's NVIDIA model classes on the CPU platform (nvidia_emulation.py), TP = 2 with multiprocess workers (one
core each, `VLLM_CPU_OMP_THREADS_BIND=0|1`), V1 runner, eager: query heads and wo_a / wo_b are sharded, the KV
projection, compressors, indexer and every cache are replicated, so both ranks must build the same tree plan
every step and end with byte-identical caches. Every process of an engine (driver, engine core, workers) is a
fresh interpreter; a test-only `sitecustomize.py` installs Triton's interpreter and the emulation there before
vLLM is imported, the oracle drafter, and per-rank probes (no change to the adapter):

* after the adapter's `on_metadata`, digests (sha256 over the bytes) of the step's plan: its host half, its
  device half (every tensor it uploaded or built) and the lists it wrote into vLLM's metadata
  (nv_tree_harness.plan_digests);
* after each refresh, digests of every store of each committed request (nv_tree_harness.snapshot_nv);
* after the run, digests of every KV-cache tensor, whole (scratch blocks included), fetched per rank with
  `collective_rpc`.

Checks: greedy output of the TP = 2 tree engine (oracle random trees crossing C4 blocks, the 128-token window
and the C128 boundaries at 127 / 255) identical to the TP = 2 engine without speculation (the strict comparison
is TP = 2 against TP = 2: TP changes the reduction order of the sharded projections); the two ranks' sequences
of plan digests equal and non-empty, their refresh digests and final cache digests equal. Negative controls
(each must be caught): rank 1 takes its scratch blocks from the other end of the reserved range (output
unchanged; its plans and scratch contents differ), and rank 1 commits a shorter path than rank 0's broadcast
(its plans stay equal, its caches do not).
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

PROMPT_LENGTHS = (61, 124, 253)
MAX_TOKENS = 16
SPEC = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}
MTP_SPEC = {"method": "tree", "drafter": "mtp", "tree": "s3_k2_d6"}
N_HEADS = 16  # the tiny checkpoint's query heads (tests/integration_dsv4/tiny_dsv4.py)
TIMEOUT_S = 1500

SITE = textwrap.dedent("""
    import json, os, sys
    if os.environ.get("NV_TP_TEST") == "1":
        sys.path[:0] = os.environ["NV_TP_PATH"].split(os.pathsep)
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":  # Model Runner V2's test-only shims (v2_cpu.py)
            import v2_cpu
            v2_cpu.install_emulation()
        from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter
        enable_triton_interpreter()
        import nvidia_emulation
        nvidia_emulation.install(fast=True)

        def _rank():
            from vllm.distributed import get_tp_group
            return get_tp_group().rank_in_group

        control = os.environ.get("NV_TP_CONTROL", "")
        truth_path = os.environ.get("NV_TP_TRUTH")
        if truth_path:
            from vllm_tree_spec.integration import proposer

            def make(cfg, vllm_config=None, **_):
                from dsv4_harness import OracleTreeDrafter
                d = json.load(open(truth_path))
                return OracleTreeDrafter({tuple(p): o for p, o in zip(d["prompts"], d["outputs"])}, "random",
                                         seed=11, p_full=0.7)
            proposer.make_drafter = make

        if control == "scratch":  # rank 1 hands out the reserved scratch blocks from the top of the range
            from vllm_tree_spec.integration.dsv4 import layout
            real_take = layout.ScratchBlocks.take

            def take(self, n):
                out = real_take(self, n)
                if _rank() == 1:
                    out = [2 * self.first + self.count - 1 - b for b in out]
                return out
            layout.ScratchBlocks.take = take

        if control == "path":  # rank 1 commits rank 0's path without its last node
            from vllm_tree_spec.integration import tree_sampler
            real_broadcast = tree_sampler.broadcast_from_first_rank

            def broadcast(result):
                import torch
                res = real_broadcast(result)  # every rank still joins the collective
                if _rank() == 1:
                    num = res.num_accepted.clone()
                    acc = res.accepted_nodes.clone()
                    rows = torch.nonzero(num > 0).flatten()
                    acc[rows, num[rows] - 1] = -1
                    num[rows] -= 1
                    res = type(res)(acc, num, res.next_token, res.output_token_ids, res.walked)
                return res
            tree_sampler.broadcast_from_first_rank = broadcast

        import nv_tree_harness as T
        from vllm_tree_spec.integration.dsv4.nvidia.adapter import DeepseekV4NvidiaTreeAdapter as A
        real_on_metadata, real_commit = A.on_metadata, A.commit

        def on_metadata(self, runner, step, md):
            real_on_metadata(self, runner, step, md)
            if self.plan is not None:
                T.TP_PROBE["plans"].append(T.plan_digests(self.plan, md, self.caches))

        def commit(self, runner, step, result):
            n = real_commit(self, runner, step, result)
            for req, k in zip(step.requests, result.num_accepted.tolist()):
                length = req.root_pos + 1 + k
                T.TP_PROBE["refresh"].append([req.req_id, length, T.digest(T.snapshot_any(runner, req.req_index,
                                                                                         length))])
            return n
        A.on_metadata, A.commit = on_metadata, commit
""")

DRIVER = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm_tree_spec.integration import install
        import nv_tree_harness as T
        install()
        args = json.loads(sys.argv[1])
        llm = LLM(model=args["model"], max_model_len=640, enforce_eager=True, max_num_seqs=4, seed=0,
                  max_num_batched_tokens=2048, speculative_config=args["spec"], tensor_parallel_size=2,
                  distributed_executor_backend="mp")
        outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]],
                            SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True),
                            use_tqdm=False)
        ranks = llm.collective_rpc(T.tp_probe_report)
        print("RESULT " + json.dumps({"prompts": args["prompts"],
                                      "outputs": [list(o.outputs[0].token_ids) for o in outs], "ranks": ranks}))
""")


def prompts(seed=3):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def _run(tmp: pathlib.Path, model: str, spec, *, truth=None, control: str = "", max_tokens: int = MAX_TOKENS,
         n_prompts: int = len(PROMPT_LENGTHS), runner: str = "V1") -> dict:
    """One TP = 2 engine in a fresh interpreter (its workers spawned by vLLM) on the V1 runner or Model Runner V2;
    the outputs and each rank's probe report (nv_tree_harness.tp_probe_report), with the wall time."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sitecustomize.py").write_text(SITE)
    (tmp / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "NV_TP_TRUTH")}
    paths = [HERE, HERE.parent / "integration_dsv4", HERE.parent / "fixtures"]
    env.update(PYTHONPATH=os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               NV_TP_TEST="1", NV_TP_PATH=os.pathsep.join(map(str, paths)), NV_TP_CONTROL=control,
               TRITON_INTERPRET="1", VLLM_USE_V2_MODEL_RUNNER="1" if runner == "V2" else "0",
               OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc(tp_probe_report): a function, pickled
    if truth is not None:
        env["NV_TP_TRUTH"] = str(truth)
    args = {"model": model, "spec": spec, "prompts": prompts()[:n_prompts], "max_tokens": max_tokens}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(tmp / "driver.py"), json.dumps(args)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    log = tmp / f"{'tree' if spec else 'base'}{'_' + control if control else ''}.log"
    log.write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{log}:\n" + (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t0
    assert [r["rank"] for r in res["ranks"]] == [0, 1], [r["rank"] for r in res["ranks"]]
    return res


def _divergence(run: dict) -> dict[str, int]:
    """Where rank 1 differs from rank 0: plan steps, refresh points, cache tensors."""
    r0, r1 = run["ranks"]
    plans = sum(a != b for a, b in zip(r0["plans"], r1["plans"])) + abs(len(r0["plans"]) - len(r1["plans"]))
    refresh = sum(a != b for a, b in zip(r0["refresh"], r1["refresh"])) + abs(len(r0["refresh"]) -
                                                                               len(r1["refresh"]))
    caches = sum(r0["caches"][k] != r1["caches"].get(k) for k in r0["caches"]) + \
        len(set(r1["caches"]) - set(r0["caches"]))
    return {"plans": plans, "refresh": refresh, "caches": caches}


@pytest.fixture(scope="module")
def runs(decisive_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nv_tp2")
    base = _run(tmp, decisive_model, None)
    truth = tmp / "truth.json"
    truth.write_text(json.dumps(base))
    tree = _run(tmp, decisive_model, SPEC, truth=truth)
    return {"base": base, "tree": tree, "truth": truth, "tmp": tmp}


def test_tp2_tree_greedy_identical_and_ranks_agree(runs):
    base, tree = runs["base"], runs["tree"]
    assert tree["outputs"] == base["outputs"]
    r0, r1 = tree["ranks"]
    assert r0["adapter"] == r1["adapter"] == "DeepseekV4NvidiaTreeAdapter"
    st = r0["stats"]
    print(f"TP = 2: base {base['wall_s']:.0f} s, tree {tree['wall_s']:.0f} s; {len(r0['plans'])} plan steps "
          f"({sum(p['bytes'] for p in r0['plans'])} plan bytes per rank), {len(r0['refresh'])} refresh points, "
          f"{len(r0['caches'])} cache digests per rank (allocations: "
          f"{sum(b for k, (_, b) in r0['caches'].items() if k.startswith('allocation'))} bytes); "
          f"adapter {st}; tree {r0['tree_stats']}")
    # the trees did what they are for: block-completing draft nodes of both ratios, accepted paths off the
    # first branch
    assert st["emitters_c4"] > 0 and st["emitters_c128"] > 0, st
    assert r0["tree_stats"]["off_first_branch"] > 0 and r0["tree_stats"]["accepted"] > 0, r0["tree_stats"]
    assert r0["plans"] and all(p["trees"] > 0 for p in r0["plans"])
    assert r0["plans"] == r1["plans"], _divergence(tree)
    assert r0["refresh"] and r0["refresh"] == r1["refresh"], _divergence(tree)
    assert r0["caches"] and r0["caches"] == r1["caches"], _divergence(tree)
    assert r0["stats"] == r1["stats"] and r0["tree_stats"] == r1["tree_stats"]


@pytest.mark.parametrize("control", ["scratch", "path"])
def test_tp2_rank_divergence_is_caught(runs, decisive_model, control):
    """Rank 1 takes its scratch blocks from the other end of the reserved range (a rank-local plan difference
    the outputs cannot show: its plans and scratch blocks differ), or commits rank 0's path less its last node
    (plans equal, caches not): the per-rank digests must tell."""
    run = _run(runs["tmp"], decisive_model, SPEC, truth=runs["truth"], control=control, n_prompts=2)
    d = _divergence(run)
    print(f"control {control}: {d} ({run['wall_s']:.0f} s)")
    if control == "scratch":
        assert run["outputs"] == runs["base"]["outputs"][:2]  # invisible in the output
        assert d["plans"] > 0 and d["caches"] > 0, d
    else:
        assert d["plans"] == 0 and d["refresh"] > 0 and d["caches"] > 0, d


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    """The decisive checkpoint with an MTP layer that predicts the target's bigram vote (MTP trees get accepted)."""
    from tiny_dsv4 import DECISIVE_BIGRAM, make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("nv_tp2_mtp") / "dsv4", bigram=DECISIVE_BIGRAM,
                              mtp_bigram=True))


def test_v2_tp2_mtp_drafter_on_vllms_sharded_mtp_model(mtp_model, tmp_path):
    """Model Runner V2 at TP = 2 with the MTP tree drafter on vLLM's own MTP model (integration/v2/mtp_head.py):
    vLLM's loader shards its query heads, wo_a / wo_b and experts, the drafter's attention runs on each rank's
    own heads and vLLM's output projection sums the ranks. Greedy output identical to the TP = 2 V2 engine
    without speculation; both ranks load vLLM's model and build, verify and commit the same steps (plan,
    refresh and cache digests equal); MTP trees get accepted."""
    base = _run(tmp_path / "base", mtp_model, None, runner="V2", n_prompts=2)
    tree = _run(tmp_path / "tree", mtp_model, MTP_SPEC, runner="V2", n_prompts=2)
    r0, r1 = tree["ranks"]
    ts = r0["tree_stats"]
    print(f"V2, TP = 2, MTP on vLLM's model: base {base['wall_s']:.0f} s, tree {tree['wall_s']:.0f} s; "
          f"{len(r0['plans'])} plan steps, {len(r0['refresh'])} refresh points; tree {ts}")
    assert r0["runner"] == r1["runner"] == base["ranks"][0]["runner"] == "vllm.v1.worker.cpu.model_runner"
    assert r0["drafter_head"] == r1["drafter_head"] == "VllmMTPHead"
    assert r0["drafter_q_heads"] == r1["drafter_q_heads"] == N_HEADS // 2  # each rank attends with half the heads
    assert tree["outputs"] == base["outputs"]
    assert ts["accepted"] > ts["rounds"] > 0, ts
    assert r0["plans"] and r0["plans"] == r1["plans"], _divergence(tree)
    assert r0["refresh"] and r0["refresh"] == r1["refresh"], _divergence(tree)
    assert r0["caches"] and r0["caches"] == r1["caches"], _divergence(tree)
    assert r0["tree_stats"] == r1["tree_stats"]
