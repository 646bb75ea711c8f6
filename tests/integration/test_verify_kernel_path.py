"""The serving path's verification through the Triton kernel (`VLLM_TREE_SPEC_VERIFY=triton`, the default on CUDA).

No GPU here: the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors.

* Served-like batches (mixed modes, greedy rows read from an argmax with zero p rows, stop-id lists and
  token budgets that cut, seeded and unseeded requests, lazy coins): `verify_batch_triton` equals
  `verify_batch(sync_free=True)` bit for bit, `walked` included, and after `rewind` every stream (seeded
  generators and the default RNG) stands where the torch walk leaves it; seeded requests also equal the
  CPU (compacting) walk. Negative controls: coins read one depth off, or child tests one rank off, fail.
* A faked tree step through the runner (tests/integration/step_harness.py): kernel and torch verifier
  give the same tokens, KV caches and streams; the kernel step keeps one device-to-host sync.
* The served engine on a tiny model with the kernel forced: greedy identical to no speculation; seeded
  requests give the torch verifier's tokens; the exact law of the sampled mode (both in the extended set).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the kernel path needs Triton (its interpreter on CPU)")

from vllm_tree_spec.integration import tree_sampler  # noqa: E402
from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402
from vllm_tree_spec.verify import Mode, VerifyCoins, verify_batch  # noqa: E402

load_kernels_package()
from vllm_tree_spec.kernels.tree_verify_launch import verify_batch_triton  # noqa: E402

ENV = tree_sampler.VERIFY_ENV
MODES = list(Mode)


# ---------------------------------------------------------------------------
# Served-like batches


def _tree(rng: random.Random, vocab: int, n: int) -> Tree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    tree = Tree(torch.tensor(parents[:n], dtype=torch.long))
    tokens = [0] * n
    for ch in tree.children:  # distinct siblings: every mode's drafts are legal
        for i, x in zip(ch, rng.sample(range(vocab), len(ch))):
            tokens[i] = x
    return Tree(tree.parents, torch.tensor(tokens, dtype=torch.long))


def served_case(seed: int, vocab: int = 37, seeded_only: bool = False):
    """What verify_rows hands the verifier: p rows only for non-greedy requests (zeros elsewhere), the argmax
    for greedy ones, q only for the sampled modes, [B, S] stop ids (-1 padded) and budgets, and the seeds of
    the requests' generators (None: the default RNG)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B = rng.randint(1, 7)
    modes = [rng.choice(MODES) for _ in range(B)]
    trees = [_tree(rng, vocab, rng.randint(1, 12)) for _ in range(B)]
    batch = TreeBatch.from_trees(trees)
    R = int(batch.cu_num_rows[-1])
    logits = torch.randn(R, vocab, generator=g) * 2
    for b, t in enumerate(trees):  # favour a drafted child at most rows: deeper walks, more cuts
        for r, ch in enumerate(t.children):
            if ch and rng.random() < 0.8:
                logits[int(batch.cu_num_rows[b]) + r, int(t.tokens[rng.choice(ch)])] += 8
    p = torch.softmax(logits, -1)
    q = torch.zeros_like(p)
    for b, m in enumerate(modes):
        rows = slice(int(batch.cu_num_rows[b]), int(batch.cu_num_rows[b + 1]))
        if m == Mode.GREEDY:
            p[rows] = 0  # never read: greedy rows come from the argmax
        if m.needs_draft_probs:
            mix = torch.softmax(torch.randn(rows.stop - rows.start, vocab, generator=g) * 2, -1)
            q[rows] = 0.5 * mix + 0.5 * p[rows] + 1e-3
            q[rows] /= q[rows].sum(-1, keepdim=True)
    argmax = torch.softmax(logits, -1).argmax(-1)
    S = rng.randint(1, 3)
    eos = torch.full((B, S), -1, dtype=torch.long)
    for b, t in enumerate(trees):
        for s in range(S):
            if rng.random() < 0.4:  # a drafted token (cuts an accepted path) or any token
                eos[b, s] = int(t.tokens[rng.randrange(t.num_nodes)]) if rng.random() < 0.6 else rng.randrange(vocab)
    budget = torch.tensor([rng.choice([1, 2, 3, 1 << 30]) for _ in range(B)])
    seeds = [(1000 * seed + b if seeded_only or rng.random() < 0.5 else None) for b in range(B)]
    return batch, p, q, [int(m) for m in modes], argmax, eos, budget, seeds


def _coins(case, generators):
    batch, p, q, modes, *_ = case
    return VerifyCoins.draw(batch.batch_size, batch.max_depth, batch.max_children, p.shape[1],
                            generators=generators, lazy=True, track_streams=True,
                            needs_uniform=[Mode(m).needs_draft_probs for m in modes])


def run_verifier(verify, case, default_seed: int, **kw):
    """One served verification with fresh lazy coins (the default RNG seeded), then the rewind verify_rows
    does. Returns the outputs and where every stream stands afterwards."""
    batch, p, q, modes, argmax, eos, budget, seeds = case
    torch.manual_seed(default_seed)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    coins = _coins(case, gens)
    out = verify(batch, p, q, torch.tensor(modes), coins, eos_token_id=eos, max_tokens=budget, target_argmax=argmax,
                 **kw)
    coins.rewind([int(w) + 1 if m == Mode.DETERMINISTIC else 1 << 30 for w, m in zip(out.walked.tolist(), modes)])
    streams = [torch.rand(4, generator=g) if g is not None else None for g in gens] + [torch.rand(4)]
    return out, streams


def same_outputs(a, b) -> bool:
    names = ("output_token_ids", "num_accepted", "accepted_nodes", "next_token", "walked")
    return all(torch.equal(getattr(a, n).cpu(), getattr(b, n).cpu()) for n in names)


def same_streams(a, b) -> bool:
    return all((x is None) == (y is None) and (x is None or torch.equal(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", range(6))
def test_kernel_equals_sync_free_torch_walk_on_served_batches(seed):
    for trial in range(5):
        case = served_case(100 * seed + trial)
        ref, ref_streams = run_verifier(verify_batch, case, trial, sync_free=True)
        out, streams = run_verifier(verify_batch_triton, case, trial, sync_free=True)
        assert same_outputs(out, ref), (seed, trial, out, ref)
        assert same_streams(streams, ref_streams), (seed, trial)
        assert out.walked.dtype == torch.int64 and bool((out.walked >= out.num_accepted).all())


def test_seeded_requests_equal_the_cpu_walk():
    """Seeded streams are per request: the kernel (rows drawn at every depth, rewound) gives the tokens of the
    CPU walk (rows drawn only where it goes) and leaves every seeded stream where that walk does."""
    for seed in range(12):
        case = served_case(7000 + seed, seeded_only=True)
        ref, ref_streams = run_verifier(verify_batch, case, seed)
        out, streams = run_verifier(verify_batch_triton, case, seed)
        assert same_outputs(out, ref), (seed, out, ref)
        assert same_streams(streams[:-1], ref_streams[:-1]), seed


def test_the_comparison_detects_coins_read_off_by_one(monkeypatch):
    """Negative controls: the kernel reading the exponential row of the next depth, or the child test of the
    next sibling rank, is caught by the comparison above."""
    real = VerifyCoins.materialise

    def next_depth(self, det, smp, max_depth):
        rows, index = real(self, det, smp, max_depth)
        return rows, torch.cat([index[:, 1:], index[:, -1:]], 1)

    def caught() -> bool:
        for seed in range(30):
            case = served_case(500 + seed)
            ref, _ = run_verifier(verify_batch, case, seed, sync_free=True)
            out, _ = run_verifier(verify_batch_triton, case, seed, sync_free=True)
            if not same_outputs(out, ref):
                return True
        return False

    monkeypatch.setattr(VerifyCoins, "materialise", next_depth)
    assert caught(), "exponential rows read one depth off went unnoticed"
    monkeypatch.undo()

    import vllm_tree_spec.kernels.tree_verify_launch as launch

    def shifted_kernel(batch, p, q, modes, coins, **kw):
        if coins is not None:
            coins.uniform = torch.roll(coins.uniform, -1, dims=2).contiguous()
        return launch.verify_batch_triton(batch, p, q, modes, coins, **kw)

    found = False
    for seed in range(30):
        case = served_case(900 + seed)
        ref, _ = run_verifier(verify_batch, case, seed, sync_free=True)
        out, _ = run_verifier(shifted_kernel, case, seed, sync_free=True)
        found |= not same_outputs(out, ref)
    assert found, "child tests read one sibling rank off went unnoticed"


# ---------------------------------------------------------------------------
# The verifier choice


def test_verifier_choice(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert tree_sampler.verifier("cpu") is verify_batch  # default off CUDA
    assert tree_sampler.verifier(torch.device("cuda")) is verify_batch_triton  # default on CUDA
    monkeypatch.setenv(ENV, "torch")
    assert tree_sampler.verifier(torch.device("cuda")) is verify_batch
    monkeypatch.setenv(ENV, " Triton ")
    assert tree_sampler.verifier("cpu") is verify_batch_triton  # forced: TRITON_INTERPRET=1 here
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match=f"{ENV}='cuda': choose one of triton, torch"):
        tree_sampler.verifier("cpu")
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        tree_sampler.verifier("cpu")
    # Without Triton: forcing the kernel is an error with the fix; the CUDA default falls back, logged
    monkeypatch.setattr(tree_sampler, "_triton_verifier", lambda: "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(RuntimeError, match=f"install triton or set {ENV}=torch"):
        tree_sampler.verifier(torch.device("cuda"))
    monkeypatch.delenv(ENV)
    assert tree_sampler.verifier(torch.device("cuda")) is verify_batch


# ---------------------------------------------------------------------------
# A faked step through the runner


def _step(monkeypatch, kernel: bool, sync_free: bool, seeded: bool, counter=None):
    import step_harness
    from step_harness import make_step, mark_case, run_step

    from vllm_tree_spec import verify
    from vllm_tree_spec.verify import batch as verify_batch_module

    torch.manual_seed(5)
    case = make_step(6, 8, modes=("greedy", "deterministic", "sampled", "deterministic",
                                  "sampled_without_replacement"), seeded=seeded, seed=3, vocab=96)
    monkeypatch.setenv(ENV, "triton" if kernel else "torch")
    from vllm_tree_spec.kernels import tree_verify_launch

    launches = []
    real_launch = tree_verify_launch.tree_verify_triton
    monkeypatch.setattr(tree_verify_launch, "tree_verify_triton",
                        lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    monkeypatch.setattr(tree_sampler, "sync_free", lambda device: sync_free)
    monkeypatch.setattr(verify, "sync_free", lambda device: sync_free)
    if counter is not None:
        import vllm_tree_spec.kernels.tree_verify as kmod

        real_kernel = kmod.tree_verify_kernel

        class Launch:  # the launch is one device op: the interpreter's own tensor reads are not the step's
            def __getitem__(self, grid):
                def run(*args, **kw):
                    with torch._C.DisableTorchFunction():
                        real_kernel[grid](*args, **kw)
                    step_harness.mark(list(args))
                return run

        monkeypatch.setattr(kmod, "tree_verify_kernel", Launch())
        for mod in (verify, verify_batch_module, tree_sampler, tree_verify_launch):
            monkeypatch.setattr(mod, "upload", counter.counting_upload(mod.upload))
        monkeypatch.setattr(tree_sampler, "_upload_floats", counter.counting_upload_floats(tree_sampler._upload_floats))
        mark_case(case)
        with counter:
            out = run_step(case)
    else:
        out = run_step(case)
    streams = [torch.rand(3, generator=st.generator) if st.generator is not None else None
               for st in case.runner.requests.values()] + [torch.rand(3)]
    monkeypatch.undo()
    assert len(launches) == int(kernel), launches  # the verifier asked for ran, once
    return out.sampled_token_ids, case.kv.clone(), streams


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_kernel_step_equals_torch_step(monkeypatch, seeded):
    """The GPU path's step (sync-free) with either verifier: same tokens, KV caches and streams, the default
    RNG included (both draw the same rows by the same calls)."""
    ref = _step(monkeypatch, kernel=False, sync_free=True, seeded=seeded)
    out = _step(monkeypatch, kernel=True, sync_free=True, seeded=seeded)
    assert torch.equal(out[0], ref[0])
    assert torch.equal(out[1], ref[1])
    assert same_streams(out[2], ref[2])


def test_kernel_step_has_one_device_to_host_sync(monkeypatch):
    from step_harness import SyncCounter

    counter = SyncCounter()
    _step(monkeypatch, kernel=True, sync_free=True, seeded=True, counter=counter)
    where = "\n".join(f"{k}:\n{counter.where[k]}" for k in list(counter.d2h) + list(counter.mixed))
    assert sum(counter.d2h.values()) == 1 and counter.d2h["cpu"] == 1, (dict(counter.d2h), where)
    assert not counter.mixed, (dict(counter.mixed), where)


# ---------------------------------------------------------------------------
# The served engine with the kernel forced (tiny model, small vocabulary)

ENGINE_VOCAB = 512
NGRAM = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4,
         "budgets": {64: 6}}
SUFFIX = {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6", "budgets": {64: 5}}


@pytest.fixture(scope="module")
def engine_setup(tiny_models):
    from engine_utils import repetitive_prompts
    from vllm.inputs import TokensPrompt

    # peaked weights: sampled drafts get accepted
    model = str(tiny_models.llama(vocab_size=ENGINE_VOCAB, num_layers=2, seed=0, initializer_range=0.25))
    raw = repetitive_prompts(8, ENGINE_VOCAB, seed=1)
    return model, raw, [TokensPrompt(prompt_token_ids=p) for p in raw]


@pytest.mark.vllm
def test_engine_kernel_path_greedy_identical_to_no_speculation(engine_setup, monkeypatch):
    from engine_utils import compare_greedy, run_engine
    from vllm import SamplingParams

    model, raw, prompts = engine_setup
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = run_engine(model, prompts, greedy)
    monkeypatch.setenv(ENV, "triton")
    spy = _spy_verifier(monkeypatch)
    run = run_engine(model, prompts, greedy, NGRAM)
    assert spy and all(v is verify_batch_triton for v in spy), "the kernel did not verify"
    compare_greedy(base.outputs, run.outputs, raw, None)  # identical, no excuse
    assert run.tree_stats["accepted"] > 0, run.tree_stats


def _spy_verifier(monkeypatch) -> list:
    spy, real = [], tree_sampler.verifier
    monkeypatch.setattr(tree_sampler, "verifier", lambda device: spy.append(real(device)) or spy[-1])
    return spy


@pytest.mark.vllm
@pytest.mark.extended  # beyond CI's representative set (docs/testing.md)
def test_engine_kernel_path_seeded_requests_equal_torch(law_setup, monkeypatch):
    """Seeded sampled requests (deterministic mode: suffix trees; sampled mode: the target as its own draft
    model) on test_engine_sampling's peaked 48-token model: the kernel gives the torch verifier's tokens."""
    from engine_utils import run_engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path, _, prompt = law_setup
    params = [SamplingParams(temperature=0.8, top_k=8, max_tokens=8, seed=100 + i, ignore_eos=True, detokenize=False)
              for i in range(24)]
    prompts = [TokensPrompt(prompt_token_ids=prompt)] * len(params)
    spy = _spy_verifier(monkeypatch)
    for spec in (LAW_MODES["deterministic"][0], {**LAW_MODES["sampled"][0], "model": path}):
        outs = {}
        for verifier_name in ("torch", "triton"):
            monkeypatch.setenv(ENV, verifier_name)
            spy.clear()
            r = run_engine(path, prompts, params, spec, max_num_seqs=8)
            assert spy and all((v is verify_batch_triton) == (verifier_name == "triton") for v in spy)
            assert r.tree_stats["accepted"] > 0, (spec["drafter"], r.tree_stats)
            outs[verifier_name] = r.outputs
        assert outs["triton"] == outs["torch"], spec["drafter"]


# The exact law of the sampled mode through the kernel: test_engine_sampling's engine, sets and check.
from test_engine_sampling import COMBINED, MODES as LAW_MODES, check_sets, law_cache, sample  # noqa: E402,F401
from test_engine_sampling import setup as law_setup  # noqa: E402,F401


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.extended  # beyond CI's representative set (docs/testing.md)
def test_engine_kernel_path_sampling_law_is_exact(law_setup, law_cache, monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    path, model, prompt = law_setup
    spec = {**LAW_MODES["sampled"][0], "model": path}
    run, counts = sample(path, prompt, spec, COMBINED)
    assert run.tree_stats["accepted"] > 0, run.tree_stats
    failures = check_sets(law_setup, "float32", law_cache, COMBINED, counts)
    assert not failures, "\n".join(failures)
