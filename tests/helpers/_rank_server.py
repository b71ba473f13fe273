"""``python _rank_server.py serve``: the fork server :mod:`helpers.ranks` forks ranks from.

It imports torch, its distributed packages and roll-ckpt once (about 4 s of CPU a
process here), then forks each rank with torchrun's environment and runs the worker
script as ``__main__``. It computes nothing before forking (no thread pool, no process
group exists to be inherited) and never looks up the plugins, whose entry points each
rank finds itself in its own environment.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared helpers

from helpers._warm_server import _preload  # noqa: E402,F401 - the same imports as the warm interpreter
from helpers.forkserver import serve  # noqa: E402


def run(spec: dict) -> int:  # pragma: no cover - runs in the forked rank
    os.environ.clear()
    os.environ.update(spec["env"])
    for entry in reversed(spec["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    os.chdir(spec["cwd"])
    script = os.path.abspath(spec["script"])
    sys.path.insert(0, os.path.dirname(script))  # what `python script` puts first
    sys.argv = [script, *spec["args"]]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _preload()
    sys.exit(serve(run, stderr_of=lambda spec: spec["log"], orphans_die=True))
