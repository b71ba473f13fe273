"""The steps of verl's PPO trainer, committed as one: a part per role, then the trainer's ``data.pt``.

::

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt   written once the step it names is committed
        global_step_<N>/
            .verl-actor.pending             a role's save began and its part is not committed yet
            actor/      manifest.json ...   the actor's part: its roll-ckpt manager's (component actor)
            critic/     manifest.json ...   the critic's, by its own processes
            data.pt                         the trainer's dataloader state (written by verl's driver)
            manifest.json                   the step's: written last, create-only, covers all of the above

verl's trainer (``RayPPOTrainer._save_checkpoint``) calls each role's ``save_checkpoint`` in
turn, then writes ``data.pt``, then -- with ``checkpoint.async_save: false`` -- the tracker.
So once ``data.pt`` is whole, every role of the step has begun its save. Each role's
coordinator creates ``.verl-<role>.pending`` before its save returns and removes it once its
part is committed; a step is whole when ``data.pt`` is and every role with a marker has a
committed part. The process that finds it whole commits the step (``manager.commit_step``:
the step's manifest, ``data.pt`` hashed into it, then retention); with ``async_save: true``
it then writes the tracker (verl's trainer leaves it to the manager there), atomically; a step
committed late never takes the tracker back from one committed after it.

When: an asynchronous part commits in its writer thread, which then (every rank agreed on the
part's commit) waits, at most ``collective_timeout_s``, for ``data.pt``; a synchronous part returns before ``data.pt``
exists, so its step is committed by the next look at the folder: the role's next save, its
next load, or the end of its process (:meth:`RoleSteps.look_again`). Two processes finding a step
whole at once both try; the storage lets one create the step's manifest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Any

from roll_ckpt.plugin import get_plugins, hookimpl, torch_file_problem

from .layout import DATA, TRACKER

__all__ = ["RoleSteps", "marker_name", "write_tracker", "clear_for_save", "MARKER_RE"]

log = logging.getLogger("roll_ckpt")

MARKER_RE = re.compile(r"^\.verl-(.+)\.pending$")
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_TRACKER_LOCK = threading.Lock()


def marker_name(role: str) -> str:
    return f".verl-{role}.pending"


def _up(path: str, levels: int) -> str:
    for _ in range(levels):
        path = path.rstrip("/").rsplit("/", 1)[0]
    return path


class RoleSteps:
    """One role's side of the steps under ``root`` (its coordinator acts; the others do nothing)."""

    def __init__(self, manager: Any, role: str, *, tracker: bool, timeout_s: float) -> None:
        self.manager = manager
        """The role's roll-ckpt CheckpointManager (component ``role``, ``commit_steps: false``)."""
        self.storage = manager.storage
        self.root = manager.storage.root.rstrip("/")
        self.role = role
        self.tracker = tracker
        """Write ``latest_checkpointed_iteration.txt`` (verl's trainer does not, with ``async_save``)."""
        self.timeout_s = timeout_s
        self.wait_in_writer = False
        """Set per save: the part commits in the writer thread, which may wait for ``data.pt``."""
        self.threads: list[threading.Thread] = []
        # Its two commit hooks are registered for as long as it lives (the registry its manager
        # uses): a process without verl's steps runs none of this at its saves.
        self._plugins = get_plugins()
        self._plugins.register(self, name=f"verl-steps-{role}-{id(self):x}", distribution="roll-ckpt-verl")

    def close(self) -> None:
        for t in self.threads:
            t.join(self.timeout_s)
        self._plugins.unregister(self)

    def _ours(self, path: str, role: str | None) -> bool:
        """Whether ``path`` (``<root>/global_step_<N>/<role>``) is a part of this role's steps."""
        return role == self.role and _up(path, 2).rstrip("/") == self.root

    @hookimpl
    def roll_ckpt_on_commit(self, info: Any) -> None:
        """A part committed in this process: if it is this role's, its marker goes."""
        if self._ours(info.path, info.component):
            self.storage.remove(self.storage.join(self.step_path(info.step), marker_name(self.role)))

    @hookimpl
    def roll_ckpt_save_finished(self, save: Any, error: BaseException | None) -> None:
        """In the thread that wrote (every rank has agreed on the commit by now: no collective
        waits on what follows): an asynchronous part of this role committed, its coordinator
        waits for ``data.pt`` and commits the step."""
        if error is None and self._ours(save.path, save.path.rstrip("/").rsplit("/", 1)[-1]) and \
                self.wait_in_writer and self.manager.strategy.is_coordinator:
            self.await_step(save.step)

    def step_path(self, step: int) -> str:
        return self.storage.join(self.root, f"global_step_{step}")

    # ------------------------------------------------------------------ the role's save

    def begin(self, step: int) -> None:
        """Coordinator, before the part's save: this role's marker in the step's folder."""
        path = self.step_path(step)
        self.storage.makedirs(path)
        try:
            self.storage.write_create(self.storage.join(path, marker_name(self.role)),
                                      f"{os.getpid()} {time.time():.0f}\n".encode())
        except FileExistsError:
            pass  # a retry of the same step

    def await_later(self, step: int) -> None:
        """After a synchronous save: wait for the step in a thread of its own (the trainer writes
        ``data.pt`` once this returns). Not a daemon: a process that ends waits for it, bounded."""
        thread = threading.Thread(target=self.await_step, args=(step,), name=f"roll-ckpt-verl-step-{step}")
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def await_step(self, step: int) -> bool:
        """Wait (at most ``timeout_s``) for ``data.pt``, then commit the step if it is whole."""
        path = self.step_path(step)
        deadline = time.monotonic() + self.timeout_s
        pause = 0.02
        while self._data_problem(path) is not None:
            if time.monotonic() > deadline:
                log.warning("roll-ckpt: %s: the trainer's %s did not appear within %.0f s; the step is committed "
                            "by the next save or start once it is there", path, DATA, self.timeout_s)
                return False
            time.sleep(pause)
            pause = min(pause * 1.5, 0.5)
        return self.try_commit(step)

    # ------------------------------------------------------------------ committing steps

    def _data_problem(self, path: str) -> str | None:
        return torch_file_problem(self.storage, self.storage.join(path, DATA))

    def ready(self, path: str) -> list[str] | None:
        """The roles of the step at ``path`` when it is whole (``data.pt`` whole, every role that
        began its save committed), else ``None``."""
        if not self.storage.exists(self.storage.join(path, DATA)) or self._data_problem(path) is not None:
            return None
        parts, began = _parts(self.storage, path)
        if not parts or not began <= set(parts):
            return None
        return parts

    def try_commit(self, step: int) -> bool:
        """Commit ``step`` if it is whole (then write the tracker); True when this call did."""
        path = self.step_path(step)
        parts = self.ready(path)
        if parts is None:
            return False
        for role in parts:  # markers of committed parts (a process that died right after its commit)
            self.storage.remove(self.storage.join(path, marker_name(role)))
        if not self.manager.commit_step(step, parts, [DATA]):
            return False
        log.info("roll-ckpt: step %d committed (%s and %s)", step, ", ".join(parts), DATA)
        if self.tracker:
            write_tracker(self.storage, self.root, step)
        return True

    def look_again(self, below: int) -> list[int]:
        """Commit every step under ``root`` numbered below ``below`` that is whole but not
        committed yet (its last part was saved synchronously, or its waiter gave up or died).
        Steps from ``below`` on are left alone: at a save of step N or a resume of step N - 1,
        a folder numbered N or more was left by an earlier launch (another line of steps).
        Coordinator."""
        done = []
        for e in self.storage.list(self.root):
            m = _STEP_RE.match(e.name)
            if not (m and e.is_dir and int(m.group(1)) < below):
                continue
            if not self.storage.exists(self.storage.join(e.path, "manifest.json")) and self.ready(e.path) is not None \
                    and self.try_commit(int(m.group(1))):
                done.append(int(m.group(1)))
        return done


def _read_tracker(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER), "rb") as f:
            return int(f.read().decode().strip())
    except (OSError, ValueError):
        return None


def _committed_at(storage: Any, root: str, step: int) -> str | None:
    """When roll-ckpt committed ``global_step_<step>`` under ``root`` (its manifest's ``created``),
    or ``None`` when it is not a step roll-ckpt committed."""
    try:
        with storage.open_read(storage.join(root, f"global_step_{step}", "manifest.json")) as f:
            return str(json.loads(f.read().decode()).get("created", ""))
    except (OSError, ValueError, AttributeError):
        return None


def write_tracker(storage: Any, root: str, step: int) -> bool:
    """``latest_checkpointed_iteration.txt`` = ``step``, just committed: written to a temporary
    file, fsynced, renamed over the old one, the folder fsynced (verl's own is a plain
    ``open("w")``). Not when the tracker names a step roll-ckpt committed later (a step committed
    late, after a newer one, never takes the tracker back). True when written."""
    with _TRACKER_LOCK:  # this process's writer thread and its loop's look at earlier steps
        tracked = _read_tracker(root)
        if tracked is not None and tracked != step:
            theirs, mine = _committed_at(storage, root, tracked), _committed_at(storage, root, step)
            if theirs is not None and mine is not None and (theirs, tracked) > (mine, step):
                return False
        tmp = os.path.join(root, f".{TRACKER}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    log.info("roll-ckpt: %s: %d", os.path.join(root, TRACKER), step)
    return True


def _parts(storage: Any, path: str) -> tuple[list[str], set[str]]:
    """The committed parts of the step at ``path``, and the roles whose marker is there."""
    entries = storage.list(path)
    parts = sorted(e.name for e in entries if e.is_dir and not e.name.startswith(".")
                   and storage.exists(storage.join(e.path, "manifest.json")))
    return parts, {m.group(1) for e in entries if (m := MARKER_RE.match(e.name))}


def clear_for_save(storage: Any, step_path: str, role: str | None) -> str | None:
    """Make room for this launch's save of the step at ``step_path`` (coordinator, before the
    save; SFT: ``role`` ``None``). A launch saves each step once, so what is there was left by an
    earlier one -- verl's own manager would write over it in place:

    * a checkpoint someone could still want -- verl's, a step roll-ckpt committed, a PPO step
      whose parts and ``data.pt`` are all there but not its manifest, anything in an SFT step
      folder -- is moved aside, whole, to ``global_step_<N>.replaced-<time>`` (not a name any
      tool counts), with a warning;
    * a PPO step an earlier launch never finished is removed: with ``data.pt`` (every role had
      begun) but a part missing, all of it; else this role's own part and marker only (the
      other roles' may be this launch's). No tracker ever named such a step.

    Returns where the folder was moved, or ``None``."""
    from .verl_format import recognize

    if not storage.isdir(step_path):
        return None
    names = {e.name for e in storage.list(step_path)}
    parts, began = _parts(storage, step_path)
    whole = DATA in names and parts and began <= set(parts)
    if role is None or "manifest.json" in names or whole or recognize(storage, step_path) is not None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        aside, n = f"{step_path}.replaced-{stamp}", 0
        while storage.exists(aside):
            n += 1
            aside = f"{step_path}.replaced-{stamp}-{n}"
        storage.rename_dir(step_path, aside)
        log.warning("roll-ckpt: %s already held a checkpoint of an earlier run of this job; moved it to %s (verl's own "
                    "manager would have written over it). Remove it once it is not needed", step_path, aside)
        return aside
    if DATA in names:  # every role had begun, one never committed: nothing can resume it
        for part in parts:
            storage.remove(storage.join(step_path, part, "manifest.json"))
        storage.remove_tree(step_path)
        log.warning("roll-ckpt: removed %s: a step an earlier launch never finished", step_path)
        return None
    own = storage.join(step_path, role)
    if storage.isdir(own):
        storage.remove(storage.join(own, "manifest.json"))
        storage.remove_tree(own)
        log.warning("roll-ckpt: removed %s: the %s part of a step an earlier launch never finished", own, role)
    storage.remove(storage.join(step_path, marker_name(role)))
    return None
