"""Start `vllm-tree-spec serve` the way users start it, and read its `/metrics`.

Shared by the main job (`serve_compare.py`, `vllm-tree-spec demo`) and the
serving benchmark (`benchmarks/serve/`): one place knows the command line,
the environment, the health wait, the log file and the shutdown.

    with launched(model, spec, name="tree suffix", log_dir=...) as server:
        post_json(server.base + "/v1/chat/completions", {...})
        counters = scrape_metrics(server.base)

Nothing here imports vLLM: the server runs in its own processes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

DEFAULT_MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Server:
    """A running server: its URL, its process (the API server; engine/worker processes are its children)."""

    name: str
    base: str
    proc: subprocess.Popen
    log_path: str
    command: list[str]
    startup_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, spec: dict | None, max_num_seqs: int,
                  max_model_len: int = DEFAULT_MAX_MODEL_LEN, extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm-tree-spec serve MODEL ...` (= `vllm serve`, also on the CPU build), as an argv list."""
    cmd = [sys.executable, "-m", "vllm_tree_spec.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--max-num-seqs", str(max_num_seqs), "--seed", "0", *extra_args]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def server_env(overrides: dict | None = None) -> dict:
    """The environment of a benchmark server: 2 GiB KV cache on CPU, one OpenMP thread per process."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the launcher makes a fresh one per server
    env.update(overrides or {})
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it if the launching process dies (Linux), so no server is orphaned."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "server"


def wait_healthy(base: str, proc: subprocess.Popen, name: str, log_path: str,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {name!r} exited ({proc.returncode}); see {log_path}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"server for {name!r} not healthy after {timeout_s:.0f} s; see {log_path}")
            time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (vLLM shuts its engine processes down cleanly), SIGKILL after timeout_s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def launched(model: str, spec: dict | None, *, name: str, log_dir: str, max_num_seqs: int,
             max_model_len: int = DEFAULT_MAX_MODEL_LEN, extra_args: Sequence[str] = (),
             env: dict | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[Server]:
    """Start a server for one configuration, wait for /health, yield it, stop it on exit."""
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(model, port, spec, max_num_seqs, max_model_len, extra_args)
    log_path = os.path.join(log_dir, f"server-{_slug(name)}.log")
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(env),
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        try:
            wait_healthy(base, proc, name, log_path, startup_timeout_s)
            yield Server(name, base, proc, log_path, cmd, time.perf_counter() - t0)
        finally:
            stop(proc)


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------
# /metrics

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Labels = tuple[tuple[str, str], ...]


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """Prometheus text format -> {(sample name, sorted labels): value}; comments skipped."""
    out: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        key = (name, tuple(sorted(_LABEL.findall(labels or ""))))
        out[key] = out.get(key, 0.0) + v
    return out


def scrape_metrics(base: str, timeout: float = 30) -> dict[tuple[str, Labels], float]:
    return parse_metrics(urllib.request.urlopen(base + "/metrics", timeout=timeout).read().decode())


def metric_sum(metrics: dict[tuple[str, Labels], float], name: str, **labels: str) -> float:
    """Sum of every sample called `name` whose labels include `labels` (0 if absent)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def metric_by_label(metrics: dict[tuple[str, Labels], float], name: str, label: str) -> dict[str, float]:
    """{label value: summed value} over the samples called `name` (e.g. per depth, per stage)."""
    out: dict[str, float] = {}
    for (n, ls), v in metrics.items():
        if n == name:
            for k, lv in ls:
                if k == label:
                    out[lv] = out.get(lv, 0.0) + v
    return out


def spec_counters(base: str) -> tuple[float, float]:
    """vLLM's (spec-decode drafts, accepted draft tokens) counters, summed over engines."""
    m = scrape_metrics(base)
    return (metric_sum(m, "vllm:spec_decode_num_drafts_total"),
            metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total"))
