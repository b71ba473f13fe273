"""verl's plugin entry point (``[project.entry-points."verl.plugins"] roll_ckpt``), loaded by
``import verl`` in every verl process: the driver, each Ray worker, each torchrun rank.

It imports nothing of verl: ``verl/__init__`` is still running, and importing verl's engine
package now would fix verl's platform (``transformer_impl.py`` reads it at import) before the
other plugins -- a vendor's or a test's platform -- have registered theirs. Instead the
engines of vendor ``roll_ckpt`` are registered (:func:`roll_ckpt_verl.engine.register`) right
after ``verl.workers.engine`` is imported, which every verl worker does before it builds an
engine. verl logs a plugin that fails to load at DEBUG only, then goes on with its own engine:
``python -m roll_ckpt_verl check`` says whether the switch works in an environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "verl.workers.engine"


def _after(module: Any) -> None:
    from .engine import register

    register()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: once ``verl.workers.engine`` is about to load, wraps its loader so
    that the registration runs right after the package's own code, then steps aside."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _after(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if verl's engine package is imported already, else right after it is."""
    if TARGET in sys.modules:
        _after(sys.modules[TARGET])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


install()
