"""Preemption: a signal becomes a committed checkpoint at the next step boundary.

SLURM sends SIGTERM (or ``--signal``) ahead of SIGKILL, Kubernetes waits 30 s by default,
torchrun's agent forwards SIGTERM to its workers, Ray sends SIGTERM to its workers. The
handler only notes the request (no I/O, nothing that could deadlock inside a signal
handler); the next ``maybe_save(step, state)`` of every process agrees on it through a
small collective of the strategy, so a signal that reached one rank stops them all at the
same step; then the manager waits for a save in flight, saves ``step`` synchronously and
durably, closes, and raises :class:`Preempted` (a ``SystemExit``) so an unchanged training
loop exits cleanly.

One process-wide handler per signal serves every open manager; it is installed by the
first manager (main thread only) and the handler that was there before is restored when
the last one closes. While a preemption save runs, further signals are counted and held
like the first: nothing interrupts that save.

**The handler that was there before is deferred, never run before the save.** Whatever
it is -- Ray's (``sys.exit`` in a driver after ``ray.init``, a ``SystemExit`` "The process
receives a SIGTERM" in a Ray worker), a framework's, Python's ``default_int_handler``, or
the default action (``SIG_DFL``, which kills the process) -- it would end the process
before the checkpoint is written, and which callables end it cannot be known in advance.
So the signal is *held* for it, and passed on exactly once, at the first of:

* **the preemption save committed** (``maybe_save``, after the manager closed and the
  handlers were restored). A Python handler is then called (``handler(signum, None)``,
  no longer inside a signal handler). What it raises is how it would have ended the
  process: with ``preemption.exit`` (the default) :class:`Preempted` takes its place, and
  keeps a ``SystemExit``'s status and attributes -- a Ray driver exits with status 15, a
  Ray actor's worker exits as Ray's own handler makes it (status 1, "The process receives
  a SIGTERM") -- while any other exception (``KeyboardInterrupt``...) becomes
  ``Preempted(exit_code)`` with it as ``__cause__``. The default action is what
  :class:`Preempted` does: the process exits with ``exit_code`` (the default action is
  nobody's choice, ``exit_code`` is the user's; a handler someone installed keeps its
  say). With ``exit: false`` the program keeps control: the handler is called, what it
  raises is logged and dropped, the default action is not taken; ``maybe_save`` returns.
  A loop that catches :class:`Preempted` has taken control the same way. (``exit: false``
  and catching are for programs that coordinate after the save -- a worker reports its
  preemption save and its driver has the other components save the same step: Ray's
  handler or the default action, run at the worker's next ``close()``, would end it in
  the middle of that.)
* **the last manager watching the signal closes without a preemption save** (the signal
  came after the last ``maybe_save``, or the loop ended first): at the end of ``close()``,
  once everything is drained and the handler restored, the signal is raised again
  (``signal.raise_signal``), so the process ends the way it would have -- Ray's
  ``SystemExit`` comes out of ``close()``, the default action kills the process with the
  signal.

``SIG_IGN`` stays ignored: nothing is passed on. A handler that only records the signal (a
framework's flag) is deferred too: it learns of the signal at the step boundary, once the
checkpoint is committed. One that must see it at once (a process that forwards the signal
to children of its own) is installed *after* the manager and calls the handler it
replaced (ours) itself. A forked child that inherited the handler, or a signal that comes
when no manager watches any more (closed off the main thread, so the handler could not be
restored), passes the signal on at once, as if roll-ckpt were not there.

Two consequences: the process ends at the next step boundary rather than at once (a step
longer than the scheduler's grace period still ends in SIGKILL, as before, only later),
and an idle process (a Ray actor between calls) ends when its manager next runs
``maybe_save`` or ``close()``. A manager that is never closed keeps the signal held.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConfigError

__all__ = ["Preempted", "PreemptionConfig", "PreemptionWatch", "parse_preemption", "pass_on", "preemption_done",
           "run_without_interruption", "signal_number"]

log = logging.getLogger("roll_ckpt")

_lock = threading.Lock()
_watches: dict[int, list["PreemptionWatch"]] = {}
_previous: dict[int, Any] = {}
_held: dict[int, bool] = {}
"""Signals that arrived and are not passed on yet to the handler that was there before."""
_owner_pid = os.getpid()
"""The process the handlers are installed for (a forked child passes signals on at once)."""
_told_not_main = False


class Preempted(SystemExit):
    """Raised by ``maybe_save`` once a preemption checkpoint is committed (``preemption.exit``).

    A ``SystemExit``: an unchanged loop ends, and the process exits with :attr:`exit_code`:
    ``preemption.exit_code``, or the status of the ``SystemExit`` the handler that was there
    before raised when the signal was passed on to it (Ray's: 15 in a driver, 1 in a worker).
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
    ``manager.preemption.committed``."""
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
    if os.getpid() != _owner_pid or not watches:
        # a forked child that inherited the handler, or left installed without a manager
        # (closed off the main thread): roll-ckpt is not there for this signal
        _pass_on_now(signum, frame)
        return
    for watch in watches:
        watch.note(signum)
    _held[signum] = True  # passed on once: after the preemption save, or when the last manager closes


def _pass_on_now(signum: int, frame: Any) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action (or a handler not set from Python)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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
        self.committed = False
        """The preemption save is committed: the signals held so far are its to pass on."""
        self.taken: list[tuple[int, Any]] = []
        """(signal, the handler that was there before) held for the preemption save to pass on."""

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
        global _told_not_main, _owner_pid
        if not self.signals:
            return False
        if threading.current_thread() is not threading.main_thread():
            if not _told_not_main:
                _told_not_main = True
                log.info("roll-ckpt: not on the main thread, so no preemption signal handler is installed; "
                         "call manager.preemption.request() where this process learns of a preemption")
            return False
        with _lock:
            if _owner_pid != os.getpid():  # a forked child: what it inherited is its parent's
                _owner_pid = os.getpid()
                _watches.clear()
                _held.clear()
            for signum in self.signals:
                if signum not in _watches:
                    current = signal.getsignal(signum)
                    if current is not _handler:  # else: left installed, _previous still holds the one before
                        _previous[signum] = current
                    signal.signal(signum, _handler)
                    _watches[signum] = []
                _watches[signum].append(self)
        self.installed = True
        return True

    def uninstall(self) -> list[tuple[int, Any]]:
        """Stop watching; the last watch of a signal restores the handler that was there before.

        Returns the signals to pass on (:func:`pass_on`, at the very end of ``close()``):
        those held for a handler this call restored, unless the preemption save took them
        (:attr:`committed`: they go to :attr:`taken`).
        """
        if not self.installed:
            return []
        self.installed = False
        out: list[tuple[int, Any]] = []
        with _lock:
            for signum in self.signals:
                watches = _watches.get(signum, [])
                if self in watches:
                    watches.remove(self)
                previous = _previous.get(signum, signal.SIG_DFL)
                if self.committed and _held.pop(signum, False):
                    self.taken.append((signum, previous))
                if not watches and signum in _watches:
                    del _watches[signum]
                    if _restore(signum, previous):
                        del _previous[signum]
                    if _held.pop(signum, False):
                        (self.taken if self.committed else out).append((signum, previous))
        return out

    def describe(self) -> str:
        if self.signal is None:
            return "requested by manager.preemption.request()"
        return f"{signal.Signals(self.signal).name} received"


def _restore(signum: int, handler: Any) -> bool:
    try:
        if signal.getsignal(signum) is _handler:  # else one installed after ours: it stays
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        return True
    except ValueError:  # closed from another thread: the handler stays and passes signals on
        return False


def pass_on(held: Iterable[tuple[int, Any]]) -> None:
    """Raise the held signals again, now that their handler is back (``close()`` without a
    preemption save): the process ends the way it would have. ``SIG_IGN``: nothing."""
    for signum, previous in held:
        if previous == signal.SIG_IGN:
            continue
        log.info("roll-ckpt: %s arrived after the last preemption check; passing it on to the handler "
                 "that was there before", signal.Signals(signum).name)
        if threading.current_thread() is threading.main_thread():
            signal.raise_signal(signum)  # a Python handler runs in here; what it raises comes out of close()
        else:
            os.kill(os.getpid(), signum)  # the main thread gets it, as it would have


def preemption_done(watch: PreemptionWatch, exit: bool, exit_code: int, step: int, path: str) -> str:
    """After the preemption save of ``step`` committed and the manager closed: pass the held
    signals on to the handlers that were there before, then raise :class:`Preempted`
    (``exit``) or return ``path``. See the module's documentation for the rule."""
    taken, watch.taken = list(dict(watch.taken).items()), []
    ended: BaseException | None = None
    for signum, previous in taken:
        if not callable(previous):
            continue  # SIG_IGN; the default action: Preempted is what it does (exit: false: nothing)
        name = getattr(previous, "__qualname__", repr(previous))
        log.info("roll-ckpt: preemption checkpoint committed; passing %s on to the handler that was there "
                 "before (%s)", signal.Signals(signum).name, name)
        try:
            previous(signum, None)
        except BaseException as exc:  # how that handler ends the process
            ended = exc
            break
    if not exit:
        if ended is not None:
            log.warning("roll-ckpt: the handler that was there before raised %r; preemption.exit is false, "
                        "so the program keeps control and it is dropped", ended)
        return path
    if isinstance(ended, SystemExit) and not isinstance(ended, Preempted):
        preempted = Preempted(ended.code, step, path)
        for key, value in vars(ended).items():  # Ray's ray_terminate_msg: the exit Ray reports
            preempted.__dict__.setdefault(key, value)
        raise preempted from ended
    raise Preempted(exit_code, step, path) from ended


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
