"""Another framework's ``torch.save`` files (verl's per-rank model, optimizer and extra-state
files), read the way format plugins read them: ``weights_only`` only (plain NumPy arrays when
asked), memory-mapped from a local disk, a torn file told apart from a whole one without
reading its data."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from roll_ckpt.errors import CheckpointCorruptError, UnsafeCheckpointError
from roll_ckpt.plugin import torch_file_problem, torch_load
from roll_ckpt_fs.storage import LocalStorage


class _Boom:
    def __reduce__(self):
        return (print, ("PWNED",))


def _storage(tmp_path: Path) -> LocalStorage:
    return LocalStorage(str(tmp_path))


def test_tensors_and_plain_values_come_back_memory_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(3.0), "lr": [0.1], "name": "x"}
    torch.save(saved, tmp_path / "model.pt")
    calls = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, **kw: calls.append((f, kw)) or load(f, **kw))
    loaded = torch_load(_storage(tmp_path), str(tmp_path / "model.pt"))
    assert torch.equal(loaded["w"], saved["w"]) and loaded["lr"] == [0.1] and loaded["name"] == "x"
    assert calls == [(str(tmp_path / "model.pt"), {"map_location": "cpu", "weights_only": True, "mmap": True})]
    (tmp_path / "link.pt").symlink_to(tmp_path / "model.pt")  # a link is never opened by name
    with pytest.raises(OSError, match="symbolic link"):
        torch_load(_storage(tmp_path), str(tmp_path / "link.pt"))


def test_numpy_arrays_only_when_asked(tmp_path: Path) -> None:
    torch.save({"rng": {"numpy": np.random.get_state(), "random": random.getstate(), "cpu": torch.get_rng_state()}},
               tmp_path / "extra.pt")
    with pytest.raises(UnsafeCheckpointError, match="extra.pt"):
        torch_load(_storage(tmp_path), str(tmp_path / "extra.pt"))
    rng = torch_load(_storage(tmp_path), str(tmp_path / "extra.pt"), numpy=True)["rng"]
    assert np.array_equal(rng["numpy"][1], np.random.get_state()[1]) and rng["random"] == random.getstate()


def test_code_is_never_unpickled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"x": _Boom()}, tmp_path / "optim.pt")
    with pytest.raises(UnsafeCheckpointError, match="optim.pt.*never unpickles code"):
        torch_load(_storage(tmp_path), str(tmp_path / "optim.pt"), numpy=True)
    assert "PWNED" not in capsys.readouterr().out


def test_a_torn_file_is_named_and_told_apart_without_reading_it(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "torn.pt").write_bytes(data[: len(data) // 2])
    storage = _storage(tmp_path)
    assert torch_file_problem(storage, str(tmp_path / "whole.pt")) is None
    assert "cut short" in torch_file_problem(storage, str(tmp_path / "torn.pt"))
    assert torch_file_problem(storage, str(tmp_path / "gone.pt")) == "is missing"
    with pytest.raises(CheckpointCorruptError, match="torn.pt: is not a whole torch.save file"):
        torch_load(storage, str(tmp_path / "torn.pt"))
