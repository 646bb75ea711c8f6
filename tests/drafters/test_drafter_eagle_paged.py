"""The EAGLE drafters with their committed KV in the runner's paged cache (`integration/v2/draft_kv.py`).

On Model Runner V2 the head's entries live in vLLM's blocks: entry t at the cache slot of position t of the
request's block ids, read in place by the head's attention (`draft_attention.py`). Checked here against the
dense store, with the tiny target and head of test_drafter_eagle3.py, a cache in each layout the store reads
(CPU_ATTN's vec packing, the GPU backends' [blocks, H_kv, block_size, 2D]) and scattered block ids: the pages
hold the dense store's entries (bit for bit: the head's one layer computes them from its inputs alone), the
trees are the same and their q rows equal within float rounding (the in-place attention merges two softmaxes
where the dense store runs one), and prefix-cache hits are vouched for by the writer's records.
"""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the EAGLE-3 head reads its config with vLLM's parser and uses vLLM's RoPE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_drafter_eagle3 import VOCAB, aux_states, setup  # noqa: E402,F401  (setup: the module fixture)

from vllm_tree_spec.drafters.base import DraftRequest  # noqa: E402
from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter  # noqa: E402
from vllm_tree_spec.drafters.eagle3_head import load_head  # noqa: E402
from vllm_tree_spec.drafters.policy import StaticPolicy  # noqa: E402
from vllm_tree_spec.integration import kv_layout  # noqa: E402
from vllm_tree_spec.integration.v2.draft_attention import Committed  # noqa: E402
from vllm_tree_spec.integration.v2.draft_kv import PagedHeadKV  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 64
SHAPE = Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
LAYOUTS = ["cpu_attn", "paged", "paged-kernel"]  # paged-kernel: the pages read by the Triton tree kernel (CUDA's path)


def head_layer_names(num_layers: int) -> list[str]:
    """Forward-context names of the head's attention layers (vLLM's head on V2 has its own)."""
    return [f"draft.layers.{i}.self_attn.attn" for i in range(num_layers)]


class Runner:
    """The runner's part: caches bound to the head's layers, block ids handed out per request."""

    def __init__(self, cfg, layout: str, seed: int = 0):
        shape = (NUM_BLOCKS, cfg.kv_heads, BLOCK, 2 * cfg.head_dim)
        self.ctx = {name: SimpleNamespace(kv_cache=torch.randn(shape), isa="vec",
                                          impl=SimpleNamespace(tree_kv_layout=layout))
                    for name in head_layer_names(cfg.layers)}  # random: stale content of earlier owners
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)  # scattered, as a serving cache hands them out
        self.blocks: dict[str, list[int]] = {}
        self.layout = layout

    def store(self, cfg) -> PagedHeadKV:
        store = PagedHeadKV(head_layer_names(cfg.layers), cfg.kv_heads, cfg.head_dim, torch.float32,
                            torch.device("cpu"), lambda rid: self.blocks.get(rid, []))
        store.attach(self.ctx, BLOCK)
        return store

    def grow(self, rid: str, num_tokens: int, shared: list[int] = ()) -> None:
        ids = self.blocks.setdefault(rid, list(shared))
        while len(ids) * BLOCK < num_tokens:
            ids.append(self.free.pop())

    def entries(self, rid: str, n: int, head_dim: int) -> list[torch.Tensor]:
        """The request's entries 0..n-1 per layer, K and V [H_kv, n, D], read from the cache."""
        ids = torch.tensor(self.blocks[rid])
        pos = torch.arange(n)
        slots = ids[pos // BLOCK] * BLOCK + pos % BLOCK
        out = []
        for layer in self.ctx.values():
            if self.layout == "cpu_attn":
                k, v = kv_layout.cpu_gather(layer.kv_cache, slots, head_dim, "vec")
            else:
                rows = layer.kv_cache[slots // BLOCK, :, slots % BLOCK]
                k, v = rows[..., :head_dim], rows[..., head_dim:]
            out += [k.transpose(0, 1), v.transpose(0, 1)]
        return out


def make(setup, layout: str, prefix: bool = False):
    _, target, heads = setup
    head = load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight)
    dense = Eagle3TreeDrafter(head, StaticPolicy.of(SHAPE), return_draft_probs=True)
    paged = Eagle3TreeDrafter(load_head(heads["eagle"], target_embedding=target.model.embed_tokens.weight),
                              StaticPolicy.of(SHAPE), return_draft_probs=True)
    if prefix:
        paged.enable_prefix_pages(BLOCK, 4096)
    runner = Runner(head.cfg, layout)
    paged.use_runner_kv(runner.store(head.cfg))
    return target, head, dense, paged, runner


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(7, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(drafter, target, reqs: dict[str, list[int]], first: dict[str, int]):
    """The target computed rows first[rid]..n-2 of each request; draft once for all of them."""
    for rid, toks in reqs.items():
        if not drafter.is_active(rid):
            drafter.start_request(rid, toks[:-1])
        aux = aux_states(target, toks)
        drafter.observe_target([rid], [list(range(first[rid], len(toks) - 1))], torch.arange(len(toks)), aux)
    return drafter.propose([DraftRequest(rid, toks, 0.0) for rid, toks in reqs.items()], SHAPE.num_nodes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_hold_the_dense_entries_and_the_drafts_match(setup, layout, monkeypatch):
    """Three requests over three steps (prefill, then a few committed tokens each): after every step the
    pages hold each request's entries bit for bit as the dense store does, and the trees and q rows are
    the dense store's (q within float rounding)."""
    if layout == "paged-kernel":
        pytest.importorskip("triton")
        monkeypatch.setattr(Committed, "backend", "triton")
        layout = "paged"
    target, head, dense, paged, runner = make(setup, layout)
    reqs = {"a": tokens(0, 23), "b": tokens(1, 40), "c": tokens(2, 9)}
    first = {rid: 0 for rid in reqs}
    for round_ in range(3):
        for rid, toks in reqs.items():
            runner.grow(rid, len(toks))
        got, want = step(paged, target, reqs, first), step(dense, target, reqs, first)
        for g, w in zip(got, want):
            assert g.tree.tokens.tolist() == w.tree.tokens.tolist() and torch.equal(g.tree.parents, w.tree.parents)
            torch.testing.assert_close(g.draft_probs, w.draft_probs, atol=1e-6, rtol=1e-5)
        for rid, toks in reqs.items():
            n = len(toks) - 1  # entries 0..n-1
            slot = dense._states[rid].slot
            ref = [t[slot, :, :n] for layer in dense.store.layers for t in layer]
            for g, w in zip(runner.entries(rid, n, head.cfg.head_dim), ref):
                assert torch.equal(g, w), (rid, round_)
        first = {rid: len(toks) - 1 for rid, toks in reqs.items()}
        reqs = {rid: toks + tokens(10 + round_, 1 + round_) for rid, toks in reqs.items()}  # committed tokens


def test_prefix_hits_are_vouched_for_by_the_writers_records(setup):
    """b repeats a's 41 tokens with a 32-token hit on a's first two blocks: every entry is trusted and b
    drafts a's tree; c shares a's first 32 tokens only: the hit's last entry read a's token 32, not c's, and
    is dropped; d hits a block that changed hands since its record (another content key): all missing."""
    target, head, _, paged, runner = make(setup, "cpu_attn", prefix=True)
    a = tokens(0, 41)
    runner.grow("a", len(a))
    (prop_a,) = step(paged, target, {"a": a}, {"a": 0})
    assert len(paged.store.records) == 2  # entries 0..39: blocks 0 and 1 complete
    runner.grow("b", len(a), shared=runner.blocks["a"][:2])
    (prop_b,) = step(paged, target, {"b": a}, {"b": 32})
    s = paged.prefix_stats
    assert (s.hits, s.restored, s.dropped, s.missing) == (1, 32, 0, 0), s
    assert prop_b.tree.tokens.tolist() == prop_a.tree.tokens.tolist()
    torch.testing.assert_close(prop_b.draft_probs, prop_a.draft_probs, atol=1e-6, rtol=1e-5)  # 32 entries read in place
    assert not paged.store.has_holes

    c = a[:32] + tokens(2, 17)
    runner.grow("c", len(c), shared=runner.blocks["a"][:2])
    step(paged, target, {"c": c}, {"c": 32})
    assert (s.restored, s.dropped, s.missing) == (32 + 31, 1, 0), s
    slot = paged._states["c"].slot
    assert paged.store.valid[slot, :32].tolist() == [True] * 31 + [False]
    # only c's forwards carry the hole mask (it would close the kernel's path on a GPU); b's stay unmasked
    store, slot_b = paged.store, paged._states["b"].slot
    assert store.holed == {slot}
    assert store._step([slot], [40], 1)[0].committed.valid is not None
    assert store._step([slot_b], [40], 1)[0].committed.valid is None

    stale = runner.blocks["a"][1]
    paged.store.records[stale] = (b"another content", 0)  # the block was reused for other tokens
    runner.grow("d", len(a), shared=runner.blocks["a"][:2])
    step(paged, target, {"d": a}, {"d": 32})
    assert (s.restored, s.dropped, s.missing) == (32 + 31 + 16, 1, 16), s
    assert paged.store.valid[paged._states["d"].slot, :32].tolist() == [True] * 16 + [False] * 16
