"""The supported range is declared and true: what the compat seams say they were checked on is
the matrix that ran (``matrix/results/``), the packages' bounds are the legs' (``matrix/legs.py``),
every accessor names the releases it ran on, and version-dependent transformers APIs are used
in the transformers seam only.

A framework leg (verl's) runs its integration's tests on the stack the framework resolves to:
not part of the range (its releases are not among those the seams were checked on, nor its
pins among the bounds), but that stack must lie within the range's bounds."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from helpers.launch import REPO

CORE = REPO / "packages" / "core" / "src" / "roll_ckpt"
PYPROJECTS = [REPO / "pyproject.toml", *sorted(REPO.glob("packages/*/pyproject.toml"))]


def _legs(range_only: bool = True):
    """The legs of the supported range (``range_only``), or every leg, framework legs included."""
    spec = importlib.util.spec_from_file_location("matrix_legs", REPO / "matrix" / "legs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.RANGE if range_only else module.LEGS


def _pin(leg, name: str) -> tuple[int, ...]:
    for pin in leg.pins:
        if pin.startswith(f"{name}=="):
            return tuple(int(x) for x in pin.split("==")[1].split(".")[:2])
    raise AssertionError(f"leg {leg.name} pins no {name}")


def _passed_results() -> list[dict]:
    """The recorded results of the range's legs that passed their whole suite."""
    found = [json.loads(p.read_text()) for p in sorted((REPO / "matrix" / "results").glob("*.json"))]
    assert found, "no recorded matrix (make test-matrix writes matrix/results/)"
    names = {leg.name for leg in _legs()}
    return [r for r in found if r["failed"] == 0 and r["errors"] == 0 and r["whole_suite"] and r["leg"] in names]


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def test_checked_on_is_the_matrix_that_ran() -> None:
    import os

    from roll_ckpt.runtime import torch_compat, transformers_compat

    if os.environ.get("ROLL_CKPT_TEST_RECORDING"):
        pytest.skip("this run records the matrix (python -m matrix test --record): the record is checked after it")

    results = _passed_results()
    assert {r["leg"] for r in results} == {leg.name for leg in _legs()}, "a leg did not pass, or was not run"
    torch_minors = sorted({_minor(r["versions"]["torch"]) for r in results}, key=_key)
    transformers_minors = sorted({_minor(r["versions"]["transformers"]) for r in results}, key=_key)
    assert list(torch_compat.CHECKED_ON) == torch_minors
    assert list(transformers_compat.CHECKED_ON) == transformers_minors


def _ranges(doc: str, major: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``2.6-2.14`` and lone ``2.8`` (with ``major`` = "2") in a docstring, as (low, high)."""
    out = []
    for lo, hi in re.findall(rf"\b({major}\.\d+)(?:\s*[-–]\s*({major}\.\d+))?\b", doc):
        out.append((_key(lo), _key(hi or lo)))
    return out


@pytest.mark.parametrize("module,major", [("torch_compat", "2"), ("transformers_compat", "4|5")])
def test_every_accessor_names_releases_that_cover_the_matrix(module: str, major: str) -> None:
    """Between them, the releases an accessor's docstring names cover every release of the
    matrix: what it does on each is said."""
    mod = importlib.import_module(f"roll_ckpt.runtime.{module}")
    tree = ast.parse((CORE / "runtime" / f"{module}.py").read_text())
    uncovered = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")):
        ranges = [r for m in major.split("|") for r in _ranges(ast.get_docstring(fn) or "", m)]
        missing = [v for v in mod.CHECKED_ON if not any(lo <= _key(v) <= hi for lo, hi in ranges)]
        if missing:
            uncovered[fn.name] = missing
    assert not uncovered, f"accessors whose docstrings do not say what they do on: {uncovered}"


def _requirement(pyproject: Path, name: str) -> str | None:
    text = pyproject.read_text()
    found = re.search(rf'"{re.escape(name)}(?P<spec>[<>=!~][^";]*)', text)
    return found.group("spec") if found else None


def test_the_declared_bounds_are_the_legs() -> None:
    legs = _legs()
    pythons = sorted(_key(leg.python) for leg in legs)
    low, high = pythons[0], pythons[-1]
    python = f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"
    for p in PYPROJECTS:
        assert re.search(rf'requires-python = "{re.escape(python)}"', p.read_text()), f"{p}: not {python}"

    def bounds(name: str, upper_by_major: bool) -> str:
        versions = sorted(_pin(leg, name) for leg in legs)
        lo, hi = versions[0], versions[-1]
        upper = f"{hi[0] + 1}" if upper_by_major else f"{hi[0]}.{hi[1] + 1}"
        return f">={lo[0]}.{lo[1]},<{upper}"

    core = REPO / "packages" / "core" / "pyproject.toml"
    assert _requirement(core, "torch") == bounds("torch", False)
    assert _requirement(core, "numpy") == bounds("numpy", True)
    assert _requirement(REPO / "pyproject.toml", "transformers") == bounds("transformers", True)
    ray = sorted(_pin(leg, "ray") for leg in legs)[0]
    assert _requirement(REPO / "pyproject.toml", "ray") == f">={ray[0]}.{ray[1]}"


def test_a_framework_legs_stack_lies_within_the_range() -> None:
    """verl's leg is not part of the range, but what it runs on is: its Python and each pin
    between the range's lowest and highest release (transformers and NumPy by major)."""
    legs, framework = _legs(), [leg for leg in _legs(range_only=False) if leg.framework]
    assert framework, "no framework leg (matrix/legs.py: verl's)"
    for leg in framework:
        assert min(_key(x.python) for x in legs) <= _key(leg.python) <= max(_key(x.python) for x in legs), leg.name
        for name in ("torch", "transformers", "numpy", "ray"):
            lo, hi = min(_pin(x, name) for x in legs), max(_pin(x, name) for x in legs)
            by_major = name in ("transformers", "numpy", "ray")
            assert lo <= _pin(leg, name) and (_pin(leg, name)[0] <= hi[0] if by_major else _pin(leg, name) <= hi), \
                f"leg {leg.name}: {name} {_pin(leg, name)} is outside the supported range {lo}-{hi}"


def test_this_environment_is_the_stack_of_its_leg() -> None:
    """A leg's suite runs on exactly its pins: ``make test`` on the default leg's (the Makefile
    asks ``python -m matrix pins default``), ``make test-leg`` on the leg's."""
    import os
    from importlib import metadata

    name = os.environ.get("ROLL_CKPT_TEST_LEG")
    if not name:
        pytest.skip("not run as a leg of the matrix (make test, make test-leg, make test-matrix set it)")
    leg = next(leg for leg in _legs(range_only=False) if leg.name == name)

    def dist(pin: str) -> str:
        return pin.split("==")[0].split("[")[0]

    wrong = {pin: metadata.version(dist(pin)) for pin in (*leg.pins, *leg.framework)
             if metadata.version(dist(pin)).split("+")[0] != pin.split("==")[1]}
    assert not wrong, f"leg {name}: installed {wrong}"


def test_version_dependent_transformers_apis_are_used_in_the_seam_only() -> None:
    """Outside ``runtime/transformers_compat.py``, roll-ckpt imports only transformers' top level
    (``AutoConfig``, model classes), whose names every supported release has."""
    sources = [p for p in CORE.rglob("*.py") if p.name != "transformers_compat.py"]
    sources += [p for src in REPO.glob("packages/*/src") for p in src.rglob("*.py") if "roll_ckpt/" not in str(p)]
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers."):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(REPO)}:{node.lineno}: import {a.name}" for a in node.names
                              if a.name.startswith("transformers.")]
    assert not offenders, offenders
