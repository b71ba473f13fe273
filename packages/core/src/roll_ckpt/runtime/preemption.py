"""Preemption: a signal becomes a committed checkpoint at the next step boundary.

SLURM sends SIGTERM (or ``--signal``) ahead of SIGKILL, Kubernetes waits 30 s by default,
torchrun's agent forwards SIGTERM to its workers. The handler only notes the request (no
I/O, nothing that could deadlock inside a signal handler); the next
``maybe_save(step, state)`` of every process agrees on it through a small collective of
the strategy, so a signal that reached one rank stops them all at the same step; then
the manager waits for a save in flight, saves ``step`` synchronously and durably,
closes, and raises :class:`Preempted` (a ``SystemExit``) so an unchanged training loop
exits cleanly.

One process-wide handler per signal serves every open manager and chains the handler
that was there before (a Python callable: the framework's own, Lightning's...; never the
default action, which would kill the process before it saves). It is restored when the
last manager closes. While a preemption save runs, further signals are counted, not
passed on: nothing interrupts that save.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConfigError

__all__ = ["Preempted", "PreemptionConfig", "PreemptionWatch", "parse_preemption", "signal_number"]

log = logging.getLogger("roll_ckpt")

_lock = threading.Lock()
_watches: dict[int, list["PreemptionWatch"]] = {}
_previous: dict[int, Any] = {}
_told_not_main = False


class Preempted(SystemExit):
    """Raised by ``maybe_save`` once a preemption checkpoint is committed (``preemption.exit``).

    A ``SystemExit``: an unchanged loop ends, and the process exits with :attr:`exit_code`.
    """

    def __init__(self, exit_code: int, step: int, path: str) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code
        self.step = step
        self.path = path


@dataclass(frozen=True)
class PreemptionConfig:
    """``checkpoint_config.preemption``: what a preemption signal does."""

    signals: tuple[int, ...] = (signal.SIGTERM,)
    """Signals that ask for a preemption save (names or numbers); ``[]`` turns it off."""
    exit: bool = True
    """Raise :class:`Preempted` once the checkpoint is committed; ``false`` returns and sets
    ``manager.preempted``."""
    exit_code: int = 0
    """The process's exit status when it stops for a preemption."""


def parse_preemption(value: Any) -> PreemptionConfig:
    """``checkpoint_config.preemption`` validated; every error names its key."""
    key = "checkpoint_config.preemption"
    if value is None:
        return PreemptionConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(key, "has the wrong type", value, "a mapping with signals, exit, exit_code")
    for k in value:
        if k not in ("signals", "exit", "exit_code"):
            raise ConfigError(f"{key}.{k}", "unknown key; known keys are signals, exit, exit_code")
    names = value.get("signals", ["SIGTERM"])
    if not isinstance(names, list):
        raise ConfigError(f"{key}.signals", "has the wrong type", names,
                          "a list of signal names or numbers, e.g. [SIGTERM, SIGUSR1]")
    numbers = []
    for i, name in enumerate(names):
        try:
            number = signal_number(name)
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{key}.signals[{i}]", "is not a signal", name,
                              "a name such as SIGTERM or SIGUSR1, or its number") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"{key}.signals[{i}]", "cannot be caught", name, "SIGTERM, SIGINT, SIGUSR1, SIGUSR2...")
        numbers.append(number)
    exit_ = value.get("exit", True)
    if not isinstance(exit_, bool):
        raise ConfigError(f"{key}.exit", "has the wrong type", exit_, "true or false")
    code = value.get("exit_code", 0)
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise ConfigError(f"{key}.exit_code", "is not an exit status", code, "an integer from 0 to 255")
    return PreemptionConfig(signals=tuple(dict.fromkeys(numbers)), exit=exit_, exit_code=code)


def signal_number(name: str | int) -> int:
    """``SIGTERM``, ``TERM``, ``15`` -> 15; ``ValueError`` for anything else."""
    if isinstance(name, int) and not isinstance(name, bool):
        return int(signal.Signals(name))
    text = str(name).strip().upper()
    if text.isdigit():
        return int(signal.Signals(int(text)))
    return int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])


def _handler(signum: int, frame: Any) -> None:
    # Runs in the main thread between two bytecodes: flags only, no I/O, no locks.
    watches = list(_watches.get(signum, ()))
    for watch in watches:
        watch.note(signum)
    previous = _previous.get(signum)
    if callable(previous) and not any(w.saving for w in watches):
        previous(signum, frame)


class PreemptionWatch:
    """One manager's view of preemption requests: from signals, or :meth:`request`."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.signal: int | None = None
        """The first signal that asked (``None``: asked by :meth:`request`, or not at all)."""
        self.extra_signals = 0
        """Signals that arrived after the first (logged once the preemption save is done)."""
        self.saving = False
        self.installed = False

    def note(self, signum: int | None) -> None:
        if self.requested:
            self.extra_signals += 1
        else:
            self.requested, self.signal = True, signum

    def request(self) -> None:
        """Ask for a preemption save at the next ``maybe_save`` (what a handler does)."""
        self.note(None)

    def install(self) -> bool:
        """Install the handlers (main thread only). False, logged once per process, elsewhere."""
        global _told_not_main
        if not self.signals:
            return False
        if threading.current_thread() is not threading.main_thread():
            if not _told_not_main:
                _told_not_main = True
                log.info("roll-ckpt: not on the main thread, so no preemption signal handler is installed; "
                         "call manager.request_preemption() where this process learns of a preemption")
            return False
        with _lock:
            for signum in self.signals:
                if signum not in _watches:
                    _previous[signum] = signal.signal(signum, _handler)
                    _watches[signum] = []
                _watches[signum].append(self)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Stop watching; the last watch of a signal restores the handler that was there before."""
        if not self.installed:
            return
        self.installed = False
        with _lock:
            for signum in self.signals:
                watches = _watches.get(signum, [])
                if self in watches:
                    watches.remove(self)
                if not watches and signum in _watches:
                    del _watches[signum]
                    _restore(signum, _previous.pop(signum, signal.SIG_DFL))

    def describe(self) -> str:
        if self.signal is None:
            return "requested by request_preemption()"
        return f"{signal.Signals(self.signal).name} received"


def _restore(signum: int, handler: Any) -> None:
    try:
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    except ValueError:  # closed from another thread: the handler stays, harmless without watches
        pass


def run_without_interruption(watch: PreemptionWatch, save: Callable[[], Any]) -> Any:
    """Run ``save`` with further signals counted, not passed on; log them afterwards."""
    watch.saving = True
    try:
        return save()
    finally:
        watch.saving = False
        if watch.extra_signals:
            log.warning("roll-ckpt: %d more preemption signal(s) arrived during the preemption save; "
                        "they did not interrupt it", watch.extra_signals)
