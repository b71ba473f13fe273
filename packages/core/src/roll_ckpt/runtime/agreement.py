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
same class and the message ``rank N: ...``. It costs one all-reduce of one integer when
no rank failed, and a broadcast of the error when one did.
"""

from __future__ import annotations

from typing import Any

from ..errors import RollCkptError, portable
from .torch_compat import all_reduce_ints

__all__ = ["first_error", "from_rank"]


def from_rank(error: BaseException, rank: int) -> BaseException:
    """``error`` marked as raised on ``rank`` (a roll-ckpt error's message then begins ``rank N:``)."""
    if isinstance(error, RollCkptError) and error.origin_rank is None:
        error.origin_rank = rank
    return error


def first_error(dist: Any, group: Any, rank: int, world_size: int,
                error: BaseException | None) -> BaseException | None:
    """The error of the lowest rank of ``group`` that has one, on every rank; ``None`` when
    none has. ``dist`` is ``torch.distributed`` (``None`` or a world of one: ``error`` itself)."""
    if error is not None:
        error = from_rank(portable(error), rank) if world_size > 1 else error
    if dist is None or world_size == 1:
        return error
    first = all_reduce_ints(dist, [rank if error is not None else world_size], dist.ReduceOp.MIN, group)[0]
    if first == world_size:
        return None
    box = [error if rank == first else None]
    src = dist.get_global_rank(group, first) if group is not None else first
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
