"""What every tree worker shares, whichever model runner it builds: the tree-aware attention backends
(patch P2, through vLLM's documented registry) and the read-only probes reachable with collective_rpc."""

from __future__ import annotations

import contextlib

from vllm_tree_spec.integration.live_state import live_state
from vllm_tree_spec.integration.logs import route_to_vllm_handlers
from vllm_tree_spec.integration.worker_memory import heap_stats, python_objects

TREE_CPU_BACKENDS = {"CPU_ATTN": "vllm_tree_spec.integration.cpu_attention.TreeCPUAttentionBackend"}


@contextlib.contextmanager
def tree_attention_backends(overrides: dict[str, str]):
    """Route vLLM backends to their tree-aware subclasses while a worker builds its model (patch P2).

    Uses vLLM's documented backend registry. The selector caches backend classes
    per process, so the cache is cleared on entry (an earlier engine in the same
    process must not leak its causal backend into us) and on exit (our backends
    must not leak into a later engine without tree speculation).
    """
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    members = {AttentionBackendEnum[name]: path for name, path in overrides.items()}
    previous = {m: _ATTN_OVERRIDES.get(m) for m in members}
    for member, path in members.items():
        register_backend(member, path)
    _cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        for member, old in previous.items():
            if old is None:
                member.clear_override()
            else:
                register_backend(member, old)
        _cached_get_attn_backend.cache_clear()


def tree_cpu_attention():
    return tree_attention_backends(TREE_CPU_BACKENDS)


class TreeWorkerProbes:
    """Read-only worker methods of every tree worker, reachable through vLLM's collective_rpc (and, at
    construction, the plugin's logs routed through vLLM's handlers)."""

    def __init__(self, *args, **kwargs):
        route_to_vllm_handlers()
        super().__init__(*args, **kwargs)

    def tree_live_state(self) -> dict[str, list[str]]:
        """Request ids held in every per-request place (leak checks: integration/live_state.py)."""
        return live_state(self.model_runner)

    def tree_memory(self, trim: bool | str = False, objects: bool | str = False) -> dict:
        """The worker's RSS and glibc heap: live vs retained free memory (integration/worker_memory.py).
        `trim` also runs malloc_trim, `objects` counts Python objects by type (True, or "1" through
        /collective_rpc, which passes strings)."""
        out = heap_stats(trim in (True, "1", "true"))
        out["heap_trims"] = self.model_runner._tree_heap.trims  # the periodic ones (HeapTrimmer)
        if objects in (True, "1", "true"):
            out.update(python_objects())
        return out
