"""Bounded collectives: a rank that hangs (stopped, cut off) ends the others' wait.

Every collective roll-ckpt issues in a save, its commit and a resume runs on a gloo group
of roll-ckpt's own (:func:`checkpoint_group`), created with
``checkpoint_config.collective_timeout_s`` (default 600 s; gloo's own default is 30 min):
DCP's plan, write-result and metadata exchanges, the coordinator's decisions
(:func:`roll_ckpt.runtime.collective.decide`) and the preemption check of ``maybe_save``. When one
does not complete in time, :func:`bounded` turns gloo's error into a
:class:`~roll_ckpt.errors.CollectiveTimeoutError` naming this rank, the phase and the
step. The commit protocol does the rest: a save whose collectives did not all complete
never reaches its manifest, and the coordinator removes what it wrote.

A timeout leaves the group unusable (gloo cannot tell which messages are late): the job
must be restarted, as after any lost rank; ``resume('latest')`` then finds the last whole
checkpoint.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

from ..errors import CollectiveTimeoutError, RollCkptError, carried

__all__ = ["checkpoint_group", "bounded", "lost_peer"]

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
