"""A reusable pytest conformance suite for roll-ckpt storage backends.

Every backend — roll-ckpt's own and third parties' — proves the same contract by
subclassing :class:`BackendConformance` in its test suite and providing one fixture,
``storage``: a fresh :class:`~roll_ckpt.storage.Storage` rooted in an empty location::

    import pytest
    from roll_ckpt.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_type = "my_backend"          # the name its BackendRecord registers

        @pytest.fixture
        def storage(self, tmp_path):
            return MyStore(str(tmp_path / "root"))

The suite checks the :class:`~roll_ckpt.storage.Storage` protocol call by call, then
runs the real commit protocol (:mod:`roll_ckpt.commit`) and a full
:class:`~roll_ckpt.CheckpointManager` save → verify → resume round trip on a tiny torch
model over the backend, selected through ``checkpoint_config.type`` like a user would.
Override the ``checkpoint_config`` fixture when the backend needs ``storage_options``.

This module imports pytest (it is a testing module); ``import roll_ckpt`` never imports
it. The manager tests import torch when they run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Mapping

try:
    import pytest
except ImportError as exc:  # pragma: no cover - only without the dev extra
    raise ImportError("roll_ckpt.testing is a pytest suite: pip install pytest") from exc

from . import commit as commit_mod
from . import layout
from .digest import hash_bytes
from .errors import CheckpointCorruptError
from .manifest import MANIFEST_NAME, FileEntry, Manifest
from .storage import Entry, Storage

__all__ = ["BackendConformance", "tiny_state", "state_snapshot", "assert_same_state",
           "dead_pid", "write_stale_marker"]


# --------------------------------------------------------------------------- helpers


def _read(storage: Storage, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def _write(storage: Storage, path: str, data: bytes) -> None:
    with storage.open_write(path) as f:
        f.write(data)


def _names(entries: list[Entry]) -> set[str]:
    return {e.name for e in entries}


def dead_pid() -> int:
    """The pid of a process of this host that has exited (for stale-marker tests)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def write_stale_marker(storage: Storage, pending: commit_mod.PendingCheckpoint, pid: int | None = None) -> None:
    """Rewrite ``pending``'s owner marker as if its writer (a process now gone) had crashed."""
    owner = {"host": socket.gethostname(), "pid": dead_pid() if pid is None else pid,
             "started": time.time() - 60, "write_path": pending.write_path,
             "final_path": pending.final_path}
    _write(storage, pending.marker_path, json.dumps(owner).encode())


def tiny_state(seed: int = 0) -> dict[str, Any]:
    """A small model with dropout, AdamW after two steps, a LR scheduler and a counter dict."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = {"seen": 0}
    for _ in range(2):
        x = torch.randn(5, 8, generator=g)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter["seen"] += 5
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counter": counter}


def state_snapshot(state: Mapping[str, Any]) -> dict[str, Any]:
    """Deep copies of the comparable parts of a :func:`tiny_state`-like state."""
    import copy

    import torch

    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            out[key] = {k: v.detach().clone() for k, v in obj.state_dict().items()}
        elif hasattr(obj, "state_dict"):
            out[key] = copy.deepcopy(obj.state_dict())
        else:
            out[key] = copy.deepcopy(obj)
    return out


def _assert_equal(a: Any, b: Any, where: str) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Bitwise comparison of two :func:`state_snapshot` results."""
    _assert_equal(dict(a), dict(b), "state")


# --------------------------------------------------------------------------- the suite


class BackendConformance:
    """Tests every storage backend must pass. Subclass it and provide ``storage``.

    ``storage`` must be a fresh backend whose :attr:`~Storage.root` is an empty (or
    missing) location private to the test. ``backend_type`` is the name the backend
    registers (``checkpoint_config.type``); the manager tests build their config from it
    and from :attr:`Storage.url`.
    """

    backend_type: str = "file_system"
    big_file_bytes: int = 5 * 1024 * 1024 + 123

    @pytest.fixture
    def storage(self) -> Storage:  # pragma: no cover - the subclass provides it
        raise NotImplementedError("a BackendConformance subclass must provide a `storage` fixture")

    @pytest.fixture
    def checkpoint_config(self, storage: Storage) -> dict[str, Any]:
        """The ``checkpoint_config`` mapping that selects this backend at ``storage``'s root."""
        return {"type": self.backend_type, "output_dir": storage.url}

    # ------------------------------------------------------------ shape

    def test_implements_protocol(self, storage: Storage) -> None:
        assert isinstance(storage, Storage)
        assert isinstance(storage.url, str) and storage.url
        assert isinstance(storage.root, str) and storage.root
        assert isinstance(storage.atomic_rename, bool)

    def test_root_starts_empty(self, storage: Storage) -> None:
        assert storage.list(storage.root) == []

    def test_join_builds_usable_paths(self, storage: Storage) -> None:
        p = storage.join(storage.root, "a", "b")
        assert p.startswith(storage.root.rstrip("/")) and p.endswith("b") and "a" in p
        assert storage.join(storage.root, "a", "b") == storage.join(storage.join(storage.root, "a"), "b")
        storage.makedirs(p)
        assert storage.isdir(p) and storage.exists(p)
        assert [e.name for e in storage.list(storage.join(storage.root, "a"))] == ["b"]

    # ------------------------------------------------------------ folders

    def test_missing_paths(self, storage: Storage) -> None:
        missing = storage.join(storage.root, "no", "such")
        assert not storage.exists(missing)
        assert not storage.isdir(missing)
        assert storage.list(missing) == []
        with pytest.raises(FileNotFoundError):
            storage.open_read(storage.join(storage.root, "nofile.bin"))

    def test_makedirs_is_idempotent(self, storage: Storage) -> None:
        d = storage.join(storage.root, "x", "y", "z")
        storage.makedirs(d)
        f = storage.join(d, "keep.bin")
        _write(storage, f, b"kept")
        storage.makedirs(d)  # again: no error, nothing lost
        storage.makedirs(storage.join(storage.root, "x"))
        assert storage.isdir(d)
        assert _read(storage, f) == b"kept"

    def test_list_reports_files_and_folders(self, storage: Storage) -> None:
        d = storage.join(storage.root, "lst")
        storage.makedirs(storage.join(d, "sub"))
        _write(storage, storage.join(d, "one.bin"), b"1")
        _write(storage, storage.join(d, "three.bin"), b"333")
        _write(storage, storage.join(d, "sub", "deep.bin"), b"deep")
        entries = {e.name: e for e in storage.list(d)}
        assert set(entries) == {"sub", "one.bin", "three.bin"}, "list() must give direct children only"
        assert entries["sub"].is_dir and not entries["one.bin"].is_dir
        assert entries["one.bin"].size == 1 and entries["three.bin"].size == 3
        # an entry's path is a path of this backend
        assert _read(storage, entries["three.bin"].path) == b"333"
        assert _names(storage.list(entries["sub"].path)) == {"deep.bin"}
        assert storage.isdir(entries["sub"].path)
        assert not storage.isdir(entries["one.bin"].path)
        assert storage.exists(entries["one.bin"].path)

    # ------------------------------------------------------------ files

    def test_write_read_round_trip_large(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        data = os.urandom(self.big_file_bytes)
        p = storage.join(storage.root, "big.bin")
        with storage.open_write(p) as f:
            view = memoryview(data)
            for i in range(0, len(data), 1 << 20):  # several writes, as DCP does
                f.write(view[i:i + (1 << 20)])
        assert _read(storage, p) == data
        assert {e.name: e.size for e in storage.list(storage.root)}["big.bin"] == len(data)
        with storage.open_read(p) as f:  # DCP seeks to offsets inside a file
            f.seek(len(data) - 100)
            assert f.read() == data[-100:]
            f.seek(1000)
            assert f.read(10) == data[1000:1010]

    def test_open_write_accepts_memoryview(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, "mv.bin")
        with storage.open_write(p) as f:
            f.write(memoryview(b"abcdef")[2:])
        assert _read(storage, p) == b"cdef"

    def test_overwrite_replaces_content(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, "f.bin")
        _write(storage, p, b"a much longer first version")
        _write(storage, p, b"short")
        assert _read(storage, p) == b"short"

    def test_write_create_is_create_only(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, MANIFEST_NAME)
        storage.write_create(p, b"first")
        assert _read(storage, p) == b"first"
        with pytest.raises(FileExistsError):
            storage.write_create(p, b"second")
        assert _read(storage, p) == b"first"

    def test_write_create_refuses_a_file_written_otherwise(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, "existing.json")
        _write(storage, p, b"old")
        with pytest.raises(FileExistsError):
            storage.write_create(p, b"new")
        assert _read(storage, p) == b"old"

    def test_rename_file(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        a, b = storage.join(storage.root, "a.tmp"), storage.join(storage.root, "b.bin")
        _write(storage, a, b"payload")
        storage.rename_file(a, b)
        assert not storage.exists(a)
        assert _read(storage, b) == b"payload"

    def test_rename_dir_publishes_atomically(self, storage: Storage) -> None:
        if not storage.atomic_rename:
            pytest.skip("this backend commits by manifest (atomic_rename is false)")
        src, dst = storage.join(storage.root, ".tmp-x"), storage.join(storage.root, "x")
        storage.makedirs(storage.join(src, "dcp"))
        _write(storage, storage.join(src, "dcp", "data"), b"d" * 1000)
        storage.rename_dir(src, dst)
        assert not storage.exists(src)
        assert _read(storage, storage.join(dst, "dcp", "data")) == b"d" * 1000
        # dst exists now: a second rename must refuse and leave both sides alone
        storage.makedirs(src)
        _write(storage, storage.join(src, "other"), b"o")
        with pytest.raises(FileExistsError):
            storage.rename_dir(src, dst)
        assert _read(storage, storage.join(src, "other")) == b"o"
        assert _names(storage.list(dst)) == {"dcp"}

    def test_remove_and_remove_tree(self, storage: Storage) -> None:
        d = storage.join(storage.root, "t")
        storage.makedirs(storage.join(d, "a", "b"))
        f = storage.join(d, "a", "b", "f.bin")
        _write(storage, f, b"x")
        _write(storage, storage.join(d, "top.bin"), b"y")
        storage.remove(f)
        assert not storage.exists(f)
        storage.remove(f)  # missing: no-op
        storage.remove(storage.join(storage.root, "never", "there"))
        storage.remove_tree(d)
        assert not storage.exists(d)
        assert storage.list(d) == []
        storage.remove_tree(d)  # missing: no-op
        storage.remove_tree(storage.join(storage.root, "never"))

    def test_sync_dir(self, storage: Storage) -> None:
        d = storage.join(storage.root, "s")
        storage.makedirs(d)
        _write(storage, storage.join(d, "f"), b"f")
        storage.sync_dir(d)
        assert _read(storage, storage.join(d, "f")) == b"f"

    def test_free_bytes(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        free = storage.free_bytes(storage.root)
        assert free is None or (isinstance(free, int) and not isinstance(free, bool) and free >= 0)
        missing = storage.free_bytes(storage.join(storage.root, "not", "yet"))
        assert missing is None or (isinstance(missing, int) and missing >= 0)

    # ------------------------------------------------------------ commit protocol

    def _pending(self, storage: Storage, step: int, token: str = "conf1") -> commit_mod.PendingCheckpoint:
        run = storage.join(storage.root, "20240101-000000")
        return commit_mod.plan(storage, storage.join(run, layout.checkpoint_name(step)), token)

    def _write_payload(self, storage: Storage, pending: commit_mod.PendingCheckpoint) -> bytes:
        """Write a small fake checkpoint into ``pending.write_path``; return its manifest."""
        files = {"dcp/.metadata": b"metadata", "dcp/__0_0.distcp": os.urandom(4096),
                 "trainer_state.json": b'{"step": 1}'}
        storage.makedirs(storage.join(pending.write_path, "dcp"))
        entries = {}
        for rel, data in files.items():
            _write(storage, storage.join(pending.write_path, *rel.split("/")), data)
            size, digest = hash_bytes(data)
            entries[rel] = FileEntry(size, digest)
        step = layout.parse_step(pending.final_path.rstrip("/").rsplit("/", 1)[-1])
        return Manifest(step=step or 0, files=entries).to_bytes()

    def _committed_paths(self, storage: Storage) -> list[str]:
        return [r.path for r in layout.committed(storage, storage.root)]

    def test_commit_publishes_only_at_commit(self, storage: Storage) -> None:
        from .verify import verify

        pending = self._pending(storage, 3)
        commit_mod.begin(storage, pending)
        assert storage.exists(pending.marker_path), "begin() leaves an owner marker"
        manifest = self._write_payload(storage, pending)
        assert self._committed_paths(storage) == []
        assert layout.latest(storage, storage.root) is None
        commit_mod.commit(storage, pending, manifest, ["dcp"])
        refs = layout.committed(storage, storage.root)
        assert [(r.step, r.run) for r in refs] == [(3, "20240101-000000")]
        assert refs[0].path.rstrip("/") == pending.final_path.rstrip("/")
        assert not storage.exists(pending.marker_path), "commit() removes the owner marker"
        if storage.atomic_rename:
            assert not storage.exists(pending.write_path)
        report = verify(storage, pending.final_path)
        assert report.files == 3

    def test_failed_commit_point_leaves_nothing_committed(self, storage: Storage) -> None:
        pending = self._pending(storage, 4)
        commit_mod.begin(storage, pending)
        manifest = self._write_payload(storage, pending)
        failing = _FailingCommitPoint(storage)
        with pytest.raises(OSError, match="injected"):
            commit_mod.commit(failing, pending, manifest, ["dcp"])
        assert self._committed_paths(storage) == []
        commit_mod.abort(storage, pending)
        assert self._committed_paths(storage) == []
        assert not storage.exists(pending.write_path)
        assert not storage.exists(pending.marker_path)

    def test_abort_removes_everything_it_wrote(self, storage: Storage) -> None:
        pending = self._pending(storage, 5)
        commit_mod.begin(storage, pending)
        self._write_payload(storage, pending)
        commit_mod.abort(storage, pending)
        assert not storage.exists(pending.write_path)
        assert not storage.exists(pending.final_path)
        assert not storage.exists(pending.marker_path)
        assert layout.scan(storage, storage.root) == []

    def test_abort_never_touches_a_committed_checkpoint(self, storage: Storage) -> None:
        done = self._pending(storage, 6, "first")
        commit_mod.begin(storage, done)
        commit_mod.commit(storage, done, self._write_payload(storage, done), ["dcp"])
        again = self._pending(storage, 6, "second")
        with pytest.raises(Exception, match="already exists"):
            commit_mod.begin(storage, again)
        commit_mod.abort(storage, again)
        assert self._committed_paths(storage) == [done.final_path]

    def test_clean_stale_removes_dead_writers_only(self, storage: Storage) -> None:
        from .verify import verify

        done = self._pending(storage, 1, "done")
        commit_mod.begin(storage, done)
        commit_mod.commit(storage, done, self._write_payload(storage, done), ["dcp"])
        dead = self._pending(storage, 2, "dead")
        commit_mod.begin(storage, dead)
        self._write_payload(storage, dead)
        write_stale_marker(storage, dead)
        alive = self._pending(storage, 3, "alive")
        commit_mod.begin(storage, alive)  # marker owned by this (live) process
        self._write_payload(storage, alive)

        assert layout.latest(storage, storage.root).step == 1, "an uncommitted save is never latest"
        removed = commit_mod.clean_stale(storage, storage.root)
        assert [p.rstrip("/") for p in removed] == [dead.write_path.rstrip("/")]
        assert not storage.exists(dead.write_path) and not storage.exists(dead.marker_path)
        assert storage.exists(alive.write_path) and storage.exists(alive.marker_path)
        verify(storage, done.final_path)
        commit_mod.abort(storage, alive)

    # ------------------------------------------------------------ manager round trip

    def _config(self, checkpoint_config: Mapping[str, Any], **top: Any) -> Any:
        from .config import load_config

        return load_config({"checkpoint_config": dict(checkpoint_config), **top})

    def test_manager_save_verify_resume(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from . import CheckpointManager
        from .verify import verify

        state = tiny_state(seed=1)
        before = state_snapshot(state)
        with CheckpointManager.from_config(self._config(checkpoint_config, save_steps=2), quiet=True) as m:
            assert m.resume(state) == 0
            assert m.maybe_save(1, state) is None
            path = m.maybe_save(2, state)
            assert path is not None
            m.save(3, state, final=True, metadata={"note": "conformance"})
        refs = layout.committed(storage, storage.root)
        assert [r.step for r in refs] == [2, 3]
        for r in refs:
            report = verify(storage, r.path)
            assert set(report.manifest.files) >= {"trainer_state.json", "dcp/.metadata"}

        fresh = tiny_state(seed=99)
        cfg = self._config(checkpoint_config, resume_from_checkpoint="latest")
        with CheckpointManager.from_config(cfg, quiet=True) as m2:
            assert m2.resume(fresh) == 3
            assert m2.trainer_state["user"] == {"note": "conformance"}
        assert_same_state(state_snapshot(fresh), before)

        # an explicit checkpoint path/URL of this backend resumes too
        fresh2 = tiny_state(seed=98)
        explicit = refs[0].path if "://" not in storage.url else _url_of(storage, refs[0].path)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=explicit),
                                           quiet=True) as m3:
            assert m3.resume(fresh2) == 2

    def test_manager_async_save_round_trip(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        import torch

        from . import CheckpointManager

        state = tiny_state(seed=2)
        before = state_snapshot(state)
        cfg = self._config(checkpoint_config, strategy_config={"async_save_ckpt": True})
        with CheckpointManager.from_config(cfg, quiet=True) as m:
            m.save(7, state)
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(1.0)  # the checkpoint must hold the values at save time
            m.wait()
            assert m.last_save is not None and m.last_save.is_async
        fresh = tiny_state(seed=3)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=True),
                                           quiet=True) as m2:
            assert m2.resume(fresh) == 7
        assert_same_state(state_snapshot(fresh), before)

    def test_manager_refuses_corrupt_checkpoint(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from . import CheckpointManager

        state = tiny_state(seed=4)
        with CheckpointManager.from_config(self._config(checkpoint_config), quiet=True) as m:
            path = m.save(1, state)
        target = storage.join(path, "trainer_state.json")
        data = bytearray(_read(storage, target))
        data[len(data) // 2] ^= 0xFF
        _write(storage, target, bytes(data))
        fresh = tiny_state(seed=5)
        untouched = state_snapshot(fresh)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=True),
                                           quiet=True) as m2:
            with pytest.raises(CheckpointCorruptError, match="trainer_state.json"):
                m2.resume(fresh)
        assert_same_state(state_snapshot(fresh), untouched)

    def test_manager_retention_sorts_by_step(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from . import CheckpointManager

        state = tiny_state(seed=6)
        cc = {**checkpoint_config, "max_ckpt_to_keep": 2}
        with CheckpointManager.from_config(self._config(cc), quiet=True) as m:
            for step in (9, 10, 100):
                m.save(step, state)
        assert [r.step for r in layout.committed(storage, storage.root)] == [10, 100]
        assert [r.step for r in layout.scan(storage, storage.root)] == [10, 100], "removed folders are gone"

    def test_manager_cleans_stale_temp_at_next_save(self, storage: Storage,
                                                    checkpoint_config: dict[str, Any]) -> None:
        from . import CheckpointManager

        state = tiny_state(seed=7)
        with CheckpointManager.from_config(self._config(checkpoint_config), quiet=True) as m:
            m.save(1, state)
            run_dir = m.run_dir
        crashed = commit_mod.plan(storage, storage.join(run_dir, layout.checkpoint_name(2)), "crashed0")
        commit_mod.begin(storage, crashed)
        self._write_payload(storage, crashed)
        write_stale_marker(storage, crashed)
        fresh = tiny_state(seed=8)
        cfg = self._config(checkpoint_config, resume_from_checkpoint="latest")
        with CheckpointManager.from_config(cfg, quiet=True) as m2:
            assert m2.resume(fresh) == 1, "the crashed save of step 2 is not a checkpoint"
            assert storage.exists(crashed.write_path)
            m2.save(3, fresh)
        assert not storage.exists(crashed.write_path)
        assert not storage.exists(crashed.marker_path)
        assert [r.step for r in layout.committed(storage, storage.root)] == [1, 3]


def _url_of(storage: Storage, path: str) -> str:
    """``path`` of ``storage`` written as a URL of the same scheme (``memory://...``)."""
    scheme = storage.url.split("://", 1)[0]
    return f"{scheme}://{path.lstrip('/')}" if scheme != "file" else f"file://{path}"


class _FailingCommitPoint:
    """A storage whose commit point (rename_dir / write_create of the manifest) fails."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def rename_dir(self, src: str, dst: str) -> None:
        raise OSError("injected failure at the commit point")

    def write_create(self, path: str, data: bytes) -> None:
        if path.rstrip("/").endswith(MANIFEST_NAME):
            raise OSError("injected failure at the commit point")
        self._inner.write_create(path, data)
