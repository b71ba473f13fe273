"""What a manager's save pipeline and resume logic share: one job's storage, plugins,
strategy and run folder (:class:`Job`)."""

from __future__ import annotations

import json
import logging
import threading
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, ContextManager, Mapping

from .backup import BackupLink
from ..runtime.distributed import decide, storage_error
from ..config.schema import Config
from ..contracts import CommitInfo, Storage, Strategy
from ..errors import RollCkptDeprecationWarning, RollCkptError
from ..format.owners import hold, release
from ..format.manifest import Manifest
from ..plugins import Plugins
from ..runtime.progress import Progress, progress
from .retention import note_open_run
from ..format.owners import claim_run_folder, release_folder
from ..runtime.distributed import bounded

__all__ = ["Job", "open_storage"]

log = logging.getLogger("roll_ckpt")


def open_storage(plugins: Plugins, type_: str, url: str, options: Mapping[str, Any]) -> Storage:
    """The backend ``type_`` (``checkpoint_config.type``) rooted at ``url``."""
    return plugins.backend(type_).factory(url, dict(options))


@dataclass
class Job:
    config: Config
    component: str | None
    storage: Storage
    plugins: Plugins
    quiet: bool = False
    backup: BackupLink | None = None
    strategy: Strategy | None = None
    """Chosen from the state by :meth:`bind` (the first ``resume``/``save``)."""
    token: str = ""
    """The same on every process of this manager: names its saves' temporary folders."""
    run_dir: str | None = None
    resumed_from: str | None = None
    local_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by retention and ``backup.keep_local`` while they remove local checkpoints."""
    local: Any = None
    """The fast recovery tier (``checkpoint_config.local``; a ``LocalTier``), or ``None``."""
    open: bool = True
    """False once its manager closes: until then retention by other managers of this process
    leaves this job's run folder alone."""
    held: str | None = None
    """Coordinator: the hold on the checkpoint this launch resumed from (:mod:`roll_ckpt.format.owners`)."""

    def hold(self, path: str) -> None:
        """Hold the checkpoint at ``path`` (coordinator, before reading it) until this launch
        commits one of its own or closes."""
        self.release_hold()
        try:
            self.held = hold(self.storage, path, self.token)
        except Exception as exc:  # a read-only location: nobody's retention removes anything there either
            log.info("roll-ckpt: cannot hold %s while resuming from it (%s: %s)", path, type(exc).__name__, exc)

    def release_hold(self) -> None:
        held, self.held = self.held, None
        try:
            release(self.storage, held)
        except Exception as exc:  # a hold of a process that is gone counts for nothing
            log.warning("roll-ckpt: could not remove the hold %s (%s: %s)", held, type(exc).__name__, exc)

    def release(self) -> None:
        """Let go of the hold and, with ``timestamp_subdir: false``, of ``output_dir`` (coordinator)."""
        try:
            self.release_hold()
            if self.run_dir == self.root and self.is_coordinator:
                release_folder(self.storage, self.root)
        except Exception as exc:  # a hold or lock of a process that is gone counts for nothing
            log.warning("roll-ckpt: could not remove this launch's hold or lock under %s (%s: %s)",
                        self.root, type(exc).__name__, exc)

    @property
    def root(self) -> str:
        return self.storage.root

    @property
    def is_coordinator(self) -> bool:
        return self.strategy is None or self.strategy.is_coordinator

    def bind(self, state: Mapping[str, Any]) -> Strategy:
        """The strategy for ``state``: forced by ``strategy_config.strategy_name``, else the
        highest-priority one that applies."""
        if self.strategy is not None:
            return self.strategy
        forced = self.config.strategy_config.strategy_name
        if forced:
            record = self.plugins.strategy(forced)
        else:
            fitting = [r for r in self.plugins.strategies().values() if r.applies(state)]
            if not fitting:
                raise RollCkptError("no installed strategy can save this state; `roll-ckpt plugins` lists them")
            record = max(fitting, key=lambda r: r.priority)
        strategy = as_strategy(record.factory(self.config, self.plugins), record.name)
        with bounded(strategy.rank, "the first save or resume: agreeing on a token", None,
                     float(strategy.collective_timeout_s)):
            self.token = strategy.broadcast(uuid.uuid4().hex[:12])
        self.strategy = strategy
        return strategy

    def ensure_run_dir(self) -> str:
        """This run's folder, claimed by the coordinator on first use."""
        if self.run_dir is not None:
            return self.run_dir
        cc = self.config.checkpoint_config
        assert self.strategy is not None
        name = decide(self.strategy, lambda: claim_run_folder(self.storage, self.root, cc, self.config.exp_name,
                                                                self.component),
                      where=f"checkpoint_config.output_dir {cc.output_dir}", on_error=storage_error,
                      phase="save: claiming the run folder")
        self.run_dir = self.storage.join(self.root, name) if name else self.root
        if name:
            note_open_run(self.run_dir, self)  # retention by other managers leaves it alone
        return self.run_dir

    def progress(self, desc: str, total: int | None = None) -> ContextManager[Progress | None]:
        """The coordinator's progress bar for ``with ... as on_bytes`` (``None`` where none is shown)."""
        return progress(desc, total, enabled=not self.quiet and self.is_coordinator)

    def announce(self, path: str, manifest: Manifest, component: str | None = None) -> None:
        """``roll_ckpt_on_commit`` for a checkpoint, a step or a part just committed here
        (the checkpoint this launch resumed from need not be held any longer)."""
        self.release_hold()
        self.plugins.hook.roll_ckpt_on_commit(info=CommitInfo(
            path=path, step=manifest.step, url=self.storage.url, manifest=json.loads(manifest.to_bytes()),
            component=component))


def as_strategy(strategy: Any, name: str) -> Strategy:
    """``strategy`` (what strategy ``name``'s factory built) as a :class:`Strategy`. One that does
    not subclass it (written against the protocol that class replaced) keeps working until 1.0:
    the defaults it leaves out are set on it, with a ``RollCkptDeprecationWarning``."""
    if isinstance(strategy, Strategy):
        return strategy
    warnings.warn(f"strategy '{name}' ({type(strategy).__qualname__}) does not subclass roll_ckpt.plugin.Strategy: "
                  "subclass it (objects of the old protocol work until 1.0)", RollCkptDeprecationWarning, stacklevel=4)
    for member in ("collective_timeout_s", "increments", "agree"):  # the protocol's optional members
        if not hasattr(strategy, member):
            default = getattr(Strategy, member)
            setattr(strategy, member, default.__get__(strategy) if callable(default) else default)
    return strategy
