"""Python processes forked from a warm interpreter (``_warm_server.py``) instead of started fresh.

``Popen([sys.executable, script | "-m", mod | "-c", code, *args], ...)`` behaves as
:class:`subprocess.Popen` (pipes, ``communicate``, ``poll``, ``wait``, signals, a session
of its own), but the child is forked from a per-test-process interpreter that imported
torch, DCP, FSDP and roll-ckpt once: about 4 s of CPU saved a process, most of what a
short child script costs here. The child is a real, separate process with its own pid;
SIGKILL ends it as abruptly as a fresh interpreter.

Use it only for children that import torch anyway and test nothing about imports (a
test of what a fresh process imports needs a fresh process). ``ROLL_CKPT_TEST_FRESH=1``
starts every such child fresh instead.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SERVER = Path(__file__).with_name("_warm_server.py")


def enabled() -> bool:
    return os.environ.get("ROLL_CKPT_TEST_FRESH", "") != "1"


class _Server:
    def __init__(self) -> None:
        from .launch import child_env

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = child_env(PYTHONUNBUFFERED="1")
        env.pop("OMP_NUM_THREADS", None)  # each child sets its own; the server learns the default
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.sock.settimeout(180)
        hello = json.loads(self.sock.recv(1 << 16) or b"{}")
        assert "ready" in hello, "the warm interpreter did not start"
        self.sock.settimeout(60)

    def ask(self, msg: dict[str, Any], fds: list[int] = ()) -> dict[str, Any]:  # type: ignore[assignment]
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
            answer = self.sock.recv(1 << 16)
        if not answer:
            raise AssertionError(f"the warm interpreter exited ({self.proc.poll()})")
        return json.loads(answer)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


_server: _Server | None = None
_server_lock = threading.Lock()
_closed = False


def _close() -> None:
    global _closed
    with _server_lock:
        _closed = True
        if _server is not None:
            _server.close()


atexit.register(_close)


def _the_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            if _closed:
                raise AssertionError("the warm interpreter is closed (the test session is ending)")
            _server = _Server()
        return _server


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` whose child is forked from the warm interpreter.

    ``args`` must be ``[sys.executable, script | "-m", module | "-c", code, *rest]``;
    ``preexec_fn``, ``pass_fds``, ``shell`` and user/group changes are not supported."""

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                       cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any,
                       p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        args = [os.fspath(a) for a in args]
        if shell or preexec_fn is not None or pass_fds or args[0] != sys.executable or len(args) < 2:
            raise ValueError(f"helpers.warm.Popen cannot start {args[:3]}")
        start_new_session = rest[-2] if sys.version_info >= (3, 11) else rest[-1]
        std = [0, 1, 2]
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        spec = {"argv": args[1:], "env": dict(os.environ if env is None else env),
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "session": bool(start_new_session),
                "std": std}
        try:
            self.pid = int(_the_server().ask({"spawn": spec}, fds)["pid"])
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # the child has its copies

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if self.returncode is None:
            try:
                status = _the_server().ask({"poll": self.pid})["status"]
            except (OSError, AssertionError):
                if _deadstate is None:  # not Popen.__del__ at the end of the session
                    raise
                status = None
                self.returncode = _deadstate
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status) if status != -1 else -1
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._internal_poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """:class:`Popen` when the warm interpreter is enabled, else :class:`subprocess.Popen`."""
    return (Popen if enabled() else subprocess.Popen)(cmd, **kwargs)


def run(cmd: list[str], *, timeout: float | None = None, capture_output: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` with :func:`popen`: wait at most ``timeout`` (the child is killed after)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with popen(cmd, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
