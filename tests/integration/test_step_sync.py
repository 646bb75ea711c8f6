"""A tree step's host syncs and its vectorised pieces (metadata, sync-free verification, fused commit).

* The GPU code path (`verify_batch(sync_free=True)`, device metadata, device commit) run on CPU
  tensors under `step_harness.SyncCounter`: one device-to-host sync per step (the transfer vLLM's
  bookkeeping needs) and a constant number of host-to-device transfers, whatever the batch size and
  tree size; no op mixes device and host tensors.
* The sync-free walk equals the compacting walk bit for bit, and its rewound streams stand where the
  compacting walk leaves them (a seeded request's tokens do not depend on the path taken).
* The fused commit (one gather + scatter over every layer of a group) equals the per-layer reference
  on every cache layout (paged; CPU_ATTN vec and amx), and the whole faked step commits exactly what
  `compaction_pairs` says; over an amx cache it moves the same K/V as over a vec cache.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

import step_harness  # noqa: E402
from step_harness import SyncCounter, make_step, mark_case, run_step  # noqa: E402

from vllm_tree_spec import verify  # noqa: E402
from vllm_tree_spec.verify import batch as verify_batch_module  # noqa: E402  (where verify_batch looks up upload)
from vllm_tree_spec.integration import commit, kv_layout, tree_sampler  # noqa: E402
from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.verify import Mode, VerifyCoins, verify_batch  # noqa: E402

MIXED = ("greedy", "deterministic", "sampled", "deterministic", "sampled_without_replacement")


def _counted_step(monkeypatch, case):
    counter = SyncCounter()
    monkeypatch.setattr(tree_sampler, "sync_free", lambda device: True)  # the accelerator path
    monkeypatch.setattr(verify, "sync_free", lambda device: True)
    monkeypatch.setattr(verify, "upload", counter.counting_upload(verify.upload))
    monkeypatch.setattr(verify_batch_module, "upload", counter.counting_upload(verify_batch_module.upload))
    monkeypatch.setattr(tree_sampler, "upload", counter.counting_upload(tree_sampler.upload))
    monkeypatch.setattr(tree_sampler, "_upload_floats", counter.counting_upload_floats(tree_sampler._upload_floats))
    mark_case(case)
    with counter:
        out = run_step(case)
    monkeypatch.undo()
    return counter, out


@pytest.mark.parametrize("modes", [("greedy",), ("deterministic",), MIXED], ids=["greedy", "deterministic", "mixed"])
def test_host_syncs_per_step_are_constant(monkeypatch, modes):
    counts = {}
    for batch_size in (1, 4, 16) if len(modes) == 1 else (len(modes), 16):  # mixed: every mode present
        for nodes, chain in ((3, True), (10, False)):
            counter, _ = _counted_step(monkeypatch, make_step(batch_size, nodes, modes=modes, chain=chain,
                                                              seeded=batch_size == 4, seed=batch_size + nodes))
            where = "\n".join(f"{k}:\n{counter.where[k]}" for k in list(counter.d2h) + list(counter.mixed))
            assert sum(counter.d2h.values()) == 1 and counter.d2h["cpu"] == 1, (dict(counter.d2h), where)
            assert not counter.mixed, (dict(counter.mixed), where)
            counts[batch_size, nodes] = sum(counter.h2d.values())
    assert len(set(counts.values())) == 1, counts  # host-to-device transfers: independent of B and tree size
    assert max(counts.values()) <= 16, counts


def test_the_counter_sees_a_per_request_sync(monkeypatch):
    """Negative control: the compacting walk (CPU path) syncs once per depth and is counted."""
    counter = SyncCounter()
    case = make_step(4, 6, modes=("deterministic",), chain=True)
    mark_case(case)
    with counter:
        run_step(case)
    assert sum(counter.d2h.values()) - counter.d2h["cpu"] >= 3, dict(counter.d2h)  # one per depth walked


def test_sync_free_step_equals_cpu_step(monkeypatch):
    """Seeded requests: same tokens, KV caches and streams from the faked step with and without the
    sync-free path (unseeded rows come from the default RNG, which the two walks consume differently)."""
    outs, caches, streams = [], [], []
    for sync_free in (False, True):
        torch.manual_seed(5)
        case = make_step(6, 8, modes=MIXED, seeded=True, seed=3)
        monkeypatch.setattr(tree_sampler, "sync_free", lambda device, v=sync_free: v)
        monkeypatch.setattr(verify, "sync_free", lambda device, v=sync_free: v)
        out = run_step(case)
        monkeypatch.undo()
        outs.append(out.sampled_token_ids)
        caches.append(case.kv.clone())
        streams.append([torch.rand(3, generator=st.generator) if st.generator is not None else None
                        for st in case.runner.requests.values()])
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
    for a, b in zip(*streams):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


# (layout, CPU_ATTN isa, cache dtype, head size, block size); amx: bf16, sizes in multiples of 32 as vLLM needs
LAYOUTS = [("cpu_attn", "vec", torch.float32, 16, 16), ("cpu_attn", "amx", torch.bfloat16, 32, 32),
           ("paged", None, torch.float32, 16, 16)]


@pytest.mark.parametrize("layout,isa,dtype,head_size,block_size", LAYOUTS)
def test_step_commits_what_compaction_pairs_says(layout, isa, dtype, head_size, block_size):
    case = make_step(5, 9, modes=("greedy", "deterministic"), layout=layout, seed=7, isa=isa, kv_dtype=dtype,
                     head_size=head_size, block_size=block_size)
    before = case.kv.clone()
    out = run_step(case)
    r = case.runner
    want = before.clone()
    bs, d = want.shape[3], want.shape[4] // 2
    acc = out.sampled_token_ids
    slots = r.input_batch.block_table[0].slot_mapping.gpu
    qsl = r.query_start_loc.np
    for b in range(5):
        n_out = int((acc[b] >= 0).sum())
        tree = r._tree_drafts[f"r{b}"].tree
        # the accepted path: follow the emitted tokens down the tree
        path, row = [], 0
        for tok in acc[b, : n_out - 1].tolist():
            node = next(c for c in tree.children[row] if int(tree.tokens[c]) == tok)
            path.append(node)
            row = node + 1
        row_slots = slots[qsl[b]: qsl[b + 1]].tolist()
        pairs = kv_layout.compaction_pairs(row_slots, path)
        if pairs:
            s = torch.tensor([p[0] for p in pairs])
            t = torch.tensor([p[1] for p in pairs])
            for layer in want:
                if layout == "cpu_attn":
                    kv_layout.cpu_copy_slots(layer, s, t, d, isa)
                else:
                    kv_layout.paged_copy_slots(layer, s, t)
    assert torch.equal(case.kv, want)


@pytest.mark.parametrize("layout,isa,bs,d,dtype", [("cpu_attn", "vec", 4, 5, torch.float32),
                                                   ("cpu_attn", "amx", 16, 32, torch.bfloat16),
                                                   ("paged", None, 4, 5, torch.float32)])
@pytest.mark.parametrize("shared", [True, False])
def test_fused_copy_equals_per_layer_reference(layout, isa, bs, d, dtype, shared):
    gen = torch.Generator().manual_seed(1)
    L, nb, hkv = 3, 7, 2
    if shared:  # one allocation, layers at a constant stride (and not first in memory order)
        buf = torch.randn(nb, L, hkv, bs, 2 * d, generator=gen).to(dtype)
        layers = [buf[:, i] for i in (2, 0, 1)]
    else:
        layers = [torch.randn(nb, hkv, bs, 2 * d, generator=gen).to(dtype) for _ in range(L)]
    joined = commit.join_layers(layers)
    assert (joined is not None) == shared
    src = torch.tensor([5, 9, 10, 3, 3, 17])  # overlapping and self copies, across blocks
    dst = torch.tensor([4, 5, 9, 3, 20, 2])
    want = [c.clone() for c in layers]
    for c in want:
        if layout == "cpu_attn":
            kv_layout.cpu_copy_slots(c, src, dst, d, isa)
        else:
            kv_layout.paged_copy_slots(c, src, dst)
    for c in [joined] if shared else layers:
        commit.copy_slots(c, src, dst, layout, d, joined=shared, isa=isa)
    for got, exp in zip(layers, want):
        assert torch.equal(got, exp)


def test_amx_commit_moves_what_the_vec_commit_moves():
    """One faked step over a vec cache and over an amx cache holding the same K/V (written through
    `amx_pack_model`, the transcription of vLLM's AMX cache write): the same rows end up in every slot."""
    kw = dict(modes=("greedy",), seed=3, kv_dtype=torch.bfloat16, head_size=32, block_size=32, layers=2,
              context=40)
    vec = make_step(4, 7, isa="vec", **kw)
    amx = make_step(4, 7, isa="amx", **kw)
    for case in (vec, amx):  # accept down the last child at every node: paths that leave the first branch
        r = case.runner
        qsl = r.query_start_loc.np
        for b, rid in enumerate(r.input_batch.req_ids):
            tree = r._tree_drafts[rid].tree
            for row, kids in enumerate(tree.children):  # row 0 = root, row i + 1 = node i
                if kids:
                    case.logits[qsl[b] + row, int(tree.tokens[kids[-1]])] = 100.0
    slots = torch.arange(vec.kv.shape[1] * 32)
    for v_layer, a_layer in zip(vec.kv, amx.kv):  # every byte of the amx cache rewritten from the vec K/V
        kv_layout.amx_pack_model(*kv_layout.vec_gather(v_layer, slots, 32), a_layer, slots)
    before = vec.kv.clone()
    out_vec, out_amx = run_step(vec), run_step(amx)
    assert torch.equal(out_vec.sampled_token_ids, out_amx.sampled_token_ids)
    assert not torch.equal(before, vec.kv), "no accepted path moved a row: the comparison below would be vacuous"
    for v_layer, a_layer in zip(vec.kv, amx.kv):
        kv_v, kv_a = kv_layout.vec_gather(v_layer, slots, 32), kv_layout.amx_gather(a_layer, slots, 32)
        assert torch.equal(kv_v[0], kv_a[0]) and torch.equal(kv_v[1], kv_a[1])


def _random_batch(rng, batch_size, vocab, max_nodes):
    trees = []
    for _ in range(batch_size):
        n = rng.randint(0, max_nodes)
        trees.append(step_harness.random_tree(rng, n, vocab, chain=False) if n else Tree([], []))
    return TreeBatch.from_trees(trees)


@pytest.mark.parametrize("seed", range(6))
def test_sync_free_verify_is_bit_identical(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab = 11
    batch = _random_batch(rng, 6, vocab, 7)
    R = int(batch.cu_num_rows[-1])
    p = torch.softmax(torch.randn(R, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(R, vocab, generator=g, dtype=torch.float64), -1)
    modes = torch.tensor([rng.choice([0, 1, 2]) for _ in range(6)])  # greedy / deterministic / sampled
    coins = VerifyCoins.draw(6, batch.max_depth, batch.max_children, vocab, dtype=torch.float64)
    eos = torch.tensor([rng.randrange(vocab) for _ in range(6)])
    mt = torch.tensor([rng.randint(1, 6) for _ in range(6)])
    a = verify_batch(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=mt)
    b = verify_batch(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=mt, sync_free=True)
    for name in ("accepted_nodes", "num_accepted", "next_token", "output_token_ids", "walked"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("seed", range(4))
def test_rewound_streams_equal_the_compacting_walk(seed):
    """Lazy seeded coins: the sync-free walk draws at every depth, then `rewind` gives back the rows it
    did not read; outputs and the streams' next draws equal the compacting walk's."""
    rng = random.Random(seed)
    vocab = 6
    batch = _random_batch(rng, 5, vocab, 8)
    R = int(batch.cu_num_rows[-1])
    p = torch.softmax(torch.randn(R, vocab, generator=torch.Generator().manual_seed(seed)) * 0.3, -1)
    modes = torch.full((5,), int(Mode.DETERMINISTIC))
    res, nxt = [], []
    for sync_free in (False, True):
        gens = [torch.Generator().manual_seed(100 + b) for b in range(5)]
        coins = VerifyCoins.draw(5, batch.max_depth, batch.max_children, vocab, generators=gens, lazy=True,
                                 needs_uniform=[False] * 5, track_streams=sync_free)
        out = verify_batch(batch, p, None, modes, coins, sync_free=sync_free)
        if sync_free:
            coins.rewind([int(w) + 1 for w in out.walked])
        res.append(out)
        nxt.append(torch.stack([torch.rand(4, generator=gg) for gg in gens]))
    assert torch.equal(res[0].output_token_ids, res[1].output_token_ids)
    assert torch.equal(nxt[0], nxt[1])


def test_cpu_commit_moves_only_pairs_out_of_place():
    """`commit.moving_rows`: an accepted chain prefix is already in place (nothing to copy); a branch's node
    moves to its depth's row, in step rows (request b's rows start at cu_num_rows[b])."""
    from vllm_tree_spec.integration.commit import moving_rows

    cu = torch.tensor([0, 7, 12])
    acc = torch.tensor([[0, 1, 2, -1], [1, 3, -1, -1]])  # request 0: chain prefix; request 1: nodes 1, 3
    assert moving_rows(cu, acc, torch.tensor([3, 0])) == ([], [])
    # request 1's node 1 (row 2) -> row 1, node 3 (row 4) -> row 2; rows offset by 7
    assert moving_rows(cu, acc, torch.tensor([3, 2])) == ([9, 11], [8, 9])
