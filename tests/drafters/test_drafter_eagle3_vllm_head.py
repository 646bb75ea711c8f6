"""The EAGLE-3 tree drafter on vLLM's own head (Model Runner V2: `integration/v2/draft_head.py`).

vLLM's `Eagle3LlamaForCausalLM`, loaded by vLLM's EAGLE loader (`load_eagle_model`) for a tiny target vLLM
also loads, drafts trees with the plugin's tree mask in place of vLLM's attention. In child processes (vLLM's
distributed state), with the tiny target and head of test_drafter_eagle3.py:

* the path invariant: q at every expanded row (static, dynamic, sampled trees) equals vLLM's class run
  sequentially, causal, along the row's path;
* the same trees as the plugin's PyTorch head (V1's), q rows equal within float rounding;
* tensor parallelism (2 ranks over gloo): each rank holds half the head's query and KV heads and shares the
  target's sharded embedding; both ranks draft the same trees with bit-identical q rows, equal to one rank's
  within float rounding.

A planted control: the tree mask replaced by a causal mask over the level's columns breaks the invariant.
A head vLLM's own eagle3 loader refuses (a d2t over the full vocabulary) fails at load with the field, vLLM's
reason and the fix (the V1 runner's PyTorch head loads it).
The two-rank case is in the extended set (~45 s).
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="runs vLLM's EAGLE-3 model class")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_drafter_eagle3 import POLICIES, VOCAB, aux_states, setup, start  # noqa: E402,F401  (setup: fixture)

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter  # noqa: E402
from vllm_tree_spec.drafters.eagle3_head import load_head  # noqa: E402
from vllm_tree_spec.drafters.policy import StaticPolicy  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402

SHAPE = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
CONTEXTS = (5, 12, 9)  # tokens of the three requests drafted together


def draft_scenario(head, target) -> dict:
    """Three requests drafted together twice (the second step after 2 more committed tokens each): the trees'
    tokens and q rows."""
    drafter = Eagle3TreeDrafter(head, StaticPolicy.of(SHAPE), return_draft_probs=True, seed=5)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(7, VOCAB, (n,), generator=g).tolist() for n in CONTEXTS]
    for i, toks in enumerate(contexts):
        start(drafter, target, f"r{i}", toks)
    out = {"tokens": [], "q": []}
    for step in range(2):
        props = drafter.propose([DraftRequest(f"r{i}", toks, 0.0) for i, toks in enumerate(contexts)], 8)
        out["tokens"] += [p.tree.tokens.tolist() for p in props]
        out["q"] += [p.draft_probs for p in props]
        if step == 0:
            for i, toks in enumerate(contexts):
                n = len(toks)
                toks += torch.randint(7, VOCAB, (2,), generator=g).tolist()
                drafter.observe_target([f"r{i}"], [[n - 1, n]], torch.arange(len(toks)), aux_states(target, toks))
    return out


CHILD = textwrap.dedent("""
    import json, sys, types, torch
    sys.path.insert(0, {here!r})
    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker's shims: torch.accelerator calls on CPU)
    from test_drafter_eagle3 import POLICIES, aux_states, check_path_invariant, reference_logits
    from test_drafter_eagle3_vllm_head import draft_scenario
    from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter
    from vllm_tree_spec.integration.v2.draft_head import load_vllm_eagle_head

    tp, rank, control = {tp}, int(sys.argv[1]), {control}
    vc = EngineArgs(model={target!r}, dtype="float32", enforce_eager=True, max_model_len=512,
                    tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None
                    ).create_engine_config()
    hf_target = AutoModelForCausalLM.from_pretrained({target!r}, dtype=torch.float32).eval()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method="file://" + {init!r})
        initialize_model_parallel(tp, 1)
        target = get_model(vllm_config=vc)
        vc.speculative_config = types.SimpleNamespace(num_speculative_tokens=4)  # what the loader reads of it
        head = load_vllm_eagle_head(vc, target, "eagle3", {head!r})
        report = {{"heads": head.cfg.heads, "kv_heads": head.cfg.kv_heads,
                  "embedding_shared": head.model.model.embed_tokens is target.model.embed_tokens,
                  "checked": {{}}, "failed": {{}}}}
        for name in [{policies}]:
            policy, temp, q_temp, floor = POLICIES[name]
            drafter = Eagle3TreeDrafter(head, policy, return_draft_probs=True, seed=5)
            try:
                report["checked"][name] = check_path_invariant(drafter, head, hf_target, aux_states,
                                                               reference_logits, temp, q_temp, floor)
            except AssertionError as e:
                report["failed"][name] = str(e)[:300]
        torch.save(draft_scenario(head, hf_target), {out!r} + f".{{rank}}.pt")
        if control:  # planted after the real checks: every tree row sees all earlier columns (no ancestor mask)
            from vllm_tree_spec.drafters import eagle3_head
            import vllm_tree_spec.integration.v2.draft_head as dh
            attend = eagle3_head.attend
            def causal(q, k, v, mask, cache, cols, scale=None):
                if cache is not None:
                    mask = torch.arange(mask.shape[-1]) <= cols[..., None]
                return attend(q, k, v, mask, cache, cols, scale)
            dh.attend = causal
            policy, temp, q_temp, floor = POLICIES["static"]
            drafter = Eagle3TreeDrafter(head, policy, return_draft_probs=True, seed=5)
            try:
                check_path_invariant(drafter, head, hf_target, aux_states, reference_logits, temp, q_temp, floor)
                report["control"] = "passed"
            except AssertionError:
                report["control"] = "failed"
        if {refused!r}:  # a head vLLM's own eagle3 loader refuses: start-up names the field and the fix
            for name in head.layer_names:  # the first head's layers leave the forward context (same layer names)
                vc.compilation_config.static_forward_context.pop(name)
            try:
                load_vllm_eagle_head(vc, target, "eagle3",
                                     {refused!r})
                report["refused"] = None
            except ValueError as e:
                report["refused"] = str(e)
    print("REPORT", json.dumps(report))
""")


def run_vllm_head(setup, tmp: Path, tp: int, control: bool = False, policies=tuple(POLICIES), refused: str = ""):
    """Run the child on every rank; returns (reports, scenarios) per rank. control: afterwards, the planted
    causal-levels check (its outcome in the report); refused: a head directory to load last, whose refusal
    message the report holds."""
    target_dir, _, heads = setup
    tmp.mkdir(parents=True, exist_ok=True)
    out = str(tmp / "scenario")
    init = tempfile.mktemp(dir=tmp)
    script = CHILD.format(here=str(HERE), tp=tp, control=control, target=str(target_dir), head=str(heads["eagle"]),
                          init=init, out=out, policies=", ".join(repr(p) for p in policies), refused=refused)
    # VLLM_DIST_IDENT: the group name vLLM's shared-memory CPU communicator (AVX-512 builds) reads; vLLM's CPU
    # worker sets it from the init method as here
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "VLLM_DIST_IDENT": os.path.basename(init)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(tp)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("REPORT ")]
        assert p.returncode == 0 and lines, stdout[-2000:] + stderr[-4000:]
        reports.append(json.loads(lines[-1][7:]))
    return reports, [torch.load(f"{out}.{r}.pt") for r in range(tp)]


def assert_same_drafts(got: dict, want: dict, exact: bool) -> None:
    assert got["tokens"] == want["tokens"]
    for a, b in zip(got["q"], want["q"]):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_vllm_head_drafts_the_path_invariant_trees(setup, tmp_path):
    """vLLM's class drafts trees whose every expanded row's q equals vLLM's class run sequentially along the
    row's path (all policies), and the same trees as the plugin's PyTorch head, q within float rounding.
    Control (same child, afterwards): tree rows that attend to every earlier column (a causal mask over the
    level's columns) no longer equal the sequential decode of their paths."""
    from tiny_eagle3 import make_tiny_eagle3

    target_dir, target, heads = setup
    # a d2t over the full vocabulary: vLLM's Eagle3LlamaForCausalLM has no d2t parameter then, and its loader fails
    full = make_tiny_eagle3(tmp_path / "full-vocab-head", target_dir, draft_vocab=VOCAB)
    (report,), (got,) = run_vllm_head(setup, tmp_path, tp=1, control=True, refused=str(full))
    assert not report["failed"], report["failed"]
    msg = report["refused"] or ""
    assert "speculative_config.model" in msg and "VLLM_USE_V2_MODEL_RUNNER=0" in msg, msg
    assert "draft_id_to_target_id" in msg or "d2t" in msg, msg  # vLLM's own reason, not a side effect
    assert all(report["checked"][name] >= 6 for name in POLICIES), report["checked"]
    assert report["embedding_shared"], "the head shares the target's embedding module (vLLM's loader)"
    assert report["control"] == "failed", "a causal mask over the tree levels went unnoticed"
    plugin = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    assert_same_drafts(got, draft_scenario(plugin, target), exact=False)


@pytest.mark.extended
def test_vllm_head_sharded_over_two_ranks(setup, tmp_path):
    """TP = 2 (gloo): each rank holds 2 of the 4 query heads and 1 of the 2 KV heads and shares the target's
    sharded embedding; each rank's trees satisfy the path invariant, both ranks draft the same trees with
    bit-identical q rows, equal to one rank's within float rounding."""
    reports, scen = run_vllm_head(setup, tmp_path, tp=2, policies=("static", "sampled"))
    for r in reports:
        assert not r["failed"] and r["heads"] == 2 and r["kv_heads"] == 1 and r["embedding_shared"], r
    assert_same_drafts(scen[1], scen[0], exact=True)
    (_,), (one,) = run_vllm_head(setup, tmp_path / "tp1", tp=1, policies=())
    assert_same_drafts(scen[0], one, exact=False)
