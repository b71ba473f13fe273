"""The other legs' interpreters on this machine, for the cross-version tests.

A leg's environment is ``.matrix/<leg>/`` (``python -m matrix build <leg>``; ``make test-matrix``
builds them all), and ``make venv``'s ``.venv`` is the default leg. A leg is another when its
Python or torch release differs from this interpreter's. Found without importing torch
(package metadata only), so collecting the tests stays fast.
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .launch import REPO

__all__ = ["Leg", "others", "this"]

_ASK = ("import json, platform; from importlib import metadata as m; "
        "print(json.dumps([platform.python_version(), m.version('torch'), m.version('numpy')]))")


@dataclass(frozen=True)
class Leg:
    name: str
    python: str
    python_version: str
    torch: str
    numpy: str

    @property
    def id(self) -> str:
        return f"{self.name}(py{self.python_version},torch{self.torch.split('+')[0]})"


def this() -> Leg:
    return Leg("this", sys.executable, platform.python_version(), metadata.version("torch"), metadata.version("numpy"))


def _candidates() -> list[tuple[str, Path]]:
    found = [("default", REPO / ".venv" / "bin" / "python")]
    found += [(p.parent.parent.name, p) for p in sorted((REPO / ".matrix").glob("*/bin/python"))
              if (p.parent.parent / ".installed").is_file()]
    return found


@functools.lru_cache(maxsize=None)
def others() -> tuple[Leg, ...]:
    """Every built leg whose (Python, torch) is not this interpreter's, one per (Python, torch)."""
    me = this()
    seen = {(me.python_version, me.torch)}
    out = []
    for name, exe in _candidates():
        if not exe.exists():
            continue
        try:
            ran = subprocess.run([str(exe), "-c", _ASK], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ran.returncode != 0:
            continue
        py, torch, numpy = json.loads(ran.stdout.strip().splitlines()[-1])
        if (py, torch) in seen:
            continue
        seen.add((py, torch))
        out.append(Leg(name, str(exe), py, torch, numpy))
    return tuple(out)
