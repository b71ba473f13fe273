"""``python _warm_server.py FD``: the warm interpreter :mod:`helpers.warm` forks Python processes from.

It imports torch, its distributed packages and roll-ckpt once, then serves requests on
the ``AF_UNIX``/``SOCK_SEQPACKET`` socket ``FD``: ``{"spawn": SPEC}`` with the child's
standard streams as passed descriptors forks a child that becomes ``python ARGV`` with
SPEC's environment and working directory (``{"pid": N}``); ``{"poll": N}`` reaps it once
it ended (``{"status": S}``, the raw wait status, ``null`` while it runs). It computes
nothing before forking (no thread exists to be inherited), never looks up roll-ckpt's
plugins (each child finds them in its own environment) and imports no test helper.

A child does what a fresh interpreter does, in the same order: ``sys.path`` from its
``PYTHONPATH``, torch's thread count from its ``OMP_NUM_THREADS``, a seed of its own for
torch and numpy (as a fresh interpreter draws one), then the script, the
module (``-m``) or the code (``-c``) as ``__main__``; at the end non-daemon threads are
joined and ``atexit`` handlers run before it exits with the script's status.

The tree stays warm: in a child, ``subprocess.Popen([sys.executable, ...])`` (a torchrun
agent starting its workers, the demo or a benchmark starting torchrun) forks the calling
process the same way instead of starting a fresh interpreter (:class:`ForkPopen`), so a
child of a child is its caller's own child, as after ``exec``. What ``exec`` would reset
is reset: Python signal handlers, ``atexit`` handlers, descriptors other than the standard
three and ``pass_fds``, and the modules the caller imported from outside the installed
libraries (they are imported again). Any other command starts as usual.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from typing import Any, Callable, NoReturn

_ENV_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_HERE = os.path.dirname(os.path.abspath(__file__))
_BASE_PATH: list[str] = []  # the server's sys.path without its PYTHONPATH and script folder
_DEFAULT_THREADS = 1
_SERVER_MODULES: frozenset[str] = frozenset()  # what every child starts with
_SPAWN = subprocess.Popen
_CHILD_ARGS = tuple(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]
"""The names of ``Popen._execute_child``'s arguments on this Python (after ``self``)."""


def _preload() -> None:
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import roll_ckpt.manager  # noqa: F401
    import roll_ckpt.strategies.dcp  # noqa: F401

    for optional in ("roll_ckpt_fsdp2", "roll_ckpt_fs", "transformers", "yaml", "safetensors.torch"):
        try:
            __import__(optional)
        except ImportError:
            pass
    global _BASE_PATH, _DEFAULT_THREADS, _SERVER_MODULES
    _SERVER_MODULES = frozenset(sys.modules)
    _BASE_PATH = [p for p in sys.path if p not in _ENV_PATHS and p != _HERE]
    _DEFAULT_THREADS = torch.get_num_threads()  # what a fresh process without OMP_NUM_THREADS uses


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _as_after_exec() -> None:  # pragma: no cover - in a child forked by ForkPopen
    """Undo what the forking process set up that ``exec`` + a fresh interpreter would not keep."""
    gc.freeze()  # the caller's garbage holds descriptors this child closed: never finalise it here
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT and handler is not signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler)
            elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_IGN)  # what the interpreter sets at start
            elif callable(handler):
                signal.signal(sig, signal.SIG_DFL)  # exec resets caught signals; ignored ones stay
        except (OSError, ValueError, TypeError):
            pass
    signal.set_wakeup_fd(-1)
    atexit._clear()
    # The caller's own modules (its script's helpers, test helpers) hold its state, such as a
    # descriptor of /proc/self: the child imports them again. Installed libraries stay.
    installed = tuple({os.path.join(os.path.realpath(p), "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name not in _SERVER_MODULES and file and not os.path.realpath(file).startswith(installed):
            del sys.modules[name]


def _run_python(argv: list[str], env: dict[str, str], unbuffered: bool) -> int:  # pragma: no cover - child
    """Run ``python ARGV`` in this (forked) process once its descriptors are in place; its exit status."""
    code = 1
    os.environ.clear()
    os.environ.update(env)
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    subprocess.Popen = ForkPopen  # type: ignore[misc] - the tree stays warm
    for module in list(sys.modules.values()):
        if getattr(module, "Popen", None) is _SPAWN and module is not subprocess:
            module.Popen = ForkPopen  # a `from subprocess import Popen` done before (torchrun's handler)

    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or _DEFAULT_THREADS))
    torch.seed()  # a fresh interpreter seeds torch from the OS (Python's random reseeds at fork itself)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.abspath(argv[0]))
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - what the interpreter prints for an uncaught one
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # from the script's frames on
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    threading._shutdown()  # type: ignore[attr-defined] - what interpreter exit does first
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    return code


def end_child(run: Callable[[], int]) -> NoReturn:  # pragma: no cover - the forked child
    """End a forked child as the interpreter would end: with ``run()``'s status, its
    traceback printed if it raised, its output flushed, and nothing of the parent's run."""
    code = 1
    try:
        code = run()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent ends (best effort)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def _child(spec: dict, fds: list[int]) -> NoReturn:  # pragma: no cover - the forked child
    def run() -> int:
        die_with_parent()  # with the warm interpreter, so with the test process: nothing outlives the tests
        if spec["session"]:
            os.setsid()
        for target, fd in zip(spec["std"], fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(spec["cwd"])
        return _run_python(spec["argv"], spec["env"], False)

    end_child(run)


def _python_argv(args: Any) -> tuple[list[str], bool] | None:
    """``[sys.executable, [-u], script | -m mod | -c code, ...]`` as (argv after the interpreter,
    unbuffered); None for any other command."""
    if isinstance(args, (str, bytes)) or not args:
        return None
    args = [os.fspath(a) for a in args]
    if any(not isinstance(a, str) for a in args) or args[0] != sys.executable:
        return None
    unbuffered = len(args) > 1 and args[1] == "-u"
    rest = args[2:] if unbuffered else args[1:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-m", "-c")) or (rest[0] in ("-m", "-c") and len(rest) < 2):
        return None
    return rest, unbuffered


class ForkPopen(_SPAWN):  # type: ignore[misc, valid-type]
    """:class:`subprocess.Popen` that, for a Python command, forks this (warm) process and runs
    the script in the fork, as :func:`_run_python` does; other commands start as usual."""

    def _execute_child(self, *call: Any) -> None:
        # Bound by name: the private method's arguments differ between Pythons (3.11 added
        # process_group), and the base class is called back with them as they came.
        a = dict(zip(_CHILD_ARGS, call))
        args, env, cwd, shell = a["args"], a["env"], a["cwd"], a["shell"]
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = (
            a[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite"))
        preexec_fn, close_fds, pass_fds, start_new_session = (
            a["preexec_fn"], a["close_fds"], a["pass_fds"], a["start_new_session"])
        parsed = None if (shell or a["executable"] is not None or a["gid"] is not None or a["gids"] is not None
                          or a["uid"] is not None or a["umask"] != -1
                          or a.get("process_group") not in (None, -1)) else _python_argv(args)
        if parsed is None:
            return super()._execute_child(*call)
        argv, unbuffered = parsed
        child_env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # else the child would write the caller's buffered output again
            except (OSError, ValueError):
                pass
        pid = os.fork()
        if pid == 0:
            def run() -> int:
                _as_after_exec()
                if start_new_session:
                    os.setsid()
                sources = [os.dup(fd) if fd != -1 else -1 for fd in (p2cread, c2pwrite, errwrite)]
                for target, fd in enumerate(sources):
                    if fd != -1:
                        os.dup2(fd, target)
                keep = {0, 1, 2, *pass_fds}
                if close_fds:
                    for fd in map(int, os.listdir("/proc/self/fd")):
                        if fd not in keep:
                            try:
                                os.close(fd)
                            except OSError:
                                pass
                else:
                    for fd in sources:
                        if fd > 2:
                            os.close(fd)
                os.chdir(workdir)
                if preexec_fn is not None:
                    preexec_fn()
                return _run_python(argv, child_env, unbuffered)

            end_child(run)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def serve(sock: socket.socket) -> None:
    _preload()
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 22, 3)
        except OSError:
            return
        if not data:
            return
        msg = json.loads(data)
        if "spawn" in msg:
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(msg["spawn"], fds)
            for fd in fds:
                os.close(fd)
            answer: dict = {"pid": pid}
        elif "poll" in msg:
            try:
                done, status = os.waitpid(int(msg["poll"]), os.WNOHANG)
            except ChildProcessError:
                done, status = -1, -1
            answer = {"status": status if done else None}
        else:
            return
        sock.send(json.dumps(answer).encode())


if __name__ == "__main__":
    die_with_parent()  # with the test process
    serve(socket.socket(fileno=int(sys.argv[1])))
