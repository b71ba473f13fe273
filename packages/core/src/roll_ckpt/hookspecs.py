"""Every hook a roll-ckpt plugin can implement, documented in one place.

Plugins are pluggy plugins of the project ``roll_ckpt``. A distribution exposes one
through the entry-point group ``roll_ckpt``::

    [project.entry-points.roll_ckpt]
    my_backend = "my_package.plugin"

and implements hooks with :data:`roll_ckpt.hookimpl`. Registration hooks return typed
records (:mod:`roll_ckpt.records`); lifecycle hooks let a plugin take part in a save.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .records import BackendRecord, StagingPolicyRecord, StrategyRecord
    from .savectx import CommitInfo, SaveContext

__all__ = ["hookspec", "hookimpl", "PROJECT"]

PROJECT = "roll_ckpt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ------------------------------------------------------------------ registration


@hookspec
def roll_ckpt_backends() -> list[BackendRecord]:
    """Return the storage backends this plugin provides.

    ``checkpoint_config.type`` selects one by :attr:`BackendRecord.name`. Two plugins
    returning the same name is an error that names both distributions.
    """


@hookspec
def roll_ckpt_strategies() -> list[StrategyRecord]:
    """Return the checkpoint strategies (how a training state becomes a checkpoint)."""


@hookspec
def roll_ckpt_staging_policies() -> list[StagingPolicyRecord]:
    """Return the staging policies this plugin implements in :func:`roll_ckpt_stage`.

    The records are informational (``roll-ckpt plugins`` lists them); the decision is
    made per tensor by :func:`roll_ckpt_stage`.
    """


# ------------------------------------------------------------------ lifecycle


@hookspec(firstresult=True)
def roll_ckpt_stage(name: str, tensor: Any, save: SaveContext) -> Any | None:
    """Capture one tensor of an asynchronous save; return what DCP should write.

    Called for every tensor of the state dict before ``save`` returns. The first
    non-``None`` result wins. Return the tensor itself (or an alias of its memory) only
    when the memory stays unmodified until the write has finished — register the
    release with :meth:`SaveContext.on_finished`. Core's fallback, which runs last,
    copies the tensor into a CPU staging buffer reused across saves.

    :param name: the flattened key (``model.layer.weight``).
    :param tensor: a ``torch.Tensor`` (or ``DTensor``) of the live state.
    :param save: the save in progress.
    """


@hookspec
def roll_ckpt_save(save: SaveContext) -> None:
    """A save starts: the state dict is built, nothing is written yet.

    Runs on every rank, in the caller's thread, before staging.
    """


@hookspec
def roll_ckpt_save_finished(save: SaveContext, error: BaseException | None) -> None:
    """The write of ``save`` has finished (``error`` is set if it failed).

    Runs on every rank, in the thread that wrote (a background thread for async
    saves). Staged memory may be reused from here on.
    """


@hookspec
def roll_ckpt_load(path: str, state: dict[str, Any]) -> None:
    """A checkpoint at ``path`` was verified and loaded into ``state``."""


@hookspec
def roll_ckpt_on_commit(info: CommitInfo) -> None:
    """A checkpoint was committed (its manifest is durable). Runs on the coordinator.

    With ``checkpoint_config.components``, once for the part a manager committed
    (``info.component`` set) and once more, in the one process that commits it, for the
    whole step (``info.component`` is ``None``).
    """
