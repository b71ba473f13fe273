"""Decisions the coordinator takes for every process of a job (one broadcast each).

Ranks that looked at the storage themselves could see different things (a checkpoint
committed meanwhile), so one process decides and the others take its answer. An error
travels as the exception object itself, so every rank raises the same type with the
same message, and none is left waiting in a collective for a coordinator that gave up.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .contracts import Strategy
from .errors import RollCkptError, StorageError, StorageFullError, disk_full

__all__ = ["decide", "storage_error"]

T = TypeVar("T")


def storage_error(exc: OSError, where: str) -> StorageError:
    """The roll-ckpt error for an ``OSError`` met while writing under ``where`` (a folder)."""
    if disk_full(exc):
        return StorageFullError(f"no space left under {where}: {exc}; free space there; training can go on "
                                "and the next save will try again")
    return StorageError(f"cannot write under {where}: {exc}; choose a writable location")


def decide(strategy: Strategy, fn: Callable[[], T], *, where: str,
           on_oserror: Callable[[OSError, str], RollCkptError] | None = None) -> T:
    """``fn()`` run on the coordinator, its result (or its error) on every process.

    An ``OSError`` becomes ``on_oserror(exc, where)`` (default: a :class:`StorageError`
    naming ``where``); any other unexpected error becomes a :class:`RollCkptError` naming
    ``where`` and its type, chained on the coordinator.
    """
    result: Any = None
    error: RollCkptError | None = None
    cause: BaseException | None = None
    if strategy.is_coordinator:
        try:
            result = fn()
        except RollCkptError as exc:
            error = exc
        except OSError as exc:
            error = on_oserror(exc, where) if on_oserror is not None else \
                StorageError(f"{where}: {type(exc).__name__}: {exc}")
            cause = exc
        except Exception as exc:  # every rank must hear of it: none may stay in the broadcast
            error, cause = RollCkptError(f"{where}: {type(exc).__name__}: {exc}"), exc
    result, error = strategy.broadcast((result, error))
    if error is not None:
        raise error from cause
    return result
