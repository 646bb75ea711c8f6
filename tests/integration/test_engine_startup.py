"""Start-up refusals through vLLM's own entry points, and the per-step tree-mask layer check.

* Malformed configs, an untested vLLM and a re-signed vLLM method stop `LLM(...)` before any model is
  loaded (the config route runs inside `EngineArgs.create_engine_config`).
* The gates (hybrid / Mamba, encoder-decoder, KV connectors, dual-batch overlap) refuse at the config
  route with the fix named; tiny configs on disk stand in for such models (no weights are needed).
* A tree step in which one attention layer did not apply the tree mask (the causal kernel's output
  kept) fails loudly instead of verifying trees against causal logits.
"""

import pytest
from engine_utils import repetitive_prompts, run_engine

from vllm_tree_spec.config import TreeSpecError

VOCAB = 2048
TREE = {"method": "tree", "drafter": "ngram", "tree": "chain:6", "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))


def _llm(model, spec, **kw):
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, speculative_config=spec, **kw)


def _route(model_dir, spec, **engine_kw):
    """The config route alone: what `LLM(...)` runs before it builds an engine."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_tree_spec.integration import install

    install()
    args = EngineArgs(model=str(model_dir), max_model_len=64, speculative_config=spec, **engine_kw)
    return args.create_speculative_config(args.create_model_config(), ParallelConfig(enable_dbo=args.enable_dbo))


@pytest.mark.vllm
@pytest.mark.parametrize("spec,match", [
    ({**TREE, "prompt_lookup_maxx": 4}, "did you mean 'prompt_lookup_max'"),
    ({**TREE, "tree": "chain:0"}, "key 'tree'"),
    ({**TREE, "verification": "greedy"}, "key 'verification' = 'greedy'"),
    ({**TREE, "num_speculative_tokens": 3}, "raise it to >= 6"),
    ({**TREE, "drafter": "mtp", "prompt_lookup_max": 3}, "drafter 'mtp' drafts with DeepSeek-V4's MTP head"),
], ids=["unknown-key", "bad-tree", "lossy-rule", "too-few-slots", "mtp-on-llama"])
def test_malformed_config_stops_engine_start(model, spec, match):
    with pytest.raises(TreeSpecError, match=match):
        _llm(model, spec)


@pytest.mark.vllm
def test_untested_vllm_is_refused_unless_allowed(model, monkeypatch):
    import vllm

    from vllm_tree_spec.integration.vllm_guard import ALLOW_ENV

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(TreeSpecError, match=rf"tested with vLLM 0\.32\.0 only; this is vLLM 0\.99\.0.*{ALLOW_ENV}=1"):
        _llm(model, TREE)
    monkeypatch.setenv(ALLOW_ENV, "1")  # the override gets past the version check (route only: no engine)
    spec = _route(model, TREE)
    assert spec.method == "custom_class"


@pytest.mark.vllm
def test_other_engines_are_untouched_by_the_guard(model, monkeypatch):
    """The guard applies to tree configs only: no speculation and vLLM's own methods pass on any version."""
    import vllm

    monkeypatch.delenv("VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert _route(model, None) is None
    spec = _route(model, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert spec.method == "ngram"


@pytest.mark.vllm
def test_resigned_vllm_method_is_refused_at_start(model, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def _prepare_inputs(self, scheduler_output):  # a vLLM release that dropped a parameter
        raise AssertionError("never called: start-up must refuse first")

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    with pytest.raises(TreeSpecError, match=r"_prepare_inputs: parameters \('self', 'scheduler_output'\)"):
        _llm(model, TREE)


@pytest.mark.vllm
def test_kv_connector_is_refused(model):
    from vllm.config import KVTransferConfig

    with pytest.raises(TreeSpecError, match="KV connectors.*remove --kv-transfer-config"):
        _llm(model, TREE, kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))


@pytest.mark.vllm
def test_dual_batch_overlap_is_refused(model):
    with pytest.raises(TreeSpecError, match="dual-batch overlap.*remove --enable-dbo"):
        _route(model, TREE, enable_dbo=True)


@pytest.mark.vllm
def test_mamba_model_is_refused(tmp_path):
    import transformers

    cfg = transformers.MambaConfig(vocab_size=256, hidden_size=16, num_hidden_layers=1, state_size=4)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(TreeSpecError, match="hybrid / Mamba.*without --speculative-config"):
        _route(tmp_path, TREE, skip_tokenizer_init=True)


@pytest.mark.vllm
def test_encoder_decoder_model_is_refused(tmp_path):
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=256, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_source_positions=16,
        max_target_positions=64)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(TreeSpecError, match="encoder-decoder / cross-attention.*without --speculative-config"):
        _route(tmp_path, TREE, skip_tokenizer_init=True)


@pytest.mark.vllm
def test_bad_verifier_choice_stops_engine_start(model, monkeypatch):
    """VLLM_TREE_SPEC_VERIFY is checked when the runner's KV cache exists, before any request is served."""
    from vllm_tree_spec.integration.tree_sampler import VERIFY_ENV

    monkeypatch.setenv(VERIFY_ENV, "cuda-kernel")
    with pytest.raises(Exception, match=f"{VERIFY_ENV}='cuda-kernel': choose one of"):
        _llm(model, TREE)


@pytest.mark.vllm
def test_a_layer_without_the_tree_mask_fails_loudly(model, monkeypatch):
    """Negative control for the silent causal fallback: layer 1 keeps the stock causal output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl

    tree_forward = TreeCPUAttentionImpl.forward

    def forward(self, layer, *args, **kwargs):
        if layer.layer_name.endswith("layers.1.self_attn.attn"):
            return CPUAttentionBackendImpl.forward(self, layer, *args, **kwargs)  # as if not overridden
        return tree_forward(self, layer, *args, **kwargs)

    monkeypatch.setattr(TreeCPUAttentionImpl, "forward", forward)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(2, VOCAB, seed=1)]
    with pytest.raises(RuntimeError, match=r"1 of 2 attention layers \(e.g. model.layers.1.self_attn.attn\) did not "
                                           r"apply the tree mask"):
        run_engine(model, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), TREE)


@pytest.mark.vllm
def test_every_layer_applies_the_tree_mask_in_every_tree_step(model, monkeypatch):
    """The positive side: the check ran on every tree step and saw both layers each time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_tree_spec.integration.tree_step import TreeStep

    seen = []
    check = TreeStep.check_applied

    def record(self, expected):
        seen.append((len(expected), len(self.applied)))
        return check(self, expected)

    monkeypatch.setattr(TreeStep, "check_applied", record)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(2, VOCAB, seed=1)]
    run = run_engine(model, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), TREE)
    assert run.tree_stats["rounds"] > 0
    assert len(seen) >= run.tree_stats["rounds"] / 2 and set(seen) == {(2, 2)}, seen


@pytest.mark.vllm
@pytest.mark.parametrize("rule,mode", [("auto", "SAMPLED_WITHOUT_REPLACEMENT"), ("deterministic", "DETERMINISTIC")])
def test_verification_key_picks_the_rule(model, monkeypatch, rule, mode):
    """`verification` is honoured: sampled requests' trees are verified with the rule the user picked
    (draws without replacement admit both), temperature-0 requests greedily whatever the rule."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_tree_spec.integration import runner as runner_mod
    from vllm_tree_spec.verify import Mode

    seen = []
    tree_sample = runner_mod.tree_sample

    def record(runner, logits, spec_meta, step):
        seen.extend((runner.requests[r.req_id].sampling_params.temperature > 0, r.mode) for r in step.requests)
        return tree_sample(runner, logits, spec_meta, step)

    monkeypatch.setattr(runner_mod, "tree_sample", record)
    spec = {"method": "tree", "drafter": "draft_model", "model": model, "tree": "[(0,), (1,), (0, 0)]",
            "draft_sampling": "sample_without_replacement", "seed": 0, "verification": rule}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(3, VOCAB, seed=2)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True) for i in range(2)] + \
        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    run = run_engine(model, prompts, params, spec)
    assert all(len(o) == 16 for o in run.outputs) and run.tree_stats["rounds"] > 0
    assert set(seen) == {(True, Mode[mode]), (False, Mode.GREEDY)}, seen


def _runner_with_layers(layers: dict):
    from types import SimpleNamespace

    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))


def _attention(attn_type: str, tree_aware: bool = True):
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.attention import Attention

    layer = Attention.__new__(Attention)  # no vLLM config needed: the check reads two attributes
    torch.nn.Module.__init__(layer)
    layer.attn_type = attn_type
    layer.impl = SimpleNamespace(tree_aware=tree_aware)
    return layer


@pytest.mark.vllm
def test_model_load_refuses_mamba_and_cross_attention_layers():
    """Second line of defence after the config gates: the layers the model actually built."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backend import AttentionType

    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    class FakeMamba(MambaBase):
        pass

    FakeMamba.__abstractmethods__ = frozenset()
    ok = {"model.layers.0.self_attn.attn": _attention(AttentionType.DECODER)}
    TreeRunnerMixin.tree_check_attention(_runner_with_layers(ok))
    with pytest.raises(RuntimeError, match="hybrid / Mamba layers.*model.layers.1.mixer"):
        TreeRunnerMixin.tree_check_attention(_runner_with_layers({**ok, "model.layers.1.mixer": FakeMamba()}))
    cross = {**ok, "model.layers.0.encoder_attn.attn": _attention(AttentionType.ENCODER_DECODER)}
    with pytest.raises(RuntimeError, match="decoder self-attention only; model.layers.0.encoder_attn.attn"):
        TreeRunnerMixin.tree_check_attention(_runner_with_layers(cross))
    causal = {**ok, "model.layers.1.self_attn.attn": _attention(AttentionType.DECODER, tree_aware=False)}
    with pytest.raises(RuntimeError, match="tree-aware attention in every layer"):
        TreeRunnerMixin.tree_check_attention(_runner_with_layers(causal))
