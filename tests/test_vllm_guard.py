"""The start-up guard: tested vLLM versions only, and every overridden vLLM method exists as recorded."""

import pytest

pytest.importorskip("vllm", reason="the guard inspects the installed vLLM")

from vllm_tree_spec.config import TreeSpecError  # noqa: E402
from vllm_tree_spec.integration import vllm_guard  # noqa: E402

pytestmark = pytest.mark.vllm

PLATFORMS = [("cpu", False), ("cpu", True), ("cuda", False)]


@pytest.mark.parametrize("platform,dsv4", PLATFORMS, ids=["cpu", "cpu-dsv4", "cuda"])
def test_every_derived_override_has_a_recorded_signature(platform, dsv4):
    """The list is derived from our classes; a new override without a record fails here, not in production."""
    targets = vllm_guard.overrides(platform=platform, dsv4=dsv4)
    unrecorded = [f"{c}.{n}" for c, n in targets if f"{c}.{n}" not in vllm_guard.SIGNATURES]
    assert not unrecorded, f"record these in vllm_guard.SIGNATURES: {unrecorded}"
    names = {n for _, n in targets}
    # the hooks the runner and the attention overrides cannot work without are among them
    assert {"_prepare_inputs", "_build_attention_metadata", "_sample", "_model_forward", "forward",
            "propose_draft_token_ids"} <= names


@pytest.mark.parametrize("platform,dsv4", PLATFORMS, ids=["cpu", "cpu-dsv4", "cuda"])
def test_installed_vllm_matches_the_records(platform, dsv4):
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
    vllm_guard.check_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1", "0.32.0rc1", "0.33.0.dev12+gabc"])
def test_untested_versions_are_refused_unless_allowed(version, monkeypatch):
    monkeypatch.delenv(vllm_guard.ALLOW_ENV, raising=False)
    with pytest.raises(TreeSpecError) as info:
        vllm_guard.check_version(version)
    msg = str(info.value)
    assert "0.32.0" in msg and version in msg and vllm_guard.ALLOW_ENV in msg
    monkeypatch.setenv(vllm_guard.ALLOW_ENV, "1")
    vllm_guard.check_version(version)  # a warning, not a refusal
