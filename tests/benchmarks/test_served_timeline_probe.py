"""The served-step probe (benchmarks/step/probe/sitecustomize.py): it wraps a method after its module is
imported, records one line per call, and the timeline analysis splits plain and drafted steps."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "benchmarks" / "step" / "probe"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_wraps_on_import_and_records_each_call(tmp_path):
    # A stand-in module with the probe's target names, imported after the probe installed its finder.
    pkg = tmp_path / "fake_target.py"
    pkg.write_text(textwrap.dedent("""
        class Worker:
            def execute_model(self, sched):
                return sum(range(1000))
    """))
    out = tmp_path / "rec"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import sitecustomize as probe
        probe.TARGETS = {{"fake_target": [("Worker", "execute_model")]}}
        import fake_target
        class S: total_num_scheduled_tokens = 7
        w = fake_target.Worker()
        assert w.execute_model(S()) == 499500
        assert w.execute_model(S()) == 499500
        assert fake_target.Worker.execute_model.__name__ == "timed"
    """)
    env = {"PYTHONPATH": str(PROBE), "STEP_PROBE_DIR": str(out), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    files = list(out.glob("*-Worker.jsonl"))
    assert len(files) == 1
    rows = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert len(rows) == 2 and all(r["m"] == "execute_model" and r["ntok"] == 7 for r in rows)
    assert all(r["wall"] >= 0 and r["cpu"] >= 0 and isinstance(r["cpus"], list) for r in rows)


def test_probe_is_inert_without_its_variable(tmp_path):
    code = "import sys, sitecustomize; assert not any(type(f).__name__ == '_PostImport' for f in sys.meta_path)"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(PROBE), "PATH": "/usr/bin:/bin"})


def test_analysis_splits_plain_and_drafted_steps(tmp_path):
    tl = _load(ROOT / "benchmarks" / "step" / "served_timeline.py", "served_timeline")
    base = dict(cpu=0.0, utime=0.0, stime=0.0, minflt=0, ivcsw=1, vcsw=0, cpus=[0])
    rows = [dict(base, m="execute_model", t0=10.0 + i, wall=0.05 if n == 1 else 0.06, ntok=n)
            for i, n in enumerate([1, 7, 1, 7, 3])]
    rows.append(dict(base, m="execute_model", t0=1.0, wall=9.0, ntok=1))  # warm-up: before the mark
    (tmp_path / "123-Worker.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = tl.analyse(tmp_path, mark=5.0)["Worker"]
    assert res["execute_model"]["n"] == 5
    assert res["execute_model/plain"]["n"] == 2 and abs(res["execute_model/plain"]["wall_ms_mean"] - 50) < 1e-9
    assert res["execute_model/drafted"]["n"] == 3 and abs(res["execute_model/drafted"]["wall_ms_mean"] - 60) < 1e-9
