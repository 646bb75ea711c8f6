"""The plugin entry point is declared, importable without vLLM side effects, and idempotent."""

import importlib.metadata
import subprocess
import sys


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
