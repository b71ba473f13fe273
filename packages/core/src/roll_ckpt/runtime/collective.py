"""Decisions the coordinator takes for every process of a job (one broadcast each).

Ranks that looked at the storage themselves could see different things (a checkpoint
committed meanwhile), so one process decides and the others take its answer. An error
travels as the exception object itself, so every rank raises the same type with the
same message, and none is left waiting in a collective for a coordinator that gave up.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ..contracts import Strategy, strategy_member
from ..errors import RollCkptError, StorageError, StorageFullError, disk_full
from .timeouts import bounded

__all__ = ["decide", "storage_error"]

T = TypeVar("T")


def storage_error(exc: Exception, where: str) -> StorageError:
    """The roll-ckpt error for a failure met while writing under ``where`` (a folder): an
    ``OSError``, or a store client's own error type (S3 unreachable)."""
    if disk_full(exc):
        return StorageFullError(f"no space left under {where}: {exc}; free space there; training can go on "
                                "and the next save will try again")
    return StorageError(f"cannot write under {where}: {type(exc).__name__}: {exc}; choose a writable, "
                        "reachable location; training can go on and the next save will try again")


def _default_error(exc: Exception, where: str) -> RollCkptError:
    if isinstance(exc, OSError):
        return StorageError(f"{where}: {type(exc).__name__}: {exc}")
    return RollCkptError(f"{where}: {type(exc).__name__}: {exc}")


def decide(strategy: Strategy, fn: Callable[[], T], *, where: str,
           on_error: Callable[[Exception, str], RollCkptError] = _default_error,
           phase: str = "taking the coordinator's decision", step: int | None = None) -> T:
    """``fn()`` run on the coordinator, its result (or its error) on every process.

    A :class:`RollCkptError` travels as it is; any other exception becomes
    ``on_error(exc, where)`` (default: a :class:`StorageError` for an ``OSError``, else a
    :class:`RollCkptError`, each naming ``where`` and the cause), chained on the coordinator.
    A coordinator that never answers ends the wait after the strategy's
    ``collective_timeout_s`` (:class:`~roll_ckpt.errors.CollectiveTimeoutError`, naming ``phase``).
    """
    result: Any = None
    error: RollCkptError | None = None
    cause: BaseException | None = None
    if strategy.is_coordinator:
        try:
            result = fn()
        except RollCkptError as exc:
            error = exc
        except Exception as exc:  # every rank must hear of it: none may stay in the broadcast
            error, cause = on_error(exc, where), exc
    with bounded(strategy.rank, phase, step, float(strategy_member(strategy, "collective_timeout_s"))):
        result, error = strategy.broadcast((result, error))
    if error is not None:
        raise error from cause
    return result
