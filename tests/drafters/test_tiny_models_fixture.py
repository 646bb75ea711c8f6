"""The reusable tiny-model factory (tests/fixtures/tiny_models.py): seeded, memoised, loadable."""

from __future__ import annotations

import pytest
import torch

from tiny_models import BOS_ID, EOS_ID, MIN_VOCAB, PAD_ID, build_tiny_llama, make_tokenizer


def test_factory_memoises_and_checkpoints_are_seeded(tiny_models):
    from transformers import AutoModelForCausalLM

    a = tiny_models.llama(vocab_size=512, num_layers=1, seed=3)
    assert tiny_models.llama(vocab_size=512, num_layers=1, seed=3) == a  # built once per session
    b = tiny_models.llama(vocab_size=512, num_layers=1, seed=4)
    assert b != a
    ma = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    mb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    same = build_tiny_llama(3, vocab_size=512, num_layers=1)
    wa, wb, ws = (m.model.embed_tokens.weight for m in (ma, mb, same))
    assert torch.equal(wa, ws) and not torch.equal(wa, wb)
    assert ma.config.num_hidden_layers == 1 and ma.config.vocab_size == 512
    assert (ma.config.bos_token_id, ma.config.eos_token_id, ma.config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)


def test_building_does_not_touch_the_global_rng():
    torch.manual_seed(0)
    expect = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_llama(7, vocab_size=300, num_layers=1)
    assert torch.equal(torch.rand(3), expect)


def test_tokenizer_round_trip_and_chat_template(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.tokenizer(512))
    text = "def tree(node):  # the root's child\n    return node.parent"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi</s><|assistant|>"
    with pytest.raises(ValueError, match=f">= {MIN_VOCAB}"):
        make_tokenizer(tiny_models.root / "too-small", 100)
