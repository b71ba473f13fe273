"""A stateful value whose state dict is the job's, not the process's: saved as a module is.

Every other stateful object of a state (a scheduler, a dataloader, counters) is saved *per
process*, under ``per_rank.<rank>.<key>``, as one pickled leaf. That is wrong for an object
whose state dict holds the job's sharded tensors -- a framework's wrapper of its model parts
or of its optimizers (torchtitan's ``ModelWrapper``, ``OptimizersContainer``): each process
would pickle its own shards, nothing could be resharded, and the tensors would be read with
``weights_only`` as pickles. :class:`GlobalState` marks such an object::

    state = {"model": GlobalState(model_wrapper), "optimizer": GlobalState(optimizers),
             "loader": dataloader}              # the dataloader stays per process

The strategy then treats its state dict as it treats a module's (:mod:`roll_ckpt.strategies.dcp`):

* **save** -- ``obj.state_dict()`` is called at every save. Its tensors become DCP entries
  ``<key>.<path>`` (``<path>``: the keys down to the tensor, joined with dots): a DTensor is
  written as the global tensor it is a shard of (each process writes its own shards), a plain
  tensor is taken to be the same on every process (DCP writes it once). Its other values
  (numbers, strings, tuples, bytes) are written once for the job, as DCP writes any value
  every process holds under the same key: they must be the same on every process.
* **resume** -- ``obj.state_dict()`` is the template: its tensors are loaded in place
  (resharded to this job's world size, as DCP reshards), its other values replaced by the
  saved ones (read with ``torch.load(weights_only=True)``); then
  ``obj.load_state_dict(template)``. This is DCP's own ``Stateful`` protocol, as ``dcp.save``
  and ``dcp.load`` apply it to a value of their state dict.

A checkpoint of a state with a :class:`GlobalState` at ``model`` holds the same DCP keys as
``dcp.save({"model": obj})`` would write: plain DCP, loadable by ``dcp.load``.
"""

from __future__ import annotations

from typing import Any

from ..errors import RollCkptError

__all__ = ["GlobalState"]


class GlobalState:
    """``GlobalState(obj)``: ``obj``'s state dict is saved and resumed as the job's (the module doc).

    ``obj`` has ``state_dict()`` and ``load_state_dict(sd)``; its state dict is a mapping
    (nested mappings allowed) of tensors, DTensors and plain values.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise RollCkptError(f"GlobalState({type(obj).__name__}): the object has no state_dict()/load_state_dict(); "
                                "wrap an object that has both (a Stateful)")
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        """``obj.state_dict()``, checked to be a mapping (DCP saves mappings only)."""
        sd = self.obj.state_dict()
        if not isinstance(sd, dict):
            raise RollCkptError(f"GlobalState({type(self.obj).__name__}).state_dict() returned a "
                                f"{type(sd).__name__}, not a dict: DCP saves a dict of tensors and values")
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"GlobalState({type(self.obj).__name__})"
