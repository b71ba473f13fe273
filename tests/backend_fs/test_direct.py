"""Data files written with O_DIRECT (roll_ckpt_fs.direct) and the local ``direct_io`` option."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest

from roll_ckpt import StorageError
from roll_ckpt_fs import LocalStorage, open_storage
from roll_ckpt_fs.direct import BUFFER_SIZE, DirectFile

SIZES = [0, 1, 4095, 4096, 4097, BUFFER_SIZE - 1, BUFFER_SIZE, BUFFER_SIZE + 1, 2 * BUFFER_SIZE + 123]


def _write(f: Any, data: bytes, rng: random.Random) -> None:
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 3 * BUFFER_SIZE // 2)
        f.write(data[pos:pos + n])
        pos += n
    f.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("size", SIZES)
def test_every_size_is_written_exactly_with_o_direct(tmp_path: Path, size: int) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    f = LocalStorage(str(tmp_path)).open_write(str(tmp_path / "f"))
    assert isinstance(f, DirectFile)
    assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    _write(f, data, rng)
    assert f.closed and f.tell() == size
    assert f.direct == (size % 4096 == 0), "only the last partial block goes through the page cache"
    assert (tmp_path / "f").read_bytes() == data


def test_the_buffer_goes_back_to_the_pool(tmp_path: Path) -> None:
    import roll_ckpt_fs.direct as direct

    storage = LocalStorage(str(tmp_path))
    for k in range(3):
        f = storage.open_write(str(tmp_path / f"f{k}"))
        f.write(b"x" * 10)
        f.close()
    assert 1 <= direct._pool.qsize() <= direct._POOL_MAX


def test_einval_part_way_goes_on_with_buffered_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = LocalStorage(str(tmp_path)).open_write(str(tmp_path / "f"))
    real, fd, refused = os.write, f.fileno(), []

    def write(to: int, data: Any) -> int:
        if to == fd and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and os.lseek(fd, 0, os.SEEK_CUR) >= BUFFER_SIZE:
            refused.append(True)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(to, data)

    monkeypatch.setattr(os, "write", write)
    data = random.Random(1).randbytes(3 * BUFFER_SIZE + 77)
    _write(f, data, random.Random(2))
    assert refused and not f.direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_without_o_direct_gets_buffered_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.open

    def refuse(path: Any, flags: int, *a: Any, **kw: Any) -> int:  # as tmpfs before Linux 6.6 and some FUSE mounts do
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **kw)  # (dir_fd: Python 3.13's rmtree of tmp_path opens with it)

    monkeypatch.setattr(os, "open", refuse)
    f = LocalStorage(str(tmp_path)).open_write(str(tmp_path / "f"))
    assert not isinstance(f, DirectFile)
    f.write(b"abc")
    f.close()
    assert (tmp_path / "f").read_bytes() == b"abc"


def test_a_disk_full_at_close_raises_it_and_leaks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _open_fds()
    f = LocalStorage(str(tmp_path)).open_write(str(tmp_path / "f"))
    f.write(b"y" * (BUFFER_SIZE // 2 + 5))
    real, fd = os.write, f.fileno()
    monkeypatch.setattr(os, "write", lambda to, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left"))
                        if to == fd else real(to, data))
    with pytest.raises(OSError) as info:
        f.close()
    assert info.value.errno == errno.ENOSPC
    assert f.closed and _open_fds() == before


def test_a_child_forked_after_a_save_writes_from_a_buffer_of_its_own(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    warm = storage.open_write(str(tmp_path / "warm"))
    warm.write(b"w" * BUFFER_SIZE)
    warm.close()  # its buffer is in the pool now
    a, b = (random.Random(k).randbytes(3 * BUFFER_SIZE + 11) for k in (3, 4))
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits for the parent to be part-way, then writes alongside it
        try:
            os.read(go_r, 1)
            _write(storage.open_write(str(tmp_path / "child")), b, random.Random(5))
        finally:
            os._exit(0)
    f = storage.open_write(str(tmp_path / "parent"))
    f.write(a[:BUFFER_SIZE // 2])
    os.write(go_w, b"1")
    _write(f, a[BUFFER_SIZE // 2:], random.Random(6))
    os.waitpid(pid, 0)
    assert (tmp_path / "parent").read_bytes() == a
    assert (tmp_path / "child").read_bytes() == b


def test_direct_io_false_writes_through_the_page_cache(tmp_path: Path) -> None:
    s = open_storage(str(tmp_path), {"direct_io": False})
    f = s.open_write(str(tmp_path / "f"))
    assert not isinstance(f, DirectFile)
    f.write(b"z")
    f.close()
    assert (tmp_path / "f").read_bytes() == b"z"


def test_direct_io_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="direct_io"):
        open_storage(str(tmp_path), {"direct_io": "yes"})


def test_other_options_on_a_local_path_are_named_not_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="roll_ckpt"):
        s = open_storage(str(tmp_path), {"endpoint_url": "http://127.0.0.1:1", "key": "k"})
    assert isinstance(s, LocalStorage) and s.direct_io
    assert "endpoint_url, key" in caplog.text and "no effect" in caplog.text
