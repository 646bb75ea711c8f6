"""The Triton tree-attention kernel against the PyTorch reference and the causal-path oracle.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py), so the
sizes are small; on a CUDA machine the same tests run natively.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from _tree_attention_cases import ATOL, DEVICE, make_case, mixed_trees, random_tree  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402
from vllm_tree_spec.tree_attention import (  # noqa: E402
    causal_attention,
    load_triton_launcher,
    tree_attention,
    tree_attention_path_oracle,
    tree_attention_reference,
)

if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

tree_attention_triton = load_triton_launcher()
from vllm_tree_spec.kernels.tree_attention_launch import TreeAttentionConfig  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CONTEXTS = [37, 5, 70, 0, 19]  # odd lengths, one empty context (root at slot 0)


def _sinks(hq: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize(
    "dtype, head_dim, hq, hkv, page",
    [
        (torch.float32, 16, 4, 1, 16),  # MQA-like, G = 4
        (torch.float16, 32, 4, 2, 16),
        (torch.bfloat16, 64, 8, 2, 32),
        (torch.float32, 32, 6, 2, 7),  # G = 3 (not a power of two), odd page size
        (torch.float16, 64, 2, 2, 16),  # MHA
        (torch.float32, 24, 4, 2, 16),  # head_dim padded to 32
    ],
)
def test_kernel_matches_reference(dtype, head_dim, hq, hkv, page):
    gen = torch.Generator().manual_seed(head_dim + hq)
    case = make_case(mixed_trees(gen), CONTEXTS, num_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page, dtype=dtype, seed=head_dim)  # fmt: skip
    out = tree_attention_triton(*case.args)
    _close(out, tree_attention_reference(*case.args), dtype)


FEATURES = {
    "window": lambda hq: {"sliding_window": 5},
    "softcap": lambda hq: {"softcap": 2.0},
    "sinks": lambda hq: {"sinks": _sinks(hq)},
    "all": lambda hq: {"sliding_window": 9, "softcap": 3.0, "sinks": _sinks(hq, 1)},
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_kernel_matches_path_oracle(feature, num_splits):
    """Every row equals plain causal attention over its own root-to-node path (float32)."""
    gen = torch.Generator().manual_seed(7)
    case = make_case(mixed_trees(gen), CONTEXTS, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    kw = FEATURES[feature](4)
    out = tree_attention_triton(*case.args, num_splits=num_splits, **kw)
    _close(out, tree_attention_path_oracle(*case.oracle_args, **kw), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window", [None, 4, 40])
def test_small_tiles_split_rows_and_keys(window, num_splits):
    """16-wide tiles: query tiles start mid-prefill and mid-tree, and long prefixes take many key tiles."""
    gen = torch.Generator().manual_seed(13)
    trees = [random_tree(21, gen), Tree.chain(6), Tree.chain(0)]
    case = make_case(trees, [150, 40, 7], num_heads=4, num_kv_heads=2, head_dim=16, page_size=16,
                     prefill_rows=[11, 3, 7])  # fmt: skip
    cfg = TreeAttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)  # 8 rows x 2 heads per tile
    kw = {"sliding_window": window} if window else {}
    out = tree_attention_triton(*case.args, config=cfg, num_splits=num_splits, **kw)
    _close(out, tree_attention_path_oracle(*case.oracle_args, **kw), torch.float32)


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    ctx=st.lists(st.integers(0, 80), min_size=4, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 30)),
    softcap=st.one_of(st.none(), st.floats(0.5, 20.0)),
    sinks=st.booleans(),
    group=st.sampled_from([1, 2, 4]),
    num_splits=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_random(sizes, ctx, window, softcap, sinks, group, num_splits, seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, gen) for n in sizes]
    case = make_case(trees, ctx[: len(trees)], num_heads=2 * group, num_kv_heads=2, head_dim=16, page_size=8,
                     seed=seed)  # fmt: skip
    kw = {"sliding_window": window, "softcap": softcap, "sinks": _sinks(2 * group, seed) if sinks else None}
    out = tree_attention_triton(*case.args, num_splits=num_splits, **kw)
    _close(out, tree_attention_reference(*case.args, **kw), torch.float32)


def test_depth_aware_window_on_a_wide_tree():
    """40 depth-1 nodes, window 2: each node sees only the root and itself, whatever its slot."""
    tree = Tree(torch.full((40,), -1))
    case = make_case([tree], [21], num_heads=2, num_kv_heads=1, head_dim=16, page_size=16)
    out = tree_attention_triton(*case.args, sliding_window=2)
    _close(out, tree_attention_path_oracle(*case.oracle_args, sliding_window=2), torch.float32)
    # A node's output is a mix of exactly two value rows (root, itself): compare to that directly.
    q, kc, vc = case.q[5:6], case.key_cache, case.value_cache  # row 5 = node 4 at slot 21 + 1 + 4
    bt = case.block_table[0].long()
    slots = torch.tensor([21, 26], device=DEVICE)
    k, v = kc[bt[slots // 16], slots % 16], vc[bt[slots // 16], slots % 16]
    _close(out[5:6], causal_attention(q, k, v, scale=16**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_causal_prefill_rows_before_the_tree(dtype):
    """Chunked-prefill rows precede the root; they are plain causal rows."""
    gen = torch.Generator().manual_seed(11)
    trees = [random_tree(6, gen), Tree.chain(0), Tree.chain(3)]
    case = make_case(trees, [40, 9, 30], num_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                     dtype=dtype, prefill_rows=[17, 9, 0])  # fmt: skip
    out = tree_attention_triton(*case.args, softcap=5.0)
    _close(out, tree_attention_path_oracle(*case.oracle_args, softcap=5.0), dtype)


def test_split_kv_matches_single_pass():
    gen = torch.Generator().manual_seed(5)
    case = make_case(mixed_trees(gen), [130, 3, 64, 1, 90], head_dim=32, page_size=16, dtype=torch.bfloat16)
    sinks = _sinks(4)
    one = tree_attention_triton(*case.args, sinks=sinks, num_splits=1)
    many = tree_attention_triton(*case.args, sinks=sinks, num_splits=4)
    _close(many, one, torch.bfloat16)
    _close(one, tree_attention_reference(*case.args, sinks=sinks), torch.bfloat16)


def test_root_only_batch_is_paged_decode():
    """No draft nodes anywhere (packed_mask [0, 1]): plain decode attention over the cache."""
    case = make_case([Tree.chain(0)] * 3, [0, 16, 33], num_heads=8, num_kv_heads=2, head_dim=16, page_size=16)
    assert case.packed_mask.shape[0] == 0
    out = tree_attention_triton(*case.args)
    _close(out, tree_attention_path_oracle(*case.oracle_args), torch.float32)


def test_page_size_one_and_multiword_mask():
    gen = torch.Generator().manual_seed(2)
    case = make_case([random_tree(37, gen), Tree.chain(1)], [6, 2], num_heads=2, num_kv_heads=2,
                     head_dim=16, page_size=1)  # fmt: skip
    assert case.packed_mask.shape[1] == 2
    out = tree_attention_triton(*case.args)
    _close(out, tree_attention_path_oracle(*case.oracle_args), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_lse_out_is_the_log_sum_exp_over_the_visible_keys(num_splits):
    """lse_out (for merging with attention over other keys) against the explicit mask's log-sum-exp."""
    from vllm_tree_spec.tree_attention import tree_attention_mask

    gen = torch.Generator().manual_seed(7)
    case = make_case(mixed_trees(gen), [37, 5, 70, 0, 19], num_heads=4, num_kv_heads=2, head_dim=16)
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32, device=DEVICE)
    out = tree_attention_triton(*case.args, lse_out=lse, num_splits=num_splits)
    _close(out, tree_attention_reference(*case.args), torch.float32)
    qsl, sl, page = case.query_start_loc.tolist(), case.seq_lens.tolist(), case.key_cache.shape[1]
    for b, tree in enumerate(case.trees):
        q_len, s = qsl[b + 1] - qsl[b], sl[b]
        slots = torch.arange(s)
        keys = case.key_cache.cpu()[case.block_table.cpu()[b, slots // page].long(), slots % page]  # [S, Hkv, D]
        scores = torch.einsum("qhd,khd->hqk", case.q.cpu()[qsl[b]: qsl[b + 1]].double(),
                              keys.repeat_interleave(2, 1).double()) * 16 ** -0.5
        mask = tree_attention_mask(q_len, s, tree.ancestor_mask)
        want = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1).T  # [q_len, H]
        torch.testing.assert_close(lse.cpu()[qsl[b]: qsl[b + 1]].double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sinks"):
        tree_attention_triton(*case.args, lse_out=lse, sinks=_sinks(4))


def test_out_argument_and_dispatch():
    case = make_case([Tree.chain(2), Tree(torch.tensor([-1, -1, 1]))], [5, 12], head_dim=16)
    out = torch.full_like(case.q, float("nan"))
    res = tree_attention(*case.args, backend="triton", out=out, max_query_len=4, max_seq_len=16)
    assert res.data_ptr() == out.data_ptr()
    _close(out, tree_attention_reference(*case.args), torch.float32)


# ---------------------------------------------------------------------------
# Unsupported inputs raise (never a silent fallback)


def _small_case(**kw):
    return make_case([Tree.chain(2)], [5], head_dim=16, **kw)


def test_error_fp8_cache():
    case = _small_case()
    args = list(case.args)
    args[1] = case.key_cache.to(torch.float8_e4m3fn)
    args[2] = case.value_cache.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8"):
        tree_attention_triton(*args)


def test_error_mixed_dtypes_and_bad_heads():
    case = _small_case()
    args = list(case.args)
    args[0] = case.q.half()
    with pytest.raises(NotImplementedError, match="differs from q dtype"):
        tree_attention_triton(*args)
    args = list(case.args)
    args[0] = case.q[:, :3]  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        tree_attention_triton(*args)


def test_error_head_dim_too_large():
    case = make_case([Tree.chain(1)], [3], num_heads=1, num_kv_heads=1, head_dim=512)
    with pytest.raises(NotImplementedError, match="head_dim 512"):
        tree_attention_triton(*case.args)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"sliding_window": 0}, ValueError, "sliding_window"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"sinks": torch.zeros(3)}, ValueError, "sinks"),
        ({"num_splits": 0}, ValueError, "num_splits"),
    ],
)
def test_error_bad_options(kw, exc, match):
    case = _small_case()
    if "sinks" in kw:
        kw = {"sinks": kw["sinks"].to(DEVICE)}
    with pytest.raises(exc, match=match):
        tree_attention_triton(*case.args, **kw)


def test_error_window_without_depth_and_int64_block_table():
    case = _small_case()
    args = list(case.args)
    args[-1] = None
    with pytest.raises(ValueError, match="depth"):
        tree_attention_triton(*args, sliding_window=4)
    args = list(case.args)
    args[3] = case.block_table.long()
    with pytest.raises(TypeError, match="block_table"):
        tree_attention_triton(*args)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU-without-interpreter error")
def test_error_cpu_tensors_without_interpreter(monkeypatch):
    case = _small_case()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        tree_attention_triton(*case.args)
