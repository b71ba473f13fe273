"""The tests' warm interpreter (helpers/warm.py) behaves as a fresh ``python`` for the children it forks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import warm
from helpers.launch import child_env

SCRIPT = """\
import atexit, os, sys, threading, time
import torch
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
print(sys.argv[1:], os.getcwd(), os.environ["ONLY_HERE"], torch.get_num_threads(), sys.path[0])
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_child_runs_like_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    res = warm.run([sys.executable, str(script), "3", "x"], capture_output=True, text=True, timeout=120,
                   cwd=tmp_path, env=child_env(ONLY_HERE="yes", OMP_NUM_THREADS="1"))
    assert res.returncode == 3, res
    assert res.stdout.splitlines() == [f"['3', 'x'] {tmp_path} yes 1 {tmp_path}", "thread", "atexit"]
    assert res.stderr == "to stderr\n"
    assert "ONLY_HERE" not in os.environ


def test_an_uncaught_exception_and_a_signal_end_it_as_they_end_python(tmp_path: Path) -> None:
    res = warm.run([sys.executable, "-c", "raise ValueError('boom')"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.rstrip().endswith("ValueError: boom") and "_warm_server" not in res.stderr
    proc = warm.Popen([sys.executable, "-c", "import os, time; print(os.getsid(0) == os.getpid(), flush=True); "
                       "time.sleep(60)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "True\n"
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()


PARENT = """\
import os, signal, subprocess, sys, torch
signal.signal(signal.SIGTERM, lambda *_: None)  # the caller's handler: a child must not keep it
leak = open(os.devnull)  # not a standard stream: a child does not inherit it
code = "import os, signal, sys, torch; print(os.getppid(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, " \\
       "torch.initial_seed() != int(sys.argv[2]), sys.argv[1:2], os.environ['ONLY_CHILD'], os.getsid(0) == os.getpid(), " \\
       f"os.path.exists('/proc/self/fd/{leak.fileno()}'), sys.path[0] == os.getcwd())"
out = subprocess.run([sys.executable, "-u", "-c", code, "a", str(torch.initial_seed())], capture_output=True, text=True, timeout=60,
                     env={**os.environ, "ONLY_CHILD": "1"}, start_new_session=True, check=True)
print(os.getpid(), out.stdout.strip(), out.stderr.strip())
print(subprocess.run(["echo", "not python"], capture_output=True, text=True).stdout.strip())
"""


def test_a_child_starting_python_forks_itself_and_resets_what_exec_resets(tmp_path: Path) -> None:
    """A warm child's own ``python`` children are forked from it (torch is already there, the
    child's parent is the caller) with what a fresh interpreter has: default signal handlers,
    a random seed of its own, no descriptor but the standard ones."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    res = warm.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                   env=child_env())
    assert res.returncode == 0, res
    first, second = res.stdout.splitlines()
    pid, rest = first.split(" ", 1)
    assert rest == f"{pid} True True ['a'] 1 True False False ", first
    assert second == "not python"
