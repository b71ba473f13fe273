"""The driver's plain Python state, saved as JSON: no pickle on save or on load.

An RL driver (the pipeline process that schedules actor and critic) holds the global
step, counters, the data-sampling position and the logged history. :class:`DriverState`
is a ``dict`` of JSON values; a manager given only driver states picks the ``json``
strategy, which writes ``state/state.json`` (checksummed in the manifest like any other
file) instead of a DCP folder::

    driver = DriverState(step=0, consumed_samples=0, history=[])
    manager = CheckpointManager.from_config(config, component="pipeline")
    start = manager.resume({"driver": driver})      # restores the dict in place
    ...
    manager.save(step, {"driver": driver})

Values must come back exactly as they were, so only JSON types are accepted: ``str``
keys; ``str``, ``int``, ``float`` (NaN and infinities included), ``bool``, ``None``, and
lists and dicts of them. A tuple, set, bytes or NumPy scalar is refused at save, naming
its key path. NaN and the infinities are written as Python's ``json`` writes them
(``NaN``, ``Infinity``): Python reads them back exactly; strict JSON parsers (``jq``) do not. With ``rng=True`` (the default) the process's Python ``random`` and NumPy
global generator states are saved too, and restored by ``resume``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, MutableMapping

from ..contracts import SpaceEstimate, Storage, Strategy, StrategyIO
from .manifest import hash_bytes
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, RollCkptError
from ..runtime.rng import plain_rng_state, restore_plain_rng_state

__all__ = ["DriverState", "JSONStrategy", "JSONIO", "STATE_FILE", "STATE_FORMAT"]

STATE_FILE = "state.json"
STATE_FORMAT = "roll-ckpt-driver-state"
"""The ``format`` field of :data:`STATE_FILE`."""


class DriverState(dict):
    """A ``dict`` of JSON values saved and restored without pickle (see the module doc)."""

    def __init__(self, *args: Any, rng: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        _check_json(dict(self), "DriverState")
        out: dict[str, Any] = {"values": json.loads(json.dumps(dict(self)))}
        if self.rng:
            out["rng"] = plain_rng_state()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        values = state.get("values")
        if not isinstance(values, dict):
            raise RollCkptError("driver state without 'values': not written by DriverState")
        self.clear()
        self.update(values)
        if self.rng and state.get("rng") is not None:
            restore_plain_rng_state(state["rng"])


_SCALARS = (type(None), str, bool, int, float)


def _check_json(value: Any, where: str, seen: frozenset[int] = frozenset()) -> None:
    # Exact types: a subclass (np.float64, an IntEnum, an OrderedDict) would come back as its base.
    kind = type(value)
    if kind in _SCALARS:
        return
    if kind is list or kind is dict:
        if id(value) in seen:
            raise RollCkptError(f"{where} contains itself; DriverState holds trees of JSON values")
        seen = seen | {id(value)}
        if kind is list:
            for i, v in enumerate(value):
                _check_json(v, f"{where}[{i}]", seen)
            return
        for k, v in value.items():
            if type(k) is not str:
                raise RollCkptError(f"{where} has the key {k!r} ({type(k).__name__}); DriverState keys are "
                                    "strings (JSON objects), or they would come back as strings")
            _check_json(v, f"{where}[{k!r}]", seen)
        return
    raise RollCkptError(
        f"{where} is a {type(value).__name__}; DriverState holds JSON values only (str, int, float, bool, "
        "None, lists and dicts of them) so it restores exactly without pickle: convert it (a tuple "
        "to a list, a NumPy number with .item()) or keep it in a module/optimizer state instead")


def holds_driver_state(state: Mapping[str, Any]) -> bool:
    return bool(state) and all(isinstance(v, DriverState) for v in state.values())


class JSONStrategy(Strategy):
    """One process, driver states only: ``state/state.json``, written and read without pickle
    by :class:`JSONIO`.

    A :class:`roll_ckpt.contracts.Strategy` that never imports torch (one process: the base
    class's ``broadcast``, ``agree`` and ``any_true``).
    """

    name = "json"
    data_dir = "state"
    rank = 0
    world_size = 1
    is_coordinator = True

    def __init__(self, config: Any, plugins: Any = None) -> None:
        self.config = config

    def state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The bytes of ``state.json``: a snapshot taken now, so the caller may go on right away."""
        body: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, DriverState):
                raise RollCkptError(f"state['{key}'] is a {type(value).__name__}: the json strategy saves "
                                    "DriverState values only; save tensors, modules and optimizers "
                                    "with a component of their own")
            body[key] = value.state_dict()
        # Insertion order is kept (no sort_keys): the dicts come back as they were.
        data = json.dumps({"format": STATE_FORMAT, "version": 1, "state": body}, allow_nan=True).encode()
        return {STATE_FILE: data}

    def load_targets(self, state: Mapping[str, Any], saved: Any, path: str) -> tuple[dict[str, Any], str]:
        """The saved values of ``state``'s keys (``saved``: the file's ``state`` object)."""
        missing = sorted(set(state) - set(saved))
        if missing:
            raise CheckpointNotFoundError(f"{path} has no driver state for {', '.join(map(repr, missing))} "
                                          f"(it holds {', '.join(map(repr, sorted(saved))) or 'nothing'})")
        return {key: saved[key] for key in state}, "0"

    def hand_over(self, state: MutableMapping[str, Any], target: dict[str, Any], src: str) -> None:
        for key, value in state.items():
            value.load_state_dict(target[key])


class JSONIO(StrategyIO):
    """The :class:`~roll_ckpt.contracts.StrategyIO` of :class:`JSONStrategy`: one small JSON
    file, checked whole before use (whatever ``stream`` says)."""

    def estimate(self, sd: dict[str, Any], user: Mapping[str, Any] | None = None) -> SpaceEstimate:
        """Exact but for the manifest and trainer_state.json (a few KiB, counted generously)."""
        overhead = 16 << 10
        if user:
            overhead += len(json.dumps(dict(user), indent=1))
        return SpaceEstimate(total=len(sd[STATE_FILE]) + overhead, tensor_bytes=0, items=1, files=3)

    def write(self, sd: dict[str, Any], storage: Storage, path: str,
              on_bytes: Any = None, *, save: Any = None, alone: bool = False) -> dict[str, tuple]:
        data = sd[STATE_FILE]
        storage.makedirs(path)
        with storage.open_write(storage.join(path, STATE_FILE)) as f:
            f.write(data)
        if on_bytes is not None:
            on_bytes(len(data))
        return {STATE_FILE: hash_bytes(data)}

    def load(self, state: MutableMapping[str, Any], storage: Storage, path: str, on_bytes: Any = None, *,
             files: Mapping[str, Any] | None = None, checkpoint: str | None = None, stream: bool = False,
             alone: bool = False) -> None:
        where = checkpoint or path
        name = f"{self.strategy.data_dir}/{STATE_FILE}"
        try:
            with storage.open_read(storage.join(path, STATE_FILE)) as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where} holds no driver state ({name} is missing): it was "
                                          "not saved from DriverState values") from None
        entry = (files or {}).get(STATE_FILE)
        if entry is not None and hash_bytes(data) != (entry.size, entry.checksum):
            raise CheckpointCorruptError(where, [(name, "checksum mismatch (the content changed after it was written)")])
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointCorruptError(where, [(name, f"not valid JSON ({exc})")]) from None
        saved = body.get("state") if isinstance(body, dict) and body.get("format") == STATE_FORMAT else None
        if not isinstance(saved, dict):
            raise CheckpointCorruptError(where, [(name, "not a roll-ckpt driver state")])
        target, src = self.strategy.load_targets(state, saved, where)
        self.strategy.hand_over(state, target, src)
        if on_bytes is not None:
            on_bytes(len(data))


JSONStrategy.io_class = JSONIO  # (set here: the strategy's class comes first in this module, its I/O second)
