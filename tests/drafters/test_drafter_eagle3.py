"""The EAGLE-3 tree drafter on its own: the checkpoint vLLM loads, the path invariant, committed-KV catch-up.

Tiny random target (tests/fixtures/tiny_models.py) and a tiny random head in vLLM's EAGLE-3 layouts
(tests/fixtures/tiny_eagle3.py). The target's auxiliary hidden states are computed here with
transformers (aux layer k = the input of decoder layer k, k = num_layers: the last layer's output
before the final norm, as in vLLM's `_maybe_add_hidden_state`).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the EAGLE-3 head reads its config with vLLM's parser and uses vLLM's RoPE")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_eagle3 import make_tiny_eagle3  # noqa: E402

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.eagle3 import WITHOUT_REPLACEMENT_FLOOR, Eagle3TreeDrafter  # noqa: E402
from vllm_tree_spec.drafters.eagle3_head import load_head  # noqa: E402
from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy  # noqa: E402
from vllm_tree_spec.tree import Tree, TreeShape  # noqa: E402
from vllm_tree_spec.verify import Mode  # noqa: E402

VOCAB = 2048
AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    target_dir = tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    heads = {layout: make_tiny_eagle3(tiny_models.root / f"eagle3-{layout}", target_dir, layout=layout,
                                      aux_layer_ids=AUX)
             for layout in ("eagle", "speculators")}
    return target_dir, target, heads


def aux_states(target, tokens: list[int]) -> torch.Tensor:
    """[n, 3 * H] the target's aux hidden states at every position (vLLM's layer semantics)."""
    taps = {}
    hooks = [target.model.layers[k].register_forward_pre_hook(lambda m, a, k=k: taps.__setitem__(k, a[0]))
             for k in AUX if k < len(target.model.layers)]
    last = target.model.layers[-1].register_forward_hook(lambda m, a, out: taps.__setitem__(
        len(target.model.layers), out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            target(torch.tensor([tokens]))
    finally:
        for h in hooks + [last]:
            h.remove()
    return torch.cat([taps[k][0] for k in AUX], dim=-1)


def reference_logits(head, tokens: list[int], aux: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor:
    """Draft logits [V_draft] after `path`, running the head sequentially with no cache (full recompute)."""
    n = len(tokens)
    ids = list(tokens[1:])  # entry t = (x_{t+1}, g_t)
    with torch.no_grad():
        feats = [head.combine(aux[t]) for t in range(n - 1)]
        for y in (None,) + path:
            if y is not None:
                ids.append(y)
                feats.append(g_last)
            m = len(ids)
            mask = torch.tril(torch.ones(m, m, dtype=torch.bool))[None]
            logits, g = head(torch.tensor([ids]), torch.stack(feats)[None], torch.arange(m)[None], mask)
            g_last = g[0, -1]
    return logits[0, -1]


def node_path(tree, i: int) -> tuple[int, ...]:
    path = []
    while i >= 0:
        path.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return tuple(reversed(path))


def start(drafter, target, rid, tokens, feats_fn=None):
    drafter.start_request(rid, tokens[:-1] or tokens)
    aux = (feats_fn or aux_states)(target, tokens)
    drafter.observe_target([rid], [list(range(len(tokens) - 1))], torch.arange(len(tokens)), aux)
    return aux


def chain_drafter(setup, seed: int, n: int):
    """(target, head, drafter, generator, tokens): a 3-chain drafter on the speculators head, request "a"
    started on n random tokens."""
    _, target, heads = setup
    head = load_head(heads["speculators"])
    drafter = Eagle3TreeDrafter(head, StaticPolicy.of(Tree.chain(3)), return_draft_probs=True)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(7, VOCAB, (n,), generator=g).tolist()
    start(drafter, target, "a", toks)
    return target, head, drafter, g, toks


# ~16 s each (a subprocess): extended. The default representative is test_drafter_eagle3_vllm_head.py, where
# vLLM's class (the head V2 serves with) drafts the trees and q of this head.
@pytest.mark.extended
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_logits_equal_vllm_eagle3_class(setup, layout):
    """Our head == vLLM's Eagle3LlamaForCausalLM on the same checkpoint (vLLM's loader, name mapping, d2t);
    vLLM's paged attention is replaced by causal SDPA (the only part a standalone run cannot build).
    In a subprocess: it initialises vLLM's distributed state, which in-process engines own."""
    target_dir, _, heads = setup
    script = textwrap.dedent(f"""
        import tempfile, torch
        from transformers import AutoModelForCausalLM
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
        from safetensors.torch import load_file
        from vllm_tree_spec.drafters.eagle3_head import load_head

        head_dir = {str(heads[layout])!r}
        vc = EngineArgs(model={str(target_dir)!r}, dtype="float32", enforce_eager=True, max_model_len=512,
                        speculative_config={{"method": "eagle3", "model": head_dir,
                                            "num_speculative_tokens": 2}}).create_engine_config()

        class Causal(torch.nn.Module):
            def __init__(self, h, kvh, d):
                super().__init__(); self.h, self.kvh, self.d = h, kvh, d
            def forward(self, q, k, v, *a, **kw):
                t = q.shape[0]
                q, k, v = (x.view(t, n, self.d).transpose(0, 1)[None] for x, n in ((q, self.h), (k, self.kvh), (v, self.kvh)))
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return o[0].transpose(0, 1).reshape(t, -1)

        target = AutoModelForCausalLM.from_pretrained({str(target_dir)!r}, dtype=torch.float32)
        emb = target.model.embed_tokens.weight.detach()
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="file://" + tempfile.mktemp())
            initialize_model_parallel(1, 1)
            ref = Eagle3LlamaForCausalLM(vllm_config=vc)
            ref.load_weights(load_file(head_dir + "/model.safetensors").items())
            process_weights_after_loading(ref, vc.model_config, torch.device("cpu"))
            if {layout!r} == "eagle":  # no embed_tokens in the head: vLLM shares the target's
                ref.model.embed_tokens.weight.data.copy_(emb)
            cfg = ref.config
            ref.model.layers[0].self_attn.attn = Causal(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            head = load_head(head_dir, target_embedding=emb)
            g = torch.Generator().manual_seed(0)
            T = 9
            ids = torch.randint(0, {VOCAB}, (T,), generator=g)
            aux = torch.randn(T, 3 * cfg.hidden_size, generator=g)
            with torch.no_grad():
                normed, pre = ref(ids, torch.arange(T), ref.combine_hidden_states(aux))
                want = ref.compute_logits(normed)
                mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
                ld, ours_pre = head(ids[None], head.combine(aux[None]), torch.arange(T)[None], mask)
                got = head.target_logits(ld)[0]
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got)), "draft vocabulary (d2t) differs"
            assert int(fin[0].sum()) == cfg.draft_vocab_size < {VOCAB}
            err = (want[fin] - got[fin]).abs().max().item()
            assert err < 1e-4, err
            assert (pre - ours_pre[0]).abs().max().item() < 1e-4
            print("OK", err)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def draft_q(head, draft_logits: torch.Tensor, temperature: float = 1.0, floor: float = 0.0) -> torch.Tensor:
    """q [V] on the target vocabulary: softmax over the draft vocabulary (a uniform share `floor` mixed in
    for draws without replacement), 0 outside it."""
    q = torch.softmax(draft_logits.float() / temperature, -1)
    q = (1 - floor) * q + floor / q.shape[-1] if floor else q
    return torch.zeros(head.cfg.vocab).index_copy_(0, head.target_ids, q)


SHAPE = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
POLICIES = {  # policy, request temperature, temperature and uniform floor of the q rows
    "static": (StaticPolicy.of(SHAPE), 0.0, 1.0, 0.0),
    "dynamic": (DynamicPolicy.of(TreeShape.parse("s3_k3_d9")), 0.0, 1.0, 0.0),
    "sampled": (SampledPolicy.of(SHAPE, replacement=True), 0.8, 0.8, 0.0),
    "sampled_without_replacement": (SampledPolicy.of(SHAPE, replacement=False), 0.8, 0.8,
                                    WITHOUT_REPLACEMENT_FLOOR),
}


def check_path_invariant(drafter, head, target, feats_fn, reference_fn, temp, q_temp, floor) -> int:
    """Three requests drafted together; q at every expanded row == the head run sequentially along the
    row's path. Returns the number of rows checked."""
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(7, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 9)]
    feats = [start(drafter, target, f"r{i}", toks, feats_fn) for i, toks in enumerate(contexts)]
    props = drafter.propose([DraftRequest(f"r{i}", toks, temp) for i, toks in enumerate(contexts)], 8)
    checked = 0
    for toks, aux, prop in zip(contexts, feats, props):
        tree = prop.tree
        assert tree.num_nodes >= 5
        paths = [()] + [node_path(tree, i) for i in range(tree.num_nodes)]
        for row, path in enumerate(paths):
            if not tree.children[row]:
                continue  # leaves are never expanded
            want = draft_q(head, reference_fn(head, toks, aux, path), q_temp, floor)
            torch.testing.assert_close(prop.draft_probs[row], want, atol=1e-5, rtol=1e-4)
            checked += 1
    return checked


@pytest.mark.parametrize("gemm", ["torch", "vllm"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_path_invariant(setup, name, gemm):
    """q at every expanded tree row equals the head run sequentially along that row's path (static,
    dynamic and sampled trees; the sampled rows are the q verification uses). "vllm": the head's
    linears on vLLM's CPU GEMM, as served (integration/cpu_gemm.py)."""
    _, target, heads = setup
    policy, temp, q_temp, floor = POLICIES[name]
    head = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    if gemm == "vllm":
        from vllm_tree_spec.integration.cpu_gemm import use_vllm_cpu_gemm

        assert use_vllm_cpu_gemm(head) == sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    drafter = Eagle3TreeDrafter(head, policy, return_draft_probs=True, seed=5)
    assert check_path_invariant(drafter, head, target, aux_states, reference_logits, temp, q_temp, floor) >= 6


def test_catch_up_after_accepts_and_rewind(setup):
    """Committed head KV after several steps (and after a rewind) gives the same root q as a fresh run."""
    target, head, drafter, g, toks = chain_drafter(setup, seed=2, n=10)
    for step, extra in enumerate([3, 1, 4]):
        drafter.propose([DraftRequest("a", toks, 0.0)], 3)
        n = len(toks)
        toks = toks + torch.randint(7, VOCAB, (extra,), generator=g).tolist()
        aux = aux_states(target, toks)
        rows = list(range(n - 1, len(toks) - 1))  # the root and the accepted rows of this step
        drafter.observe_target(["a"], [rows], torch.arange(len(toks)), aux)
    prop = drafter.propose([DraftRequest("a", toks, 0.0)], 3)[0]
    assert drafter.cached_tokens("a") == toks[1:]
    want = torch.softmax(head.target_logits(reference_logits(head, toks, aux, ())).float(), -1)
    torch.testing.assert_close(prop.draft_probs[0], want, atol=1e-5, rtol=1e-4)
    # rewind: the caller's context diverges 4 tokens back (its features were observed before)
    toks2 = toks[:-4] + [toks[-4] + 1 if toks[-4] + 1 < VOCAB else 7]
    aux2 = aux_states(target, toks2)
    drafter.observe_target(["a"], [[len(toks2) - 2]], torch.arange(len(toks2)), aux2)
    prop = drafter.propose([DraftRequest("a", toks2, 0.0)], 3)[0]
    assert drafter.cached_tokens("a") == toks2[1:]
    want = torch.softmax(head.target_logits(reference_logits(head, toks2, aux2, ())).float(), -1)
    torch.testing.assert_close(prop.draft_probs[0], want, atol=1e-5, rtol=1e-4)


def test_budget_zero_steps_defer_the_catch_up(setup):
    """Steps with budget 0 (the shape policy's `none`) run no head forward; the next drafting step catches
    the head up over the whole gap in one forward and gives the same root q as a fresh run."""
    target, head, drafter, g, toks = chain_drafter(setup, seed=3, n=9)
    drafter.propose([DraftRequest("a", toks, 0.0)], 3)
    cached = drafter.cached_tokens("a")
    assert cached == toks[1:]
    calls = []
    feed = drafter._feed
    drafter._feed = lambda todo: (calls.append(sum(len(t) for _, _, t in todo)), feed(todo))[1]
    for extra in (2, 1, 3):  # three steps without speculation: one committed token each (plus a no-op)
        n = len(toks)
        toks = toks + torch.randint(7, VOCAB, (extra,), generator=g).tolist()
        drafter.observe_target(["a"], [list(range(n - 1, len(toks) - 1))], torch.arange(len(toks)),
                               aux_states(target, toks))
        assert drafter.propose([DraftRequest("a", toks, 0.0)], 0)[0].num_nodes == 0
    assert calls == [] and drafter.cached_tokens("a") == cached  # nothing fed while not drafting
    prop = drafter.propose([DraftRequest("a", toks, 0.0)], 3)[0]
    assert calls == [6] and drafter.cached_tokens("a") == toks[1:]  # the gap's six entries in one forward
    want = torch.softmax(head.target_logits(reference_logits(head, toks, aux_states(target, toks), ())).float(), -1)
    torch.testing.assert_close(prop.draft_probs[0], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("replacement", [True, False])
def test_sampled_children_return_q(setup, replacement):
    """Sampled trees carry q rows (validated: normalised, every child drawable) in the matching mode."""
    _, target, heads = setup
    head = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    shape = Tree.from_paths([(0,), (1,), (0, 0), (1, 0)])
    drafter = Eagle3TreeDrafter(head, SampledPolicy.of(shape, replacement=replacement), seed=3)
    toks = list(range(20, 31))
    start(drafter, target, "s", toks)
    prop = drafter.propose([DraftRequest("s", toks, 0.8)], 4)[0]
    assert prop.mode == (Mode.SAMPLED if replacement else Mode.SAMPLED_WITHOUT_REPLACEMENT)
    assert prop.draft_probs is not None and prop.tree.num_nodes == 4
    in_vocab = torch.isfinite(head.target_logits(torch.zeros(head.cfg.draft_vocab)))
    assert bool(in_vocab[prop.tree.tokens].all())  # children come from the draft vocabulary


def test_seeded_requests_draw_the_same_sampled_tree_under_any_request_id(setup):
    """A request with its own sampling seed seeds its draft generator from it (a server gives every request a
    fresh id, so a generator keyed by the id would draft other trees on every run); without a seed, the id."""
    _, target, heads = setup
    head = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    shape = Tree.from_paths([(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)])
    drafter = Eagle3TreeDrafter(head, SampledPolicy.of(shape, replacement=False), seed=3)
    toks = list(range(20, 31))

    def tree_of(rid, seed):
        drafter.start_request(rid, toks[:-1], seed=seed)
        drafter.observe_target([rid], [list(range(len(toks) - 1))], torch.arange(len(toks)), aux_states(target, toks))
        trees = [drafter.propose([DraftRequest(rid, toks, 1.0)], 6)[0].tree.tokens.tolist() for _ in range(3)]
        drafter.finish_request(rid)
        return trees

    assert tree_of("run-1", 7) == tree_of("run-2", 7)  # same seed, other ids: the same draws
    assert drafter.rng_key("gone") == "gone" and not drafter._rng_keys  # keys go with their requests
    by_seed = [tree_of(f"r{s}", s) for s in range(4)]
    by_id = [tree_of(f"id{i}", None) for i in range(4)]
    assert len({str(t) for t in by_seed}) > 1 and len({str(t) for t in by_id}) > 1  # the draws do move


def test_shared_embedding_padded_rows_dropped_shard_refused(setup):
    """vLLM pads the target's embedding to a multiple of 64 rows: the padding is dropped; a bare tensor-parallel
    shard (fewer rows than the vocabulary, nothing to gather it with) is refused with the fix."""
    from vllm_tree_spec.drafters.base import DrafterError

    _, target, heads = setup
    emb = target.model.embed_tokens.weight
    padded = torch.cat([emb, torch.full((64, emb.shape[1]), 7.0)])
    head = load_head(heads["eagle"], target_embedding=padded)
    assert torch.equal(head.embed_tokens.weight, emb)
    with pytest.raises(DrafterError, match="tensor-parallel shard.*pass the full table"):
        load_head(heads["eagle"], target_embedding=emb[: VOCAB // 2])


# -- the target's vocab-parallel embedding under tensor parallelism -----------------------------------------


def vocab_parallel_ranks(full: torch.Tensor, tp: int, added: int = 0):
    """vLLM's own VocabParallelEmbedding on each of `tp` simulated ranks, each loaded by vLLM's weight_loader
    from the full [V, H] table (vLLM does the sharding and padding). The rank's group is a stand-in whose
    all_gather concatenates the shards in rank order, each rank contributing the tensor it passes in."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    layers = []

    def group(rank):
        def all_gather(w, dim):
            assert dim == 0 and torch.equal(w, layers[rank].weight)
            return torch.cat([w if r == rank else layer.weight.detach() for r, layer in enumerate(layers)])
        return SimpleNamespace(rank_in_group=rank, world_size=tp, all_gather=all_gather)

    v = full.shape[0]
    for rank in range(tp):
        layer = VocabParallelEmbedding(v + added, full.shape[1], params_dtype=full.dtype, org_num_embeddings=v,
                                       parallel_group=group(rank))
        if not added:
            layer.weight.weight_loader(layer.weight, full)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("vocab,tp", [(1000, 2), (1000, 4), (2048, 2)])
def test_vocab_parallel_shards_gather_to_the_full_table(vocab, tp):
    """Every rank rebuilds exactly the unsharded table from vLLM's shards (padded vocabulary: 1000 -> 1024 rows,
    the last rank's tail is padding, dropped)."""
    from vllm_tree_spec.integration.tp_weights import full_vocab_table

    full = torch.randn(vocab, 24)
    layers = vocab_parallel_ranks(full, tp)
    assert all(layer.weight.shape[0] < vocab for layer in layers)  # each rank holds a shard
    for layer in layers:
        assert torch.equal(full_vocab_table(layer, "head", "embedding"), full)


def test_drafter_load_model_gathers_the_targets_sharded_embedding(setup):
    """The EAGLE-3 drafter's load_model on each TP rank of a target whose embed_tokens is a vocab-parallel shard:
    the head's embedding is the target's full table on every rank."""
    from types import SimpleNamespace

    _, target, heads = setup
    emb = target.model.embed_tokens.weight.detach()  # [V, H]
    for layer in vocab_parallel_ranks(emb, 2):
        drafter = Eagle3TreeDrafter(None, StaticPolicy.of(Tree.chain(3)), path=heads["eagle"])
        drafter.load_model(SimpleNamespace(model=SimpleNamespace(embed_tokens=layer)))
        assert torch.equal(drafter.head.embed_tokens.weight, emb)


def test_vocab_parallel_layouts_that_cannot_be_rebuilt_are_refused(monkeypatch):
    """Added (LoRA) vocabulary inside each shard, and a shard with no tensor-parallel group to gather from
    (outside an engine), are refused naming the fix."""
    from vllm.distributed import parallel_state

    from vllm_tree_spec.drafters.base import DrafterError
    from vllm_tree_spec.integration.tp_weights import full_vocab_table

    full = torch.randn(1000, 24)
    lora = vocab_parallel_ranks(full, 2, added=16)[0]
    with pytest.raises(DrafterError, match="added \\(LoRA\\) vocabulary.*own embedding weights, or run it with TP = 1"):
        full_vocab_table(lora, "head", "embedding")
    shard = vocab_parallel_ranks(full, 2)[1]
    shard.parallel_group = None  # vLLM's TP group then, and none is initialized here
    monkeypatch.setattr(parallel_state, "_TP", None)
    with pytest.raises(DrafterError, match="no vLLM tensor-parallel group.*inside the vLLM engine"):
        full_vocab_table(shard, "head", "embedding")
