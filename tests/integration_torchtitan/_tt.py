"""What the torchtitan tests share: whether torchtitan is here, and launches of
torchtitan's own ``Trainer`` (``tt_run.py``) under the real torchrun, bounded and ended by
process group.

torchtitan is installed in the ``torchtitan`` leg only (``make test-leg LEG=torchtitan``); the
tests that need it are skipped elsewhere with that reason (``needs_torchtitan``).
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import child_env, kill_group

HERE = Path(__file__).resolve().parent
TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(not TORCHTITAN, reason="torchtitan is not installed here: its tests run in the "
                                                             "torchtitan leg (make test-leg LEG=torchtitan)")

COMMON = ("--module llama3 --config llama3_debugmodel --training.seq_len 128 --training.local_batch_size 2 "
          "--training.steps 6 --training.disable_cuda_graphs --training.mixed_precision_param float32 "
          "--parallelism.spmd_backend partial_dtensor --validator.no-enable --checkpoint.enable "
          "--checkpoint.interval 2 --checkpoint.keep_latest_k 0 --debug.seed 42 --metrics.log_freq 1").split()
"""torchtitan's llama3 debug model (6.2 M parameters; its config saves the last step whole) on short
sequences, 6 steps, a checkpoint every 2, seeded; ``spmd_backend partial_dtensor``: torch 2.13 and
torchtitan's default ``spmd_types`` fail in ``fully_shard`` (on CPU and GPU alike)."""
SWITCH = ("--override.imports", "roll_ckpt_torchtitan.use_roll_ckpt")
"""The one setting that makes roll-ckpt torchtitan's checkpoint manager."""


@dataclass
class Launch:
    """One torchrun launch of ``tt_run.py``: its exit status, its output, what its hooks wrote."""

    out: Path
    rc: int
    log: str
    seconds: float

    def losses(self) -> dict[int, float]:
        path = self.out / "losses.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return {r["step"]: r["loss"] for r in rows}

    def dump(self, tag: str, rank: int) -> dict[str, Any]:
        import torch

        return torch.load(self.out / "dumps" / f"{tag}.rank{rank}.pt", weights_only=False)


def launch(out: Path, dump_folder: Path, assets: dict[str, str], *flags: str, roll: bool = True,
           kill: str = "", timeout: float = 240) -> Launch:
    """``torchrun --standalone --nproc_per_node 2 tt_run.py`` with :data:`COMMON` and ``flags``
    (``roll``: through the switch), writing checkpoints under ``dump_folder``; ``kill``:
    ``rank:step:bytes`` (``tt_run.py``). Bounded by ``timeout``; the agent and its workers are
    killed by process group afterwards in any case."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "tt_run.py"), *COMMON, "--hf_assets_path", assets["tokenizer"],
           "--dataloader.dataset_path", assets["data"], "--dump_folder", str(dump_folder),
           *(SWITCH if roll else ()), *flags]
    env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TT_TEST_OUT=str(out), TT_TEST_KILL=kill)
    started = time.monotonic()
    with open(out / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(out), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()
            raise AssertionError(f"torchtitan did not end within {timeout:.0f} s:\n"
                                 f"{(out / 'torchrun.log').read_text()[-6000:]}") from None
        finally:
            kill_group(proc)
    return Launch(out, rc, (out / "torchrun.log").read_text(errors="replace"), time.monotonic() - started)


def _bytes(t: Any) -> bytes:
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""


def differences(a: dict[str, Any], b: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """Every key of two dumps whose value differs (tensors: dtype, shape and every byte; the
    dataloader's pickles: what they hold); keys starting with ``skip`` are left out."""
    import torch

    out = []
    keys = {k for k in a.keys() | b.keys() if not k.startswith(skip)}
    for k in sorted(keys):
        if k not in a or k not in b:
            out.append(f"{k}: only in {'the first' if k in a else 'the second'}")
            continue
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape or _bytes(x) != _bytes(y):
                out.append(f"{k}: tensor differs")
        elif isinstance(x, bytes) and k.startswith("dataloader.dp_rank_"):
            if pickle.loads(x) != pickle.loads(y):
                out.append(f"{k}: dataloader state differs")
        elif x != y:
            out.append(f"{k}: {x!r} != {y!r}")
    return out
