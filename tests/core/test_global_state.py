"""GlobalState: a stateful value whose state dict is the job's (a framework's wrapper of its
sharded model parts or optimizers) is saved as a module's is -- global DCP entries under its
key, tensors loaded in place and resharded, other values once for the job -- not per process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.launch import torchrun
from helpers.training import config
from roll_ckpt import CheckpointManager, GlobalState, RollCkptError
from roll_ckpt.plugin import read_dcp_metadata
from roll_ckpt_fs.storage import LocalStorage

CHILD = Path(__file__).with_name("_global_state_child.py")


class Holder:
    """A Stateful whose state dict is a live, nested dict (as torchtitan's ModelWrapper keeps one)."""

    def __init__(self, sd: dict) -> None:
        self.sd = sd
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.loaded.append(sd)
        self.sd = sd


def _values(scale: float = 1.0) -> dict:
    return {"w": torch.arange(6.0).reshape(2, 3) * scale, "nested": {"b": torch.ones(4) * scale, "n": 3},
            "step": 7, "name": "x", "betas": (0.9, 0.999), "raw": b"\x00\x01pickled"}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_global_state_round_trips_as_global_dcp_entries(tmp_path: Path, async_save: bool) -> None:
    live = Holder(_values())
    state = {"wrapped": GlobalState(live), "counter": {"n": 1}}
    with CheckpointManager(config(tmp_path / "ckpt", async_save=async_save), quiet=True) as m:
        path = m.save(1, state)
        m.wait()
        live.sd["w"].add_(100)  # changed after the save: not in the checkpoint
        live.sd["step"] = 8

    md = read_dcp_metadata(LocalStorage(str(tmp_path)), f"{path}/dcp")
    keys = set(md.state_dict_metadata)
    assert {"wrapped.w", "wrapped.nested.b", "wrapped.nested.n", "wrapped.step", "wrapped.name", "wrapped.betas",
            "wrapped.raw"} <= keys
    assert not any(".wrapped" in k for k in keys if k.startswith("per_rank.")), "saved per process too"

    template = _values(scale=0.0)
    template.update(step=0, name="", betas=(0, 0), raw=b"")
    w_before = template["w"]
    target = Holder(template)
    with CheckpointManager(config(tmp_path / "ckpt", resume_from_checkpoint=path), quiet=True) as m:
        assert m.resume({"wrapped": GlobalState(target), "counter": {}}) == 1
    assert len(target.loaded) == 1
    got = target.sd
    assert got["w"] is w_before, "a tensor of the template is loaded in place"
    assert torch.equal(got["w"], _values()["w"]) and torch.equal(got["nested"]["b"], torch.ones(4))
    assert (got["nested"]["n"], got["step"], got["name"], got["betas"], got["raw"]) == \
        (3, 7, "x", (0.9, 0.999), b"\x00\x01pickled")


def test_a_global_state_missing_from_the_checkpoint_is_named(tmp_path: Path) -> None:
    with CheckpointManager(config(tmp_path / "ckpt"), quiet=True) as m:
        path = m.save(1, {"model": torch.nn.Linear(2, 2)})
    with CheckpointManager(config(tmp_path / "ckpt", resume_from_checkpoint=path), quiet=True) as m:
        with pytest.raises(RollCkptError, match="no entry for state key.*wrapped"):
            m.resume({"model": torch.nn.Linear(2, 2), "wrapped": GlobalState(Holder(_values()))})


def test_only_a_stateful_object_can_be_global() -> None:
    with pytest.raises(RollCkptError, match=r"GlobalState\(int\).*no state_dict"):
        GlobalState(3)
    with pytest.raises(RollCkptError, match="returned a list, not a dict"):
        GlobalState(Holder([1])).state_dict()  # type: ignore[arg-type]


@pytest.mark.timeout(180)
def test_dtensor_shards_of_two_ranks_resume_resharded_in_one_process(tmp_path: Path) -> None:
    """Two ranks save a GlobalState holding a DTensor sharded over them (each its own rows) and
    a value they share; one process resumes it into a plain tensor: DCP reshards."""
    torchrun(CHILD, tmp_path, nproc=2, timeout=150)
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved == {"0": "ok", "1": "ok"}
    target = Holder({"w": torch.zeros(8, 2), "count": 0})
    with CheckpointManager(config(tmp_path / "ckpt", resume_from_checkpoint="latest"), quiet=True) as m:
        assert m.resume({"wrapped": GlobalState(target)}) == 3
    assert torch.equal(target.sd["w"], torch.arange(16.0).reshape(8, 2)) and target.sd["count"] == 5
