"""The torchrun script of the Trainer tests: torchtitan's own ``torchtitan.train.main()``, with
the CPU shims (``tt_cpu_shims.py``) and the tests' hooks, set by the environment:

``TT_TEST_OUT``   a folder: rank 0 appends ``{"step", "loss"}`` (the exact float torchtitan logs)
                  to ``losses.jsonl``; every rank writes ``dumps/<save|load>-<step>.rank<r>.pt``,
                  every value of torchtitan's flattened state (:func:`snapshot`), right before
                  each save and right after a load -- with torchtitan's own manager and with
                  roll-ckpt's alike.
``TT_TEST_KILL``  ``rank:step:bytes``: that rank SIGKILLs itself while it writes its data file of
                  the save of ``step``, after ``bytes`` bytes (roll-ckpt's manager: through its
                  storage's ``open_write``; torchtitan's: after that many items in DCP's writer).

    torchrun --standalone --nproc_per_node 2 tt_run.py --module llama3 --config llama3_debugmodel ...
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tt_cpu_shims  # noqa: E402

OUT = os.environ.get("TT_TEST_OUT", "")
KILL = os.environ.get("TT_TEST_KILL", "")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def snapshot(states: dict) -> dict:
    """Every value a torchtitan save holds on this rank, as local copies: the flattened dict
    torchtitan's ``CheckpointManager`` hands DCP (the model's keys at the top level)."""
    import torch
    from torch.distributed.tensor import DTensor

    flat = {k: v for k, v in states.items() if k != "model"}
    flat.update(states["model"].state_dict())
    out: dict = {}

    def walk(prefix: str, v: object) -> None:
        if isinstance(v, DTensor):
            out[prefix] = v.to_local().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.detach().clone()
        elif hasattr(v, "state_dict") and not isinstance(v, dict):
            walk(prefix, v.state_dict())
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            out[prefix] = v

    walk("", flat)
    return out


def _dump(states: dict, tag: str) -> None:
    import torch

    os.makedirs(f"{OUT}/dumps", exist_ok=True)
    torch.save(snapshot(states), f"{OUT}/dumps/{tag}.rank{_rank()}.pt")


class _KillingFile:
    def __init__(self, inner: object, limit: int) -> None:
        self._inner, self._limit, self._n = inner, limit, 0

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        room = self._limit - self._n
        if view.nbytes >= room:
            self._inner.write(bytes(view[:max(room, 0)]))  # type: ignore[attr-defined]
            self._inner.flush()  # type: ignore[attr-defined]
            os.kill(os.getpid(), signal.SIGKILL)
        self._n += view.nbytes
        return self._inner.write(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __enter__(self) -> "_KillingFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()  # type: ignore[attr-defined]


class _KillingStorage:
    """roll-ckpt's storage, but the data file of the save of ``step`` kills this process."""

    def __init__(self, inner: object, step: int, limit: int) -> None:
        self._inner, self._step, self._limit = inner, step, limit

    def open_write(self, path: str) -> object:
        f = self._inner.open_write(path)  # type: ignore[attr-defined]
        if f"step-{self._step}" in path and path.endswith(".distcp"):
            return _KillingFile(f, self._limit)
        return f

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def install_hooks() -> None:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor

    from roll_ckpt_torchtitan.manager import RollCkptCheckpointManager

    original_log = MetricsProcessor.log

    def log(self, step, global_avg_loss, *args, **kwargs):  # type: ignore[no-untyped-def]
        if _rank() == 0:
            with open(f"{OUT}/losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss)}) + "\n")
        return original_log(self, step, global_avg_loss, *args, **kwargs)

    MetricsProcessor.log = log

    def wrap(cls: type) -> None:
        save, load = cls._save, cls._load

        def _save(self, curr_step: int, last_step: bool = False) -> bool:  # type: ignore[no-untyped-def]
            if last_step or curr_step % self.interval == 0:
                _dump(self.states, f"save-{curr_step}")
            return save(self, curr_step, last_step)

        def _load(self, step: int = -1) -> bool:  # type: ignore[no-untyped-def]
            loaded = load(self, step)
            if loaded:
                _dump(self.states, f"load-{self.states['train_state'].step}")
            return loaded

        cls._save, cls._load = _save, _load

    if OUT:
        wrap(CheckpointManager)
        wrap(RollCkptCheckpointManager)
    if KILL:
        rank, step, limit = (int(x) for x in KILL.split(":"))
        if _rank() != rank:
            return
        init = RollCkptCheckpointManager.__init__

        def __init__(self, config, **kwargs):  # type: ignore[no-untyped-def]
            init(self, config, **kwargs)
            if self.enable:
                self.manager.storage = _KillingStorage(self.manager.storage, step, limit)

        RollCkptCheckpointManager.__init__ = __init__
        _kill_in_dcp_writer(CheckpointManager, step, items=3)


def _kill_in_dcp_writer(cls: type, step: int, items: int) -> None:
    """torchtitan's own manager: SIGKILL inside DCP's file writer during the save of ``step``."""
    import torch.distributed.checkpoint.filesystem as fs

    armed = {"on": False, "n": 0}
    write_item, save = fs._write_item, cls._save

    def _write_item(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = write_item(*args, **kwargs)
        if armed["on"]:
            armed["n"] += 1
            if armed["n"] >= items:
                args[1].flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    def _save(self, curr_step: int, last_step: bool = False) -> bool:  # type: ignore[no-untyped-def]
        armed["on"] = curr_step == step
        return save(self, curr_step, last_step)

    fs._write_item = _write_item
    cls._save = _save


if __name__ == "__main__":
    tt_cpu_shims.apply()
    install_hooks()
    from torchtitan.train import main

    main()
