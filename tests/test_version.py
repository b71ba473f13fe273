"""One place for the version: ``[tool.bumpversion] current_version`` in the root pyproject.toml.

The eight distributions are released in lockstep (a plugin is built against one core), so each
one's version and every pin between them must be that version; ``bump-my-version`` writes them
all, and this test fails on a hand edit that missed one. ``__version__`` is the installed
metadata's, never a literal of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECTS = [REPO / "pyproject.toml", *sorted(REPO.glob("packages/*/pyproject.toml"))]
DISTRIBUTIONS = {"roll-ckpt", "roll-ckpt-core", "roll-ckpt-fs", "roll-ckpt-fsdp2", "roll-ckpt-demo", "roll-ckpt-roll",
                 "roll-ckpt-torchtitan", "roll-ckpt-verl"}


def _current_version() -> str:
    # no tomllib on Python 3.10 (the ROLL legs): the one line of the table is enough
    table = (REPO / "pyproject.toml").read_text().split("[tool.bumpversion]", 1)[1]
    return re.search(r'^current_version = "([^"]+)"$', table, re.M).group(1)


def test_every_distribution_and_every_pin_is_the_current_version() -> None:
    current = _current_version()
    names = set()
    for pyproject in PYPROJECTS:
        text = pyproject.read_text()
        project = text.split("[project]", 1)[1].split("\n[", 1)[0]
        names.add(re.search(r'^name = "([^"]+)"$', project, re.M).group(1))
        assert re.search(r'^version = "([^"]+)"$', project, re.M).group(1) == current, pyproject
        requirements = re.sub(r'^name = .*$', "", text, flags=re.M)
        for name, pin in re.findall(r'"(roll-ckpt[a-z0-9-]*)(?:\[[a-z0-9,]+\])?(\s*[=<>~!][^"]*|)"', requirements):
            assert pin == f"=={current}", f"{pyproject}: {name}{pin} is not pinned to {current}"
    assert names == DISTRIBUTIONS


def test_no_version_literal_outside_the_pyprojects() -> None:
    current = _current_version()
    found = [str(p.relative_to(REPO)) for p in REPO.glob("packages/*/src/**/*.py") if current in p.read_text()]
    assert found == []


@pytest.mark.parametrize("module, distribution", [("roll_ckpt", "roll-ckpt-core"), ("roll_ckpt_fs", "roll-ckpt-fs"),
                                                  ("roll_ckpt_fsdp2", "roll-ckpt-fsdp2"), ("roll_ckpt_demo", "roll-ckpt-demo")])
def test_dunder_version_is_the_installed_one(module: str, distribution: str) -> None:
    import importlib
    from importlib.metadata import version

    assert importlib.import_module(module).__version__ == version(distribution) == _current_version()
