"""The conformance suite itself: the Storage protocol call by call, the commit protocol
over the backend, and a manager round trip selected through ``checkpoint_config.type``."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ..format import layout
from ..format.commit import PendingCheckpoint, pending_checkpoint, clean_stale
from ..contracts import Storage
from ..format.manifest import hash_bytes, MANIFEST_NAME, FileEntry, Manifest
from .helpers import names, read_file, write_file, write_stale_marker
from .manager_checks import ManagerChecks

__all__ = ["BackendConformance"]


class BackendConformance(ManagerChecks):
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
        write_file(storage, f, b"kept")
        storage.makedirs(d)  # again: no error, nothing lost
        storage.makedirs(storage.join(storage.root, "x"))
        assert storage.isdir(d)
        assert read_file(storage, f) == b"kept"

    def test_list_reports_files_and_folders(self, storage: Storage) -> None:
        d = storage.join(storage.root, "lst")
        storage.makedirs(storage.join(d, "sub"))
        write_file(storage, storage.join(d, "one.bin"), b"1")
        write_file(storage, storage.join(d, "three.bin"), b"333")
        write_file(storage, storage.join(d, "sub", "deep.bin"), b"deep")
        entries = {e.name: e for e in storage.list(d)}
        assert set(entries) == {"sub", "one.bin", "three.bin"}, "list() must give direct children only"
        assert entries["sub"].is_dir and not entries["one.bin"].is_dir
        assert entries["one.bin"].size == 1 and entries["three.bin"].size == 3
        # an entry's path is a path of this backend
        assert read_file(storage, entries["three.bin"].path) == b"333"
        assert names(storage.list(entries["sub"].path)) == {"deep.bin"}
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
        assert read_file(storage, p) == data
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
        assert read_file(storage, p) == b"cdef"

    def test_overwrite_replaces_content(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, "f.bin")
        write_file(storage, p, b"a much longer first version")
        write_file(storage, p, b"short")
        assert read_file(storage, p) == b"short"

    def test_write_create_is_create_only(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, MANIFEST_NAME)
        storage.write_create(p, b"first")
        assert read_file(storage, p) == b"first"
        with pytest.raises(FileExistsError):
            storage.write_create(p, b"second")
        assert read_file(storage, p) == b"first"

    def test_write_create_refuses_a_file_written_otherwise(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        p = storage.join(storage.root, "existing.json")
        write_file(storage, p, b"old")
        with pytest.raises(FileExistsError):
            storage.write_create(p, b"new")
        assert read_file(storage, p) == b"old"

    def test_rename_file(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        a, b = storage.join(storage.root, "a.tmp"), storage.join(storage.root, "b.bin")
        write_file(storage, a, b"payload")
        storage.rename_file(a, b)
        assert not storage.exists(a)
        assert read_file(storage, b) == b"payload"

    def test_rename_dir_publishes_atomically(self, storage: Storage) -> None:
        if not storage.atomic_rename:
            pytest.skip("this backend commits by manifest (atomic_rename is false)")
        src, dst = storage.join(storage.root, ".tmp-x"), storage.join(storage.root, "x")
        storage.makedirs(storage.join(src, "dcp"))
        write_file(storage, storage.join(src, "dcp", "data"), b"d" * 1000)
        storage.rename_dir(src, dst)
        assert not storage.exists(src)
        assert read_file(storage, storage.join(dst, "dcp", "data")) == b"d" * 1000
        # dst exists now: a second rename must refuse and leave both sides alone
        storage.makedirs(src)
        write_file(storage, storage.join(src, "other"), b"o")
        with pytest.raises(FileExistsError):
            storage.rename_dir(src, dst)
        assert read_file(storage, storage.join(src, "other")) == b"o"
        assert names(storage.list(dst)) == {"dcp"}

    def test_remove_and_remove_tree(self, storage: Storage) -> None:
        d = storage.join(storage.root, "t")
        storage.makedirs(storage.join(d, "a", "b"))
        f = storage.join(d, "a", "b", "f.bin")
        write_file(storage, f, b"x")
        write_file(storage, storage.join(d, "top.bin"), b"y")
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
        write_file(storage, storage.join(d, "f"), b"f")
        storage.sync_dir(d)
        assert read_file(storage, storage.join(d, "f")) == b"f"

    def test_take_over_makes_an_independent_whole_file(self, storage: Storage) -> None:
        """Incremental saves: ``take_over`` (or core's copy for a backend without it) gives a
        file with the source's bytes that outlives the source."""
        from ..format.commit import take_over_file

        d = storage.join(storage.root, "t")
        storage.makedirs(d)
        data = os.urandom(300_000)
        write_file(storage, storage.join(d, "src"), data)
        how = take_over_file(storage, storage.join(d, "src"), storage.join(d, "dst"))
        assert how in ("link", "server_copy", "copy")
        storage.remove(storage.join(d, "src"))
        assert read_file(storage, storage.join(d, "dst")) == data
        assert {e.name: e.size for e in storage.list(d)} == {"dst": len(data)}

    def test_optional_features_do_what_their_protocols_say(self, storage: Storage) -> None:
        """Each optional feature the backend has (``contracts.STORAGE_CAPABILITIES``, checked
        with ``isinstance`` as core checks it) behaves as its protocol says."""
        from ..contracts import AbortableWrite, CountsNetwork, ListsByPrefix, NetworkCounts

        d = storage.join(storage.root, "features")
        storage.makedirs(d)
        for name in ("a-1", "a-2", "b-1"):
            write_file(storage, storage.join(d, name), name.encode())
        if isinstance(storage, ListsByPrefix):
            assert sorted(e.name for e in storage.list_prefix(d, "a-")) == ["a-1", "a-2"]
            assert storage.list_prefix(d, "zzz") == []
        if isinstance(storage, CountsNetwork):
            counts = storage.network_counts()
            assert counts is None or isinstance(counts, NetworkCounts)
        f = storage.open_write(storage.join(d, "dropped"))
        f.write(b"x" * 1000)
        if isinstance(f, AbortableWrite):
            f.abort()
            assert not storage.exists(storage.join(d, "dropped"))
        else:
            f.close()

    def test_free_bytes(self, storage: Storage) -> None:
        storage.makedirs(storage.root)
        free = storage.free_bytes(storage.root)
        assert free is None or (isinstance(free, int) and not isinstance(free, bool) and free >= 0)
        missing = storage.free_bytes(storage.join(storage.root, "not", "yet"))
        assert missing is None or (isinstance(missing, int) and missing >= 0)

    # ------------------------------------------------------------ commit protocol

    def _pending(self, storage: Storage, step: int, token: str = "conf1") -> PendingCheckpoint:
        run = storage.join(storage.root, "20240101-000000")
        return pending_checkpoint(storage, storage.join(run, layout.checkpoint_name(step)), token)

    def _write_payload(self, storage: Storage, pending: PendingCheckpoint) -> bytes:
        """Write a small fake checkpoint into ``pending.write_path``; return its manifest."""
        files = {"dcp/.metadata": b"metadata", "dcp/__0_0.distcp": os.urandom(4096),
                 "trainer_state.json": b'{"step": 1}'}
        storage.makedirs(storage.join(pending.write_path, "dcp"))
        entries = {}
        for rel, data in files.items():
            write_file(storage, storage.join(pending.write_path, *rel.split("/")), data)
            size, digest = hash_bytes(data)
            entries[rel] = FileEntry(size, digest)
        step = layout.parse_step(pending.final_path.rstrip("/").rsplit("/", 1)[-1])
        return Manifest(step=step or 0, files=entries).to_bytes()

    def _committed_paths(self, storage: Storage) -> list[str]:
        return [r.path for r in layout.committed(storage, storage.root)]

    def test_commit_publishes_only_at_commit(self, storage: Storage) -> None:
        from ..format.manifest import verify

        pending = self._pending(storage, 3)
        pending.begin()
        assert storage.exists(pending.marker_path), "begin() leaves an owner marker"
        manifest = self._write_payload(storage, pending)
        assert self._committed_paths(storage) == []
        assert layout.latest(storage, storage.root) is None
        pending.commit(manifest)
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
        pending.begin()
        manifest = self._write_payload(storage, pending)
        failing = pending_checkpoint(_FailingCommitPoint(storage), pending.final_path, "conf1")
        assert failing.write_path == pending.write_path
        with pytest.raises(OSError, match="injected"):
            failing.commit(manifest)
        assert self._committed_paths(storage) == []
        pending.abort()
        assert self._committed_paths(storage) == []
        assert not storage.exists(pending.write_path)
        assert not storage.exists(pending.marker_path)

    def test_abort_removes_everything_it_wrote(self, storage: Storage) -> None:
        pending = self._pending(storage, 5)
        pending.begin()
        self._write_payload(storage, pending)
        pending.abort()
        assert not storage.exists(pending.write_path)
        assert not storage.exists(pending.final_path)
        assert not storage.exists(pending.marker_path)
        assert layout.scan(storage, storage.root) == []

    def test_abort_never_touches_a_committed_checkpoint(self, storage: Storage) -> None:
        done = self._pending(storage, 6, "first")
        done.begin()
        done.commit(self._write_payload(storage, done))
        again = self._pending(storage, 6, "second")
        with pytest.raises(Exception, match="already exists"):
            again.begin()
        again.abort()
        assert self._committed_paths(storage) == [done.final_path]

    def test_clean_stale_removes_dead_writers_only(self, storage: Storage) -> None:
        from ..format.manifest import verify

        done = self._pending(storage, 1, "done")
        done.begin()
        done.commit(self._write_payload(storage, done))
        dead = self._pending(storage, 2, "dead")
        dead.begin()
        self._write_payload(storage, dead)
        write_stale_marker(storage, dead)
        alive = self._pending(storage, 3, "alive")
        alive.begin()  # marker owned by this (live) process
        self._write_payload(storage, alive)

        assert layout.latest(storage, storage.root).step == 1, "an uncommitted save is never latest"
        removed = clean_stale(storage, storage.root)
        assert [p.rstrip("/") for p in removed] == [dead.write_path.rstrip("/")]
        assert not storage.exists(dead.write_path) and not storage.exists(dead.marker_path)
        assert storage.exists(alive.write_path) and storage.exists(alive.marker_path)
        verify(storage, done.final_path)
        alive.abort()


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
