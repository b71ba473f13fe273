"""The save and resume paths, measured (issue 37): how much of roll-ckpt one steady-state
asynchronous save and one resume run, and how many long functions the product has.

``_paths_child.py`` traces one ``maybe_save`` (until ``wait()`` returns: the manifest
committed) and one ``resume(state, "latest")`` on one gloo rank, a small FSDP2 model with
AdamW; what it counts is in its docstring (functions of ``packages/*/src``, comprehensions and
generator expressions left out; a module is a file one of them lies in). The child imports the
product from this checkout (its ``packages/*/src`` first on ``PYTHONPATH``), whatever the
environment has installed; the plugins it finds are the installed ones (entry points), so the
figures hold for an environment with every distribution installed (``make venv``).

``pytest tests/core/test_paths.py -s`` prints the counts and the functions of each module.
The figures are in docs/architecture.md ("The save and resume paths, measured").
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import free_port, rank_env, run_ok

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("_paths_child.py")
SOURCES = sorted(REPO.glob("packages/*/src"))
CHILD_TIMEOUT_S = 150

# Issue 37's bounds: each path at most this many modules and functions of the product.
MAX_MODULES = 20
MAX_FUNCTIONS = 120
# Product functions longer than LONG_LINES lines today; the redesign must not add any (issue 37:
# "not by inlining into long functions").
LONG_LINES = 60
LONG_TODAY = 10


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The child's trace: ``{"save": {"modules": n, "functions": n, "by_module": {...}}, "resume": ...}``."""
    tmp = tmp_path_factory.mktemp("paths")
    out = tmp / "paths.json"
    pythonpath = os.pathsep.join([*map(str, SOURCES), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**rank_env(0, 1, free_port()), "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "ROLL_CKPT_QUIET": "1"}
    cmd = [sys.executable, str(CHILD), str(tmp / "ckpt"), str(out)]
    try:
        run_ok(cmd, CHILD_TIMEOUT_S, env=env)
    except AssertionError as e:  # not an AssertionError: the xfail below expects only the bound's
        raise RuntimeError(f"the trace failed: {e}") from None
    return json.loads(out.read_text())


def _summary(paths: dict[str, Any]) -> str:
    return ", ".join(f"{p}: {paths[p]['modules']} modules, {paths[p]['functions']} functions" for p in ("save", "resume"))


def _report(paths: dict[str, Any]) -> str:
    lines = [f"python {paths['python']}, torch {paths['torch']}; {_summary(paths)}"]
    for p in ("save", "resume"):
        lines.append(f"-- {p}: {paths[p]['modules']} modules, {paths[p]['functions']} functions")
        for module, names in paths[p]["by_module"].items():
            lines.append(f"{len(names):4d}  {module}: {', '.join(names)}")
    return "\n".join(lines)


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
def test_the_paths_are_measured(paths: dict[str, Any]) -> None:
    """The measurement itself works: both paths traced, nonzero, through the manager's public
    calls (a trace that lost its profile function, or imported another copy of the product,
    would count nothing)."""
    print("\n" + _report(paths))
    for p in ("save", "resume"):
        by_module = paths[p]["by_module"]
        assert paths[p]["modules"] == len(by_module) > 0, p
        assert paths[p]["functions"] == sum(map(len, by_module.values())) > 0, p
    manager = "packages/core/src/roll_ckpt/manager.py"
    # Python 3.10 has no co_qualname: the bare name then
    assert {"maybe_save", "wait"} <= {n.rsplit(".", 1)[-1] for n in paths["save"]["by_module"].get(manager, [])}
    assert "resume" in {n.rsplit(".", 1)[-1] for n in paths["resume"]["by_module"].get(manager, [])}
    # the save's writing runs on threads of its own: they are traced too
    assert any(m.endswith("dcp/writer.py") for m in paths["save"]["by_module"])


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
def test_save_and_resume_run_at_most_20_modules(paths: dict[str, Any]) -> None:
    """Issue 37: one steady-state asynchronous save, and one resume, each run at most 20
    modules of the product (torch_checkpointing: 10 per async save, 16-17 per load)."""
    over = [f"{p}: {paths[p]['modules']} modules" for p in ("save", "resume") if paths[p]["modules"] > MAX_MODULES]
    assert not over, f"above {MAX_MODULES} modules: {'; '.join(over)}\n" + _report(paths)


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
def test_save_and_resume_run_at_most_120_functions(paths: dict[str, Any]) -> None:
    """Issue 37: one steady-state asynchronous save, and one resume, each run at most 120
    functions of the product (torch_checkpointing: 70 per async save, 64-81 per load)."""
    over = [f"{p}: {paths[p]['functions']} functions" for p in ("save", "resume")
            if paths[p]["functions"] > MAX_FUNCTIONS]
    assert not over, f"above {MAX_FUNCTIONS} functions: {'; '.join(over)}\n" + _report(paths)


def long_functions() -> list[str]:
    """The product's functions (``def`` and ``async def``, nested ones too) longer than
    LONG_LINES lines, from the ``def`` line to the last line, docstring included."""
    out = []
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LONG_LINES:
                        out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return out


@pytest.mark.timeout(60)
def test_no_more_long_functions_than_today() -> None:
    """No more product functions over 60 lines than today: issue 37's paths get shorter by
    removing layers, not by inlining into long functions.

    Today's count is 10, measured from the ``def`` line to the function's last line (the
    issue's 8 is what the same count gave at its filing without docstrings, or without blank
    and comment lines; ``tiers/space.estimate_checkpoint_bytes`` has left the list since). The
    ten: the CLI's ``cmd_ls``, ``cmd_verify``, ``cmd_copy``, ``hf/export.export_hf``,
    ``config/schema._checkpoint``, ``format/manifest.from_bytes``, ``format/hub_layout.hub_layout``,
    ``tiers/transfer.copy_checkpoint``, ROLL's ``state_map.load_worker_part`` and the demo's
    ``train``."""
    long = long_functions()
    print("\n" + "\n".join(long))
    assert long, "no function found: the walk over packages/*/src is broken"
    assert len(long) <= LONG_TODAY, f"{len(long)} functions over {LONG_LINES} lines (at most {LONG_TODAY}):\n" + \
        "\n".join(long)
