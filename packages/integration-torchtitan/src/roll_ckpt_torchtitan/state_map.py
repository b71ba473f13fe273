"""torchtitan's state as a roll-ckpt state, and torchtitan's own DCP folders loaded into it.

The roll-ckpt state of a torchtitan job (:func:`roll_state`), by the keys torchtitan's
``CheckpointManager`` gives them (``torchtitan/components/checkpointer/dcp.py``)::

    "model"         GlobalState(ModelWrapper(model_parts))   torchtitan's flat model dict (fused
                                                             QKV split by its hooks), sharded
    "optimizer"     GlobalState(OptimizersContainer)         torchtitan's flat FQN optimizer dict
    "lr_scheduler"  GlobalState(LRSchedulersContainer)       {"last_epoch": n}
    "train_state"   GlobalState(trainer)                     {"step", "ntokens_seen"}
    "dataloader"    DataloaderState(dataloader)              per process: {"dp_rank_<r>": pickle
                                                             bytes, "world_size": n}
    (any other state torchtitan was handed: GlobalState)

A torchtitan step folder holds the same values under other DCP keys: the model's at the top
level, the others under their key (``optimizer.state.<fqn>.exp_avg``,
``dataloader.dp_rank_<r>``...). :func:`load_torchtitan_folder` reads one into the state with
roll-ckpt's safe reader: ``.metadata`` through the restricted unpickler, every byte value
with ``torch.load(weights_only=True)``, tensors resharded into the live ones.

The dataloader's value is a pickle torchtitan's own ``load_state_dict`` unpickles
(``torchtitan/components/dataloader.py``). :class:`DataloaderState` vets it first: the bytes
are unpickled by an unpickler that admits plain Python values only (no class, no function:
what a ``StatefulDataLoader`` state holds), and refused otherwise.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Mapping, MutableMapping

from roll_ckpt import GlobalState
from roll_ckpt.plugin import RollCkptError, UnsafeCheckpointError

__all__ = ["DataloaderState", "roll_state", "vet_pickle", "MODEL", "DATALOADER", "load_torchtitan_folder",
           "model_only_keys", "OWN_PREFIXES"]

MODEL = "model"
DATALOADER = "dataloader"
OWN_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
"""The keys of a torchtitan folder that are not the model's (torchtitan's ``Trainer``'s states)."""

_ADMITTED = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                       ("builtins", "complex"), ("builtins", "slice"), ("builtins", "range"),
                       ("builtins", "bytearray")})


class _Vetting(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, key: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where, self.key = where, key

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.where, [(self.key, f"its pickle asks for {module}.{name}: only plain Python "
                                                  "values are admitted in a dataloader state (set --checkpoint."
                                                  "exclude_from_loading dataloader to start the data afresh)")])

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self.where, [(self.key, "its pickle refers to outside objects")])


def vet_pickle(data: bytes, where: str, key: str) -> None:
    """Unpickle ``data`` admitting plain Python values only (dicts, lists, numbers, strings,
    bytes, sets); :class:`~roll_ckpt.errors.UnsafeCheckpointError` naming ``key`` otherwise."""
    try:
        _Vetting(data, where, key).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a torn or foreign pickle
        raise UnsafeCheckpointError(where, [(key, f"is not a readable pickle ({type(exc).__name__}: {exc})")]) from None


class DataloaderState:
    """torchtitan's dataloader as a per-process value of the roll-ckpt state.

    ``load_state_dict`` refuses a state another data-parallel world size saved (torchtitan's
    dataloader cannot be resharded: its own check is an ``assert``) and vets every pickled
    value (:func:`vet_pickle`) before torchtitan's ``load_state_dict`` unpickles it.
    """

    def __init__(self, loader: Any, where: str = "the checkpoint") -> None:
        self.loader = loader
        self.where = where

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        if isinstance(state_dict, Mapping) and state_dict:
            saved = state_dict.get("world_size")
            mine = getattr(self.loader, "dp_world_size", None)
            if saved is not None and mine is not None and saved != mine:
                raise RollCkptError(
                    f"{self.where}: the dataloader's state was saved by {saved} data-parallel ranks, this job has "
                    f"{mine}; torchtitan's dataloader cannot be resharded. Resume with --checkpoint."
                    "exclude_from_loading dataloader (the data starts from the beginning), or with the same "
                    "data-parallel degree")
            for key, value in state_dict.items():
                if isinstance(value, (bytes, bytearray)):
                    vet_pickle(bytes(value), self.where, f"dataloader.{key}")
        self.loader.load_state_dict(state_dict)


def roll_state(states: Mapping[str, Any], exclude: tuple[str, ...] = (), model_only: bool = False) -> dict[str, Any]:
    """The roll-ckpt state of torchtitan's ``states`` (the module doc); ``exclude``: keys left
    out (``exclude_from_loading``); ``model_only``: the model alone."""
    out: dict[str, Any] = {}
    for key, value in states.items():
        if value is None or key in exclude or (model_only and key != MODEL):
            continue
        out[key] = DataloaderState(value) if key == DATALOADER else GlobalState(value)
    return out


def model_only_keys(keys: Any) -> bool:
    """True when a torchtitan folder's DCP keys are the model's only (a model-only save)."""
    return not any(k.startswith(OWN_PREFIXES) for k in keys)


# --------------------------------------------------------------------------- loading a torchtitan folder


def _targets(state: Mapping[str, Any], saved: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The DCP template of torchtitan's flattened dict for ``state``, checked against ``saved``."""
    model = state.get(MODEL)
    if not isinstance(model, GlobalState):
        raise RollCkptError(f"{where} is a torchtitan checkpoint: it resumes into torchtitan's own objects, with "
                            "state['model'] = GlobalState(ModelWrapper(model_parts)) -- the state roll_ckpt_torchtitan's "
                            "checkpoint manager builds")
    flat: dict[str, Any] = {}
    msd = model.state_dict()
    missing = [k for k in msd if k not in saved]
    if missing:
        have = [k for k in saved if not k.startswith(OWN_PREFIXES)]
        raise RollCkptError(f"{where} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                            f"({len(missing)} of the model's {len(msd)} entries); it holds {len(have)} model entries, "
                            f"e.g. {', '.join(have[:3])}: resume it into the model torchtitan trained")
    flat.update(msd)
    for key, value in state.items():
        if key == MODEL:
            continue
        if not isinstance(value, (GlobalState, DataloaderState)):
            raise RollCkptError(f"state['{key}'] is a {type(value).__name__}: a torchtitan checkpoint resumes into "
                                "GlobalState values and torchtitan's dataloader only")
        sd = value.state_dict()
        lacking = [f"{key}.{k}" for k in sd if f"{key}.{k}" not in saved and
                   not any(s.startswith(f"{key}.{k}.") for s in saved)]
        if lacking:
            raise RollCkptError(f"{where} holds no {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}"
                                f" (state '{key}'); set --checkpoint.exclude_from_loading {key} to leave it as it is"
                                if key != DATALOADER else
                                f"{where} holds no {lacking[0]}: it was saved by fewer data-parallel ranks (or "
                                "without a dataloader); set --checkpoint.exclude_from_loading dataloader")
        flat[key] = sd
    return flat


def load_torchtitan_folder(storage: Any, path: str, state: MutableMapping[str, Any], md: Any = None) -> None:
    """torchtitan's DCP folder at ``path`` into ``state`` (a :func:`roll_state`), on this
    process alone (each loads its share; no collective)."""
    from roll_ckpt.plugin import load_dcp, read_dcp_metadata

    md = md if md is not None else read_dcp_metadata(storage, path)
    where = path
    for value in state.values():
        if isinstance(value, DataloaderState):
            value.where = where
    flat = _targets(state, md.state_dict_metadata, where)
    model = state[MODEL]
    others = [k for k in state if k != MODEL]
    model_keys = [k for k in flat if k not in others]
    load_dcp(flat, storage, path)
    model.load_state_dict({k: flat[k] for k in model_keys})
    for key, value in state.items():
        if key != MODEL:
            value.load_state_dict(flat[key])
