"""The one exception hierarchy for errors a user can cause.

Every message says what happened, to which file or key, and what to do about it. The
CLI prints ``str(error)`` on one line and exits non-zero; anything that is not a
``RollCkptError`` is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [  # the hierarchy; carried, portable, carried_roll_error and disk_full are core's helpers
    "RollCkptError",
    "ConfigError",
    "PluginError",
    "UnknownPluginError",
    "StorageError",
    "StorageFullError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "PartlyLoadedError",
    "UnsafeCheckpointError",
    "SaveError",
    "BackupError",
    "RollCkptDeprecationWarning",
    "CollectiveTimeoutError",
    "TorchCompatError",
]


def carried(exc: BaseException):
    """``exc`` and every exception it carries: causes, contexts and the per-rank failures
    of DCP's ``CheckpointException`` (``{rank: (exception, traceback)}``, in ``failures``
    or in ``args``). Each is yielded once."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, tuple):
            stack.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        for per_rank in [getattr(e, "failures", None), *getattr(e, "args", ())]:
            if isinstance(per_rank, dict):
                stack.extend(per_rank.values())


def carried_roll_error(exc: BaseException, *, include_self: bool = True) -> "RollCkptError | None":
    """The first roll-ckpt error ``exc`` is or carries (a refusal DCP brought from another rank)."""
    return next((e for e in carried(exc) if isinstance(e, RollCkptError) and (include_self or e is not exc)), None)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle (it is sent to other processes), else a
    :class:`RollCkptError` with its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RollCkptError(f"{type(exc).__name__}: {exc}")


def disk_full(exc: BaseException) -> bool:
    """True when ``exc`` (or what it carries) says the storage ran out of space or quota."""
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or "No space left on device" in str(e) for e in carried(exc))


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls)
    BaseException.__init__(error, *args)
    error.__dict__.update(state)
    return error


class RollCkptError(Exception):
    """Base class of every error roll-ckpt raises on purpose.

    Every subclass pickles as itself, whatever its constructor takes: errors cross
    processes (one rank's refusal is raised on every rank, DCP carries a rank's error to
    the coordinator), and each process raises the same type with the same message.

    An error one rank met and every rank raises (:mod:`roll_ckpt.runtime.distributed`) has
    :attr:`origin_rank` set, and its message begins ``rank N:``.
    """

    origin_rank: int | None = None
    """The rank the error happened on, when every rank of a job raises it; else ``None``."""

    def __str__(self) -> str:
        text = super().__str__()
        rank = self.origin_rank
        if rank is None or text.startswith(f"rank {rank}:"):
            return text
        return f"rank {rank}: {text}"

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class ConfigError(RollCkptError, ValueError):
    """A configuration key is missing, unknown, or has a value that is not allowed."""

    def __init__(self, key: str, problem: str, value: Any = None, allowed: str | None = None) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        msg = f"config key '{key}': {problem}"
        if value is not None:
            msg += f" (got {value!r})"
        if allowed:
            msg += f"; allowed: {allowed}"
        super().__init__(msg)


class PluginError(RollCkptError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class UnknownPluginError(PluginError, LookupError):
    """No installed plugin provides the requested backend or strategy name."""


class StorageError(RollCkptError, OSError):
    """The storage refused an operation (permissions, missing bucket, network...)."""


class StorageFullError(StorageError):
    """The storage ran out of space while writing a checkpoint."""


class CheckpointNotFoundError(RollCkptError, FileNotFoundError):
    """The path does not hold a committed checkpoint."""


class CheckpointCorruptError(RollCkptError):
    """A checkpoint file does not match its manifest (size, checksum, missing, extra)."""

    def __init__(self, checkpoint: str, faults: list[tuple[str, str]]) -> None:
        self.checkpoint = checkpoint
        self.faults = faults
        shown = "; ".join(f"{name}: {fault}" for name, fault in faults[:5])
        more = f" (+{len(faults) - 5} more)" if len(faults) > 5 else ""
        super().__init__(
            f"checkpoint {checkpoint} is damaged: {shown}{more}. "
            "Resume from an earlier checkpoint or from a backup copy."
        )


class PartlyLoadedError(CheckpointCorruptError):
    """Damage found part-way through a load with ``checkpoint_config.verify_before_load:
    false``: the state may already hold some of the checkpoint's tensors."""

    def __init__(self, checkpoint: str, faults: list[tuple[str, str]]) -> None:
        super().__init__(checkpoint, faults)
        self.args = (self.args[0] + " The state being loaded may already hold part of it "
                     "(checkpoint_config.verify_before_load: false checks each piece as it is loaded): "
                     "load a sound checkpoint into it, or rebuild it, before training on.",)


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint file asks to run code or to reach outside its folder."""


class SaveError(RollCkptError):
    """A save (usually an asynchronous one) failed; the cause is chained."""


class CollectiveTimeoutError(RollCkptError):
    """A collective of a save, commit or resume did not complete within
    ``checkpoint_config.collective_timeout_s``: another rank is stopped, hung or cut off.
    The message names this rank, the phase and the step; nothing was half-committed."""


class TorchCompatError(RollCkptError):
    """A torch API roll-ckpt relies on is missing from the installed torch (the message
    names the API, this torch and the releases the suite ran on)."""


class BackupError(RollCkptError):
    """Checkpoints could not be replicated to ``checkpoint_config.backup`` (raised at ``close()``).

    The local checkpoints are intact; :attr:`failed` maps each local checkpoint path that
    has no committed replica to the last error of its copy.
    """

    def __init__(self, message: str, failed: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})


class RollCkptDeprecationWarning(DeprecationWarning):
    """A name of roll-ckpt's API that moved: the message says where to; the old name works until 1.0."""
