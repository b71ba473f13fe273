"""The processes of a multi-component job for ``test_components.py`` (run as a child; never imported by pytest).

Three components save the same steps of one RL job, each with its own processes and its
own ``CheckpointManager(config, component=...)``:

* ``actor_train`` - an FSDP2 model on a 2-rank gloo process group (``roll_ckpt_fsdp2``),
  AdamW and a LR scheduler, saved asynchronously;
* ``critic``      - a plain model on one process, no process group (``dcp``), saved synchronously;
* ``pipeline``    - the driver's :class:`roll_ckpt.DriverState` (``json``), saved asynchronously.

Each loop is deterministic (fixed seeds, fixed data per step, dropout and the Python and
NumPy generators restored on resume), so a run that was killed and resumed must produce
the same losses (``float.hex``) and the same final state as an uninterrupted one.

Modes:

* ``python _components_child.py run SPEC_JSON`` - one process of one component (the actor's
  ranks under ``torchrun``, which sets ``RANK``/``WORLD_SIZE``/``MASTER_PORT``);
* ``python _components_child.py serve`` - a fork server (:mod:`helpers.forkserver`): imports
  torch and roll_ckpt once, then forks a process running SPEC per ``{"fork": SPEC}`` and
  reaps ended ones on ``{"poll": N}``. A forked actor rank sets the environment torchrun
  would set (:func:`helpers.launch.rank_env`) and joins a real gloo process group (env://
  rendezvous); forking saves the seconds of importing torch per process.

``tests/`` is on ``PYTHONPATH`` (helpers.launch.child_env): the shared helpers.

SPEC (JSON): ``mode`` (``component``, the default, or ``complete``), ``component``, ``out``,
``storage_options``, ``run_name`` (exported as ``ROLL_CKPT_RUN_NAME``: the config says
``run_name: ${env:ROLL_CKPT_RUN_NAME}``), ``steps``, ``every``, ``keep``, ``stop_after``
(return after the save of that step), ``kill`` (``{"rank", "step", "at", "suffix"}``: with
``at: write`` SIGKILL this process in the middle of writing the file of that step whose
name holds ``suffix``; with ``at: step_commit`` commit this part of the step last, once the
processes whose log files ``logs`` lists are done, then SIGKILL the process before it
commits the step), ``log`` and ``result`` (``{rank}`` is
replaced), and for a forked actor rank ``rank``, ``world_size`` and ``master_port``.

Events go to the log file, one line each, written with one ``os.write`` (never torn by a kill):

    start <pid>                            the process started
    built                                  its model (and process group) is ready
    ready <start> <resumed_from or ->     resumed (0: fresh start)
    loss <step> <float.hex>                trained step <step>
    part <step> <path>                     this component's part of <step> is committed
    step <step> <path>                     this process committed the whole step (its manifest)
    last <step>                            (at: step_commit) every other part is committed
    dying <step> <bytes> <file>            about to SIGKILL itself, <bytes> into writing <file>
    done                                   finished normally

``complete`` mode (the commit race): ``out``, ``storage_options``, ``step_path``, ``step``,
``expected``, ``sync`` (a folder), ``index``, ``n``, ``barrier`` (``start``: all start
``try_complete`` at once; ``create``: all wait at the create of the step's manifest until
every one of them got there). Writes ``{"won": bool}`` or ``{"error": ...}`` to ``result``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from typing import Any

from helpers.forkserver import emit, serve
from helpers.launch import rank_env
from helpers.training import config, mlp, optimizer_and_scheduler, shard, train_step
from roll_ckpt.plugin import hookimpl

COMPONENTS = ["actor_train", "critic", "pipeline"]
IN_FLIGHT = {"actor_train": True, "critic": False, "pipeline": True}  # async_save_ckpt


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_digest(t: Any) -> str:
    t = t.detach().contiguous().cpu()
    return f"{t.dtype}{tuple(t.shape)}:" + _sha(t.numpy().tobytes())


# --------------------------------------------------------------------------- killing mid-write


class _DyingFile:
    """A file being written: its first write puts half of the bytes down, then SIGKILLs the process."""

    def __init__(self, inner: Any, fd: int, step: int, path: str) -> None:
        self._inner, self._fd, self._step, self._path = inner, fd, step, path

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        half = max(1, len(view) // 2)
        self._inner.write(view[:half])
        try:
            self._inner.flush()
        except Exception:  # noqa: BLE001 - the bytes may or may not reach the store: both are "mid-write"
            pass
        emit(self._fd, "dying", self._step, half, self._path)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        raise AssertionError("not killed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> "_DyingFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


class KillMidWrite:
    """The manager's storage: the file of step ``step`` whose name holds ``suffix`` kills
    this process halfway through its first write (see :class:`_DyingFile`)."""

    def __init__(self, inner: Any, fd: int, step: int, suffix: str) -> None:
        self._inner, self._fd, self._step, self._suffix = inner, fd, step, suffix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def open_write(self, path: str) -> Any:
        f = self._inner.open_write(path)
        if f"/checkpoint-{self._step}/" in str(path) and self._suffix in str(path).rsplit("/", 1)[-1]:
            return _DyingFile(f, self._fd, self._step, str(path))
        return f


class KillBeforeStepCommit:
    """The manager's storage: commits this component's part of step ``step`` last (it waits
    until every other part is committed and the other components' processes, listed by
    their ``logs``, are done: none of them can commit the step any more), then SIGKILLs
    the process when it looks for the step's manifest, which it would now create: the
    step is complete but not committed."""

    def __init__(self, inner: Any, fd: int, step: int, component: str, components: list[str],
                 logs: list[str]) -> None:
        self._inner, self._fd, self._step = inner, fd, step
        self._component, self._others = component, [c for c in components if c != component]
        self._logs = logs
        self._armed = False

    def _others_done(self) -> bool:
        for log in self._logs:
            try:
                with open(log) as f:
                    if not any(line.startswith("done ") for line in f):
                        return False
            except FileNotFoundError:
                return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _step_path(self, path: str) -> str | None:
        head, sep, _ = str(path).partition(f"/checkpoint-{self._step}/")
        return head + sep.rstrip("/") if sep else None

    def _wait_for_the_others(self, step_path: str) -> None:
        deadline = time.monotonic() + 120
        while not (all(self._inner.exists(self._inner.join(step_path, c, "manifest.json")) for c in self._others)
                   and self._others_done()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other parts of {step_path} were never committed")
            time.sleep(0.02)
        emit(self._fd, "last", self._step)
        self._armed = True

    def rename_dir(self, src: str, dst: str) -> None:  # POSIX: the part's commit
        step_path = self._step_path(dst)
        if step_path is not None and str(dst).rstrip("/").endswith(f"/{self._component}"):
            self._wait_for_the_others(step_path)
        self._inner.rename_dir(src, dst)

    def write_create(self, path: str, data: bytes) -> None:  # object stores: the part's manifest
        step_path = self._step_path(path)
        if step_path is not None and str(path).endswith(f"/{self._component}/manifest.json"):
            self._wait_for_the_others(step_path)
        self._inner.write_create(path, data)

    def exists(self, path: str) -> bool:
        step_path = self._step_path(path)
        if self._armed and step_path is not None and str(path) == self._inner.join(step_path, "manifest.json"):
            emit(self._fd, "dying", self._step, 0, path)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return self._inner.exists(path)


class _Events:
    """Plugin: logs the commits this process makes (its part; the whole step when it wins)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @hookimpl
    def roll_ckpt_on_commit(self, info: Any) -> None:
        emit(self.fd, "part" if info.component else "step", info.step, info.path)


# --------------------------------------------------------------------------- the components


def _config(spec: dict[str, Any], component: str) -> Any:
    os.environ["ROLL_CKPT_RUN_NAME"] = spec["run_name"]
    return config(spec["out"], storage_options=spec.get("storage_options") or {},
                  components=list(spec.get("components", COMPONENTS)), run_name="${env:ROLL_CKPT_RUN_NAME}",
                  max_ckpt_to_keep=int(spec.get("keep", 0)), resume_from_checkpoint="latest",
                  save_steps=int(spec["every"]), async_save=IN_FLIGHT[component])


def _actor(spec: dict[str, Any]) -> tuple[dict[str, Any], Any, Any, int]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if "rank" in spec:  # a forked rank: the environment torchrun gives its workers
        os.environ.update(rank_env(int(spec["rank"]), int(spec["world_size"]), int(spec["master_port"])))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = shard(mlp(32, depth=2, seed=0), mesh)
    opt, sched = optimizer_and_scheduler(model)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    def train(step: int) -> float:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        x = x + torch.randn(x.shape) * 0.01 * float(np.random.rand()) + random.random() * 1e-3
        return train_step(state, x, scheduler=True).item()

    def final() -> dict[str, str]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out = {f"param.{k}": _tensor_digest(v.full_tensor()) for k, v in model.state_dict().items()}
        osd = get_optimizer_state_dict(model, opt)
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"optim.{fqn}.{k}"] = _tensor_digest(full) if isinstance(full, torch.Tensor) else repr(full)
        out["lr"] = float(sched.get_last_lr()[0]).hex()
        out["rank_rng"] = _sha(torch.get_rng_state().numpy().tobytes() + repr(random.getstate()).encode()
                               + repr(np.random.get_state()).encode())
        return out

    return state, train, final, rank


def _critic(spec: dict[str, Any]) -> tuple[dict[str, Any], Any, Any, int]:
    import torch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    torch.manual_seed(7)

    def train(step: int) -> float:
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(5000 + step))
        loss = (model(x) - x.sum(1, keepdim=True) * 0.1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def final() -> dict[str, str]:
        out = {f"param.{k}": _tensor_digest(v) for k, v in model.state_dict().items()}
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = _tensor_digest(v) if isinstance(v, torch.Tensor) else repr(v)
        out["torch_rng"] = _sha(torch.get_rng_state().numpy().tobytes())
        return out

    return {"model": model, "optimizer": opt}, train, final, 0


def _pipeline(spec: dict[str, Any]) -> tuple[dict[str, Any], Any, Any, int]:
    import numpy as np

    from roll_ckpt import DriverState

    random.seed(11)
    np.random.seed(12)
    driver = DriverState(step=0, consumed_samples=0, best_reward=float("-inf"), history=[])

    def train(step: int) -> float:
        batch = sorted(random.sample(range(10_000), 4))
        reward = float(np.random.rand()) + random.gauss(0.0, 1.0)
        driver["step"] = step
        driver["consumed_samples"] += len(batch)
        driver["best_reward"] = max(driver["best_reward"], reward)
        driver["history"].append({"step": step, "batch": batch, "reward": reward})
        return reward

    def final() -> dict[str, str]:
        return {"driver": json.dumps(dict(driver)),  # key order too
                "python_rng": _sha(repr(random.getstate()).encode()),
                "numpy_rng": _sha(repr(np.random.get_state()).encode())}

    return {"driver": driver}, train, final, 0


BUILD = {"actor_train": _actor, "critic": _critic, "pipeline": _pipeline}


def run_component(spec: dict[str, Any]) -> int:
    """Resume from ``latest``, train to ``steps`` saving every ``every`` (or stop after ``stop_after``)."""
    component = spec["component"]
    rank = int(spec.get("rank", os.environ.get("RANK", 0)))
    fd = os.open(spec["log"].format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    emit(fd, "start", os.getpid())
    if component != "pipeline":
        import torch

        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    state, train, final, rank_ = BUILD[component](spec)
    assert rank_ == rank, (rank_, rank)
    emit(fd, "built")
    from roll_ckpt import CheckpointManager
    from roll_ckpt.plugins import get_plugins

    plugins = get_plugins()
    events = f"components-test-events-{os.getpid()}"
    hooks = _Events(fd)
    plugins.register(hooks, events)
    manager = CheckpointManager(_config(spec, component), component=component, plugins=plugins, quiet=True)
    kill = spec.get("kill")
    if kill and int(kill.get("rank", 0)) == rank and kill.get("at", "write") == "write":
        manager.storage = KillMidWrite(manager.storage, fd, int(kill["step"]), kill["suffix"])
    elif kill and int(kill.get("rank", 0)) == rank:
        manager.storage = KillBeforeStepCommit(manager.storage, fd, int(kill["step"]), component,
                                               list(spec.get("components", COMPONENTS)), kill["logs"])
    start = manager.resume(state)
    emit(fd, "ready", start, manager.resumed.path or "-")
    losses: dict[int, str] = {}
    stop = int(spec.get("stop_after") or 0)
    for step in range(start + 1, int(spec["steps"]) + 1):
        losses[step] = float(train(step)).hex()
        emit(fd, "loss", step, losses[step])
        manager.maybe_save(step, state)
        if step == stop:
            break
    manager.close()
    digests = final()
    with open(spec["result"].format(rank=rank), "w") as f:
        json.dump({"component": component, "rank": rank, "start": start, "losses": losses,
                   "final": digests}, f)
    emit(fd, "done")
    plugins.unregister(hooks)  # the fork server's own runs leave nothing to its children
    os.close(fd)
    if component == "actor_train":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the commit race


def run_complete(spec: dict[str, Any]) -> int:
    """One of several processes calling ``try_complete`` on the same complete step at once."""
    from roll_ckpt.format.components import try_complete
    from roll_ckpt_fs import open_storage

    times = {"start": time.time()}
    sync, n, me = spec["sync"], int(spec["n"]), int(spec["index"])
    storage = open_storage(spec["out"], spec.get("storage_options") or {})
    storage.list(spec["step_path"])  # connect (S3) before the start line
    times["connected"] = time.time()

    def wait_for(prefix: str) -> None:
        deadline = time.monotonic() + 60
        while sum(1 for name in os.listdir(sync) if name.startswith(prefix)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every process reached '{prefix}'")
            time.sleep(0.0005)

    if spec["barrier"] == "create":
        real = storage.write_create

        def write_create(path: str, data: bytes) -> None:
            open(os.path.join(sync, f"create-{me}"), "w").close()
            wait_for("create-")
            real(path, data)

        storage.write_create = write_create  # type: ignore[method-assign]
    open(os.path.join(sync, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(sync, "go")):
        time.sleep(0.001)
    times["go"] = time.time()
    try:
        won = try_complete(storage, spec["step_path"], int(spec["step"]), spec["expected"]) is not None
        out: dict[str, Any] = {"won": won}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out = {"error": f"{type(exc).__name__}: {exc}"}
    times["done"] = time.time()
    out["times"] = times
    with open(spec["result"], "w") as f:
        json.dump(out, f)
    return 0


def run(spec: dict[str, Any]) -> int:
    return run_complete(spec) if spec.get("mode") == "complete" else run_component(spec)


# --------------------------------------------------------------------------- fork server


def _prewarm() -> None:
    """Run the critic and the pipeline for a few steps here (no process group), so that
    forked processes find every lazy import done. Leaves no thread behind."""
    import shutil
    import tempfile
    import threading

    tmp = tempfile.mkdtemp(prefix="roll-ckpt-components-prewarm-")
    try:
        base = {"out": os.path.join(tmp, "ckpt"), "run_name": "20000101-000000", "steps": 2, "every": 1,
                "components": ["critic", "pipeline"]}
        for component in ("critic", "pipeline"):
            run_component(dict(base, component=component, log=os.path.join(tmp, f"{component}.log"),
                               result=os.path.join(tmp, f"{component}.json")))
        base["run_name"] = "20000101-000001"
        for component in ("critic", "pipeline"):  # resume
            run_component(dict(base, component=component, steps=3, log=os.path.join(tmp, f"{component}.log"),
                               result=os.path.join(tmp, f"{component}.json")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert threading.active_count() == 1, threading.enumerate()


def main() -> int:
    if sys.argv[1] != "serve":
        return run(json.loads(sys.argv[2]))
    import torch

    torch.set_num_threads(1)
    # imported up front so that forked processes start warm
    import numpy  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import roll_ckpt.format.components  # noqa: F401
    import roll_ckpt.dcp.reader, roll_ckpt.dcp.writer  # noqa: F401,E401
    import roll_ckpt_fs  # noqa: F401
    import roll_ckpt_fsdp2  # noqa: F401
    try:
        import s3fs  # noqa: F401
    except ImportError:  # pragma: no cover
        pass
    return serve(run, stderr_of=lambda spec: spec["stderr"], prewarm=_prewarm, orphans_die=True)


if __name__ == "__main__":
    sys.exit(main())
