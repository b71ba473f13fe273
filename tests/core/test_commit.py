"""The commit protocol's guard for folders written in place (object stores)."""

from __future__ import annotations

import pytest

from roll_ckpt import RollCkptError
from roll_ckpt import commit as commit_mod
from roll_ckpt.manifest import MANIFEST_NAME


def test_a_second_live_writer_of_an_in_place_folder_is_refused_and_deletes_nothing(memory_url: str) -> None:
    from roll_ckpt_fs.storage import FsspecStorage

    storage = FsspecStorage(memory_url, {})
    assert not storage.atomic_rename
    final = storage.join(storage.root, "run", "checkpoint-3")
    first = commit_mod.plan(storage, final, "aaaa")
    commit_mod.begin(storage, first)
    with storage.open_write(storage.join(first.write_path, "data")) as f:
        f.write(b"first writer's bytes")

    second = commit_mod.plan(storage, final, "bbbb")
    with pytest.raises(RollCkptError, match="being written by another process"):
        commit_mod.begin(storage, second)
    assert not storage.exists(second.marker_path)
    with storage.open_read(storage.join(final, "data")) as f:  # the first writer's files are intact
        assert f.read() == b"first writer's bytes"

    commit_mod.commit(storage, first, b"{}", [])
    assert storage.exists(storage.join(final, MANIFEST_NAME))
    # once the first is done, a later writer is told the checkpoint exists (not that it is busy)
    with pytest.raises(RollCkptError, match="already exists"):
        commit_mod.begin(storage, commit_mod.plan(storage, final, "cccc"))
