"""Build a leg's virtual environment and run the whole suite in it.

A leg's environment is ``.matrix/<leg>/``: its Python's ``venv``, pip, the leg's pins and the
project's distributions installed editable, as ``make venv`` installs them (a framework leg:
the framework too, :attr:`Leg.framework`). It is built
again only when the leg's pins or the project's ``pyproject.toml`` files change (a stamp
holds their digest). The suite runs as ``make test`` runs it (two xdist workers; a framework
leg's suite is its :attr:`Leg.tests`); its JUnit report gives the counts and every skip's reason.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .legs import Leg

__all__ = ["ROOT", "MATRIX", "venv_of", "find_python", "python_of", "build", "run_suite", "versions"]

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / ".matrix"
PROJECT = ("-e", "packages/core", "-e", "packages/backend-fs", "-e", "packages/strategy-fsdp2",
           "-e", "packages/demo", "-e", "packages/integration-roll", "-e", "packages/integration-torchtitan",
           "-e", "packages/integration-verl",
           "-e", ".[all,dev]")
_VERSIONS = ("import json, platform, torch, numpy, transformers, ray; print(json.dumps({"
             "'python': platform.python_version(), 'torch': torch.__version__, 'numpy': numpy.__version__, "
             "'transformers': transformers.__version__, 'ray': ray.__version__}))")


def venv_of(leg: Leg) -> Path:
    return MATRIX / leg.name


def python_of(leg: Leg) -> str:
    """The leg's interpreter: its own (:attr:`Leg.interpreter`), else one of its ``major.minor``."""
    if not leg.interpreter:
        return find_python(leg.python)
    if not os.access(leg.interpreter, os.X_OK) or subprocess.run([leg.interpreter, "-c", ""],
                                                                 capture_output=True).returncode != 0:
        raise SystemExit(f"{leg.interpreter} does not run here; the leg {leg.name} runs on that interpreter")
    return leg.interpreter


def find_python(version: str) -> str:
    """The interpreter for ``major.minor``: ``MATRIX_PYTHON_3_10`` if set, else pyenv's newest
    patch release of it, else ``python3.10`` on PATH when it runs."""
    env = os.environ.get(f"MATRIX_PYTHON_{version.replace('.', '_')}")
    if env:
        return env
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"),
                   key=lambda p: tuple(int(x) if x.isdigit() else -1 for x in Path(p).parents[1].name.split(".")))
    if found:
        return found[-1]
    exe = shutil.which(f"python{version}")
    if exe and subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
        return exe
    if platform.python_version().startswith(version + "."):
        return sys.executable
    raise SystemExit(f"no Python {version} here: install it (pyenv install {version}) or set "
                     f"MATRIX_PYTHON_{version.replace('.', '_')} to its interpreter")


def _stamp(leg: Leg, python: str) -> str:
    h = hashlib.sha256(json.dumps([leg.python, list(leg.pins), python, list(leg.framework)]).encode())
    for f in sorted(ROOT.glob("packages/*/pyproject.toml")) + [ROOT / "pyproject.toml"]:
        h.update(f.read_bytes())
    return h.hexdigest()


def _sh(cmd: list[str], log: Path, **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))


def build(leg: Leg) -> Path:
    """``.matrix/<leg>/`` with the leg's stack; its python."""
    venv = venv_of(leg)
    python = python_of(leg)
    stamp = _stamp(leg, python)
    exe = venv / "bin" / "python"
    if (venv / ".installed").is_file() and (venv / ".installed").read_text() == stamp and exe.exists():
        return exe
    started = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    venv.mkdir(parents=True)
    log = venv / "build.log"
    _sh([python, "-m", "venv", str(venv)], log)
    _sh([str(exe), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    # the pins are constraints too: nothing the project asks for may move them
    constraints = venv / "constraints.txt"
    constraints.write_text("".join(p + "\n" for p in leg.pins))
    _sh([str(exe), "-m", "pip", "install", "-q", "--no-compile", "-c", str(constraints), *leg.pins, *leg.framework,
         *PROJECT], log)
    purelib = subprocess.run([str(exe), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([str(exe), "-m", "compileall", "-q", "-j", "0", purelib], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # a file that does not compile is skipped, as pip skips it
    (venv / ".installed").write_text(stamp)
    print(f"[{leg.name}] built in {time.monotonic() - started:.0f} s", flush=True)
    return exe


def _distribution(requirement: str) -> str:
    """``verl[verl-core]==0.9.1`` -> ``verl``."""
    return requirement.split("==")[0].split("[")[0].strip()


def versions(exe: Path | str, framework: tuple[str, ...] = ()) -> dict[str, str]:
    """The leg's stack as installed (and each framework's distribution's version)."""
    out = subprocess.run([str(exe), "-c", _VERSIONS], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{exe} cannot import its stack:\n{out.stderr[-2000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for name in map(_distribution, framework):
        got = subprocess.run([str(exe), "-c", f"from importlib.metadata import version; print(version({name!r}))"],
                             capture_output=True, text=True, timeout=120)
        found[name] = got.stdout.strip() if got.returncode == 0 else "not installed"
    return found


def _counts(junit: Path) -> dict[str, object]:
    tree = ET.parse(junit)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips: dict[str, int] = {}
    failures: list[str] = []
    for case in tree.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            counts["errors"] += 1
            failures.append(name)
        elif "failure" in kinds:
            counts["failed"] += 1
            failures.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = next(c for c in case if c.tag == "skipped").get("message", "").strip()
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "skips": skips, "failures": failures}


def run_suite(leg: Leg, exe: Path, workers: int, extra: list[str], recording: bool = False) -> dict[str, object]:
    """The whole suite in the leg's environment; its result (also ``.matrix/<leg>/result.json``).
    ``recording``: the run writes ``matrix/results/`` (the test that checks that record skips)."""
    venv = venv_of(leg)
    junit = venv / "junit.xml"
    junit.unlink(missing_ok=True)
    dist = ["-n", str(workers), "--dist", "worksteal"] if workers else []
    cmd = [str(exe), "-m", "pytest", "-q", *dist, "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(extra or leg.tests)]
    print(f"[{leg.name}] +", " ".join(cmd), flush=True)
    started = time.monotonic()
    env = {**os.environ, "ROLL_CKPT_TEST_LEG": leg.name}
    if recording:
        env["ROLL_CKPT_TEST_RECORDING"] = "1"
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    elapsed = time.monotonic() - started
    if not junit.exists():
        raise SystemExit(f"[{leg.name}] pytest wrote no report (exit {proc.returncode})")
    result = {"leg": leg.name, "who": leg.who, "pins": list(leg.pins) + list(leg.framework),
              "versions": versions(exe, leg.framework), "tests": list(leg.tests) or "the whole suite",
              **_counts(junit), "seconds": round(elapsed), "exit": proc.returncode,
              "date": time.strftime("%Y-%m-%d"), "whole_suite": not extra}
    (venv / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"[{leg.name}] {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
          f"{result['skipped']} skipped in {elapsed:.0f} s", flush=True)
    return result
