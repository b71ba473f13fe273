"""Progress bars (bytes and rate) for work that lasts more than about a second.

Shown on stderr by the coordinator only; ``ROLL_CKPT_QUIET=1`` (or ``--quiet``) hides them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, ContextManager

__all__ = ["Progress", "progress", "quiet"]

_DELAY_S = 1.0


def quiet() -> bool:
    return os.environ.get("ROLL_CKPT_QUIET", "").strip().lower() not in ("", "0", "false", "no")


def progress(desc: str, total: int | None = None, *, enabled: bool = True) -> ContextManager["Progress | None"]:
    """A :class:`Progress` for ``with ... as on_bytes``, or, when no bar can be shown (``enabled``
    false, or ``ROLL_CKPT_QUIET``), ``None`` in its place: nothing counts bytes nobody sees."""
    if enabled and not quiet():
        return Progress(desc, total)
    return contextlib.nullcontext()


class Progress:
    """A byte counter that turns into a tqdm bar once the work lasts over a second."""

    def __init__(self, desc: str, total: int | None = None, *, enabled: bool = True) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        self.bytes = 0
        if enabled and not quiet():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             delay=_DELAY_S, leave=False, dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        with self._lock:
            self.bytes += n
            if self._bar is not None:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
