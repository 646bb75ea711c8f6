"""serve_report on the stored runs (benchmarks/results): per-window ratios, the results-page table and plot."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVE, RESULTS = ROOT / "benchmarks" / "serve", ROOT / "benchmarks" / "results"
if str(SERVE) not in sys.path:
    sys.path.insert(0, str(SERVE))

import serve_report  # noqa: E402


def _row(config: str, key: str, tok_s: list[float]) -> dict:
    return {"config": config, "key": key, "output_tok_s": sorted(tok_s)[len(tok_s) // 2],
            "per_repeat": {str(i): {"output_tok_s": x} for i, x in enumerate(tok_s)}}


def test_windows_pair_repeat_i_with_repeat_i():
    tree, lin = _row("t", "c4", [10.0, 30.0, 20.0]), _row("l", "c4", [10.0, 20.0, 40.0])
    assert serve_report.windows(tree, lin, "output_tok_s") == pytest.approx([1.0, 1.5, 0.5])
    assert serve_report._rratio(tree, lin, "output_tok_s") == pytest.approx(1.0)  # median of windows, not of rows
    assert serve_report.windows(_row("t", "c1", [3.0]), _row("l", "c1", [2.0]), "output_tok_s") == []


def test_page_table_of_a_stored_run():
    """The suffix table of docs/benchmarks.md: medians of the per-window ratios, each window listed, and the
    configuration the run never measured (no speculation) marked as such."""
    table = serve_report.page_table([RESULTS / "cpu-suffix"])
    lines = table.splitlines()
    c4 = next(ln for ln in lines if ln.startswith("| 4 | tree-suffix-D6 |"))
    windows = [float(w) for w in c4.split("(")[1].split(")")[0].split(", ")]
    assert len(windows) == 4 and "| 0.995x (" in c4 and sorted(windows)[1] <= 0.995 <= sorted(windows)[2]
    assert [ln.split(" | ")[1] for ln in lines[2:]] == ["off", "linear-suffix-D6", "tree-suffix-D6"] * 4
    assert all("| not measured |" in ln for ln in lines[2:] if ln.startswith(("| 1 | off", "| 64 | off")))
    assert "| 64 | linear-suffix-D6 | 2.05 | 87.0 | - | 11112 / 19614 | 268.2 / 1174.4 | cpu-suffix |" in lines


def test_page_table_merges_runs_and_marks_levels_never_measured():
    table = serve_report.page_table([RESULTS / "cpu-eagle3", RESULTS / "cpu-eagle3-c16"])
    assert "| 16 | tree-eagle3-dynamic-D6 | 1.61 | 95.1 | 1.326x (" in table and "| cpu-eagle3-c16 |" in table
    assert "| 16 | tree-eagle3-planned-D6 | not measured |" in table  # measured at c = 1, 4 only
    assert "| 64 | every configuration | not measured |" in table
    assert table.count("| 1 | ") == 5  # off, linear and three trees, from the first folder


def test_page_plot_and_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert serve_report.main(["--page", "--plot", str(png), str(RESULTS / "cpu-ngram")]) == 0
    assert "| 64 | tree-ngram-D6 | 3.04 | 106.1 | 1.649x (" in capsys.readouterr().out
    assert png.stat().st_size > 1000
    with pytest.raises(SystemExit, match="no summary.json"):
        serve_report.page_table([tmp_path])
