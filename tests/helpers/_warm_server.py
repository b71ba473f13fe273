"""``python _warm_server.py FD``: the warm interpreter :mod:`helpers.warm` forks Python processes from.

It imports torch, its distributed packages and roll-ckpt once, then serves requests on
the ``AF_UNIX``/``SOCK_SEQPACKET`` socket ``FD``: ``{"spawn": SPEC}`` with the child's
standard streams as passed descriptors forks a child that becomes ``python ARGV`` with
SPEC's environment and working directory (``{"pid": N}``); ``{"poll": N}`` reaps it once
it ended (``{"status": S}``, the raw wait status, ``null`` while it runs). It computes
nothing before forking (no thread exists to be inherited), never looks up roll-ckpt's
plugins (each child finds them in its own environment) and imports no test helper.

A child does what a fresh interpreter does, in the same order: ``sys.path`` from its
``PYTHONPATH``, torch's thread count from its ``OMP_NUM_THREADS``, then the script, the
module (``-m``) or the code (``-c``) as ``__main__``; at the end non-daemon threads are
joined and ``atexit`` handlers run before it exits with the script's status.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback
import types

_ENV_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_HERE = os.path.dirname(os.path.abspath(__file__))


def _preload() -> int:
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import roll_ckpt.manager  # noqa: F401
    import roll_ckpt.strategy  # noqa: F401

    for optional in ("roll_ckpt_fsdp2", "roll_ckpt_fs", "transformers", "yaml", "safetensors.torch"):
        try:
            __import__(optional)
        except ImportError:
            pass
    return torch.get_num_threads()  # what a fresh process without OMP_NUM_THREADS uses


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(spec: dict, fds: list[int], default_threads: int) -> None:  # pragma: no cover - the forked child
    code = 1
    try:
        if spec["session"]:
            os.setsid()
        for target, fd in zip(spec["std"], fds):
            os.dup2(fd, target)
            os.close(fd)
        env = spec["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(spec["cwd"])
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        if unbuffered:
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)

        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or default_threads))
        argv = spec["argv"]
        if argv[0] == "-c":
            first = ""
        elif argv[0] == "-m":
            first = os.getcwd()
        else:
            first = os.path.dirname(os.path.abspath(argv[0]))
        base = [p for p in sys.path if p not in _ENV_PATHS and p != _HERE]
        extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *base]
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
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket) -> None:
    default_threads = _preload()
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
                _child(msg["spawn"], fds, default_threads)
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
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test process
    except Exception:  # noqa: BLE001 - best effort
        pass
    serve(socket.socket(fileno=int(sys.argv[1])))
