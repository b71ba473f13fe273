"""checkpoint_config.verify_before_load: false -- one pass, each piece checked just before use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.damage import flip_byte
from helpers.training import config
from roll_ckpt import CheckpointCorruptError, CheckpointManager
from roll_ckpt.errors import PartlyLoadedError
from roll_ckpt.dcp import checked
from roll_ckpt.format.manifest import CHUNK_SIZE
from roll_ckpt.format.manifest import MANIFEST_NAME

pytestmark = pytest.mark.timeout(120)


def big_state(seed: int) -> dict[str, Any]:
    """A model whose one file spans several pieces: a 24 MiB weight among small tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 3072), torch.nn.LayerNorm(3072), torch.nn.Linear(3072, 8))
    return {"model": model, "counter": {"seen": seed}}


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = big_state(1)
    with CheckpointManager.from_config(config(tmp_path / "ckpt", timestamp_subdir=False), quiet=True) as m:
        path = Path(m.save(3, state))
    return path, snapshot(state)


def data_files(ckpt: Path) -> dict[str, Any]:
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    return {n: e for n, e in body["files"].items() if n.endswith(".distcp")}


def resume(ckpt: Path, **keys: Any) -> tuple[dict[str, Any], BaseException | None]:
    state = big_state(7)
    cfg = config(ckpt.parent, timestamp_subdir=False, resume_from_checkpoint=str(ckpt), **keys)
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        try:
            m.resume(state)
        except BaseException as exc:  # noqa: BLE001 - the caller checks it
            return state, exc
    return state, None


def test_one_pass_reads_each_piece_once_and_loads_exactly(saved: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, expected = saved
    big = max(data_files(ckpt).values(), key=lambda e: e["size"])
    assert big["size"] > 3 * CHUNK_SIZE and len(big["chunks"]) == -(-big["size"] // CHUNK_SIZE)
    reads: list[tuple[int, int]] = []
    buffers: list[int] = []
    original_read, original_start = checked.StreamedFile._read_piece, checked.StreamedFile._start

    def counting_read(self: Any, k: int, buf: memoryview) -> memoryview:
        reads.append((id(self), k))
        return original_read(self, k, buf)

    def counting_start(self: Any, k: int) -> None:
        original_start(self, k)
        buffers.append(len(self._pieces) + len(self._free))

    monkeypatch.setattr(checked.StreamedFile, "_read_piece", counting_read)
    monkeypatch.setattr(checked.StreamedFile, "_start", counting_start)
    state, err = resume(ckpt, verify_before_load=False)
    assert err is None
    assert same(snapshot(state), expected)
    assert state["counter"] == {"seen": 1}
    assert len(reads) == len(set(reads)), "a piece was read twice"
    assert len(reads) >= len(big["chunks"])
    # memory stays bounded: the pieces ahead, the one being copied, the item's last piece
    assert max(buffers) <= checked.AHEAD + 3


def test_the_default_checks_everything_first_and_leaves_the_state_untouched(saved: Any) -> None:
    ckpt, _ = saved
    name, entry = max(data_files(ckpt).items(), key=lambda kv: kv[1]["size"])
    flip_byte(ckpt / name, entry["size"] - 100)  # the last piece
    fresh = snapshot(big_state(7))
    state, err = resume(ckpt)
    assert isinstance(err, CheckpointCorruptError) and not isinstance(err, PartlyLoadedError)
    assert same(snapshot(state), fresh)


def test_damage_found_part_way_says_the_state_is_partly_loaded(saved: Any) -> None:
    ckpt, expected = saved
    name, entry = max(data_files(ckpt).items(), key=lambda kv: kv[1]["size"])
    last = len(entry["chunks"]) - 1
    flip_byte(ckpt / name, last * CHUNK_SIZE + 10)
    state, err = resume(ckpt, verify_before_load=False)
    assert isinstance(err, PartlyLoadedError), err
    assert name in str(err) and f"byte {last * CHUNK_SIZE}" in str(err)
    assert "partly" in str(err) or "part of it" in str(err)
    assert err.faults[0][0] == name


def test_a_truncated_file_is_refused_before_anything_is_read(saved: Any) -> None:
    ckpt, _ = saved
    name, entry = max(data_files(ckpt).items(), key=lambda kv: kv[1]["size"])
    with open(ckpt / name, "r+b") as f:
        f.truncate(entry["size"] - 1)
    state, err = resume(ckpt, verify_before_load=False)
    assert isinstance(err, CheckpointCorruptError)
    assert "truncated" in str(err) or "size" in str(err)


def test_files_without_piece_checksums_are_checked_first(saved: Any) -> None:
    """A manifest of an older writer (no chunks): the one-pass option checks the file whole
    before loading, as by default, so damage leaves the state untouched."""
    from roll_ckpt.format.manifest import seal

    ckpt, _ = saved
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body.pop("chunk_size", None)
    for entry in body["files"].values():
        entry.pop("chunks", None)
    (ckpt / MANIFEST_NAME).write_bytes(seal(body))
    name, entry = max(data_files(ckpt).items(), key=lambda kv: kv[1]["size"])
    flip_byte(ckpt / name, entry["size"] - 100)
    fresh = snapshot(big_state(7))
    state, err = resume(ckpt, verify_before_load=False)
    assert isinstance(err, CheckpointCorruptError) and not isinstance(err, PartlyLoadedError), err
    assert same(snapshot(state), fresh)


def test_streams_from_a_backend_without_file_descriptors(tmp_path: Path) -> None:
    import uuid

    root = f"memory://streamed-{uuid.uuid4().hex}"
    state = big_state(1)
    expected = snapshot(state)
    with CheckpointManager.from_config(config(root, timestamp_subdir=False), quiet=True) as m:
        m.save(2, state)
    fresh = big_state(9)
    cfg = config(root, timestamp_subdir=False, resume_from_checkpoint=True, verify_before_load=False)
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        assert m.resume(fresh) == 2
    assert same(snapshot(fresh), expected)
