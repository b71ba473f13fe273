"""The commit protocol: one class per protocol, chosen by the backend; the guard for folders
written in place (object stores); owner records across PID namespaces."""

from __future__ import annotations

import pytest

from roll_ckpt import RollCkptError
from roll_ckpt.format.commit import ManifestLast, RenameIntoPlace, pending_checkpoint
from roll_ckpt.format.manifest import MANIFEST_NAME


def test_the_backend_chooses_the_protocol(tmp_path, memory_url: str) -> None:
    from roll_ckpt_fs.storage import FsspecStorage, LocalStorage

    disk, store = LocalStorage(str(tmp_path)), FsspecStorage(memory_url, {})
    on_disk = pending_checkpoint(disk, disk.join(disk.root, "checkpoint-1"), "tok1")
    in_store = pending_checkpoint(store, store.join(store.root, "checkpoint-1"), "tok1")
    assert type(on_disk) is RenameIntoPlace and on_disk.write_path.endswith("/.tmp-checkpoint-1-tok1")
    assert type(in_store) is ManifestLast and in_store.write_path == in_store.final_path
    assert on_disk.marker_path.endswith("/.inflight-checkpoint-1-tok1.json")


def test_a_second_live_writer_of_an_in_place_folder_is_refused_and_deletes_nothing(memory_url: str) -> None:
    from roll_ckpt_fs.storage import FsspecStorage

    storage = FsspecStorage(memory_url, {})
    assert not storage.atomic_rename
    final = storage.join(storage.root, "run", "checkpoint-3")
    first = pending_checkpoint(storage, final, "aaaa")
    first.begin()
    with storage.open_write(storage.join(first.write_path, "data")) as f:
        f.write(b"first writer's bytes")

    second = pending_checkpoint(storage, final, "bbbb")
    with pytest.raises(RollCkptError, match="being written by another process"):
        second.begin()
    assert not storage.exists(second.marker_path)
    with storage.open_read(storage.join(final, "data")) as f:  # the first writer's files are intact
        assert f.read() == b"first writer's bytes"

    first.commit(b"{}")
    assert storage.exists(storage.join(final, MANIFEST_NAME))
    # once the first is done, a later writer is told the checkpoint exists (not that it is busy)
    with pytest.raises(RollCkptError, match="already exists"):
        pending_checkpoint(storage, final, "cccc").begin()


def test_a_writer_in_another_pid_namespace_is_not_judged_by_its_pid(tmp_path) -> None:
    """Containers sharing a host name: a pid that is dead here may run there."""
    import json
    import os
    import socket
    import time

    from roll_ckpt.format.commit import _pid_namespace, clean_stale, owner_gone
    from roll_ckpt.testing import dead_pid

    here = {"host": socket.gethostname(), "pid": dead_pid(), "pidns": _pid_namespace(), "started": time.time()}
    there = dict(here, pidns="pid:[1]:another-container")
    assert owner_gone(here) and not owner_gone(there)
    assert owner_gone(dict(there, started=time.time() - 2 * 86400))  # foreign writers expire after a day

    from roll_ckpt_fs.storage import LocalStorage

    step = tmp_path / "20260101-000000" / "checkpoint-4"
    (step / ".tmp-critic-abc").mkdir(parents=True)
    (step / ".inflight-critic-abc.json").write_text(json.dumps(dict(there, write_path=str(step / ".tmp-critic-abc"),
                                                                    final_path=str(step / "critic"))))
    old = time.time() - 600
    os.utime(step / ".tmp-critic-abc", (old, old))
    assert clean_stale(LocalStorage(str(tmp_path)), str(tmp_path)) == []
    assert (step / ".tmp-critic-abc").is_dir()
    # the same marker written in this namespace is a dead writer's: its folder goes
    (step / ".inflight-critic-abc.json").write_text(json.dumps(dict(here, write_path=str(step / ".tmp-critic-abc"),
                                                                    final_path=str(step / "critic"))))
    assert clean_stale(LocalStorage(str(tmp_path)), str(tmp_path)) == [str(step / ".tmp-critic-abc")]


def test_a_hold_appears_whole_and_a_second_hold_of_the_launch_is_the_same(tmp_path, memory_url: str) -> None:
    """Another launch's retention reads holds at any time and counts one it cannot read as no
    hold: a hold is written create-only (never an empty or half-written file to read), and the
    same launch holding the same checkpoint again keeps its one hold."""
    from roll_ckpt.format.commit import hold, held, release
    from roll_ckpt_fs.storage import FsspecStorage, LocalStorage

    for storage in (LocalStorage(str(tmp_path)), FsspecStorage(memory_url, {})):
        ckpt = storage.join(storage.root, "run", "checkpoint-3")
        storage.makedirs(ckpt)
        opened: list[str] = []
        real_open_write = storage.open_write
        storage.open_write = lambda path: opened.append(path) or real_open_write(path)  # type: ignore[method-assign]
        marker = hold(storage, ckpt, "tok1")
        assert hold(storage, ckpt, "tok1") == marker
        assert opened == [], "a hold goes through write_create, not open_write"
        assert held(storage, ckpt)
        assert [e.name for e in storage.list(storage.join(storage.root, "run")) if not e.is_dir] == \
            [marker.rsplit("/", 1)[-1]]
        release(storage, marker)
        assert not held(storage, ckpt)
