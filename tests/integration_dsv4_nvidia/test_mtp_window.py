"""The MTP tree drafter's window in vLLM's page of the MTP layer (integration/v2/mtp_window.py), on vLLM's insert
kernel and gather as the emulation provides them (the reference pack's insert op, checked against vLLM's Triton
quantizer in test_pack_vs_vllm.py; vLLM's gather by the name its NVIDIA attention calls).

* committed rows land at their positions' slots through the request's block ids, byte for byte what vLLM's
  insert kernel writes for those rows, and read back (one gather) as the kernel's FP8 rows;
* tree rows leave vLLM's page untouched and read back as the same rows would from the page (so an ancestor in
  a tree equals the row on a chain);
* the rows vLLM's sliding-window manager keeps, a position past a request's blocks, a cache that is not
  fp8_ds_mla: each handled with a clear rule or error.
"""

from types import SimpleNamespace

import pytest
import torch
from test_pack_vs_vllm import BS, _cos_sin, _pages  # strided pages as vLLM pools them, a RoPE table

from vllm_tree_spec.integration.v2.mtp_window import PagedMTPWindow
from vllm_tree_spec.reference.dsv4_gpu_ops import layout, qnorm_rope_kv_insert

pytestmark = pytest.mark.vllm
W, HEADS, PADDED = 128, 4, 8


def _page(num_blocks=8):
    return _pages(num_blocks)[1]


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    return q, kv, _cos_sin()


def _window(blocks):
    w = PagedMTPWindow(W, lambda rid: blocks[rid])
    w.attach(_page(), BS, "mtp.swa_cache")
    return w


def test_committed_rows_are_vllms_insert_in_the_requests_blocks():
    w = _window({"r": [5, 2]})
    st = SimpleNamespace(req_id="r")
    pos = torch.arange(60, 70)  # across the request's two blocks (5, then 2)
    q, kv, cs = _inputs(len(pos))
    slots = w.slots([(st, pos)])
    assert slots.tolist() == [5 * BS + p for p in range(60, 64)] + [2 * BS + p - 64 for p in range(64, 70)]
    q_pad, rows = w.run_insert(q, kv, pos, slots, cs, PADDED, 1e-6)
    expect = _page()
    q_ref = qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, expect.view(expect.shape[0], -1), slots, pos, cs, PADDED, 1e-6, BS)
    assert torch.equal(w.cache, expect) and torch.equal(q_pad, q_ref)
    assert torch.equal(rows, layout.gather_dequant(expect, slots, BS))
    back = w.rows_many([(st, 62, 70), (st, 60, 61)])
    assert torch.equal(back[0], rows[2:]) and torch.equal(back[1], rows[:1])


def test_tree_rows_leave_the_page_and_read_as_the_page_would():
    w = _window({"r": [1]})
    st = SimpleNamespace(req_id="r")
    pos = torch.arange(3, 9)
    q, kv, cs = _inputs(len(pos), seed=1)
    before = w.cache.clone()
    q_tree, tree_rows = w.run_insert(q, kv, pos, None, cs, PADDED, 1e-6)
    assert torch.equal(w.cache, before)  # tree rows never enter vLLM's page
    q_chain, chain_rows = w.run_insert(q, kv, pos, w.slots([(st, pos)]), cs, PADDED, 1e-6)
    assert torch.equal(tree_rows, chain_rows) and torch.equal(q_tree, q_chain)
    assert not torch.equal(w.cache, before)


def test_retained_rows_blocks_and_layout_errors():
    w = _window({"r": [3]})
    # vLLM keeps every block holding one of the W - 1 positions before the step's first computed position
    assert w.retained_from(10) == 0 and w.retained_from(W + 63) == 64 and w.retained_from(W + 64) == 64
    assert w.retained_from(W + 128) == 128
    with pytest.raises(RuntimeError, match="position 64 of request r lies past its 1 blocks"):
        w.slots([(SimpleNamespace(req_id="r"), torch.tensor([63, 64]))])
    bad = PagedMTPWindow(W, lambda rid: [])
    with pytest.raises(ValueError, match="fp8_ds_mla.*--kv-cache-dtype auto"):
        bad.attach(torch.zeros(4, BS, 512, dtype=torch.bfloat16), BS, "mtp.swa_cache")
