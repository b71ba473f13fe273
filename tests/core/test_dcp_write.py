"""roll-ckpt's DCP writer: write items kept across saves, no collectives in a job of one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from roll_ckpt import CheckpointManager
from roll_ckpt.testing import tiny_state
from tests.helpers.training import config


def _count_items(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import roll_ckpt.dcp.writer as dw

    made: list[str] = []
    real = dw.create_write_items

    def counting(fqn: str, obj: Any) -> list[Any]:
        made.append(fqn)
        return real(fqn, obj)

    monkeypatch.setattr(dw, "create_write_items", counting)
    return made


def test_a_save_of_an_unchanged_structure_makes_no_write_items(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_items(monkeypatch)
    state = tiny_state()
    tensors = len(state["model"].state_dict()) + sum(len(s) for s in state["optimizer"].state.values())
    with CheckpointManager.from_config(config(tmp_path, timestamp_subdir=False), quiet=True) as m:
        m.save(1, state)
        assert len(made) >= tensors  # (and the per-process RNG states)
        made.clear()
        m.save(2, state)
        assert made == [], "the second save of the same structure reuses every write item"
        # another shape for one parameter: only its items are made again
        first = next(iter(state["model"].parameters()))
        with torch.no_grad():
            first.data = torch.randn(first.shape[0] + 1, *first.shape[1:])
        state["optimizer"].state.pop(first, None)
        path = m.save(3, state)
        assert made == ["model." + next(iter(state["model"].state_dict()))]
    _assert_module_saved(state["model"], path)


def _assert_module_saved(model: torch.nn.Module, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    sd = model.state_dict()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}
    dcp.load(loaded, checkpoint_id=f"{path}/dcp")  # one process, no group
    for k, v in sd.items():
        assert torch.equal(loaded["model"][k], v), k


def test_one_process_saves_without_dcp_collectives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    calls: list[str] = []
    try:
        for name in ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
                     "all_reduce", "barrier"):
            real = getattr(dist, name)
            monkeypatch.setattr(dist, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
        state = tiny_state()
        with CheckpointManager.from_config(config(tmp_path / "out", timestamp_subdir=False), quiet=True) as m:
            path = m.save(1, state)
        assert calls == [], f"a job of one process made DCP collectives: {calls}"
        _assert_module_saved(state["model"], path)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_a_written_file_is_hashed_whole_and_in_chunks_whatever_its_writes(tmp_path: Path) -> None:
    """The stream a data file is written through (``dcp.files``) gives the manifest the file's
    size, its checksum and the checksums of its ``CHUNK_SIZE`` pieces, for writes of any size
    that start and end anywhere within a chunk."""
    import random

    import xxhash

    from roll_ckpt.dcp.files import StorageFileSystem
    from roll_ckpt.format.manifest import CHUNK_SIZE
    from roll_ckpt_fs import LocalStorage

    rng = random.Random(0)
    fs = StorageFileSystem(LocalStorage(str(tmp_path)))
    for k, total in enumerate([0, 5, CHUNK_SIZE, 2 * CHUNK_SIZE + 17, 3 * CHUNK_SIZE - 1]):
        data = rng.randbytes(total)
        path = str(tmp_path / f"f{k}")
        with fs.create_stream(path, "wb") as stream:
            pos = 0
            while pos < total:
                n = rng.choice([1, 100, CHUNK_SIZE - 3, CHUNK_SIZE, CHUNK_SIZE + 5, 3 << 20])
                assert stream.write(data[pos:pos + n]) == len(data[pos:pos + n])
                pos += n
                assert stream.tell() == min(pos, total)
        chunks = tuple(xxhash.xxh3_128_hexdigest(data[i:i + CHUNK_SIZE]) for i in range(0, total, CHUNK_SIZE))
        assert fs.digests[path] == (total, xxhash.xxh3_128_hexdigest(data), chunks), total
        assert Path(path).read_bytes() == data
    # a file system with a root (the writer's: its DCP folder) keeps them by name within it
    rooted = StorageFileSystem(LocalStorage(str(tmp_path)), root=str(tmp_path) + "/")
    with rooted.create_stream(str(tmp_path / "f5"), "wb") as stream:
        stream.write(b"abc")
    assert rooted.digests == {"f5": (3, xxhash.xxh3_128_hexdigest(b"abc"), (xxhash.xxh3_128_hexdigest(b"abc"),))}
