"""Background replication of committed checkpoints to a second location (``checkpoint_config.backup``).

The manager hands every checkpoint it commits to a :class:`Replicator`; a thread of the
replicator's own (never the save thread) copies it to the backup with
:func:`roll_ckpt.tiers.transfer.copy_checkpoint` — streamed, verified at the destination,
committed by the destination backend's own protocol — at the same place relative to the
root::

    <output_dir>/<run>/checkpoint-<step>   ->   <backup.output_dir>/<run>/checkpoint-<step>

* A failed copy is retried ``backup.retries`` times with exponential backoff (1 s, 2 s,
  4 s... up to 60 s); every failure is logged, the last one as an error. A copy that
  failed or was interrupted is never counted as a backup: nothing of it is committed at
  the replica, and ``keep_local`` never removes its local checkpoint.
* Saves never wait for replication. ``close()`` waits at most ``backup.max_wait_s`` for
  the copies still queued or running, then stops them (an interrupted copy removes what
  it wrote) and reports what was not replicated; copies that failed for good are raised
  there as :class:`~roll_ckpt.errors.BackupError`.
* When the replicator starts (the first save of a run) it removes what killed copies left
  at the replica and queues every local committed checkpoint that has no committed
  replica yet — a copy killed with its process is made again by the next run.
* ``backup.keep_local: N`` — after a replica commits, the oldest local checkpoints whose
  replica is committed (the same manifest, byte for byte) are removed so that ``N`` local
  ones remain; the newest local one and any without a committed replica are kept.
  Checkpoints of another live run under the same ``output_dir`` are neither counted nor
  touched.

:attr:`Replicator.status` (``manager.backup.status``) tells, per checkpoint, where its
replica stands: ``queued``, ``copying``, ``committed``, ``failed``, ``interrupted`` or
``skipped`` (removed locally before it could be copied).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace

from ..config.schema import BackupConfig
from ..errors import (BackupError, CheckpointCorruptError, CheckpointNotFoundError, RollCkptError,
                     StorageError, UnsafeCheckpointError)
from ..format.layout import basename, committed, parse_step
from ..format.manifest import MANIFEST_NAME
from ..format.commit import clean_stale
from .retention import drop_empty_runs, live_foreign_runs, remove_checkpoint
from ..runtime.background import lower_priority
from ..contracts import Storage
from .transfer import CopyInterrupted, committed_manifest, copy_checkpoint, relative_path, same_checkpoint

__all__ = ["Replicator", "BackupStatus", "ReplicaStatus", "replica_path", "replica_url", "BACKOFF_S",
           "BACKOFF_MAX_S"]

log = logging.getLogger("roll_ckpt")

BACKOFF_S = 1.0
"""Wait before the first retry; doubled for each further one."""
BACKOFF_MAX_S = 60.0
STOP_GRACE_S = 2.0
"""After ``max_wait_s``, how long ``close()`` lets an interrupted copy clean up after itself."""

QUEUED, COPYING, COMMITTED, FAILED, INTERRUPTED, SKIPPED = (
    "queued", "copying", "committed", "failed", "interrupted", "skipped")


@dataclass(frozen=True)
class ReplicaStatus:
    """Where the replica of one local checkpoint stands."""

    local: str
    replica: str
    step: int
    state: str
    """``queued``, ``copying``, ``committed``, ``failed``, ``interrupted`` or ``skipped``."""
    attempts: int = 0
    error: str | None = None
    """The last copy error (kept after a successful retry, for the record)."""
    bytes: int = 0
    seconds: float = 0.0
    local_removed: bool = False
    """The local copy was removed by ``keep_local`` (the replica is the only copy now)."""


@dataclass(frozen=True)
class BackupStatus:
    """A snapshot of the replication of this manager's checkpoints (``manager.backup.status``)."""

    target: str
    """The backup location (``backup.output_dir``)."""
    checkpoints: tuple[ReplicaStatus, ...]
    running: bool
    """The replication thread is running."""

    def _with(self, *states: str) -> list[ReplicaStatus]:
        return [c for c in self.checkpoints if c.state in states]

    @property
    def committed(self) -> list[ReplicaStatus]:
        return self._with(COMMITTED)

    @property
    def pending(self) -> list[ReplicaStatus]:
        """Queued or being copied."""
        return self._with(QUEUED, COPYING)

    @property
    def failed(self) -> list[ReplicaStatus]:
        return self._with(FAILED)

    @property
    def not_replicated(self) -> list[ReplicaStatus]:
        """Everything without a committed replica: pending, failed, interrupted, skipped."""
        return [c for c in self.checkpoints if c.state != COMMITTED]

    def __str__(self) -> str:
        counts = {s: len(self._with(s)) for s in (COMMITTED, QUEUED, COPYING, FAILED, INTERRUPTED, SKIPPED)}
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"backup to {self.target}: {parts or 'nothing to replicate yet'}"


def replica_path(local: Storage, local_root: str, replica: Storage, path: str) -> str:
    """Where the local checkpoint ``path`` lives at the replica (same place below the root)."""
    rel = relative_path(local_root, path)
    return replica.join(replica.root, *rel.split("/")) if rel else replica.root


def replica_url(replica: Storage, path: str) -> str:
    """``path`` of ``replica`` as a URL the user can pass back (``s3://...``, a plain path...)."""
    try:
        rel = relative_path(replica.root, path)
    except ValueError:
        return path
    return replica.url.rstrip("/") + ("/" + rel if rel else "")


class Replicator:
    """Copies committed checkpoints to the backup location, in a thread of its own."""

    def __init__(self, local: Storage, local_root: str, replica: Storage, config: BackupConfig, *,
                 lock: threading.Lock | None = None, own_run: str | None = None,
                 nice: int = 0) -> None:
        self.local = local
        self.local_root = local_root
        self.replica = replica
        self.config = config
        self.lock = lock or threading.Lock()
        """Held while local checkpoints are removed (shared with the manager's retention)."""
        self._own_run = own_run  # this launch's run folder (its checkpoints are never "foreign")
        self._nice = nice
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._items: dict[str, ReplicaStatus] = {}
        self._current: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token = uuid.uuid4().hex[:12]

    # ------------------------------------------------------------------ public

    def start(self, catch_up: bool = True) -> None:
        """Start the thread (once); with ``catch_up`` it first queues what has no replica yet."""
        with self._cv:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, args=(catch_up,), name="roll-ckpt-backup",
                                            daemon=True)
            self._thread.start()

    def submit(self, path: str, step: int | None = None) -> None:
        """Queue the committed local checkpoint ``path`` (cheap: never blocks on a copy)."""
        with self._cv:
            old = self._items.get(path)
            if old is not None and old.state in (QUEUED, COPYING, COMMITTED):
                return
            if step is None:
                step = parse_step(basename(path)) or 0
            self._items[path] = ReplicaStatus(path, replica_path(self.local, self.local_root, self.replica, path),
                                              step, QUEUED)
            self._queue.append(path)
            self._cv.notify_all()

    @property
    def current(self) -> str | None:
        """The local checkpoint being copied right now (retention leaves it alone)."""
        return self._current

    @property
    def status(self) -> BackupStatus:
        with self._cv:
            items = tuple(self._items.values())
            running = self._thread is not None and self._thread.is_alive()
        return BackupStatus(self.replica.url, items, running)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being copied; ``False`` if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
        return True

    def close(self, max_wait_s: float | None = None) -> BackupStatus:
        """Wait up to ``max_wait_s`` (default ``backup.max_wait_s``), then stop; returns the final status.

        Copies still queued or running are interrupted (nothing of them is committed) and
        reported; they are made again by the next run's first save.
        """
        wait_s = self.config.max_wait_s if max_wait_s is None else max_wait_s
        drained = self.wait(wait_s) if self._thread is not None else not self._busy()
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(STOP_GRACE_S)
        with self._cv:
            for path in list(self._queue):
                self._set(path, state=INTERRUPTED, error="not copied: the manager closed first")
            self._queue.clear()
        status = self.status
        if not drained:
            left = [c for c in status.checkpoints if c.state in (INTERRUPTED, QUEUED, COPYING)]
            if left:
                log.warning("roll-ckpt: %d checkpoint(s) were not replicated to %s within "
                            "checkpoint_config.backup.max_wait_s=%gs (%s); nothing of them is committed there "
                            "and the next run's first save copies them", len(left), self.replica.url, wait_s,
                            ", ".join(c.local for c in left))
        return status

    def error(self) -> BackupError | None:
        """The error to raise at close: checkpoints whose copy failed for good."""
        failed = {c.local: c.error or "failed" for c in self.status.failed}
        if not failed:
            return None
        listed = "; ".join(f"{p}: {e}" for p, e in list(failed.items())[:3])
        more = f" (+{len(failed) - 3} more)" if len(failed) > 3 else ""
        return BackupError(f"{len(failed)} checkpoint(s) could not be replicated to {self.replica.url} "
                           f"after {self.config.retries + 1} attempt(s): {listed}{more}. The local checkpoints "
                           "are intact; `roll-ckpt copy` copies them by hand, or the next run retries them",
                           failed)

    # ------------------------------------------------------------------ thread

    def _busy(self) -> bool:
        return bool(self._queue) or self._current is not None

    def _set(self, path: str, **changes) -> None:
        old = self._items.get(path)
        if old is not None:
            self._items[path] = replace(old, **changes)

    def _run(self, catch_up: bool) -> None:
        lower_priority(self._nice)
        if catch_up:
            try:
                self._catch_up()
            except Exception as exc:  # a replica that cannot be listed: the copies will say more
                log.warning("roll-ckpt: could not check %s for checkpoints to replicate: %s", self.replica.url, exc)
        while True:
            with self._cv:
                while not self._queue and not self._stop.is_set():
                    self._cv.wait()
                if self._stop.is_set():
                    return
                path = self._queue.popleft()
                self._current = path
                self._set(path, state=COPYING)
            try:
                self._replicate(path)
            except BaseException as exc:  # never let the thread die silently
                log.error("roll-ckpt: replication of %s failed unexpectedly: %s", path, exc, exc_info=True)
                with self._cv:
                    self._set(path, state=FAILED, error=f"{type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    self._current = None
                    self._cv.notify_all()

    def _catch_up(self) -> None:
        try:
            clean_stale(self.replica, self.replica.root)
        except OSError as exc:
            log.info("roll-ckpt: could not clean up interrupted copies at %s: %s", self.replica.url, exc)
        for ref in self._local_refs():
            if self._stop.is_set():
                return
            if not self._replica_matches(ref.path):
                self.submit(ref.path, ref.step)

    def _local_refs(self) -> list:
        live = live_foreign_runs(self.local, self.local_root, self._own_run)
        return [r for r in committed(self.local, self.local_root) if not (r.run and r.run in live)]

    def _replica_matches(self, path: str) -> bool:
        dst = replica_path(self.local, self.local_root, self.replica, path)
        try:
            return same_checkpoint(committed_manifest(self.local, path), committed_manifest(self.replica, dst))
        except OSError:
            return False

    def _replicate(self, path: str) -> None:
        dst = replica_path(self.local, self.local_root, self.replica, path)
        attempts = self.config.retries + 1
        for attempt in range(1, attempts + 1):
            if self._stop.is_set():
                with self._cv:
                    self._set(path, state=INTERRUPTED, error="stopped before it was copied")
                return
            with self._cv:
                self._set(path, state=COPYING, attempts=attempt)
            try:
                report = copy_checkpoint(self.local, path, self.replica, dst, stop=self._stop, token=self._token)
            except CopyInterrupted:
                with self._cv:
                    self._set(path, state=INTERRUPTED, error="interrupted: the manager closed first")
                return
            except UnsafeCheckpointError as exc:
                self._give_up(path, exc, "the local checkpoint is refused")
                return
            except CheckpointCorruptError as exc:
                if exc.checkpoint == dst:  # damaged on the way: the replica store is at fault, retry
                    if not self._retry(path, attempt, attempts, exc):
                        return
                    continue
                self._give_up(path, exc, "the local checkpoint is damaged; it has no backup")
                return
            except CheckpointNotFoundError:
                with self._cv:
                    self._set(path, state=SKIPPED, error="removed locally before it was replicated")
                log.warning("roll-ckpt: %s was removed locally (retention) before it could be replicated to %s",
                            path, self.replica.url)
                return
            except (StorageError, OSError) as exc:
                if not self._retry(path, attempt, attempts, exc):
                    return
                continue
            except RollCkptError as exc:  # e.g. a different checkpoint is committed there
                self._give_up(path, exc, "not retried")
                return
            except Exception as exc:  # a store's own error types (botocore...): retry
                if not self._retry(path, attempt, attempts, exc):
                    return
                continue
            with self._cv:
                self._set(path, state=COMMITTED, bytes=report.bytes, seconds=report.seconds)
            if report.skipped:
                log.info("roll-ckpt: %s is already replicated at %s", path, dst)
            else:
                log.info("roll-ckpt: replicated %s to %s (%d bytes in %.1fs, verified, committed)",
                         path, dst, report.bytes, report.seconds)
            self._keep_local()
            return

    def _retry(self, path: str, attempt: int, attempts: int, exc: BaseException) -> bool:
        """Log the failure; wait the backoff. ``False`` when it was the last attempt (or stopped)."""
        why = f"{type(exc).__name__}: {exc}"
        if attempt >= attempts:
            self._give_up(path, exc, f"after {attempts} attempt(s)")
            return False
        delay = min(BACKOFF_S * (2 ** (attempt - 1)), BACKOFF_MAX_S)
        with self._cv:
            self._set(path, error=why)
        log.warning("roll-ckpt: copying %s to %s failed (attempt %d of %d: %s); retrying in %.1fs",
                    path, self.replica.url, attempt, attempts, why, delay)
        if self._stop.wait(delay):
            with self._cv:
                self._set(path, state=INTERRUPTED, error=f"interrupted while waiting to retry after: {why}")
            return False
        return True

    def _give_up(self, path: str, exc: BaseException, note: str) -> None:
        why = f"{type(exc).__name__}: {exc}"
        with self._cv:
            self._set(path, state=FAILED, error=why)
        log.error("roll-ckpt: %s has NO backup at %s (%s): %s", path, self.replica.url, note, why)

    def _keep_local(self) -> None:
        keep = self.config.keep_local
        if keep <= 0:
            return
        refs = self._local_refs()
        if len(refs) <= keep:
            return
        # The replica checks (reads at the backup) happen outside the lock the saves' retention takes.
        doomed = [ref for ref in refs[:-keep] if not self._stop.is_set() and self._replica_matches(ref.path)]
        if not doomed:
            return
        with self.lock:
            for ref in doomed:
                if not self.local.exists(self.local.join(ref.path, MANIFEST_NAME)):
                    continue  # retention was first
                remove_checkpoint(self.local, ref.path)
                with self._cv:
                    self._set(ref.path, local_removed=True)
                log.info("roll-ckpt: removed local %s (keep_local=%d; its replica %s is committed)", ref.path,
                         keep, replica_url(self.replica, replica_path(self.local, self.local_root, self.replica,
                                                                      ref.path)))
            drop_empty_runs(self.local, self.local_root)
