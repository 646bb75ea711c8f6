"""`vllm-tree-spec model-path NAME` prints only the path on stdout (so `$(...)` works); progress goes to stderr."""

import pytest

from vllm_tree_spec import models
from vllm_tree_spec.cli import main


def test_model_path_prints_only_the_path(monkeypatch, capsys, tmp_path):
    def fake_smollm2(cache_dir=None):
        import sys

        print("Converting ...", file=sys.stderr)
        return tmp_path / "smollm2-135m-instruct"

    monkeypatch.setattr(models, "smollm2", fake_smollm2)
    assert main(["model-path", "smollm2"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'smollm2-135m-instruct'}\n" and "Converting" in err


def test_model_path_unknown_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["model-path", "nope"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
