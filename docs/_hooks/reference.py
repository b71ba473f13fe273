"""MkDocs hook (``hooks:`` in mkdocs.yml): adds the generated pages to the site at build
time, so none of them is a copy that could drift.

* ``reference/configuration.md``, ``reference/cli.md``, ``reference/api.md``: generated
  from the config definitions, the command-line parser and ``__all__`` (``render.py``).

The benchmark's results are not added here: ``bench/results/`` is build output (not in
git); the summaries the pages show are kept in ``docs/benchmark/`` as ordinary files.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # MkDocs loads a hook by its path; its siblings are imported by name

import render  # noqa: E402

from mkdocs.structure.files import File, Files  # noqa: E402

GENERATED = {
    "reference/configuration.md": render.configuration_page,
    "reference/cli.md": render.cli_page,
    "reference/api.md": render.api_page,
}


def on_files(files: Files, config) -> Files:
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files
