"""The worker heap reader (`integration/worker_memory.py`) that the soak uses to tell live from retained memory."""

import subprocess
import sys

import pytest

from vllm_tree_spec.integration.worker_memory import heap_stats, rss_mb

ONE = b"\x01"  # a name, not a literal: `b"\x01" * 4096` would be folded into one shared constant
glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or "heap_mb" not in heap_stats(),
                           reason="mallinfo2 needs glibc >= 2.33")


def test_rss_is_this_process():
    # statm's resident pages, as the kernel reports them in status (a new block need not add RSS: a big
    # process may reuse pages that are already resident)
    with open("/proc/self/status") as f:
        vm_rss_mb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    assert abs(rss_mb() - vm_rss_mb) < 16, (rss_mb(), vm_rss_mb)


@glibc
def test_live_and_freed_chunks_are_told_apart():
    # small chunks live in the heap: in use while held, then free (kept by glibc) after release
    base = heap_stats()
    chunks = [ONE * 4096 for _ in range(8192)]  # ~32 MiB below the mmap threshold
    held = heap_stats()
    assert held["in_use_mb"] - base["in_use_mb"] > 24
    del chunks
    freed = heap_stats(trim=True)
    assert freed["in_use_mb"] - base["in_use_mb"] < 8
    assert freed["free_mb_after_trim"] <= freed["free_mb"]
    assert set(freed) >= {"rss_mb_after_trim", "heap_mb_after_trim", "in_use_mb_after_trim"}


@glibc
def test_large_blocks_are_counted_as_mappings():
    # In a fresh interpreter: glibc serves a large request from any big enough free chunk before it maps a
    # new block, and a process that has run other tests may hold one (CI saw the 256 MiB land in the heap).
    code = (
        "from vllm_tree_spec.integration.worker_memory import heap_stats\n"
        "base = heap_stats()['mmap_mb']\n"
        "block = bytearray(256 * 2**20)  # above any mmap threshold glibc adapts to (32 MiB at most)\n"
        "held = heap_stats()['mmap_mb']\n"
        "del block\n"
        "print(held - base, heap_stats()['mmap_mb'] - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    held, after = map(float, out.split())
    assert held > 200 and after < 8, (held, after)


def test_python_objects_counts_types():
    from vllm_tree_spec.integration.worker_memory import python_objects

    class Marker:
        pass

    held = [Marker() for _ in range(5000)]
    stats = python_objects(top=None)  # every type: in a big process Marker need not be among the top 20
    assert stats["top_types"].get("test_python_objects_counts_types.<locals>.Marker", 0) >= 5000
    assert stats["gc_objects"] >= 5000 and stats["py_allocated_blocks"] > 0
    del held


def test_heap_trimmer_schedule(monkeypatch):
    import time

    from vllm_tree_spec.integration import worker_memory

    off = worker_memory.HeapTrimmer(0)
    assert not off.maybe_trim() and off.trims == 0
    t = worker_memory.HeapTrimmer(0.05)
    if t._libc is None:
        pytest.skip("no glibc malloc_trim")
    assert not t.maybe_trim()  # not due yet
    time.sleep(0.06)
    assert t.maybe_trim() and t.trims == 1
    assert not t.maybe_trim()  # the next one is an interval away


@glibc
def test_heap_trimmer_returns_retained_pages():
    from vllm_tree_spec.integration.worker_memory import HeapTrimmer

    chunks = [ONE * 32768 for _ in range(8192)]  # 256 MiB of heap chunks, all written (resident)
    chunks = chunks[::2]  # every other one freed: holes glibc keeps (they cannot merge into the heap top)
    before = rss_mb()
    t = HeapTrimmer(1e-9)
    assert t.maybe_trim()
    assert before - rss_mb() > 64, (before, rss_mb())


def test_heap_trimmer_env(monkeypatch):
    from vllm_tree_spec.integration import worker_memory

    monkeypatch.setenv(worker_memory.TRIM_ENV, "0")
    assert worker_memory.HeapTrimmer().interval_s == 0
    monkeypatch.setenv(worker_memory.TRIM_ENV, "often")
    with pytest.raises(ValueError, match=worker_memory.TRIM_ENV):
        worker_memory.HeapTrimmer()
