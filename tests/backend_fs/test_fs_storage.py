"""roll_ckpt_fs specifics: URL routing, clear errors, local-disk safety."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_ckpt import CheckpointCorruptError, CheckpointManager, StorageError, load_config
from roll_ckpt.plugins import Plugins
from roll_ckpt.testing import tiny_state
from roll_ckpt_fs import FsspecStorage, LocalStorage, open_storage


def test_registered_through_its_entry_point() -> None:
    rec = Plugins().backend("file_system")
    assert rec.distribution == "roll-ckpt-fs"
    assert "roll-ckpt[fs]" in rec.install_hint
    assert isinstance(rec.factory("/tmp/x", {}), LocalStorage)


@pytest.mark.parametrize("url,kind,root", [
    ("/data/ckpt", LocalStorage, "/data/ckpt"),
    ("file:///data/ckpt/", LocalStorage, "/data/ckpt"),
    ("memory://bucket/prefix/", FsspecStorage, "/bucket/prefix"),
])
def test_url_routing(url, kind, root) -> None:
    s = open_storage(url)
    assert isinstance(s, kind) and s.root == root and s.url == url


def test_relative_path_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert open_storage("./out/ckpt").root == str(tmp_path / "out" / "ckpt")


def test_unknown_protocol_is_a_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        CheckpointManager.from_config(load_config({"checkpoint_config": {"output_dir": "nosuchproto://b/x"}}))
    msg = str(info.value)
    assert "checkpoint_config.output_dir nosuchproto://b/x" in msg and "nosuchproto://" in msg


def test_bad_storage_options_name_the_key() -> None:
    # fsspec's memory store accepts any keyword: use a store whose constructor is strict
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Strict(MemoryFileSystem):
        protocol = ("stricttest",)

        def __init__(self, *, known: int = 0) -> None:  # no **kwargs
            super().__init__()

    fsspec.register_implementation("stricttest", Strict, clobber=True)
    with pytest.raises(StorageError) as info:
        FsspecStorage("stricttest://x", {"unknown_option": 1})
    assert "checkpoint_config.storage_options for stricttest://x" in str(info.value)
    assert "unknown_option" in str(info.value)


def test_local_reader_refuses_links(tmp_path: Path) -> None:
    s = LocalStorage(str(tmp_path))
    (tmp_path / "real.bin").write_bytes(b"data")
    os.symlink(tmp_path / "real.bin", tmp_path / "link.bin")
    with pytest.raises(OSError):
        s.open_read(str(tmp_path / "link.bin"))
    assert not s.isdir(str(tmp_path / "link.bin"))


def test_checkpoint_with_a_planted_link_is_refused(tmp_path: Path) -> None:
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt")}})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        path = Path(m.save(1, tiny_state()))
    data = path / "dcp" / "__0_0.distcp"
    elsewhere = tmp_path / "elsewhere.distcp"
    elsewhere.write_bytes(data.read_bytes())
    data.unlink()
    os.symlink(elsewhere, data)
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt")},
                       "resume_from_checkpoint": str(path)})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        with pytest.raises(CheckpointCorruptError, match=r"dcp/__0_0\.distcp"):
            m.resume(tiny_state(seed=3))


def test_memory_write_create_is_server_side_exclusive(memory_url: str) -> None:
    s = open_storage(memory_url)
    s.makedirs(s.root)
    p = s.join(s.root, "manifest.json")
    s.write_create(p, b"a")
    with pytest.raises(FileExistsError):
        s.write_create(p, b"b")
    with s.open_read(p) as f:
        assert f.read() == b"a"


def test_free_bytes_of_a_local_path_not_created_yet(tmp_path: Path) -> None:
    s = LocalStorage(str(tmp_path / "a" / "b"))
    free = s.free_bytes(s.root)
    assert isinstance(free, int) and free > 0


def test_write_create_keeps_its_temporary_file_inside_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary file a crash may leave goes one folder up (never inside a checkpoint), but
    not above the storage's root, where clean_stale would not find it: a file of the root itself
    (a hold, .launch.json with timestamp_subdir: false) has its temporary file in the root."""
    root = tmp_path / "out"
    s = LocalStorage(str(root))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    s.makedirs(s.join(s.root, "run", "checkpoint-1"))
    s.write_create(s.join(s.root, ".launch.json"), b"{}")
    s.write_create(s.join(s.root, "run", "checkpoint-1", "manifest.json"), b"{}")
    tmp = [Path(p) for p in opened if Path(p).name.startswith(".tmp-")]
    assert [p.parent for p in tmp] == [root, root / "run"], tmp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_write_create_leaves_no_partial_file(tmpfs) -> None:
    mnt = tmpfs("1m")
    s = LocalStorage(str(mnt))
    p = s.join(s.root, "manifest.json")
    with pytest.raises(OSError) as info:
        s.write_create(p, b"x" * (2 * 1024 * 1024))
    assert info.value.errno == 28
    assert not s.exists(p), "a partial file must not stand in for the whole one"
    s.write_create(p, b"small")  # and a retry is not blocked
    with s.open_read(p) as f:
        assert f.read() == b"small"
