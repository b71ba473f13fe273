"""The processes tests start: their environment, free ports, ``torchrun``, ranks started by hand.

Every process a test starts gets :func:`child_env`; every ``torchrun`` goes through
:func:`torchrun` (waits, bounded) or :func:`start_torchrun` (in the background, its own
process group: :func:`kill_group` ends the agent and its workers).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Mapping, NoReturn

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent


def child_env(env: Mapping[str, str] | None = None, **more: str) -> dict[str, str]:
    """The environment of a process a test starts: this process's, without roll-ckpt's own
    switches (``ROLL_CKPT_*``; ``ROLL_CKPT_QUIET`` and the suite's ``ROLL_CKPT_TEST_*`` stay),
    with ``tests/`` first on ``PYTHONPATH`` (child scripts import the shared helpers), then
    ``env`` and ``more`` on top."""
    out = {k: v for k, v in os.environ.items()
           if not k.startswith("ROLL_CKPT_") or k == "ROLL_CKPT_QUIET" or k.startswith("ROLL_CKPT_TEST_")}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    out.update(env or {})
    out.update(more)
    return out


def run_python(code_or_args: list[str] | str, *, env: Mapping[str, str] | None = None, timeout: float = 90,
               cwd: str | os.PathLike[str] | None = None, warm: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -c code`` or ``python *args`` with a time limit: a fresh interpreter, or
    with ``warm`` one forked from the warm interpreter (:mod:`helpers.warm`: for a child that
    imports torch anyway and tests nothing about what a fresh process imports)."""
    from . import warm as warm_

    args = ["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args)
    run = warm_.run if warm else subprocess.run
    return run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=child_env(env), cwd=cwd)


def start(cmd: list[str], *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = REPO, warm: bool = False) -> subprocess.Popen:
    """Start ``cmd`` in the background (text pipes for stdout and stderr; :func:`finish` it);
    ``warm``: ``cmd`` is ``[sys.executable, ...]``, forked from the warm interpreter (:func:`run_python`)."""
    from . import warm as warm_

    popen = warm_.popen if warm else subprocess.Popen
    return popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=child_env(env))


def finish(proc: subprocess.Popen, cmd: list[str], timeout: float) -> str:
    """Wait for a process from :func:`start`, at most ``timeout`` seconds (killed after); it
    must have succeeded without a traceback. Returns its stdout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{cmd}\n{out}\n{err}"
    assert "Traceback" not in err, err
    return out


def run_ok(cmd: list[str], timeout: float, *, env: Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = REPO, warm: bool = False) -> str:
    """Run ``cmd`` and wait (:func:`start`, :func:`finish`): its stdout."""
    return finish(start(cmd, env=env, cwd=cwd, warm=warm), cmd, timeout)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives its workers (``env://`` rendezvous on 127.0.0.1:``port``),
    for a rank started without it (a plain process or a forked one: no agent, faster)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}


# --------------------------------------------------------------------------- torchrun


def torchrun_command(script: str | os.PathLike[str], *args: Any, nproc: int, real: bool = True) -> list[str]:
    """``torchrun``'s command line; with ``real=False`` (and without ``ROLL_CKPT_TEST_TORCHRUN=1``)
    the tests' agent (``_rank_agent.py``: the same environment, one import of torch)."""
    if not real and os.environ.get("ROLL_CKPT_TEST_TORCHRUN", "") != "1":
        return [sys.executable, str(TESTS / "helpers" / "_rank_agent.py"), str(nproc), str(script), *(str(a) for a in args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(script), *(str(a) for a in args)]


def start_torchrun(script: str | os.PathLike[str], *args: Any, nproc: int = 2,
                   env: Mapping[str, str] | None = None, stdout: int | IO[Any] | None = None,
                   stderr: int | IO[Any] | None = subprocess.STDOUT, real: bool = False) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=nproc script *args`` in the background, in a
    process group of its own; one thread per rank, roll-ckpt quiet, output unbuffered.
    ``real``: torchrun itself (a test of what torchrun's agent does), else the tests' agent.
    Either is forked from the warm interpreter (:mod:`helpers.warm`), and so are the workers
    torchrun's agent starts (forked from the agent)."""
    from . import warm

    cmd = torchrun_command(script, *args, nproc=nproc, real=real)
    return warm.popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
                      env=child_env(env, OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1", PYTHONUNBUFFERED="1"))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a group of its own and everything still in that group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun(script: str | os.PathLike[str], *args: Any, nproc: int = 2, timeout: float = 180,
             check: bool = True, env: Mapping[str, str] | None = None) -> str:
    """Run ``script`` under torchrun on ``nproc`` local ranks and wait, at most ``timeout``
    seconds (then the agent and its workers are killed and the test fails). Returns the tail
    of its output; with ``check`` it must have succeeded. Workers left behind are killed.

    The ranks are forked from a warm interpreter (:mod:`helpers.ranks`) unless
    ``ROLL_CKPT_TEST_TORCHRUN=1`` asks for torchrun itself."""
    if os.environ.get("ROLL_CKPT_TEST_TORCHRUN", "") != "1":
        from .ranks import run_ranks

        code, output, timed_out = run_ranks(script, [str(a) for a in args], nproc=nproc, timeout=timeout,
                                            env=child_env(env, OMP_NUM_THREADS="1", ROLL_CKPT_QUIET="1",
                                                          PYTHONUNBUFFERED="1"))
        if timed_out:
            raise AssertionError(f"{Path(script).name} {' '.join(map(str, args))} on {nproc} ranks did not end "
                                 f"within {timeout:.0f}s\n{output[-8000:]}")
        assert code == 0 or not check, output[-8000:]
        return output[-8000:]
    proc = start_torchrun(script, *args, nproc=nproc, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          real=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"torchrun {Path(script).name} {' '.join(map(str, args))} did not end within "
                             f"{timeout:.0f}s\n{out[-3000:]}{err[-5000:]}") from None
    finally:
        kill_group(proc)
    output = out[-3000:] + err[-5000:]
    assert proc.returncode == 0 or not check, output
    return output


def exit_worker(code: int = 0) -> NoReturn:
    """End a torchrun worker now, skipping interpreter exit.

    A gloo collective returns before its worker thread drops the finished work; dropping it
    takes the GIL, which a thread cannot get once the interpreter is shutting down, and the
    process aborts ("terminate called without an active exception", seen after a worker's
    last all-gather). A worker whose results are written has nothing left to clean up.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
