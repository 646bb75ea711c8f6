"""Runs tests/integration_dsv4 in a fresh interpreter when this pytest process cannot.

vLLM 0.32's DeepSeek-V4 CPU path needs Triton's interpreter switched on before
Triton is first imported (vllm_tree_spec/integration/dsv4/cpu_env.py). When this
directory is collected together with suites whose conftests import vLLM first
(`pytest tests`), the conftest detects it, skips the tests in this process and
this gate runs them in a child pytest instead, so a full run still executes and
reports them. The gate is selected exactly when some test of this directory is
(`-m`, `-k`: the conftest decides), and the child runs just the selected ones
(same marker expression). Alone (`pytest tests/integration_dsv4`) the gate is
skipped. A child that collects no test (pytest exit code 5) fails
the gate: the DeepSeek-V4 suite must never pass by running nothing.
"""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 1800


@pytest.mark.vllm
def test_dsv4_suite_in_fresh_interpreter(request, dsv4_selected):
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(dsv4_selected or [str(HERE)])]
    markexpr = request.config.getoption("markexpr", default="")
    if markexpr:
        args += ["-m", markexpr]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(args, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode != 5, f"tests/integration_dsv4 collected no tests in a fresh interpreter:\n{tail}"
    assert proc.returncode == 0, f"tests/integration_dsv4 failed in a fresh interpreter:\n{tail}"
    summary = [line for line in proc.stdout.splitlines() if " in " in line and ("passed" in line or "skipped" in line)]
    print(f"tests/integration_dsv4 ({len(dsv4_selected) or 'all'} selected), fresh interpreter: "
          f"{summary[-1] if summary else tail}")
