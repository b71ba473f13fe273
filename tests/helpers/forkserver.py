"""A fork server for test workers, and the event logs the workers write.

A child script (``_crash_child.py``, ``_components_child.py``) imports torch and roll_ckpt
once, then calls :func:`serve`: it reads JSON commands on stdin and answers one JSON line
each: ``{"fork": SPEC}`` forks a worker running ``run(SPEC)`` (``{"pid": N}``),
``{"reap": N}`` waits for it (``{"status": S}``, the raw wait status), ``{"poll": N}``
reaps it if it ended (``{"status": S}``, ``null`` while it runs), ``{"exit": 1}`` stops.
A forked worker is a real, separate process with its own pid: SIGKILL ends it just as
abruptly as a fresh interpreter, without the seconds of importing torch.
:class:`ForkServer` starts such a server and speaks to it.

Workers report through a log file, one event a line written with one ``os.write`` (never
torn by a kill): ``<kind> <words...> @<unix time>`` (:func:`emit`, :func:`read_events`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from ._warm_server import die_with_parent, end_child


def emit(fd: int, *parts: Any) -> None:
    """Append one event line to the log open at ``fd``."""
    os.write(fd, (" ".join(str(p) for p in parts) + f" @{time.time():.4f}\n").encode())


def read_events(path: str | os.PathLike[str]) -> list[tuple[str, list[str], float]]:
    """The events of a log file (none when it does not exist): ``(kind, words, time)``."""
    out: list[tuple[str, list[str], float]] = []
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            body, _, t = line.rpartition(" @")
            if body:
                kind, *rest = body.split()
                out.append((kind, rest, float(t)))
    return out


# --------------------------------------------------------------------------- the server (child side)


def _run_forked(run: Callable[[dict[str, Any]], int], spec: dict[str, Any], stderr: str,
                orphan_dies: bool) -> NoReturn:  # pragma: no cover - runs in the forked worker
    def body() -> int:
        if orphan_dies:
            die_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 1)
        os.dup2(err, 2)
        sys.stdin = open(os.devnull)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        return run(spec)  # a traceback goes to the worker's stderr file

    end_child(body)


def serve(run: Callable[[dict[str, Any]], int], *, stderr_of: Callable[[dict[str, Any]], str],
          prewarm: Callable[[], None] | None = None, orphans_die: bool = False) -> int:
    """Serve :class:`ForkServer`'s commands on stdin until ``exit`` (or stdin closes).

    ``stderr_of(spec)``: the file a worker's stdout and stderr go to. ``prewarm`` runs first
    (a short job, so that forked workers find every lazy import done; it must leave no
    thread behind). With ``orphans_die`` the server and its workers are SIGKILLed when
    their parent ends.
    """
    if orphans_die:
        die_with_parent()
    if prewarm is not None:
        prewarm()
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "fork" in cmd:
            out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_forked(run, cmd["fork"], stderr_of(cmd["fork"]), orphans_die)
            print(json.dumps({"pid": pid}), file=out, flush=True)
        elif "reap" in cmd:
            _, status = os.waitpid(int(cmd["reap"]), 0)
            print(json.dumps({"status": status}), file=out, flush=True)
        elif "poll" in cmd:
            try:
                done, status = os.waitpid(int(cmd["poll"]), os.WNOHANG)
            except ChildProcessError:
                done, status = -1, -1
            print(json.dumps({"status": status if done else None}), file=out, flush=True)
        elif "exit" in cmd:
            break
    return 0


# --------------------------------------------------------------------------- the client (test side)


class ForkServer:
    """``python <child> serve`` (see :func:`serve`), started with :func:`helpers.launch.child_env`
    plus ``env``, and its commands. The server itself is forked from the warm interpreter
    (:mod:`helpers.warm`): its imports cost nothing more."""

    def __init__(self, child: str | os.PathLike[str], env: Mapping[str, str] | None = None,
                 ready_timeout: float = 180) -> None:
        from . import warm
        from .launch import child_env

        self.proc = warm.popen([sys.executable, str(child), "serve"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=child_env(env, PYTHONUNBUFFERED="1"))
        hello = self._read(ready_timeout)
        assert "ready" in hello, hello

    def _read(self, timeout: float) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"the fork server did not answer within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the fork server exited ({self.proc.poll()})")
        return json.loads(line)

    def _ask(self, cmd: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def fork(self, spec: dict[str, Any]) -> int:
        return int(self._ask({"fork": spec})["pid"])

    def reap(self, pid: int, timeout: float = 60) -> int:
        """Wait for the worker; its raw wait status."""
        return int(self._ask({"reap": pid}, timeout)["status"])

    def poll(self, pid: int) -> int | None:
        """The raw wait status of a forked process once it ended (it is reaped), else ``None``."""
        return self._ask({"poll": pid})["status"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"exit": 1}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
