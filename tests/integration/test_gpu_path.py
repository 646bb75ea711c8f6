"""The GPU path's pieces, on CPU: tree rows on vLLM's FLASH_ATTN/TRITON_ATTN cache, commit, config route.

No GPU here: the Triton tree-attention kernel runs under TRITON_INTERPRET=1
(set by tests/conftest.py) on CPU tensors laid out exactly as vLLM 0.32's GPU
backends lay out their caches ([num_blocks, Hkv, block_size, 2 * D] logical,
with either physical order). Every draft node's output is checked against a
plain attention over its own root-to-node path (the path invariant); rows of
other requests and the roots must stay as the stock kernel left them.
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


def make_batch(seed: int, *, hq=4, hkv=2, d=24, block_size=16, num_blocks=48):
    """A mixed batch: tree requests, plain decode rows and a prefill chunk, in vLLM's flattened row order."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kinds = ["tree", "decode", "tree", "prefill", "tree"]
    rng.shuffle(kinds)
    max_blocks = 8
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in kinds]).int()
    reqs, row, meta = [], 0, []
    for b, kind in enumerate(kinds):
        if kind == "tree":
            n = rng.randint(1, 12)
            root_pos = rng.randint(0, max_blocks * block_size - n - 2)  # crosses block boundaries
            tree = random_tree(rng, n)
            reqs.append(TreeRequestStep(f"r{b}", b, row, root_pos, tree, Mode.GREEDY, None))
            row += n + 1
        else:
            row += 1 if kind == "decode" else 3
        meta.append(kind)
    query = torch.randn(row, hq * d, generator=gen)
    return SimpleNamespace(step=TreeStep(reqs), query=query, block_table=block_table, hq=hq, hkv=hkv, d=d,
                           block_size=block_size, num_blocks=num_blocks, gen=gen, rows=row)


def slot_of(block_table_row: torch.Tensor, index: int, block_size: int) -> int:
    return int(block_table_row[index // block_size]) * block_size + index % block_size


def path_oracle(case, kv_cache, req: TreeRequestStep, node: int, *, scale, window=None, softcap=None,
                sinks=None) -> torch.Tensor:
    """[H, D] fp64 attention of one node over its prefix + root-to-node path (positions root_pos + depth)."""
    hq, hkv, d, bs = case.hq, case.hkv, case.d, case.block_size
    bt = case.block_table[req.req_index]
    path = req.tree.path_to(node)  # ancestors then the node
    key_index = list(range(req.root_pos + 1)) + [req.root_pos + 1 + j for j in path]
    key_pos = list(range(req.root_pos + 1)) + [req.root_pos + int(req.tree.depth[j]) for j in path]
    qpos = req.root_pos + int(req.tree.depth[node])
    if window is not None:
        keep = [i for i, p in enumerate(key_pos) if p > qpos - window]
        key_index = [key_index[i] for i in keep]
    slots = torch.tensor([slot_of(bt, k, bs) for k in key_index])
    rows = kv_cache[slots // bs, :, slots % bs].double()  # [L, Hkv, 2D]
    k, v = rows[..., :d], rows[..., d:]
    q = case.query[req.root_row + 1 + node].view(hq, d).double()
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


def check_rows(case, kv_cache, out, **kw) -> None:
    node_rows = set()
    for req in case.step.requests:
        for i in range(req.num_nodes):
            r = req.root_row + 1 + i
            node_rows.add(r)
            want = path_oracle(case, kv_cache, req, i, **kw)
            got = out[r].view(case.hq, case.d).double()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"{req.req_id} node {i}")
    others = [r for r in range(case.rows) if r not in node_rows]
    assert torch.all(out[others] == SENTINEL), "rows other than draft nodes must keep the stock kernel's output"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("physical_nhd", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_rows_match_path_attention(seed, physical_nhd, backend):
    from vllm_tree_spec.integration.gpu_attention import tree_rows_paged

    case = make_batch(seed)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, physical_nhd)
    out = torch.full_like(case.query, SENTINEL)
    scale = 1 / math.sqrt(case.d)
    tree_rows_paged(case.step, case.query, kv, case.block_table, out, num_heads=case.hq, head_size=case.d,
                    scale=scale, backend=backend)
    check_rows(case, kv, out, scale=scale)


@pytest.mark.parametrize("seed", [3, 4])
def test_tree_rows_window_softcap_sinks(seed):
    from vllm_tree_spec.integration.gpu_attention import tree_rows_paged

    case = make_batch(seed)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, True)
    out = torch.full_like(case.query, SENTINEL)
    sinks = torch.randn(case.hq, generator=case.gen)
    kw = dict(scale=0.3, window=7, softcap=5.0, sinks=sinks)
    tree_rows_paged(case.step, case.query, kv, case.block_table, out, num_heads=case.hq, head_size=case.d,
                    scale=0.3, sliding_window=7, softcap=5.0, sinks=sinks)
    check_rows(case, kv, out, **kw)


def test_tree_rows_detects_a_wrong_mask():
    """The oracle is sharp: the plain causal (chain) mask over the same rows fails it."""
    from vllm_tree_spec.integration.gpu_attention import tree_rows_paged

    case = make_batch(5)
    branching = [r for r in case.step.requests if bool((r.tree.parents != torch.arange(r.num_nodes) - 1).any())]
    assert branching, "the case must contain a branching tree"
    chains = [TreeRequestStep(r.req_id, r.req_index, r.root_row, r.root_pos, Tree.chain(r.num_nodes, r.tree.tokens),
                              r.mode, None) for r in case.step.requests]
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, False)
    out = torch.full_like(case.query, SENTINEL)
    tree_rows_paged(TreeStep(chains), case.query, kv, case.block_table, out, num_heads=case.hq, head_size=case.d,
                    scale=0.2)
    with pytest.raises(AssertionError):
        check_rows(case, kv, out, scale=0.2)


def test_plan_is_built_once_per_step_and_block_table():
    from vllm_tree_spec.integration.gpu_attention import plan_tree_rows

    case = make_batch(6)
    p1 = plan_tree_rows(case.step, case.block_table)
    assert plan_tree_rows(case.step, case.block_table) is p1
    total = sum(r.num_nodes for r in case.step.requests)
    assert p1.packed_mask.shape[0] == total == p1.depth.shape[0] == p1.node_rows.shape[0]
    assert p1.query_start_loc[-1] == total + len(case.step.requests)


# ---------------------------------------------------------------------------
# The backend impls (vLLM's own classes, constructed on CPU)


class _StockImpl:
    """Stands in for vLLM's kernel: every row gets the sentinel."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output.fill_(SENTINEL)
        return output


def test_mixin_forward_recomputes_only_tree_rows_with_vllm_window_convention():
    from vllm_tree_spec.integration.gpu_attention import TreePagedAttentionMixin

    class Impl(TreePagedAttentionMixin, _StockImpl):
        pass

    case = make_batch(7)
    impl = Impl()
    impl.num_heads, impl.head_size, impl.scale = case.hq, case.d, 0.25
    impl.sliding_window, impl.logits_soft_cap, impl.sinks = (5, 0), 0, None  # vLLM stores (W - 1, 0)
    kv = paged_cache(case.gen, case.num_blocks, case.block_size, case.hkv, case.d, True)
    out = torch.empty_like(case.query)
    md = SimpleNamespace(tree_step=case.step, block_table=case.block_table)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    impl.forward(layer, case.query, None, None, kv, md, out)
    check_rows(case, kv, out, scale=0.25, window=6)
    assert case.step.applied == {layer.layer_name}  # counted by the runner's per-step check
    case.step.check_applied({layer.layer_name})
    with pytest.raises(RuntimeError, match="1 of 2 attention layers"):
        case.step.check_applied({layer.layer_name, "model.layers.1.self_attn.attn"})
    md.tree_step = TreeStep([])  # a step without trees: the stock output, untouched
    impl.forward(layer, case.query, None, None, kv, md, out)
    assert torch.all(out == SENTINEL) and not md.tree_step.applied


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
    from vllm.platforms import current_platform

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
