"""The peer checkpoint libraries measured beside roll-ckpt: the ones a user would pick instead.

One adapter per peer says how to save, save asynchronously, wait and load with it through its
own public API, which settings it needs on a machine without a GPU, and why it cannot run
where it cannot. :mod:`bench.worker`'s cases (``tc_*``, ``bcp_*``) time them exactly as they
time roll-ckpt and DCP, on the same FSDP2 + AdamW state, in the same alternation.

The peers are not dependencies of roll-ckpt or of its tests: ``make bench-peers`` installs
them (pip) into the benchmark's own venv, ``.venv-bench``, which sees the project's ``.venv``
beneath its own packages (ByteCheckpoint pins protobuf 3.20, older than what Ray needs in
``.venv``). Each peer is imported only when a case first needs it; where one is absent its
cases are listed as not run, with :data:`INSTALL_HINT`, and the run goes on.

Facts each adapter relies on were read in the peer's own source (the release named in
:data:`VERSIONS`) and checked on a 2-core machine without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import multiprocessing
import os
import threading
from typing import Any, Callable

INSTALL_HINT = "not installed: run `make bench-peers` (the peers live in .venv-bench; `make bench` uses it)"

VERSIONS = {"torch-checkpointing": "0.1.1", "bytecheckpoint": "0.0.2"}
"""The releases the adapters were written against (``make bench-peers`` installs these)."""

CANNOT_RUN = {
    "nvidia-resiliency-ext 0.4.1 (NVRx)": (
        "cannot run here: its asynchronous checkpoint path calls torch.cuda.synchronize() before every "
        "save (checkpointing/async_ckpt/core.py, the async caller; torch_ckpt.TorchAsyncCheckpoint.async_save "
        "too), which raises 'Torch not compiled with CUDA enabled' on a machine without a GPU"),
}
"""Peers a user would also consider that cannot run on this machine, and why (in the report)."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fsync(path: str) -> None:
    """fsync a file or a folder (a folder: the entries that name its files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(paths: list[str]) -> None:
    """fsync each file, then each folder holding one (the entries that name them)."""
    for p in paths:
        _fsync(p)
    for d in sorted({os.path.dirname(p) for p in paths}):
        _fsync(d)


class Pending:
    """An asynchronous save in flight: ``staged()`` returns once the training loop may change
    the state again, ``written()`` once the library reports its files written."""

    def __init__(self, staged: Callable[[], None], written: Callable[[], None]) -> None:
        self.staged, self.written = staged, written


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


class Peer:
    """One peer library: its distribution, what it needs here, and whether it is importable."""

    def __init__(self) -> None:
        self._pids: dict[str, set[int]] = {}

    def _owning(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; the child processes it leaves are the library's, under ``key``."""
        before = _child_pids()
        try:
            return fn()
        finally:
            self._pids.setdefault(key, set()).update(_child_pids() - before)

    def processes(self, key: str) -> set[int]:
        """The live processes the library started for ``key`` (its memory is the library's too)."""
        alive = _child_pids()
        return {p for p in self._pids.get(key, set()) if p in alive}

    key = ""
    dist = ""
    module = ""
    title = ""
    settings = ""
    """The settings it runs with on this machine, and why each (shown in the report)."""

    def why_not(self) -> str | None:
        """Why this peer cannot run in this interpreter (not installed, another release), or ``None``."""
        have = _version(self.dist)
        if have is None:
            return f"{self.dist} {INSTALL_HINT}"
        if have != VERSIONS[self.dist]:
            return (f"{self.dist} {have} is installed; the adapter was written against {VERSIONS[self.dist]} "
                    "(`make bench-peers` installs it)")
        self.before_import()
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # an import that fails here is a fact for the report, whatever it raises
            return f"{self.dist} {have} does not import here: {type(exc).__name__}: {exc}"
        return None

    def before_import(self) -> None:
        """What must be set before the first import (a library that reads its settings then)."""

    def close(self) -> None:
        """End what this adapter made for one state (its managers, their processes, buffers)."""

    def shutdown(self) -> None:
        """End what lives as long as the process (servers started once); :meth:`close` first."""
        self.close()

    def describe(self) -> dict[str, Any]:
        return {"dist": self.dist, "version": _version(self.dist) or VERSIONS[self.dist], "title": self.title,
                "settings": self.settings}


# ----------------------------------------------------------------------------- torch-checkpointing


class TorchCheckpointing(Peer):
    """torch-checkpointing (meta-pytorch; torchtitan's ``TorchCheckpointingManager`` drives it).

    Its ``CheckpointManager`` stages the state dict on a thread of its own into shared memory
    and writes it from a child process; ``save()`` returns at once, and the training loop waits
    at ``with manager.lock(): optimizer.step()`` until staging is done. The cases therefore count
    as blocked the time until that lock is free (the effective stall), and report the call's own
    time beside it. It writes through the page cache and never fsyncs; "durable" adds an fsync of
    the rank's files and of their folder, timed in.
    """

    key, dist, module, title = "tc", "torch-checkpointing", "torch_checkpointing", "torch-checkpointing"
    settings = (
        "CheckpointManager, async (its default: staged on its own thread into shared memory, written by its "
        "own process); LocalFileSystemStorageConfig(use_direct_io=False): its O_DIRECT writes fail with EINVAL "
        "on this disk; CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False): both need "
        "CUDA; items model and optimizer as ItemSpec(requires_copy=True) without a resharder, the state dict "
        "from get_state_dict as torchtitan's: its DefaultResharder's metadata all-gather allocates on "
        "device='cuda', so a checkpoint reloads on the layout that wrote it; blocked = until its staging lock "
        "(manager.lock(), which guards optimizer.step()) is free; it never fsyncs: durable = its write future, "
        "then an fsync of the rank's files and their folder; the sync rows use SyncCheckpointSaverConfig")

    def __init__(self) -> None:
        super().__init__()
        self._managers: dict[bool, Any] = {}
        self._saved = False

    def manager(self, is_async: bool) -> Any:
        if is_async not in self._managers:
            self._managers[is_async] = self._owning(self.mode(is_async), lambda: self._make(is_async))
        return self._managers[is_async]

    @staticmethod
    def mode(is_async: bool) -> str:
        return "async" if is_async else "sync"

    def processes(self, key: str) -> set[int]:
        """Its async manager's writer process: started by a thread of its own after the manager
        is made, so it is read where the manager keeps it (its ``CheckpointProcess``)."""
        m = self._managers.get(key == "async")
        proc = getattr(getattr(getattr(m, "_saver", None), "_checkpoint_process", None), "process", None)
        pids = {p.pid for p in getattr(proc, "processes", []) if p.is_alive()}
        return pids | super().processes(key)

    def _make(self, is_async: bool) -> Any:
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        save = (AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(
            use_pinned_memory=False, use_non_blocking_copy=False)) if is_async else SyncCheckpointSaverConfig())
        spec = ItemSpec(requires_copy=True)
        return CheckpointManager(CheckpointManager.Config(
            items={"model": spec, "optimizer": spec}, save=save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def save(self, path: str, state_dict: dict[str, Any]) -> None:
        self.manager(False).save(path, state_dict)

    def async_save(self, path: str, state_dict: dict[str, Any]) -> Pending:
        m = self.manager(True)
        if not self._saved:  # its writer process may start at the first save (not timed: the kept phase)
            fut = self._owning("async", lambda: m.save(path, state_dict))
            self._saved = True
        else:
            fut = m.save(path, state_dict)

        def staged() -> None:
            with m.lock():  # what `with manager.lock(): optimizer.step()` waits for
                pass

        return Pending(staged, lambda: fut.result())

    @staticmethod
    def durable(path: str, rank: int) -> None:
        """fsync what this rank wrote (``<item>_<rank>.pt``); rank 0 also anything else there and
        the folder that names the checkpoint. Every rank writes into a temporary folder that
        rank 0 renames to ``path`` once all are past its barrier: another rank's save returns
        before that rename, so the ranks meet first."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        mine = []
        for name in sorted(os.listdir(path)):
            stem = os.path.splitext(name)[0]
            if stem.endswith(f"_{rank}") or (rank == 0 and not stem.rsplit("_", 1)[-1].isdigit()):
                mine.append(os.path.join(path, name))
        fsync_tree(mine)
        if rank == 0:  # the rename's entry
            _fsync(os.path.dirname(os.path.abspath(path)))

    def load(self, path: str, state_dict: dict[str, Any]) -> None:
        """Into the live state dict's tensors, in place (strict: every key must be there)."""
        self.manager(True).load(path, into=state_dict, strict=True)

    def close(self) -> None:
        for m in self._managers.values():
            m.close()  # waits for the last write, ends its writer process
        self._managers.clear()
        self._saved = False


# ----------------------------------------------------------------------------- ByteCheckpoint


class ByteCheckpoint(Peer):
    """ByteCheckpoint (ByteDance): ``bytecheckpoint.save`` / ``load`` with ``framework="fsdp2"``.

    It declares torch <= 2.5 and is installed without its dependencies (``make bench-peers``
    adds them by hand); its own version check compares strings, so torch "2.13" passes it. An
    asynchronous save (``fast_saving=True``) copies the state in the call, then writes and fsyncs
    from a thread per component (model, optimizer); rank 0 starts a gRPC server process on its
    first save for the ranks' end-of-save gather, which the library never ends: :meth:`close`
    ends it by its pid.
    """

    key, dist, module, title = "bcp", "bytecheckpoint", "bytecheckpoint", "ByteCheckpoint"
    settings = (
        "bytecheckpoint.save/load(framework='fsdp2') with the model and optimizer objects, its defaults "
        "otherwise: its staging pool calls cudaHostRegister only where torch has CUDA, so here its buffers are "
        "plain shared memory, kept between saves; async = fast_saving=True (the call copies the state, a "
        "thread per component writes and fsyncs it; done = both threads idle, after its gRPC end-of-save "
        "gather); installed with --no-deps (it declares torch<=2.5; its version check compares strings and "
        "passes 2.13) plus grpcio 1.69.0, protobuf 3.20.3, mmh3 4.1.0, universal-pathlib, cachetools; the gRPC "
        "server process rank 0 starts is ended by its pid; loads use fast_loading=False (its default)")

    COMPONENTS = ("model", "optimizer")

    def __init__(self) -> None:
        super().__init__()
        self._used = False
        self._step = 0

    def before_import(self) -> None:
        # its logger reads the level once, at import; its INFO lines come several per save
        os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "WARNING")

    def _lib(self) -> Any:
        self.before_import()
        import bytecheckpoint

        self._used = True
        return bytecheckpoint

    def _save(self, path: str, model: Any, opt: Any, fast: bool) -> None:
        bcp = self._lib()
        self._step += 1

        def save() -> None:
            # global_steps: without it the end-of-save gather and its tracker file are skipped,
            # and nothing says when an asynchronous save is done; the folder is the caller's path
            bcp.save(path, {"model": model, "optimizer": opt}, framework="fsdp2", fast_saving=fast,
                     global_steps=self._step, ignore_append_global_steps_to_folder=True)

        from bytecheckpoint.distributed import rpc_context

        if rpc_context._addr is None:  # the first save starts its gRPC server (not timed: the kept phase)
            self._owning("server", save)
        else:
            save()

    def save(self, path: str, model: Any, opt: Any) -> None:
        self._save(path, model, opt, fast=False)

    def async_save(self, path: str, model: Any, opt: Any) -> Pending:
        self._save(path, model, opt, fast=True)
        return Pending(lambda: None, self._wait)

    def _wait(self) -> None:
        """Both components' writer threads idle: their files written and fsynced, the gather done."""
        from bytecheckpoint.storage._storage import _local_storage_writer as writer

        for c in self.COMPONENTS:
            queue = writer._sync_queues.get(f"fsdp2_{c}")
            if queue is not None:
                queue.join()

    @staticmethod
    def durable(path: str, rank: int) -> None:
        """Nothing to add: it fsyncs its data files and ``.metadata`` itself."""

    def load(self, path: str, model: Any, opt: Any) -> None:
        self._lib().load(path, {"model": model, "optimizer": opt}, framework="fsdp2")

    def close(self) -> None:
        """Wait for the last save; drop its staging pools, I/O workers and plan cache, and end
        its gRPC server by its pid: the next state's first save starts them again, as a job of
        its own would (so each state's kept memory counts the server)."""
        if not self._used:
            return
        self._wait()
        from bytecheckpoint.distributed import rpc_context
        from bytecheckpoint.engine import _store_engine

        _store_engine.cleanup_resources()
        for p in multiprocessing.active_children():
            if p.pid in self._pids.get("server", set()):
                p.terminate()
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        self._pids.pop("server", None)
        # every rank forgets the server's address: the next save starts one and hands it round
        rpc_context._addr = rpc_context._stub = None

    def shutdown(self) -> None:
        """And its writer threads, which live as long as the process."""
        if not self._used:
            return
        self.close()
        from bytecheckpoint.storage._storage import _local_storage_writer as writer

        writer.cleanup_resources()
        self._used = False


PEERS: dict[str, type[Peer]] = {c.key: c for c in (TorchCheckpointing, ByteCheckpoint)}

_made: dict[str, Peer] = {}
_lock = threading.Lock()


def get(key: str) -> Peer:
    """The process's one adapter of a peer (a peer keeps process-wide state: its writer
    process, its gRPC server, its plan caches)."""
    with _lock:
        if key not in _made:
            _made[key] = PEERS[key]()
        return _made[key]


def close_all() -> None:
    """The end of a state: each adapter's per-state resources (:meth:`Peer.close`)."""
    for p in _made.values():
        p.close()


def shutdown_all() -> None:
    """The end of the process: every peer's processes and threads, ended (:meth:`Peer.shutdown`)."""
    for p in list(_made.values()):
        p.shutdown()
    _made.clear()


def describe() -> dict[str, Any]:
    """Each peer's release, title and settings, and the ones that cannot run here (for the report)."""
    return {"peers": {k: c().describe() for k, c in PEERS.items()}, "cannot_run": dict(CANNOT_RUN)}
