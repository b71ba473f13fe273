"""The job's processes acting as one: bounded collectives, one rank's failure raised on every
rank, and the coordinator's decisions taken for all.

**Bounded collectives** (:func:`checkpoint_group`, :func:`bounded`). Every collective
roll-ckpt issues in a save, its commit and a resume runs on a gloo group of roll-ckpt's own
(:func:`checkpoint_group`), created with ``checkpoint_config.collective_timeout_s`` (default
600 s; gloo's own default is 30 min): DCP's plan, write-result and metadata exchanges, the
coordinator's decisions (:func:`decide`) and the preemption check of ``maybe_save``. When
one does not complete in time, :func:`bounded` turns gloo's error into a
:class:`~roll_ckpt.errors.CollectiveTimeoutError` naming this rank, the phase and the step.
The commit protocol does the rest: a save whose collectives did not all complete never
reaches its manifest, and the coordinator removes what it wrote.

A timeout leaves the group unusable (gloo cannot tell which messages are late): the job must
be restarted, as after any lost rank; ``resume('latest')`` then finds the last whole
checkpoint.

**One rank's failure, raised on every rank** (``Strategy.agree``; DCP's strategies:
:meth:`roll_ckpt.plugin.DCPStrategy.agree`). Wherever a rank can fail
on its own before a collective the others enter (its state dict, its staging, the
coordinator's space check, begin or commit, a rank's checks or load on resume), the ranks
agree on the outcome instead: each hands its error (or ``None``) to ``strategy.agree``, and
all of them get the error of the lowest rank that failed. No rank is left waiting for one
that gave up, so no rank waits out ``checkpoint_config.collective_timeout_s`` for a failure
another rank already knows; the timeout stays for a rank that is truly hung.

The error crosses as the exception itself (every :class:`~roll_ckpt.errors.RollCkptError`
pickles as its own class), tagged with the rank it happened on, so every rank raises the
same class and the message ``rank N: ...``. An error from outside roll-ckpt's hierarchy (an
``OSError`` of a read, a ``RuntimeError`` of a ``load_state_dict``) crosses as a
:class:`~roll_ckpt.errors.StorageError` (an ``OSError`` still) or a
:class:`~roll_ckpt.errors.RollCkptError` naming the phase, its type and message; the rank it
happened on keeps it as the cause. It costs one all-reduce of one integer when no rank
failed, and a broadcast of the error when one did.

**Decisions the coordinator takes for every process** (:func:`decide`, one broadcast each).
Ranks that looked at the storage themselves could see different things (a checkpoint
committed meanwhile), so one process decides and the others take its answer. An error
travels as the exception object itself, so every rank raises the same type with the same
message, and none is left waiting in a collective for a coordinator that gave up.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

from ..contracts import Strategy
from ..errors import CollectiveTimeoutError, RollCkptError, StorageError, StorageFullError, carried, disk_full

__all__ = ["checkpoint_group", "bounded", "lost_peer", "from_rank", "decide", "storage_error"]

_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe")
_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def checkpoint_group(dist: Any, seconds: float) -> Any:
    """A new gloo group of every rank whose collectives give up after ``seconds`` (0: gloo's default)."""
    if seconds:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    return dist.new_group(backend="gloo")


def lost_peer(exc: BaseException) -> BaseException | None:
    """The error in ``exc`` (or what it carries) that says a collective's peer never answered."""
    for e in carried(exc):
        if isinstance(e, RollCkptError):
            continue
        # gloo raises RuntimeError (DistBackendError); a store's own timeouts are OSErrors
        # and must stay theirs (an S3 read timeout inside a save is the network's)
        if isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _SIGNS):
            return e
    return None


@contextmanager
def bounded(rank: int, phase: str, step: int | None, seconds: float, after: str = "") -> Iterator[None]:
    """Run a collective; a peer that never answered becomes a :class:`CollectiveTimeoutError`.

    ``phase``: what this rank was doing (``save: writing``); ``after``: what that means for
    the checkpoints (appended to the message)."""
    try:
        yield
    except CollectiveTimeoutError:
        raise
    except Exception as exc:  # DCP's CheckpointException is a BaseException: caught below
        _raise_if_lost(exc, rank, phase, step, seconds, after)
        raise
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _raise_if_lost(exc, rank, phase, step, seconds, after)
        raise


def _raise_if_lost(exc: BaseException, rank: int, phase: str, step: int | None, seconds: float, after: str) -> None:
    cause = lost_peer(exc)
    if cause is None:
        return
    at = f" of step {step}" if step is not None else ""
    limit = f"{seconds:.0f} s (checkpoint_config.collective_timeout_s)" if seconds else "the process group's timeout"
    gone = any(s in str(cause).lower() for s in _GONE)  # not a wait that ran out: a peer's connection closed
    what = ("lost its connection to another rank: that process ended (killed, crashed) or was cut off" if gone else
            f"gave up waiting for the other ranks after {limit}: one of them is stopped, hung or cut off")
    raise CollectiveTimeoutError(
        f"rank {rank}: {phase}{at} {what} ({type(cause).__name__}: {str(cause).strip()[:200]}). "
        f"{after or 'No checkpoint was committed or changed by it.'} Restart the job; "
        "resume('latest') picks the newest whole checkpoint") from exc


def from_rank(error: BaseException, rank: int, phase: str) -> RollCkptError:
    """``error`` as the roll-ckpt error every rank raises, marked as raised on ``rank``."""
    if not isinstance(error, RollCkptError):
        cls = StorageError if isinstance(error, OSError) else RollCkptError
        wrapped = cls(f"{phase} failed: {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        error = wrapped
    if error.origin_rank is None:
        error.origin_rank = rank
    return error


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
    with bounded(strategy.rank, phase, step, float(strategy.collective_timeout_s)):
        result, error = strategy.broadcast((result, error))
    if error is not None:
        raise error from cause
    return result
