"""What ``import roll_ckpt`` costs a fresh interpreter, and that it stays light.

Each run is a new ``python -c`` that times ``import roll_ckpt`` alone (interpreter start-up
not counted) and asserts that neither ``numpy`` nor ``torch.distributed`` is in
``sys.modules`` afterwards: a job that only reads its config, or the CLI, pays for neither.
The benchmark reports the median of a few runs as the row ``import`` (well under a second
in all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from .common import median
from .launch import ROOT

LIMIT_S = 0.5
"""The row's limit: seconds of ``import roll_ckpt`` (about 0.06 s on the project's 2-core machine)."""
LIGHT = ("numpy", "torch.distributed")
"""What ``import roll_ckpt`` must not import."""

CODE = f"""
import json, sys, time
t0 = time.perf_counter()
import roll_ckpt
seconds = time.perf_counter() - t0
heavy = [m for m in {LIGHT!r} if m in sys.modules]
assert not heavy, f"import roll_ckpt imported {{heavy}}"
print(json.dumps({{"seconds": seconds, "torch": "torch" in sys.modules}}))
"""


def measure(runs: int = 5, timeout: float = 60) -> dict[str, Any]:
    """``runs`` fresh interpreters: their seconds, the median, whether torch itself was
    imported; ``error`` when one failed (the assertion above, or roll_ckpt not importable)."""
    out: dict[str, Any] = {"runs": runs, "runs_s": [], "median_s": None, "not_imported": list(LIGHT),
                           "torch": None, "error": None}
    for _ in range(runs):
        try:
            # executable= given: always a new interpreter, even where Popen of sys.executable is
            # served by a fork of a warm one (the test suite's helpers.warm, torch already imported)
            proc = subprocess.run([sys.executable, "-c", CODE], executable=sys.executable, capture_output=True,
                                  text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            out["error"] = f"python -c 'import roll_ckpt' timed out after {timeout:.0f} s"
            break
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            out["error"] = lines[-1] if lines else f"exit {proc.returncode}"
            break
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out["runs_s"].append(got["seconds"])
        out["torch"] = got["torch"]
    out["median_s"] = median(out["runs_s"])
    return out


def target(imp: dict[str, Any] | None) -> dict[str, Any]:
    """The report's row ``import``: the median seconds <= :data:`LIMIT_S`, and nothing of :data:`LIGHT` imported."""
    imp = imp or {}
    value = None if imp.get("error") else imp.get("median_s")
    ok = value is not None and value <= LIMIT_S
    return {"value": value, "limit": LIMIT_S, "pass": bool(ok), "op": "<=",
            "what": f"import roll_ckpt in a fresh interpreter, seconds (median of {imp.get('runs', '?')}); and neither "
                    "numpy nor torch.distributed imported by it",
            "ms": value * 1e3 if value is not None else None, "runs_s": imp.get("runs_s"), "torch": imp.get("torch"),
            "error": imp.get("error")}
