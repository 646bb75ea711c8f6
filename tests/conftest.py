"""Suite-wide settings, applied before any test module imports vLLM or Triton.

Without a CUDA device, Triton kernels run in Triton's interpreter. Triton
caches the TRITON_INTERPRET knob the first time it is read (importing vLLM
already reads it), so it must be set here, at the root, before collection.
vLLM's CPU build still disables its own Triton use with the interpreter on.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

EXTENDED_ENV = "VLLM_TREE_SPEC_EXTENDED"


def pytest_collection_modifyitems(config, items):
    """Tests marked `extended` (exhaustive emulation and statistics beyond the representative set `make test`
    and CI run) are reported as skipped unless asked for: VLLM_TREE_SPEC_EXTENDED=1, or a -m expression that
    names the marker (`-m extended`)."""
    if os.environ.get(EXTENDED_ENV) == "1" or "extended" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"extended set, not in the default run: {EXTENDED_ENV}=1 or -m extended")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
