"""Per-call timing probe for served engines (benchmark-only; loaded through PYTHONPATH by served_timeline.py).

Python imports `sitecustomize` at start-up in every process of a server (API server, engine core, worker), so
this file can time vLLM's own methods there without touching the serving code. When STEP_PROBE_DIR is set it
wraps, as their modules are imported,

    vllm.v1.worker.gpu_worker.Worker.execute_model / .sample_tokens   (the worker: forward / sampling + drafting)
    vllm.v1.engine.core.EngineCore.step                                 (the engine core: one whole step)

and appends one JSON line per call to STEP_PROBE_DIR/<pid>-<class>.jsonl: start (CLOCK_MONOTONIC, shared by
the processes), wall, the calling thread's CPU time, user/system time, minor page faults and voluntary /
involuntary context switches (getrusage(RUSAGE_THREAD)), the thread's CPU affinity and, for the worker, the
step's scheduled tokens. Each record costs a few microseconds. Nothing here may walk the heap: a call such as
gc.get_freeze_count() walks vLLM's ~650k frozen objects and added ~60 ms to every engine-core step.
"""

import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import time

OUT = os.environ.get("STEP_PROBE_DIR")
TARGETS = {"vllm.v1.worker.gpu_worker": [("Worker", "execute_model"), ("Worker", "sample_tokens")],
           "vllm.v1.engine.core": [("EngineCore", "step")]}


def _wrap(module, cls: str, meth: str) -> None:
    klass = getattr(module, cls, None)
    fn = getattr(klass, meth, None) if klass is not None else None
    if fn is None:  # a vLLM without this method: the analysis reports the missing file
        return
    fh = open(os.path.join(OUT, f"{os.getpid()}-{cls}.jsonl"), "a", buffering=1)

    def timed(*args, **kwargs):
        sched = args[1] if len(args) > 1 else None
        ntok = getattr(sched, "total_num_scheduled_tokens", None)
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            t1, c1 = time.monotonic(), time.thread_time()
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            fh.write(json.dumps({
                "m": meth, "t0": t0, "wall": t1 - t0, "cpu": c1 - c0, "ntok": ntok,
                "utime": r1.ru_utime - r0.ru_utime, "stime": r1.ru_stime - r0.ru_stime,
                "minflt": r1.ru_minflt - r0.ru_minflt, "ivcsw": r1.ru_nivcsw - r0.ru_nivcsw,
                "vcsw": r1.ru_nvcsw - r0.ru_nvcsw, "cpus": sorted(os.sched_getaffinity(0))}) + "\n")

    setattr(klass, meth, timed)


class _PostImport(importlib.abc.MetaPathFinder):
    """Wraps the targets right after their module executes (before anyone looks the methods up)."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            for cls, meth in TARGETS[name]:
                _wrap(module, cls, meth)

        spec.loader.exec_module = exec_and_wrap
        return spec


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.meta_path.insert(0, _PostImport())
