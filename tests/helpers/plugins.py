"""Plugins in tests: a plugin manager with one extra backend, and the test-fixture backend
distribution (``tests/plugins/example_backend``: ``roll-ckpt-example-backend``, backend
``example_dir``), which is never part of the set-up (``make venv``) and is installed for the
tests that ask for it only (the ``example_backend`` fixture of tests/conftest.py)."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .launch import TESTS

EXAMPLE_BACKEND = TESTS / "plugins" / "example_backend"

# The environment switches of plugin loading (and the signing key): never inherited by a test.
PLUGIN_SWITCHES = ("ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD", "ROLL_CKPT_PLUGINS", "ROLL_CKPT_BLOCKED_PLUGINS",
                   "ROLL_CKPT_SIGNING_KEY")


def plugins_with_backend(backend: str, factory: Callable[[str, Mapping[str, Any]], Any], name: str) -> Any:
    """A fresh :class:`roll_ckpt.plugins.Plugins` plus the plugin ``name`` (distribution
    ``test-<name>``) whose backend ``backend`` opens storages with ``factory(url, options)``."""
    from roll_ckpt.plugin import BackendRecord, hookimpl
    from roll_ckpt.plugins import Plugins

    class _Plugin:
        @hookimpl
        def roll_ckpt_backends(self) -> list[BackendRecord]:
            return [BackendRecord(name=backend, factory=factory)]

    plugins = Plugins()
    plugins.register(_Plugin(), name=name, distribution=f"test-{name}")
    return plugins


def install_example_backend(target: Path, timeout: float = 300) -> Path:
    """``pip install`` the fixture distribution into the folder ``target`` (offline: no index,
    no dependencies, no build isolation; its build backend, hatchling, is in the dev extra)."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(target), str(EXAMPLE_BACKEND)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot install the test-fixture backend ({' '.join(cmd)}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return target


def reload_plugins() -> None:
    """The process-wide plugin manager, found again from what is installed now (without the
    plugin switches: tests start without them)."""
    from roll_ckpt.plugins import get_plugins

    saved = {k: os.environ.pop(k) for k in PLUGIN_SWITCHES if k in os.environ}
    try:
        get_plugins(reload=True)
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def installed(site: Path) -> Iterator[Path]:
    """Distributions installed in the folder ``site`` are installed while the block runs: for
    this process (``sys.path``; the process-wide plugin manager is found again on entry and
    on exit) and for the processes it starts (``PYTHONPATH``). A test that patches plugin
    discovery (``importlib.metadata.entry_points``) still has it patched on exit: find the
    plugins again once that is undone too (tests/conftest.py does, after the test)."""
    entry, before = str(site), os.environ.get("PYTHONPATH")
    sys.path.insert(0, entry)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (entry, before) if p)
    importlib.invalidate_caches()
    reload_plugins()
    try:
        yield site
    finally:
        while entry in sys.path:
            sys.path.remove(entry)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        for name, module in list(sys.modules.items()):  # modules imported from there are gone too
            if str(getattr(module, "__file__", None) or "").startswith(entry + os.sep):
                del sys.modules[name]
        importlib.invalidate_caches()
        reload_plugins()
