"""Everything in the state comes back exactly as it was saved: model, optimizer, scheduler,
RNG, stateful objects and plain values (key types, empty containers, tuples, None...)."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from roll_ckpt import CheckpointManager, RollCkptError, load_config
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state


class Stateful:
    def __init__(self, sd=None) -> None:
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd) -> None:
        self.sd = sd


def _odd_values() -> dict:
    return {
        0: "int key", 7: {3: [1, 2], "s": {}},
        "empty": {}, "none": None, "tuple": (1, "a", None), "one": (5,), "list": [1, [2, {}]],
        "nested": {"a": {"b": {}}, "c": [{}]}, "float": 0.1, "str": "x", "bool": True,
        "tensor_in": {"t": torch.arange(4)}, "big": 2**40,
    }


def _cfg(tmp_path: Path, **top):
    return load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt")}, **top})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_per_process_values_round_trip_exactly(tmp_path: Path, async_save: bool) -> None:
    stateful = Stateful(_odd_values())
    counter = {1: 10, "n": 0, "per_class": {}, "hist": {0: [0.5]}}
    state = {"model": torch.nn.Linear(3, 3), "loader": stateful, "counter": counter,
             "epoch": 4, "ema": torch.ones(3) * 2, "empty": {}}
    cfg = _cfg(tmp_path, strategy_config={"async_save_ckpt": async_save})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        path = m.save(1, state)
        counter["per_class"]["late"] = 1  # changed after save(): not in the checkpoint
        stateful.sd[0] = "changed"
    counter["per_class"].clear()
    stateful.sd[0] = "int key"

    loaded_counter = {"stale": True}
    loaded_empty = {"stale": True}
    target = {"model": torch.nn.Linear(3, 3), "loader": Stateful(), "counter": loaded_counter,
              "epoch": 0, "ema": None, "empty": loaded_empty}
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing may be reported missing
            assert m.resume(target) == 1
    assert_same_state(target["loader"].sd, _odd_values())
    assert loaded_counter == {1: 10, "n": 0, "per_class": {}, "hist": {0: [0.5]}}
    assert loaded_empty == {}
    assert target["epoch"] == 4 and torch.equal(target["ema"], torch.ones(3) * 2)


def test_rng_is_restored(tmp_path: Path) -> None:
    state = tiny_state()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gauss value
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        path = m.save(1, state)
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(100)
    np.random.seed(100)
    torch.manual_seed(100)
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        m.resume(tiny_state(seed=5))
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    assert got[:4] == expected[:4] and torch.equal(got[4], expected[4])


def test_optimizer_and_scheduler_state(tmp_path: Path) -> None:
    state = tiny_state(seed=1)
    snap = state_snapshot(state)
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        path = m.save(2, state)
    fresh = tiny_state(seed=2)
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        m.resume(fresh)
    assert_same_state(state_snapshot(fresh), snap)
    assert fresh["scheduler"].get_last_lr() == state["scheduler"].get_last_lr()
    assert fresh["optimizer"].param_groups[0]["lr"] == state["optimizer"].param_groups[0]["lr"]
    # and the next steps match bit for bit
    for s in (state, fresh):
        torch.manual_seed(9)
        s["model"].train()
        s["model"](torch.randn(4, 8)).sum().backward()
        s["optimizer"].step()
        s["scheduler"].step()
    assert_same_state(state_snapshot(fresh), state_snapshot(state))


def test_state_key_missing_from_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        path = m.save(1, {"model": torch.nn.Linear(2, 2)})
    target = {"model": torch.nn.Linear(2, 2), "counter": {"n": 3}}
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        with pytest.warns(UserWarning, match=r"no saved value for state\['counter'\]"):
            m.resume(target)
    assert target["counter"] == {"n": 3}
    other = {"net": torch.nn.Linear(2, 2)}
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        with pytest.raises(RollCkptError, match=r"no entry for state key\(s\) net; it holds model, per_rank"):
            m.resume(other)


def test_bad_state_keys_and_orphan_optimizer(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        with pytest.raises(RollCkptError, match="must be a non-empty string"):
            m.save(1, {"model": model, "a.b": 1})
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        with pytest.raises(RollCkptError, match="belong to no module"):
            m.save(1, {"model": model, "optimizer": opt})


def test_a_state_dict_that_draws_from_the_rng_leaves_the_restored_rng_alone(tmp_path: Path) -> None:
    """A stateful object whose ``state_dict()`` draws a random number (a ``StatefulDataLoader``
    starts its iterator, drawing its base seed from torch's generator) is asked for its state
    again after the resume restored the RNG (the layout of the next save is adopted then): the
    RNG the resume hands back is the one saved."""

    class Drawing(Stateful):
        def state_dict(self):
            torch.empty((), dtype=torch.int64).random_()
            return {"position": 3}

    state = {"model": torch.nn.Linear(2, 2), "loader": Drawing()}
    with CheckpointManager.from_config(_cfg(tmp_path), quiet=True) as m:
        saved = torch.get_rng_state().clone()  # what the save takes, before it asks the objects
        path = m.save(1, state)
    torch.rand(100)
    with CheckpointManager.from_config(_cfg(tmp_path, resume_from_checkpoint=path), quiet=True) as m:
        m.resume({"model": torch.nn.Linear(2, 2), "loader": Drawing()})
    assert torch.equal(torch.get_rng_state(), saved)
