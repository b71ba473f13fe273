"""Another framework's DCP folder (no manifest), read the way format plugins read it: the
restricted unpickler for ``.metadata``, ``weights_only`` for values (plain NumPy arrays only
when asked), tensors resharded into the caller's targets."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from roll_ckpt.errors import UnsafeCheckpointError
from roll_ckpt.plugin import dcp_placeholders, load_dcp, read_dcp_metadata, write_dcp
from roll_ckpt_fs.storage import LocalStorage


class _Boom:
    def __reduce__(self):
        return (print, ("PWNED",))


def _save(path: Path, **extra: object) -> dict:
    sd = {"w": torch.arange(12.0).reshape(3, 4), "rng": {"numpy": np.random.get_state(), "random": random.getstate()},
          **extra}
    write_dcp(sd, str(path))
    return sd


def test_tensors_and_values_are_read_into_their_targets(tmp_path: Path) -> None:
    saved = _save(tmp_path / "dcp")
    storage = LocalStorage(str(tmp_path))
    md = read_dcp_metadata(storage, str(tmp_path / "dcp"))
    target = {"w": torch.zeros(3, 4), "rng": dcp_placeholders(md, ("rng",))}
    load_dcp(target, storage, str(tmp_path / "dcp"), numpy=True)
    assert torch.equal(target["w"], saved["w"])
    kind, keys, *rest = target["rng"]["numpy"]
    assert kind == "MT19937" and np.array_equal(keys, saved["rng"]["numpy"][1])
    assert tuple(target["rng"]["random"][1]) == saved["rng"]["random"][1]


def test_numpy_arrays_only_when_asked(tmp_path: Path) -> None:
    _save(tmp_path / "dcp")
    storage = LocalStorage(str(tmp_path))
    md = read_dcp_metadata(storage, str(tmp_path / "dcp"))
    with pytest.raises(UnsafeCheckpointError, match="rng.numpy"):
        load_dcp({"rng": dcp_placeholders(md, ("rng",))}, storage, str(tmp_path / "dcp"))


def test_a_value_that_runs_code_is_refused_numpy_or_not(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _save(tmp_path / "dcp", evil=_Boom())
    storage = LocalStorage(str(tmp_path))
    for numpy in (False, True):
        with pytest.raises(UnsafeCheckpointError, match="evil"):
            load_dcp({"evil": None}, storage, str(tmp_path / "dcp"), numpy=numpy)
    assert "PWNED" not in capsys.readouterr().out
