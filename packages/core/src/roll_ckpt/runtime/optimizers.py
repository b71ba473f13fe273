"""A torch optimizer's state dict across a save and a load, through torch's state-dict helpers.

``get_optimizer_state_dict`` makes the state of an optimizer that has none yet (never
stepped: Adam creates it lazily at its first step) by running a step with zero gradients and
a learning rate of 0 -- which leaves Adam's ``step`` at 1, so the first real step's bias
correction is no longer a fresh optimizer's and training goes elsewhere. A save must not
change the training state: :func:`optimizer_state_dict` gives such an optimizer back as it was
(no state) and saves it so (its ``param_groups`` only); :func:`fit_target` loads a checkpoint
saved so into a fresh optimizer again.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import RollCkptError

__all__ = ["optimizer_state_dict", "fit_target", "owners_of", "sole_optimizer", "group_names", "load_optimizer"]


def optimizer_state_dict(module: Any, optimizer: Any) -> dict[str, Any]:
    """``get_optimizer_state_dict(module, optimizer)``; an optimizer with no state yet is left
    without one, and its state dict holds its ``param_groups`` and an empty ``state``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    osd = get_optimizer_state_dict(module, optimizer)
    if fresh:
        optimizer.state.clear()  # Optimizer.state is a defaultdict: lazily made again at the first step
        osd = {**osd, "state": {}}
    return osd


def fit_target(osd: dict[str, Any], key: str, md: Any) -> None:
    """An optimizer's load target (``osd``: ``get_optimizer_state_dict`` of the live one, its state
    made if it had none, to be loaded into) made
    to what the checkpoint under ``key`` holds: no ``state`` when it was saved with none (the
    optimizer's ``load_state_dict`` then leaves the live one fresh), and none of the
    hyperparameters it does not hold -- ones a later torch added (AdamW's
    ``decoupled_weight_decay`` from 2.7 on, absent from a torch 2.6 checkpoint), which the
    optimizer's ``load_state_dict`` gives their default, as for any state dict an older torch wrote."""
    saved = md.state_dict_metadata
    if not any(name.startswith(f"{key}.state.") for name in saved):
        osd["state"] = {}
    for i, group in enumerate(osd.get("param_groups", [])):
        for name in [n for n in group if n != "params" and f"{key}.param_groups.{i}.{n}" not in saved]:
            del group[name]


def owners_of(state: Mapping[str, Any]) -> dict[str, str]:
    """For each optimizer key of ``state``, the key of the module that owns its parameters."""
    import torch

    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    owners: dict[str, str] = {}
    for key, opt in state.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        first = next((p for g in opt.param_groups for p in g["params"]), None)
        for mkey, mod in modules.items():
            if first is not None and any(p is first for p in mod.parameters()):
                owners[key] = mkey
                break
        else:
            raise RollCkptError(
                f"state['{key}'] is an optimizer whose parameters belong to no module in the "
                "state; put the model in the same state dict (e.g. state={'model': model, "
                f"'{key}': optimizer}})"
            )
    return owners


def sole_optimizer(owners: Mapping[str, str], module_key: str) -> str | None:
    """The key of the one optimizer of the module under ``module_key`` (``owners``: :func:`owners_of`);
    ``None`` for none or several."""
    mine = [opt for opt, mod in owners.items() if mod == module_key]
    return mine[0] if len(mine) == 1 else None


def group_names(osd: Any) -> list[list[str]]:
    """An optimizer state dict's parameter names, group by group (taken before a load
    replaces them with the checkpoint's, for :func:`load_optimizer`)."""
    groups = osd.get("param_groups", ()) if isinstance(osd, Mapping) else ()
    return [list(g.get("params", ())) for g in groups]


def load_optimizer(module: Any, optimizer: Any, osd: dict[str, Any], names_before: list[list[str]]) -> None:
    """Hand a loaded optimizer state dict (``get_optimizer_state_dict``'s, filled by the load)
    to ``optimizer``: where the load filled its own state in place, only the groups'
    hyperparameters are left to take; else torch's ``set_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from .torch_compat import optimizer_loaded_in_place, take_param_groups

    if optimizer_loaded_in_place(optimizer, osd, names_before):
        take_param_groups(optimizer, osd)
    else:
        set_optimizer_state_dict(module, optimizer, osd)

