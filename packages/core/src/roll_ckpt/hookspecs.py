"""Every hook a roll-ckpt plugin can implement, documented in one place.

Plugins are pluggy plugins of the project ``roll_ckpt``. A distribution exposes one
through the entry-point group ``roll_ckpt``::

    [project.entry-points.roll_ckpt]
    my_backend = "my_package.plugin"

and implements hooks with :data:`roll_ckpt.plugin.hookimpl`. Registration hooks return typed,
frozen records (:mod:`roll_ckpt.contracts`); two plugins registering the same name is an
error naming both distributions. Lifecycle hooks let a plugin take part in a save.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .contracts import (BackendRecord, CommandRecord, CommitInfo, ConfigKeyRecord, FormatRecord, SaveContext,
                            StagingPolicyRecord, StrategyRecord)

__all__ = ["hookspec", "hookimpl", "PROJECT"]

PROJECT = "roll_ckpt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ------------------------------------------------------------------ registration


@hookspec
def roll_ckpt_backends() -> list[BackendRecord]:
    """Return the storage backends this plugin provides.

    ``checkpoint_config.type`` selects one by :attr:`BackendRecord.name`.
    """


@hookspec
def roll_ckpt_strategies() -> list[StrategyRecord]:
    """Return the checkpoint strategies (how a training state becomes a checkpoint)."""


@hookspec
def roll_ckpt_staging_policies() -> list[StagingPolicyRecord]:
    """Return the staging policies this plugin provides, each a
    :class:`~roll_ckpt.contracts.StagingPolicy` object in a record.

    For every tensor of a save, the policies are asked highest priority first whether
    they claim it; the first claim wins and core's ``regular`` copy (lowest priority)
    takes the rest. The same objects do the work and are listed by ``roll-ckpt plugins``.
    """


@hookspec
def roll_ckpt_config_keys() -> list[ConfigKeyRecord]:
    """Return the config keys this plugin owns (fsdp2: its offload store).

    Core validates each with the record's ``validate`` and keeps the value in
    :attr:`roll_ckpt.Config.options`; core never interprets them.
    """


@hookspec
def roll_ckpt_formats() -> list[FormatRecord]:
    """Return the checkpoint layouts of other frameworks this plugin recognizes (ROLL's...).

    ``roll-ckpt ls/verify/inspect`` describe such checkpoints, ``resume`` loads them
    (an explicit path, or ``latest`` when one is the newest), ``roll-ckpt export --format
    <name>`` writes one from a roll-ckpt checkpoint.
    """


@hookspec
def roll_ckpt_commands() -> list[CommandRecord]:
    """Return ``roll-ckpt`` sub-commands this plugin adds (``demo``)."""


# ------------------------------------------------------------------ lifecycle


@hookspec
def roll_ckpt_save(save: SaveContext) -> None:
    """A save starts: nothing is built or written yet.

    Runs on every rank, in the caller's thread, before the state dict is built.
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
