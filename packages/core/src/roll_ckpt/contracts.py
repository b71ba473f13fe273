"""Every contract between core and its plugins, in one module that imports no implementation.

* :class:`Storage` (with :class:`Entry`) — what a backend does; ``roll_ckpt.testing``
  holds the conformance suite every backend passes.
* :class:`Strategy` — how a training state becomes state dicts and takes loaded values back
  (``dcp``, ``json``, ``fsdp2``...); :class:`StrategyIO` — what writes and reads its files.
* :class:`StagingPolicy` — how a save captures one kind of tensor (a named class with its
  own ``stage``/``release``); the first policy that claims a tensor captures it, core's
  regular copy last.
* :class:`ForeignCheckpoint` — a checkpoint another framework wrote (ROLL's, verl's...),
  recognized by a :class:`FormatRecord`: listed, checked and resumed read-only.
* The records the registration hooks return (:class:`BackendRecord`,
  :class:`StrategyRecord`, :class:`StagingPolicyRecord`, :class:`ConfigKeyRecord`,
  :class:`CommandRecord`, :class:`FormatRecord`), and the objects lifecycle hooks receive
  (:class:`SaveContext`, :class:`CommitInfo`, :class:`SpaceEstimate`).

A record's ``factory`` is called only when the thing is used, so registering a plugin
stays cheap (no torch.distributed import, no connection to a store).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Mapping, MutableMapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "Entry", "NetworkCounts", "Storage", "TakesOver", "ListsByPrefix", "CountsNetwork", "AbortableWrite",
    "STORAGE_CAPABILITIES", "capabilities", "Strategy", "StrategyIO", "StagingPolicy", "StagingGate", "SaveContext", "CommitInfo", "SpaceEstimate",
    "BackendRecord", "StrategyRecord", "StagingPolicyRecord", "ConfigKeyRecord", "CommandRecord",
    "ForeignCheckpoint", "FormatRecord",
]


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class Entry:
    """One item of a folder listing."""

    name: str
    path: str
    is_dir: bool
    size: int = 0
    mtime: float | None = None


@dataclass(frozen=True)
class NetworkCounts:
    """What a networked backend met so far: faults (failed attempts: a reset connection, a
    timeout, a 5xx answer), the retries it made, and the seconds those faults cost (the
    failed attempts and the waits between them). ``kinds`` counts faults by kind
    (``"503 SlowDown"``, ``"read timeout"``...). A backend that has them offers
    ``network_counts()`` (optional: local disks have none); counters only grow."""

    faults: int = 0
    retries: int = 0
    lost_s: float = 0.0
    kinds: Mapping[str, int] = field(default_factory=dict)

    def since(self, before: "NetworkCounts") -> "NetworkCounts":
        """What was met after ``before`` (an earlier reading of the same counters)."""
        kinds = {k: n - before.kinds.get(k, 0) for k, n in self.kinds.items() if n > before.kinds.get(k, 0)}
        return NetworkCounts(self.faults - before.faults, self.retries - before.retries,
                             max(0.0, self.lost_s - before.lost_s), kinds)

    def describe(self) -> str:
        """One line: ``3 fault(s), 3 retried, 1.2 s lost (2 × 503 SlowDown, 1 × read timeout)``."""
        kinds = ", ".join(f"{n} × {k}" for k, n in sorted(self.kinds.items(), key=lambda kv: -kv[1]))
        return (f"{self.faults} network fault(s), {self.retries} retried, {self.lost_s:.1f} s lost"
                + (f" ({kinds})" if kinds else ""))


@runtime_checkable
class Storage(Protocol):
    """What a backend must do. Paths are strings in the backend's own namespace, made
    with :meth:`join`; a backend decides what they look like."""

    url: str
    """The root the backend was created for, as the user wrote it (for messages)."""

    root: str
    """That root as a path of this backend (what :meth:`join` builds on)."""

    atomic_rename: bool
    """The backend's choice of commit protocol (:mod:`roll_ckpt.format.commit`).

    True (POSIX disks): :meth:`rename_dir` atomically publishes a folder, so a checkpoint
    is written into a temporary sibling and renamed into place. False (object stores): it
    is written in place and committed by writing its manifest last with :meth:`write_create`.
    """

    def join(self, *parts: str) -> str:
        """Join path parts with the backend's separator."""

    def exists(self, path: str) -> bool: ...

    def isdir(self, path: str) -> bool: ...

    def list(self, path: str) -> list[Entry]:
        """The direct children of ``path``; an empty list when it does not exist. A file's
        ``size`` must be its size: on stores without atomic rename it is checked against
        what the writer wrote before a checkpoint is committed."""

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; no error when it exists."""

    def open_read(self, path: str) -> BinaryIO:
        """A seekable binary reader. ``FileNotFoundError`` when missing."""

    def open_write(self, path: str) -> BinaryIO:
        """A binary writer, replacing any file there. The data is durable once ``close()`` returns.

        A writer may also have ``abort()``: the write failed, nothing of it may become a
        file (an object store aborts the multipart upload instead of completing it with
        what it has); ``close()`` after ``abort()`` does nothing."""

    def write_create(self, path: str, data: bytes) -> None:
        """Write ``data`` durably only if ``path`` does not exist, else ``FileExistsError``.

        This is the commit point on stores without atomic rename, so it must be
        create-only on the server side where the store offers that.
        """

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a folder; ``FileExistsError`` if ``dst`` exists. Durable on return.

        Only called when :attr:`atomic_rename` is true.
        """

    def rename_file(self, src: str, dst: str) -> None:
        """Rename one file inside an uncommitted folder (need not be atomic)."""

    def sync_dir(self, path: str) -> None:
        """Make the folder's entries durable (fsync on POSIX; nothing on object stores)."""

    def remove(self, path: str) -> None:
        """Remove one file; no error when it is missing."""

    def remove_tree(self, path: str) -> None:
        """Remove a folder and everything below it; no error when it is missing."""

    def free_bytes(self, path: str) -> int | None:
        """Free space where ``path`` lives, or ``None`` when the store cannot tell."""


@runtime_checkable
class TakesOver(Protocol):
    """A :class:`Storage` that can make a file from another without the bytes going through
    this process (incremental saves, :mod:`roll_ckpt.dcp.writer`). Optional: core
    copies through ``open_read``/``open_write`` for a storage without it."""

    def take_over(self, src: str, dst: str) -> str:
        """Make ``dst`` a file with ``src``'s bytes that stays whole when ``src`` is removed,
        durable once the folder holding it is synced or committed. Returns how: ``"link"``
        (a hard link: POSIX file systems), ``"server_copy"`` (a copy the store makes itself:
        object stores) or ``"copy"`` (the bytes read and written here). ``OSError`` when
        ``src`` is missing or the store refuses."""


@runtime_checkable
class ListsByPrefix(Protocol):
    """A :class:`Storage` that lists a folder's files by name prefix without listing the
    rest (an object store's key-prefix listing). Optional: core lists the folder and
    filters for a storage without it."""

    def list_prefix(self, path: str, prefix: str) -> list[Entry]:
        """The files directly in ``path`` whose name starts with ``prefix``."""


@runtime_checkable
class CountsNetwork(Protocol):
    """A :class:`Storage` that counts the network faults it met and retried. Optional: a
    storage without it reports none."""

    def network_counts(self) -> NetworkCounts | None:
        """The faults met so far (counters only grow); ``None`` when it is not networked."""


@runtime_checkable
class AbortableWrite(Protocol):
    """A file object from :meth:`Storage.open_write` that can be dropped unfinished: after
    ``abort()`` nothing of it is at its path, not even a short object (an object store's
    multipart upload is aborted). Optional: otherwise a failed save's cleanup removes the
    file with its folder."""

    def abort(self) -> None:
        """Drop what was written; the file object is closed after."""


STORAGE_CAPABILITIES: tuple[type, ...] = (TakesOver, ListsByPrefix, CountsNetwork)
"""The optional features of a :class:`Storage`, each a Protocol checked with ``isinstance``
(``roll-ckpt plugins`` lists each backend's; :class:`AbortableWrite` is its file objects')."""


def capabilities(storage_class: type) -> list[str]:
    """The names of the optional features :data:`STORAGE_CAPABILITIES` that ``storage_class`` has."""
    out = []
    for proto in STORAGE_CAPABILITIES:
        members = [m for m in vars(proto) if not m.startswith("_")]
        if all(callable(getattr(storage_class, m, None)) for m in members):
            out.append(proto.__name__)
    return out


# --------------------------------------------------------------------------- a save in progress


@dataclass(frozen=True)
class SpaceEstimate:
    """The estimated size of one checkpoint (all processes' files together)."""

    total: int
    tensor_bytes: int
    """The tensors' own bytes (exact)."""
    items: int
    """Items written (tensors and other values) across all processes."""
    files: int


@runtime_checkable
class StagingGate(Protocol):
    """What a staging policy that stages in waves within ``SaveContext.budget`` sets as
    ``SaveContext.gate`` (core's regular copy does, :class:`roll_ckpt.save.staging.WaveGate`):
    the caller fills the waves while the writer writes what is staged."""

    error: BaseException | None
    """The write's error once it failed (the caller stops filling)."""
    caller_done: threading.Event
    """Set once the caller recorded its blocked time (the writer waits for it)."""

    def fill(self) -> None:
        """The caller: stage every wave, each once the writer freed the memory it reuses."""

    def abort(self, error: BaseException) -> None:
        """The write (or a wave's staging) failed: neither side waits for the other any more."""

    def order(self, names: Sequence[str]) -> list[int]:
        """The writer: indices of ``names`` in the order to write them."""

    def expect(self, names: Sequence[str]) -> None:
        """The writer: the tensors this process's plan writes (the others count as written)."""

    def before(self, name: str) -> None:
        """The writer, before it writes ``name``: waits until its wave is staged."""

    def after(self, name: str) -> None:
        """The writer, after it wrote ``name``: frees its wave's memory once the wave is written."""


@dataclass
class SaveContext:
    """One save in progress, shared by the save pipeline, the strategy and the plugins."""

    step: int
    path: str
    """The committed path the checkpoint will have."""
    is_async: bool
    """True when the write goes on after ``save`` returns: staging must capture the tensors."""
    rank: int = 0
    world_size: int = 1
    staging: dict[str, str] = field(default_factory=dict)
    """Per tensor name, the policy that staged it (``zero_copy``, ``regular``...); async saves only."""
    bytes_copied: int = 0
    """Bytes copied while staging (0 for zero-copy tensors)."""
    bytes_allocated: int = 0
    """Staging memory allocated inside the call: a first save, or one nobody announced while the
    buffers' memory was freed (0 when they were ready: ``prepare_save``, ``keep_buffers``)."""
    blocked_s: float = 0.0
    """Seconds an asynchronous save blocked its caller, measured by the save pipeline alone
    (from the call until control went back to the caller)."""
    strategy: Any = None
    """The :class:`Strategy` doing the save."""
    reuse: MutableMapping[str, Any] = field(default_factory=dict)
    """What staging policies keep from one save to the next, by policy name (staging
    buffers...); owned by the manager, emptied when it closes."""
    budget: int = 0
    """Bytes regular staging may hold (``strategy_config.max_staging_bytes``); 0: no bound."""
    keep_buffers: bool = True
    """Staging buffers stay allocated after the write (``strategy_config.keep_staging_buffers``);
    False: a policy frees their memory in :meth:`StagingPolicy.release` (the manager sets it)."""
    gate: StagingGate | None = None
    """Set by a policy that stages in waves (within ``budget``): the writer asks it the
    order to write in and waits for each tensor to be staged; the caller fills it after
    the write has started (``roll_ckpt.save.staging.WaveGate``)."""
    _callbacks: dict[str, list[Callable[[], None]]] = field(default_factory=dict)
    """What :meth:`before_write` and :meth:`on_finished` registered, by phase."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_finished(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the write has finished (or failed): release staged memory."""
        with self._lock:
            self._callbacks.setdefault("finished", []).append(callback)

    def before_write(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the writing thread before anything is written (a policy's
        work that must not block the caller: rebuilding shards...)."""
        with self._lock:
            self._callbacks.setdefault("before_write", []).append(callback)

    def _run_callbacks(self, phase: str) -> None:
        with self._lock:
            callbacks = self._callbacks.pop(phase, [])
        for cb in callbacks:
            cb()

    # the save pipeline runs each phase's callbacks once: the same loop for both
    run_before_write_callbacks = functools.partialmethod(_run_callbacks, "before_write")
    """Run the :meth:`before_write` callbacks (the pipeline, in the writing thread, before the write)."""
    run_finished_callbacks = functools.partialmethod(_run_callbacks, "finished")
    """Run the :meth:`on_finished` callbacks (the pipeline, once the write has finished or failed)."""

    def note_staged(self, name: str, policy: str, nbytes_copied: int) -> None:
        self.staging[name] = policy
        self.bytes_copied += nbytes_copied


@dataclass(frozen=True)
class CommitInfo:
    """A committed checkpoint, as announced to ``roll_ckpt_on_commit``."""

    path: str
    step: int
    url: str
    manifest: dict[str, Any]
    component: str | None = None
    """The component whose part was committed; ``None`` for a whole checkpoint or step."""


# --------------------------------------------------------------------------- strategies and staging


class Strategy:
    """Turns a training state into state dicts and takes loaded values back: the base class
    every strategy subclasses (as fsspec's ``AbstractFileSystem``: the defaults make the
    optional members optional, and core calls every member directly).

    Built by a :class:`StrategyRecord`'s factory once per manager, from the state of the
    first ``resume``/``save``, with its :class:`StrategyIO` (``io_class(strategy)``), which the
    manager owns: the strategy says *what* is saved and where loaded values go; the I/O writes
    and reads every file. A save calls :meth:`state_dict`, then (core) staging, then the I/O's
    ``write``; a resume calls the I/O's ``load``, which asks :meth:`load_targets` for the state
    dict to read into and gives the values read to :meth:`hand_over`.

    A subclass sets ``name``, ``rank``, ``world_size``, ``data_dir`` and ``io_class`` and
    defines :meth:`state_dict`, :meth:`load_targets` and :meth:`hand_over`; the defaults of
    the others are right for a job of one process (a strategy that runs on several defines
    :meth:`broadcast`, :meth:`agree` and :meth:`any_true`; :class:`roll_ckpt.plugin.DCPStrategy` does).

    A strategy written before :class:`StrategyIO` (its own ``write``/``load``/``estimate``,
    no ``io_class``) keeps working until 1.0, with a ``RollCkptDeprecationWarning``: core then
    calls those methods through an I/O that forwards to them.
    """

    name: str
    """Set by every subclass (no default: a strategy that forgets it fails at once)."""
    rank: int = 0
    world_size: int = 1
    data_dir: str
    """The checkpoint's folder this strategy's I/O writes its files into (``dcp``, ``state``); set by every subclass."""
    collective_timeout_s: float = 0.0
    """How long the strategy's collectives wait for the other ranks; ``0``: their process
    group's own timeout (messages say so)."""
    io_class: "type[StrategyIO] | None" = None
    """The :class:`StrategyIO` that writes and reads this strategy's files (``None``: a
    strategy of the old contract, which writes and loads them itself)."""

    @functools.cached_property
    def is_coordinator(self) -> bool:
        """True on the one process that commits: rank 0 of the checkpoint group, unless the
        strategy sets it (an attribute, or in its ``__init__``). Read once: a strategy's rank
        does not change."""
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every process (picklable; exceptions included)."""
        return obj

    def agree(self, error: BaseException | None, phase: str, step: int | None = None) -> None:
        """Raise on every process the error of the lowest rank that has one (``None``: this
        process has none); return when no process has. Every process calls it at the same
        point of a save or resume, so one rank's failure ends every rank's wait at once; the
        error raised names its rank (``rank N: ...``). ``phase`` names the point in a
        :class:`~roll_ckpt.errors.CollectiveTimeoutError` when a rank never gets there."""
        if error is not None:
            raise error

    def any_true(self, flag: bool, step: int | None = None) -> bool:
        """True on every process when ``flag`` is true on at least one (called every step by
        ``maybe_save`` to agree on a preemption request: it must cost well under a millisecond)."""
        return flag

    def state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The live, nested state dict of ``state``: nothing copied yet."""
        raise NotImplementedError(f"{type(self).__name__}.state_dict")

    def load_targets(self, state: Mapping[str, Any], saved: Any, path: str) -> tuple[dict[str, Any], str]:
        """A load's first step: the state dict the I/O reads into (its tensors the live ones
        where they can be loaded in place), made to fit ``saved`` (what the I/O read of the
        folder ``path`` before any data: DCP's metadata, the parsed JSON), and the rank whose
        per-process values this process takes."""
        raise NotImplementedError(f"{type(self).__name__}.load_targets")

    def hand_over(self, state: MutableMapping[str, Any], target: dict[str, Any], src: str) -> None:
        """A load's last step: give the values the I/O read into ``target`` (and ``src``,
        from :meth:`load_targets`) to the modules, optimizers and objects of ``state``."""
        raise NotImplementedError(f"{type(self).__name__}.hand_over")

    def close(self) -> None:
        """Release what the strategy holds (process groups stay: they belong to the job)."""


class StrategyIO:
    """Writes a strategy's folder of a checkpoint and reads it back: the only code that
    touches the checkpoint's data files. One per manager, made with its strategy
    (``strategy.io_class(strategy)``); what it keeps across saves (a repeated layout, the base
    of incremental saves, the checkpoint last loaded) is its own.

    :class:`roll_ckpt.plugin.DCPIO` writes DCP folders; core's ``json`` strategy has one of
    its own, which never imports torch. A subclass defines :meth:`estimate`, :meth:`write` and
    :meth:`load`.
    """

    increments: Any = None
    """The record of the newest committed checkpoint that incremental saves take unchanged
    files over from (:class:`roll_ckpt.dcp.writer.Increments`), or ``None``: every save whole."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def estimate(self, sd: dict[str, Any], user: Mapping[str, Any] | None = None) -> SpaceEstimate:
        """The size of a checkpoint of ``sd`` (every process's files together)."""
        raise NotImplementedError(f"{type(self).__name__}.estimate")

    def write(self, sd: dict[str, Any], storage: Storage, path: str,
              on_bytes: Callable[[int], None] | None = None, *,
              save: SaveContext | None = None, alone: bool = False) -> dict[str, tuple]:
        """Write the staged ``sd`` into ``path``; on the coordinator, every file of every
        process (relative to ``path``) as ``(size, checksum)``. ``save.gate``, when set,
        orders the tensors and says when each is ready. ``alone`` (the fast recovery tier):
        this process writes a folder of its own, loadable without any other process's
        files, without collectives, and gets its own files' checksums."""
        raise NotImplementedError(f"{type(self).__name__}.write")

    def load(self, state: MutableMapping[str, Any], storage: Storage, path: str,
             on_bytes: Callable[[int], None] | None = None, *,
             files: Mapping[str, Any] | None = None, checkpoint: str | None = None,
             stream: bool = False, alone: bool = False) -> None:
        """Load the folder ``path`` into ``state`` in place (the strategy's
        :meth:`~Strategy.load_targets`, the read, its :meth:`~Strategy.hand_over`), checking
        each file against ``files`` (the manifest's entries, relative to ``path``) before any
        of it is used.

        By default nothing of ``state`` changes unless every file checks out. ``stream``
        (``checkpoint_config.verify_before_load: false``) allows one pass instead: each
        piece checked just before use, damage raising
        :class:`~roll_ckpt.errors.PartlyLoadedError` with ``state`` partly loaded.
        ``alone``: a folder this process wrote with ``write(alone=True)``, loaded without
        collectives."""
        raise NotImplementedError(f"{type(self).__name__}.load")

    def close(self) -> None:
        """Release what the I/O keeps across saves."""


@runtime_checkable
class StagingPolicy(Protocol):
    """How a save captures one kind of tensor, so the loop may change the live tensor at once.

    The save pipeline (:func:`roll_ckpt.save.staging.stage_state_dict`) asks the policies in
    order whether they claim each tensor; the first that does stages it, core's regular
    copy last. Adding a way of staging (pinned shared memory, GPU-direct, a memory
    budget) is one class like this and one hookimpl returning it.

    A policy object is shared by every manager of the process: what it keeps between
    saves goes into ``save.reuse[self.name]``.
    """

    name: str
    """Shown in ``SaveStats.policies`` and by ``roll-ckpt plugins``."""
    description: str

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        """True when this policy stages ``tensor`` (its flattened key is ``name``)."""

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        """What the write reads for each claimed ``(name, tensor)``, in order.

        With ``save.is_async`` the result must stay unmodified until :meth:`release`;
        otherwise the write happens before ``save`` returns and no copy is needed. Call
        ``save.note_staged`` for each item an asynchronous save captured.
        """

    def release(self, save: SaveContext) -> None:
        """The write of ``save`` has finished or failed: what was staged may be reused (or,
        unless ``save.keep_buffers``, freed)."""

    # Optional: ``prepare(reuse) -> Callable | None``, called in the caller's thread when a save
    # is near (``CheckpointManager.prepare_save``); the callable it returns runs in the writer
    # thread, after the write in flight: what ``stage`` needs, made ready off the loop.
    # Optional: ``active(save) -> bool``, asked once per save before any tensor: false when the
    # policy can claim nothing in it (a store holding no tensor), so it is not asked per tensor.


# --------------------------------------------------------------------------- other frameworks' checkpoints


@runtime_checkable
class ForeignCheckpoint(Protocol):
    """A checkpoint another framework wrote, as a :class:`FormatRecord` recognized it.

    roll-ckpt lists it (``roll-ckpt ls``), checks what can be checked (``verify``: no
    checksums, the framework wrote none), shows it (``inspect``) and resumes from it
    (``resume_from_checkpoint``: its path, or ``latest`` over a folder that holds it). It is
    only ever read: nothing in it is modified, moved or deleted, not even by retention.
    """

    format: str
    """The :class:`FormatRecord`'s name (``roll``)."""
    title: str
    """What it is, for messages: ``ROLL checkpoint``."""
    path: str
    step: int
    problems: list[str]
    """Why it cannot be resumed from, each naming its file (a save the framework never
    finished); empty when it can.

    Optional member ``not_resumable`` (a string, read with ``getattr``): why a folder that *is*
    whole is still not a resume point -- a model-only export a framework writes at the end of
    a run (torchtitan's ``last_save_model_only``). ``latest`` passes over it naming the reason,
    ``verify`` calls it whole, and an explicit resume of it is refused with that reason."""

    def components(self) -> list[str]:
        """The parts it holds, by roll-ckpt component name (``actor_train``, ``critic``, ``pipeline``)."""

    def files(self) -> dict[str, int]:
        """Every file it holds, relative to :attr:`path`, with its size."""

    def describe(self) -> list[str]:
        """Lines for ``roll-ckpt inspect``: what each part holds (keys, shapes, values)."""

    def resume(self, state: MutableMapping[str, Any], strategy: Any, component: str | None) -> dict[str, Any]:
        """Load it (``component``'s part; ``None``: the one a job without components takes)
        into ``state`` on every process of ``strategy``, which calls it at the same point on
        each; return what a ``trainer_state.json`` holds (``step`` at least). Raises
        :class:`~roll_ckpt.errors.RollCkptError` naming the file or key at fault."""


# --------------------------------------------------------------------------- registration records


@dataclass(frozen=True)
class BackendRecord:
    """A storage backend, selected by ``checkpoint_config.type``."""

    name: str
    """The value of ``checkpoint_config.type`` that selects this backend."""
    factory: Callable[[str, Mapping[str, Any]], Storage]
    """``factory(url, storage_options)`` returns a :class:`Storage`."""
    install_hint: str = ""
    """What to ``pip install`` when this backend is missing (shown in errors)."""
    description: str = ""
    storage_classes: tuple[str, ...] = ()
    """``"module:Class"`` of each storage class the factory may return, imported only by
    ``roll-ckpt plugins`` to list their optional features (:func:`capabilities`)."""
    distribution: str = ""
    """Filled in by the plugin manager: the distribution that registered the record."""


def _applies_never(state: Mapping[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class StrategyRecord:
    """A way of turning a training state into a checkpoint (single process, FSDP2...)."""

    name: str
    factory: Callable[..., Strategy]
    """``factory(config, plugins)`` returns a :class:`Strategy` (``config``: a
    :class:`roll_ckpt.Config`; ``plugins``: the plugin manager, for hooks)."""
    applies: Callable[[Mapping[str, Any]], bool] = field(default=_applies_never)
    """True when this strategy must handle ``state`` (e.g. it holds DTensors)."""
    priority: int = 0
    """Among strategies that apply, the highest priority wins."""
    install_hint: str = ""
    description: str = ""
    distribution: str = ""


@dataclass(frozen=True)
class StagingPolicyRecord:
    """A :class:`StagingPolicy` a plugin provides; its name and description are the policy's."""

    policy: StagingPolicy
    """The object that does the work (``roll-ckpt plugins`` lists it too)."""
    priority: int = 0
    """Policies are asked highest first; core's regular copy is always asked last."""
    distribution: str = ""

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def description(self) -> str:
        return self.policy.description


@dataclass(frozen=True)
class ConfigKeyRecord:
    """A config key a plugin owns: core validates it with :attr:`validate` and keeps the
    result in :attr:`roll_ckpt.Config.options`; core itself never interprets it."""

    key: str
    """Top-level key (``my_key``) or one inside ``strategy_config``
    (``strategy_config.<key>``), where a ROLL worker section may also set it."""
    default: Any
    validate: Callable[[str, Any], Any]
    """``validate(key_path, value)`` returns the value to keep or raises
    :class:`roll_ckpt.ConfigError` naming ``key_path``, the value and what is allowed."""
    description: str = ""
    distribution: str = ""

    @property
    def name(self) -> str:
        return self.key


@dataclass(frozen=True)
class CommandRecord:
    """A ``roll-ckpt`` sub-command a plugin adds (``roll-ckpt demo`` is one)."""

    name: str
    help: str
    add_arguments: Callable[[Any], None]
    """``add_arguments(parser)``: an ``argparse`` sub-parser to fill."""
    run: Callable[[Any], int]
    """``run(args)`` returns the exit status; a :class:`roll_ckpt.RollCkptError` it raises
    is printed on one line."""
    description: str = ""
    distribution: str = ""


@dataclass(frozen=True)
class FormatRecord:
    """A checkpoint layout another framework writes (ROLL's, verl's, torchtitan's), which
    roll-ckpt recognizes, resumes from read-only and, with :attr:`export`, writes."""

    name: str
    """``roll-ckpt export --format <name>``; shown by ``roll-ckpt ls``."""
    recognize: Callable[[Storage, str], ForeignCheckpoint | None]
    """``recognize(storage, path)``: the checkpoint at ``path`` if it is one of this format
    (complete or not: its :attr:`ForeignCheckpoint.problems` say), else ``None``. Cheap:
    it is asked about every folder ``latest`` passes; it reads no tensor data."""
    folder_pattern: str = r"^checkpoint-(\d+)$"
    """The names its checkpoint folders have (a regular expression whose first group is the
    step), looked for in ``output_dir`` and in its run folders."""
    export: Callable[..., str] | None = None
    """``export(storage, path, out, *, component, overwrite, notes)`` writes the committed
    roll-ckpt checkpoint at ``path`` (a step of components: every part the framework keeps,
    or ``component``'s) as a folder ``out`` (a local path) the framework's own loader reads,
    and returns one line saying what it wrote (``roll-ckpt export --format <name>``).
    ``notes(line)`` prints a remark; ``overwrite`` allows replacing ``out``."""
    description: str = ""
    install_hint: str = ""
    distribution: str = ""
