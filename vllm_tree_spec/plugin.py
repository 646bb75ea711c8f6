"""vLLM general-plugin entry point (`vllm.general_plugins: tree_spec`).

vLLM calls `register()` in every process it starts (API server, engine core,
each worker) and may call it several times per process, so it must be
idempotent, cheap and inert: it imports nothing from vLLM at module import
and changes nothing unless tree speculation is configured. vLLM only logs a
plugin's exceptions, so failures here would be silent: keep this tiny and move
real work into `vllm_tree_spec.integration`, which asserts its own activation.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Install the integration hooks once per process (no-op on later calls)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    # Lazy import: importing this module must not import vLLM (vLLM imports
    # plugins while it is itself initialising). install() only wraps the
    # config route (patch P1), which is inert unless method "tree" is used.
    from vllm_tree_spec.integration import install

    install()


def is_registered() -> bool:
    return _registered
