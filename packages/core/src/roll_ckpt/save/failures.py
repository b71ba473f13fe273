"""What a failed save raises, and ``on_save_error: warn``.

A save can fail on any rank at any step; whatever it met (an ``OSError`` of the disk,
DCP's ``CheckpointException`` carrying another rank's error, a refusal of ours) becomes
one roll-ckpt error that says which checkpoint, what happened and what to do
(:func:`save_error`). With ``checkpoint_config.on_save_error: warn`` a failed periodic save
is logged and counted instead of raised (:class:`WarnMode`); final saves always raise.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from ..errors import RollCkptError, SaveError, StorageError, StorageFullError, carried_roll_error, disk_full

__all__ = ["save_error", "agreed_failure", "WarnMode"]

log = logging.getLogger("roll_ckpt")


def save_error(exc: BaseException, step: int, url: str, world_size: int) -> RollCkptError:
    """``exc`` as the roll-ckpt error the save of ``checkpoint-<step>`` under ``url`` raises;
    one that DCP carried from another rank (its ``CheckpointException``) names the first
    rank that failed."""
    if isinstance(exc, RollCkptError):  # a refusal, an error agreed on by every rank: as it is
        return exc
    failures = getattr(exc, "failures", None)
    failed_rank = min(failures) if isinstance(failures, dict) and failures else None
    error = _translate(exc, failures[failed_rank] if failed_rank is not None else None, f"checkpoint-{step} under {url}")
    if failed_rank is not None and error.origin_rank is None and world_size > 1:
        error.origin_rank = failed_rank
    return error


def agreed_failure(exc: BaseException | None, step: int, url: str, world_size: int) -> RollCkptError | None:
    """What this rank hands to an agreement of the save: its failure as the error every rank raises."""
    if exc is None:
        return None
    error = save_error(exc, step, url, world_size)
    if error is not exc and error.__cause__ is None:
        error.__cause__ = exc  # (on this rank; the others get the message)
    return error


def _translate(exc: BaseException, first: Any, where: str) -> RollCkptError:
    ours = carried_roll_error(exc, include_self=False)  # e.g. a refusal, carried by DCP from another rank
    if ours is not None:
        return ours
    if disk_full(exc):
        return StorageFullError(
            f"no space left while writing {where}; nothing of it was committed and earlier "
            "checkpoints are intact. Free space or lower checkpoint_config.max_ckpt_to_keep; "
            "training can go on and the next save will try again")
    cause = exc
    if first is not None:  # DCP's CheckpointException: what the first rank hit, not its traceback
        cause = first[0] if isinstance(first, tuple) and first else first
    if isinstance(cause, PermissionError):
        return StorageError(f"permission denied while writing {where}: {cause}; choose a writable "
                            "checkpoint_config.output_dir")
    if isinstance(cause, OSError) and cause.errno == errno.EROFS:
        return StorageError(f"cannot write {where}: {cause.strerror}; nothing of it was committed "
                            "and earlier checkpoints are intact; choose a writable checkpoint_config.output_dir")
    return SaveError(f"saving {where} failed ({type(cause).__name__}: {cause}); nothing of it was "
                     "committed and earlier checkpoints are intact")


class WarnMode:
    """``checkpoint_config.on_save_error``: whether a failed periodic save is raised or absorbed."""

    def __init__(self, on_save_error: str) -> None:
        self.tolerant = on_save_error == "warn"
        self.failed_saves = 0
        """Saves that failed and were absorbed (``manager.stats.failed``)."""

    def absorbs(self, exc: BaseException, final: bool = False) -> bool:
        """Whether ``exc`` (a save's failure) is logged and counted instead of raised."""
        return self.tolerant and not final and isinstance(exc, (StorageError, SaveError))

    def tolerate(self, step: int | None, exc: BaseException) -> None:
        self.failed_saves += 1
        what = f"checkpoint-{step}" if step is not None else "the background save"
        log.warning("roll-ckpt: saving %s failed: %s -- training goes on and the next save tries again "
                    "(checkpoint_config.on_save_error: warn; %d failed save(s) so far)", what, exc, self.failed_saves)
