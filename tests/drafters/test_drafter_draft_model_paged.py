"""The draft-model tree drafter of Model Runner V2: vLLM's model of the draft checkpoint, its KV in the runner's
pages (`drafters/draft_model_paged.py`, `integration/v2/draft_head.py`, `integration/v2/draft_kv.py`).

In a child process (vLLM's distributed state): vLLM's model of a tiny Llama draft, loaded by the plugin's V2
loader, drafts three requests over three steps from pages in the GPU backends' layout with scattered block
ids. Each request's blocks cover its committed tokens but the root's (the strictest allocation a runner can
have at drafting time: the root's slot comes with the target's next step), prompts fed in 7-entry chunks, and
in the last step two tree sessions (a smaller budget for one request) share the step's feed batch. The
trees must be those of the transformers draft-model drafter (V1's) on the same checkpoint, q within float
rounding, at every step.

Control (same child): writing the root's entry at once (`persist_last`) writes past the request's blocks, into
another entry's slot, and the drafts of the following steps move.
"""

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="runs vLLM's model of the draft checkpoint")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))
from tiny_models import tiny_models  # noqa: E402,F401  (registers the fixture)

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.policy import StaticPolicy  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402

VOCAB = 2048
BLOCK = 16
SHAPE = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
LENGTHS = {"a": 17, "b": 33, "c": 9}  # committed tokens at the first step: a's and b's roots open a new block


def scenario(drafter, grow=None) -> dict:
    """Three requests drafted together over three steps, 1..3 tokens committed between steps (the first
    branch's tokens, then random ones): each step's trees and q rows."""
    g = torch.Generator().manual_seed(3)
    reqs = {rid: torch.randint(7, VOCAB, (n,), generator=g).tolist() for rid, n in LENGTHS.items()}
    out = {"tokens": [], "q": []}
    for step in range(3):
        for rid, toks in reqs.items():
            if not drafter.is_active(rid):
                drafter.start_request(rid, toks[:-1])
            if grow is not None:
                grow(rid, len(toks) - 1)  # every committed token's slot but the root's
        # the last step gives b a smaller budget: two tree sessions, each on part of the step's feed batch
        budgets = [SHAPE.num_nodes, 3 if step == 2 else SHAPE.num_nodes, SHAPE.num_nodes]
        props = drafter.propose([DraftRequest(rid, toks, 0.0) for rid, toks in reqs.items()], budgets)
        out["tokens"] += [p.tree.tokens.tolist() for p in props]
        out["q"] += [p.draft_probs for p in props]
        reqs = {rid: toks + torch.randint(7, VOCAB, (1 + step,), generator=g).tolist() for rid, toks in reqs.items()}
    return out


CHILD = textwrap.dedent("""
    import json, random, sys, types, torch
    sys.path.insert(0, {here!r})
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker's shims: torch.accelerator calls on CPU)
    from test_drafter_draft_model_paged import BLOCK, SHAPE, scenario
    from vllm_tree_spec.drafters.draft_model_paged import RunnerDraftModelTreeDrafter
    from vllm_tree_spec.drafters.policy import StaticPolicy
    from vllm_tree_spec.integration.v2.draft_head import load_vllm_draft_model
    from vllm_tree_spec.integration.v2.draft_kv import PagedHeadKV

    vc = EngineArgs(model={model!r}, dtype="float32", enforce_eager=True, max_model_len=512).create_engine_config()
    vc.speculative_config = types.SimpleNamespace(num_speculative_tokens=6)  # what the loader reads of it
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + {init!r})
        initialize_model_parallel(1, 1)
        net = load_vllm_draft_model(vc, {model!r})
    rows = []  # what each forward reports to the speculator's EPLB hook
    net.before_forward = rows.append

    def run(persist_last):
        cfg = net.cfg
        shape = (64, cfg.kv_heads, BLOCK, 2 * cfg.head_dim)  # the GPU backends' layout; random: stale content
        ctx = {{name: types.SimpleNamespace(kv_cache=torch.randn(shape, generator=torch.Generator().manual_seed(i)),
                                           impl=types.SimpleNamespace(tree_kv_layout="paged"))
               for i, name in enumerate(net.layer_names)}}
        free = list(range(1, 64))
        random.Random(0).shuffle(free)
        blocks = {{}}
        def grow(rid, num_tokens):
            ids = blocks.setdefault(rid, [])
            while len(ids) * BLOCK < num_tokens:
                ids.append(free.pop())
        store = PagedHeadKV(net.layer_names, cfg.kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"),
                            lambda rid: blocks.get(rid, []))
        store.attach(ctx, BLOCK)
        drafter = RunnerDraftModelTreeDrafter(None, StaticPolicy.of(SHAPE), path={model!r}, return_draft_probs=True)
        drafter.persist_last = persist_last
        drafter.feed_chunk = 7 if not persist_last else None  # prompts fed in 7-entry chunks (the control: whole)
        drafter.set_head(net)
        drafter.use_runner_kv(store)
        with torch.no_grad():
            return scenario(drafter, grow)

    torch.save(run(False), {out!r} + ".pt")
    torch.save(run(True), {out!r} + ".control.pt")
    print("REPORT", json.dumps({{"layers": net.layer_names, "kv_heads": net.cfg.kv_heads, "rows": rows,
                                "model_config": net.model_config.model}}))
""")


def test_vllm_draft_model_on_pages_drafts_the_transformers_trees(tiny_models, tmp_path):
    from vllm_tree_spec.drafters.draft_model import DraftModelTreeDrafter

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    out = str(tmp_path / "scenario")
    script = CHILD.format(here=str(HERE), model=model, init=tempfile.mktemp(dir=tmp_path), out=out)
    res = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT ")]
    assert res.returncode == 0 and lines, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads(lines[-1][7:])
    assert report["layers"] == [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2)], report
    # every forward reported its rows (the EPLB hook), under the draft checkpoint's own model config
    assert report["rows"] and min(report["rows"]) > 0 and report["model_config"] == model, report
    got, control = torch.load(out + ".pt"), torch.load(out + ".control.pt")
    want = scenario(DraftModelTreeDrafter.from_pretrained(model, StaticPolicy.of(SHAPE), return_draft_probs=True))
    assert got["tokens"] == want["tokens"]
    for a, b in zip(got["q"], want["q"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    first = len(LENGTHS)  # the first step's drafts come before any root is written: the same either way
    moved = [i for i in range(first, len(want["q"]))
             if control["tokens"][i] != want["tokens"][i] or (control["q"][i] - want["q"][i]).abs().max() > 1e-3]
    assert moved, "writing the root's entry past its blocks went unnoticed"
