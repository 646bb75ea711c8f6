"""The plugin entry point is declared, importable without vLLM side effects, and idempotent."""

import importlib.metadata
import subprocess
import sys

import pytest


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "tree_spec" and ep.value == "vllm_tree_spec.plugin:register" for ep in eps)


def test_import_has_no_side_effects():
    code = (
        "import sys, vllm_tree_spec, vllm_tree_spec.plugin, vllm_tree_spec.tree, vllm_tree_spec.verify;"
        "bad = [m for m in ('vllm', 'triton') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_is_idempotent():
    from vllm_tree_spec import plugin

    plugin.register()
    plugin.register()
    assert plugin.is_registered()


def test_plugin_logs_reach_vllms_handlers():
    """Patch P9: the plugin's INFO records go through vLLM's handlers (Python's root logger drops them)."""
    import logging

    pytest.importorskip("vllm")
    import vllm.logger  # noqa: F401  (configures the "vllm" logger)
    from vllm_tree_spec.integration.logs import route_to_vllm_handlers

    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        pytest.skip("vLLM's logging is not configured here (VLLM_CONFIGURE_LOGGING=0)")
    route_to_vllm_handlers()
    route_to_vllm_handlers()  # idempotent: no second copy of each handler
    ours = logging.getLogger("vllm_tree_spec.integration.cpu_attention")
    assert ours.isEnabledFor(logging.INFO) == theirs.isEnabledFor(logging.INFO)
    root = logging.getLogger("vllm_tree_spec")
    assert root.handlers == theirs.handlers and not root.propagate
