"""One rank's failure, raised on every rank at once.

Wherever a rank can fail on its own before a collective the others enter (its state
dict, its staging, the coordinator's space check, begin or commit, a rank's checks or
load on resume), the ranks agree on the outcome instead: each hands its error (or
``None``) to :func:`first_error`, and all of them get the error of the lowest rank that
failed. No rank is left waiting for one that gave up, so no rank waits out
``checkpoint_config.collective_timeout_s`` for a failure another rank already knows; the
timeout stays for a rank that is truly hung.

The error crosses as the exception itself (every :class:`~roll_ckpt.errors.RollCkptError`
pickles as its own class), tagged with the rank it happened on, so every rank raises the
same class and the message ``rank N: ...``. An error from outside roll-ckpt's hierarchy
(an ``OSError`` of a read, a ``RuntimeError`` of a ``load_state_dict``) crosses as a
:class:`~roll_ckpt.errors.StorageError` (an ``OSError`` still) or a
:class:`~roll_ckpt.errors.RollCkptError` naming the phase, its type and message; the rank
it happened on keeps it as the cause. It costs one all-reduce of one integer when
no rank failed, and a broadcast of the error when one did.
"""

from __future__ import annotations

from typing import Any

from ..errors import RollCkptError, StorageError, portable
from .torch_compat import all_reduce_ints

__all__ = ["first_error", "from_rank"]


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


def first_error(dist: Any, group: Any, rank: int, world_size: int, error: BaseException | None,
                phase: str) -> BaseException | None:
    """The error of the lowest rank of ``group`` that has one, on every rank; ``None`` when
    none has. ``dist`` is ``torch.distributed`` (``None`` or a world of one: ``error`` itself)."""
    if dist is None or world_size == 1:
        return error
    if error is not None:
        error = from_rank(portable(error), rank, phase)
    first = all_reduce_ints(dist, [rank if error is not None else world_size], dist.ReduceOp.MIN, group)[0]
    if first == world_size:
        return None
    box = [error if rank == first else None]
    src = dist.get_global_rank(group, first) if group is not None else first
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
