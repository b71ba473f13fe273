"""Where the benchmark lives and how it starts its own processes.

Every Python process a benchmark starts runs one of its modules, ``-m bench.<name>``, with
the repository root as its working directory and first on ``PYTHONPATH``: it imports the
same ``bench`` package whatever the caller's working directory was.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root."""
RESULTS = os.path.join(ROOT, "bench", "results")
"""Where the benchmarks write by default (build output: ignored by git)."""


def module(name: str, *args: str) -> list[str]:
    """``python -m bench.<name> *args`` with this interpreter."""
    return [sys.executable, "-m", f"bench.{name}", *args]


def torchrun(nproc: int, name: str, *args: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node=<nproc> -m bench.<name> *args`` with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", f"bench.{name}", *args]


def child_env(**more: Any) -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH``, and ``more``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update({k: str(v) for k, v in more.items()})
    return env


def use_test_helpers() -> None:
    """Make the test suite's helpers importable (``helpers.training``, ``backend_fs.s3server``,
    ``backend_fs.faultproxy``): the soak and the S3 job of ``scale_jobs`` start the same
    throwaway SeaweedFS server and fault proxy as the tests. ``tests/`` is not an installed
    package, so it is put on ``sys.path`` (last: nothing installed is shadowed) -- the one
    place in ``bench/`` that changes ``sys.path``."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.append(tests)
