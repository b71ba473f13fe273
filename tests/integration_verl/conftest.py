"""What the verl integration tests share: the tiny model, and launches of verl's own code (an
SFT job under torchrun, a PPO trainer's driver on Ray), each bounded, in a process group of
its own that is killed when it ends, the Ray cluster a driver starts shut down by it.

These tests need verl itself: they run in the verl leg of the matrix (``make test-leg
LEG=verl``: verl 0.9.1 from PyPI); elsewhere they are skipped, saying so. The ones that need no
verl (the steps' commit rules, the format on hand-made folders) run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import REPO, child_env, kill_group

from ._common import HERE, cpu_env

HAS_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed here: the verl integration runs verl's own "
                                                      "code in the verl leg (make test-leg LEG=verl)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ._common import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny-llama")))


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str]:
    """``cmd`` in a process group of its own, at most ``timeout`` seconds; the group is killed
    when it ends (torchrun's workers, a Ray driver's raylet and workers if it did not shut
    them down). Returns its exit status and output."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()
            raise AssertionError(f"{' '.join(cmd[-2:])} did not end within {timeout:.0f} s:\n"
                                 f"{log.read_text(errors='replace')[-6000:]}") from None
        finally:
            kill_group(proc)
    return code, log.read_text(errors="replace")


class Jobs:
    """Launches of the test jobs, their specs and results under one folder."""

    def __init__(self, root: Path, model: str) -> None:
        self.root = root
        self.model = model
        self.out = root / "out"
        self.out.mkdir(parents=True, exist_ok=True)

    def _spec(self, tag: str, ckpt: Path, **spec: Any) -> Path:
        path = self.out / f"spec-{tag}.json"
        path.write_text(json.dumps({"model": self.model, "ckpt": str(ckpt), "out": str(self.out), "tag": tag, **spec}))
        return path

    def sft(self, tag: str, ckpt: Path, *, nproc: int = 2, vendor: bool = True, timeout: float = 240,
            ok: bool = True, **spec: Any) -> list[dict]:
        """``_sft_job.py`` under torchrun on ``nproc`` gloo ranks; each rank's result."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(HERE / "_sft_job.py"), str(self._spec(tag, ckpt, **spec))]
        t = time.monotonic()
        code, output = _run(cmd, child_env(cpu_env(vendor)), timeout, self.out / f"log-{tag}.txt")
        if ok:
            assert code == 0, output[-8000:]
            assert "Traceback" not in output, output[-8000:]
        else:
            assert code != 0, output[-4000:]
        print(f"[{tag}] {time.monotonic() - t:.1f} s")
        results = []
        for r in range(nproc):
            f = self.out / f"result-{tag}-rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"output": output[-4000:]})
        return results

    def ppo(self, tag: str, ckpt: Path, *, vendor: bool = True, timeout: float = 360, **spec: Any) -> dict:
        """``_ppo_job.py``: verl's PPO trainer's checkpoint code on a Ray driver; its result."""
        cmd = [sys.executable, str(HERE / "_ppo_job.py"), str(self._spec(tag, ckpt, **spec))]
        t = time.monotonic()
        for attempt in range(2):
            code, output = _run(cmd, child_env(cpu_env(vendor), RAY_ADDRESS="local"), timeout,
                                self.out / f"log-{tag}.txt")
            result = json.loads((self.out / f"result-{tag}.json").read_text()) if code == 0 else {}
            # verl's worker groups pick their rendezvous port as free, then bind it: another process of
            # this machine may take it first (EADDRINUSE). Nothing was loaded or saved then: launch again.
            if attempt == 0 and "EADDRINUSE" in output and "start" not in result:
                print(f"[{tag}] verl's rendezvous port was taken meanwhile (EADDRINUSE): launched again")
                continue
            break
        assert code == 0, output[-8000:]
        print(f"[{tag}] {time.monotonic() - t:.1f} s")
        result["output"] = output
        return result


def snapshot_file(jobs: Jobs, tag: str, step: int) -> str:
    """The prefix of an SFT job's snapshot files of ``step`` (``-rank<r>.pt`` follows)."""
    return str(jobs.out / f"snap-{tag}-{step}")


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its SHA-256 (what 'untouched' means)."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tracker(root: Path) -> int | None:
    f = root / "latest_checkpointed_iteration.txt"
    return int(f.read_text()) if f.exists() else None

