"""Where one launch writes (:class:`Run`, an immutable value the manager owns) and the steps
that fix it: the strategy chosen (with its I/O) and the token agreed (:func:`choose_strategy`), the run
folder claimed (:func:`claim_run`); and :class:`LaunchHold`, the hold on the checkpoint the
launch resumed from until its first own commit.

The manager keeps these and hands each save and resume what it needs: nothing here is a
bag the parts reach into.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import warnings
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, ContextManager, Mapping

from ..config.schema import Config
from ..contracts import Storage, Strategy, StrategyIO
from ..errors import RollCkptDeprecationWarning, RollCkptError
from ..format.commit import claim_run_folder, hold, release
from ..plugins import Plugins
from ..runtime.distributed import bounded, decide, storage_error
from ..runtime.progress import Progress, progress
from .retention import note_open_run

__all__ = ["Setup", "Run", "LaunchHold", "open_storage", "choose_strategy", "claim_run", "as_strategy", "OwnIO"]

log = logging.getLogger("roll_ckpt")


def open_storage(plugins: Plugins, type_: str, url: str, options: Mapping[str, Any]) -> Storage:
    """The backend ``type_`` (``checkpoint_config.type``) rooted at ``url``."""
    return plugins.backend(type_).factory(url, dict(options))


@dataclass(frozen=True)
class Setup:
    """What a manager was built with: the same for each of its saves and resumes."""

    config: Config
    component: str | None
    """This manager's part of a step made of several (``checkpoint_config.components``), or ``None``."""
    plugins: Plugins
    quiet: bool = False

    def progress(self, desc: str, strategy: Strategy, total: int | None = None) -> ContextManager[Progress | None]:
        """The coordinator's progress bar for ``with ... as on_bytes`` (``None`` where none is shown)."""
        if self.quiet or not strategy.is_coordinator:
            return contextlib.nullcontext()
        return progress(desc, total)


@dataclass(frozen=True)
class Run:
    """Where this launch writes, the same on every process of its manager."""

    storage: Storage
    token: str
    """Names this launch's saves' temporary folders (and its holds)."""
    folder: str | None = None
    """The run folder (``output_dir`` itself with ``timestamp_subdir: false``); ``None`` until
    the first save (or a resume of components) claims it."""

    @property
    def root(self) -> str:
        return self.storage.root


def choose_strategy(config: Config, plugins: Plugins, state: Mapping[str, Any]) -> tuple[Strategy, StrategyIO, str]:
    """The strategy for ``state`` (forced by ``strategy_config.strategy_name``, else the
    highest-priority one that applies), its I/O, and the token every process of the job agrees on."""
    forced = config.strategy_config.strategy_name
    if forced:
        record = plugins.strategy(forced)
    else:
        # asked highest priority first, the first that applies wins (of equal ones, the first
        # registered: a reversed sort keeps their order): the fallbacks below one that applies are never asked
        ranked = sorted(plugins.strategies().values(), key=attrgetter("priority"), reverse=True)
        record = next((r for r in ranked if r.applies(state)), None)
        if record is None:
            raise RollCkptError("no installed strategy can save this state; `roll-ckpt plugins` lists them")
    strategy, io = as_strategy(record.factory(config, plugins), record.name)
    with bounded(strategy.rank, "the first save or resume: agreeing on a token", None,
                 float(strategy.collective_timeout_s)):
        token = strategy.broadcast(uuid.uuid4().hex[:12])
    return strategy, io, token


def claim_run(run: Run, strategy: Strategy, config: Config, component: str | None,
              alive: Callable[[], bool]) -> Run:
    """``run`` with its folder: created (or joined, with ``run_name``) by the coordinator,
    decided for every process. ``alive``: whether the launch still writes there (retention
    by other managers of this process leaves the folder alone while it does)."""
    cc = config.checkpoint_config
    name = decide(strategy, lambda: claim_run_folder(run.storage, run.root, cc, config.exp_name, component),
                  where=f"checkpoint_config.output_dir {cc.output_dir}", on_error=storage_error,
                  phase="save: claiming the run folder")
    folder = run.storage.join(run.root, name) if name else run.root
    if name:
        note_open_run(folder, alive)
    return Run(run.storage, run.token, folder)


class LaunchHold:
    """The coordinator's hold on the checkpoint this launch resumed from (:mod:`roll_ckpt.format.commit`):
    another launch's retention leaves it alone until this one commits a checkpoint of its own or closes."""

    def __init__(self) -> None:
        self.held: tuple[Storage, str] | None = None

    def hold(self, run: Run, path: str) -> None:
        self.release()
        try:
            self.held = (run.storage, hold(run.storage, path, run.token))
        except Exception as exc:  # a read-only location: nobody's retention removes anything there either
            log.info("roll-ckpt: cannot hold %s while resuming from it (%s: %s)", path, type(exc).__name__, exc)

    def release(self) -> None:
        held, self.held = self.held, None
        if held is None:
            return
        try:
            release(*held)
        except Exception as exc:  # a hold of a process that is gone counts for nothing
            log.warning("roll-ckpt: could not remove the hold %s (%s: %s)", held[1], type(exc).__name__, exc)


def as_strategy(strategy: Any, name: str) -> tuple[Strategy, StrategyIO]:
    """``strategy`` (what strategy ``name``'s factory built) as a :class:`Strategy`, and the
    I/O that writes and reads its files (its ``io_class``'s).

    A strategy of the contract before :class:`StrategyIO` -- its own ``write``/``load``/``estimate``,
    no ``io_class`` -- keeps working until 1.0 through :class:`OwnIO`, with a
    ``RollCkptDeprecationWarning``; so does one that does not subclass :class:`Strategy` at all
    (the defaults it leaves out are set on it). A strategy with an ``io_class`` that also
    defines ``write`` or ``load`` is refused: core would not call them."""
    if isinstance(strategy, Strategy) and strategy.io_class is not None:
        own = [m for m in ("write", "load") if callable(getattr(strategy, m, None))]
        if own:
            raise RollCkptError(
                f"strategy '{name}' ({type(strategy).__qualname__}) defines {' and '.join(own)}(), which roll-ckpt "
                f"no longer calls: its io_class ({strategy.io_class.__qualname__}) writes and loads the files. Move "
                "what it does before a load into load_targets() and after one into hand_over() (docs/guide/plugins.md)")
        return strategy, strategy.io_class(strategy)
    if not callable(getattr(strategy, "write", None)):
        raise RollCkptError(f"strategy '{name}' ({type(strategy).__qualname__}) has no io_class: set it to the "
                            "roll_ckpt.plugin.StrategyIO that writes and reads its files (roll_ckpt.plugin.DCPIO for DCP)")
    if isinstance(strategy, Strategy):
        warnings.warn(f"strategy '{name}' ({type(strategy).__qualname__}) writes and loads its files itself: give it "
                      "an io_class (a roll_ckpt.plugin.StrategyIO) instead; strategies of that contract work until 1.0",
                      RollCkptDeprecationWarning, stacklevel=5)
    else:
        warnings.warn(f"strategy '{name}' ({type(strategy).__qualname__}) does not subclass roll_ckpt.plugin.Strategy: "
                      "subclass it (objects of the old protocol work until 1.0)", RollCkptDeprecationWarning, stacklevel=5)
        for member in ("collective_timeout_s", "agree"):  # the protocol's optional members
            if not hasattr(strategy, member):
                default = getattr(Strategy, member)
                setattr(strategy, member, default.__get__(strategy) if callable(default) else default)
    return strategy, OwnIO(strategy)


class OwnIO(StrategyIO):
    """The I/O of a strategy of the contract before :class:`StrategyIO` (deprecated, until 1.0):
    the strategy writes, loads and estimates its files itself, and this forwards to it."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.increments = getattr(strategy, "increments", None)

    def estimate(self, sd: dict[str, Any], user: Mapping[str, Any] | None = None) -> Any:
        return self.strategy.estimate(sd, user)

    def write(self, sd: dict[str, Any], storage: Storage, path: str, on_bytes: Any = None, *,
              save: Any = None, alone: bool = False) -> dict[str, tuple]:
        more = {"alone": True} if alone else {}  # (a strategy without the local tier took no ``alone``)
        return self.strategy.write(sd, storage, path, on_bytes, save=save, **more)

    def load(self, state: Any, storage: Storage, path: str, on_bytes: Any = None, **kwargs: Any) -> None:
        if not kwargs.get("alone"):
            kwargs.pop("alone", None)
        self.strategy.load(state, storage, path, on_bytes, **kwargs)
