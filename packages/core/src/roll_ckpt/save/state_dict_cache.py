"""The module and optimizer state dicts of a training state, built once per structure.

``get_model_state_dict``/``get_optimizer_state_dict`` cost ~20 µs per tensor, on every save.
While the state keeps its structure -- the same modules, parameters, buffers, optimizer
state tensors -- the dicts they return stay valid: a model's holds detached views of the
live parameters and buffers, an optimizer's holds the optimizer's own per-parameter state
dicts (``Optimizer.state_dict`` does not copy them), so later saves read the current
values through them. Only the optimizer's ``param_groups`` (copies, with the learning rate
the scheduler changes) are rebuilt every time.

The structure is compared on every save (the identity of every module, parameter, buffer
and optimizer state tensor, and the optimizer's state keys): a change is detected, never
assumed, and the dicts are built again.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..runtime.torch_compat import module_tensor_ids

__all__ = ["StateDictCache", "structure_of"]


def structure_of(state: Mapping[str, Any], module_type: type, optimizer_type: type) -> tuple:
    """What a cached state dict depends on: the identity of every tensor it holds."""
    parts: list[Any] = []
    for key, obj in state.items():
        if isinstance(obj, module_type):
            parts.append((key, id(obj), module_tensor_ids(obj)))
        elif isinstance(obj, optimizer_type):
            parts.append((key, id(obj), len(obj.param_groups),
                          tuple((id(p), tuple(st), tuple(map(id, st.values()))) for p, st in obj.state.items())))
    return tuple(parts)


class StateDictCache:
    """The state dicts of a state's modules and optimizers, kept while its structure lasts."""

    def __init__(self) -> None:
        self._structure: tuple | None = None
        self._dicts: dict[str, dict[str, Any]] = {}
        self.builds = 0
        """How often the dicts were built (a test can tell a reuse from a rebuild)."""

    def get(self, state: Mapping[str, Any], module_type: type, optimizer_type: type,
            build: Callable[[str, Any], dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``{key: state dict}`` for every module and optimizer of ``state``; ``build(key, obj)``
        makes one when the structure changed."""
        if structure_of(state, module_type, optimizer_type) != self._structure:
            self._dicts = {key: build(key, obj) for key, obj in state.items()
                           if isinstance(obj, (module_type, optimizer_type))}
            # after the build: building an optimizer's state dict may create its state
            self._structure = structure_of(state, module_type, optimizer_type)
            self.builds += 1
            return dict(self._dicts)
        out = dict(self._dicts)
        for key, obj in state.items():
            if isinstance(obj, optimizer_type):
                out[key] = _with_current_groups(self._dicts[key], obj)
        return out

    def clear(self) -> None:
        self._structure, self._dicts = None, {}


def _with_current_groups(osd: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """``osd`` with its ``param_groups`` as the optimizer has them now (learning rates move)."""
    groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": saved["params"]}
              for live, saved in zip(optimizer.param_groups, osd["param_groups"])]
    return {**osd, "param_groups": groups}
