"""The Hugging Face hub's layout of a transformers model, by transformers' own rules.

transformers 5 holds some weights in another form than the files on the hub: an MoE
layer's experts as fused tensors (``mlp.experts.gate_up_proj``) where the hub has one
tensor per expert (``mlp.experts.<k>.gate_proj.weight``; Mixtral's ``w1``/``w3``). Its
``save_pretrained`` writes the hub's form, through the model's weight-conversion mapping
(``transformers.conversion_mapping``), reverted by ``revert_weight_conversion``; it also
drops tied weights and shards with ``huggingface_hub``'s split. transformers 4 holds the
hub's form already (one module per expert). What differs between the two goes through
:mod:`roll_ckpt.runtime.transformers_compat`. :func:`hub_layout` asks the same three functions, over meta
tensors (nothing is allocated but, for a converted tensor, an uninitialized stand-in of
its size to learn which outputs share storage, as the shard split counts them), so the
names, shapes, shards and ``total_parameters`` written are ``save_pretrained``'s.

Both ways go tensor by tensor: :meth:`HubLayout.to_hub` converts the module's tensors
(export, the checkpoint's ``hf/`` folder), :meth:`HubLayout.assemble` builds one module
tensor from the hub's (``initial_load``): the module tensor's element indices are
converted as a tensor would be, which says where each hub element goes. An architecture
whose rules cannot be applied one tensor at a time is refused with its name and the keys.
A module that is not a transformers model keeps its own names (the identity layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import RollCkptError
from ..runtime.transformers_compat import drop_tied_weights, index_has_total_parameters, revert_weight_conversion

__all__ = ["HubLayout", "architecture_name", "hub_layout", "identity_layout", "meta_model", "transformers_model"]

_SHOWN = 5


@dataclass
class HubLayout:
    """How a module's state dict is written in the hub's form."""

    architecture: str | None
    """``Qwen2MoeForCausalLM``...; ``None``: not a transformers model (names kept)."""
    outputs: dict[str, list[str]]
    """Module key -> the hub names it becomes (``[]``: a tied weight, not written)."""
    hub: dict[str, tuple[tuple[int, ...], Any]]
    """Hub name -> (shape, dtype), in ``save_pretrained``'s order."""
    plan: Any = None
    """huggingface_hub's ``StateDictSplit`` of the hub tensors (files, names in each)."""
    total_parameters: int | None = None
    """``save_pretrained``'s ``metadata.total_parameters`` (``None``: not a transformers model, or a
    transformers before 4.53, whose index has none)."""
    model: Any = field(default=None, repr=False)
    """The meta model whose rules convert (``None``: the identity)."""
    module_sizes: dict[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict, repr=False)
    """Module key -> (shape, dtype) of the module's own tensors (:meth:`module_shape`)."""

    @property
    def converted(self) -> bool:
        return any(outs != [k] for k, outs in self.outputs.items())

    def sources(self, hub_names: Any) -> list[str]:
        """The module keys whose outputs hold any of ``hub_names``."""
        wanted = set(hub_names)
        return [k for k, outs in self.outputs.items() if wanted.intersection(outs)]

    def to_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """``tensors`` (module keys) in the hub's form: converted, tied names left out."""
        out: dict[str, Any] = {}
        for key, tensor in tensors.items():
            outs = self.outputs.get(key, [key])
            if not outs:
                continue
            if outs == [key] or self.model is None:
                out[key] = tensor
                continue
            got = revert_weight_conversion(self.model, {key: tensor})
            out.update({n: t.contiguous() for n, t in got.items()})
        return out

    def assemble(self, key: str, read: Callable[[str], Any], rows: tuple[slice, ...] | None = None) -> Any:
        """The module tensor ``key`` built from the hub tensors ``read(name)`` gives; with
        ``rows`` (slices of the module tensor), only that part, reading only the hub tensors
        that hold some of it."""
        import torch

        shape, dtype = self.module_shape(key)
        numel = 1
        for n in shape:
            numel *= n
        index_dtype = torch.int32 if numel < 2 ** 31 else torch.int64
        index = torch.arange(numel, dtype=index_dtype).reshape(shape)
        placed = revert_weight_conversion(self.model, {key: index})
        box = index[rows] if rows is not None else index
        lo, hi = (int(box.min()), int(box.max())) if box.numel() else (0, -1)
        full = torch.empty(numel, dtype=dtype)
        seen = torch.zeros(numel, dtype=torch.bool)
        for name, where in placed.items():
            flat = where.reshape(-1).long()
            if rows is not None and (not flat.numel() or int(flat.max()) < lo or int(flat.min()) > hi):
                continue
            data = read(name)
            full[flat] = data.reshape(-1).to(dtype)
            seen[flat] = True
        part = full.reshape(shape)[rows] if rows is not None else full.reshape(shape)
        if not bool(seen.reshape(shape)[rows].all() if rows is not None else seen.all()):
            raise RollCkptError(f"{self.architecture}: transformers' conversion of '{key}' from "
                                f"{_listed(list(placed))} does not cover the whole tensor; this architecture "
                                "cannot be loaded from the hub's layout")
        return part

    def module_shape(self, key: str) -> tuple[tuple[int, ...], Any]:
        return self.module_sizes[key]


@dataclass(frozen=True)
class _Name:
    name: str


def _listed(names: list[str]) -> str:
    more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def transformers_model(module: Any) -> Any:
    """``module`` when it is a transformers ``PreTrainedModel`` (plain or FSDP2), else ``None``."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ == "PreTrainedModel":
            return module
    return None


def architecture_name(model: Any) -> str:
    """The model's own class name (``LlamaForCausalLM``), not FSDP2's subclass of it."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch."):
            return cls.__name__
    return type(model).__name__


def _architecture(module_or_config: Any) -> tuple[Any, Any]:
    """The class to build (or an Auto class's ``from_config``) and the config."""
    import transformers

    config = getattr(module_or_config, "config", module_or_config)
    if hasattr(module_or_config, "config"):  # a live model (FSDP2 wraps it in a subclass of torch's)
        for cls in type(module_or_config).__mro__:
            if not cls.__module__.startswith("torch."):
                return cls, config
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls, config
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):  # a config without architectures
        if type(config) in auto._model_mapping:
            return auto.from_config, config
    raise RollCkptError(f"the model's config ({getattr(config, 'model_type', '?')}) names no architecture "
                        f"transformers has ({names or 'no architectures'}); give a config.json with "
                        "'architectures' (e.g. [\"Qwen2MoeForCausalLM\"])")


def meta_model(module_or_config: Any) -> Any:
    """A model of the same architecture and config on the meta device (nothing allocated);
    a live model's loaded conversion rules (``from_pretrained``'s) are kept."""
    import torch

    build, config = _architecture(module_or_config)
    with torch.device("meta"):
        model = build(config)
    conversions = getattr(module_or_config, "_weight_conversions", None)
    if conversions is not None:
        model._weight_conversions = conversions
    return model


def identity_layout(sizes: Mapping[str, tuple[tuple[int, ...], Any]], max_shard_size: int) -> HubLayout:
    """The module's names as they are (not a transformers model)."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in sizes.items()}
    plan = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)
    return HubLayout(None, {k: [k] for k in sizes}, dict(sizes), plan, module_sizes=dict(sizes))


def hub_layout(model: Any, sizes: Mapping[str, tuple[tuple[int, ...], Any]], max_shard_size: int) -> HubLayout:
    """The hub's layout of the module tensors ``sizes`` (``{key: (shape, dtype)}``) of the
    meta model ``model`` (:func:`meta_model`), as ``save_pretrained`` writes it."""
    import torch
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    arch = type(model).__name__
    meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in sizes.items()}
    try:
        kept = drop_tied_weights(meta, model)
        whole = revert_weight_conversion(model, dict(kept))
    except Exception as exc:  # transformers' own error: keys its rules expect and do not find
        raise RollCkptError(f"{arch} ({model.config.model_type}): transformers' weight conversion cannot be applied "
                            f"to the saved tensors ({type(exc).__name__}: {exc}); keys: {_listed(sorted(kept))}") from None
    outputs: dict[str, list[str]] = {k: [] for k in sizes}
    storage: dict[str, tuple[Any, int]] = {}
    one_shape: dict[str, Any] = {}
    bad: list[str] = []
    for key in kept:
        try:
            one = revert_weight_conversion(model, {key: meta[key]})
        except Exception:
            bad.append(key)
            continue
        outputs[key] = list(one)
        one_shape.update({n: t.shape for n, t in one.items()})
        if list(one) != [key]:  # converted: which outputs share storage, as the shard split sees them
            shape, dtype = sizes[key]
            stand_in = revert_weight_conversion(model, {key: torch.empty(shape, dtype=dtype)})
            storage.update({n: ((key, t.untyped_storage().data_ptr()), t.untyped_storage().nbytes())
                            for n, t in stand_in.items()})
            del stand_in
    produced: dict[str, str] = {}
    for key, outs in outputs.items():
        for n in outs:
            if n in produced or n not in whole or tuple(one_shape[n]) != tuple(whole[n].shape):
                bad.append(key)  # made from several tensors, or not as the whole conversion makes it
            produced[n] = key
    if bad or set(produced) != set(whole):
        odd = sorted(set(bad)) or sorted(set(produced) ^ set(whole))
        raise RollCkptError(f"{arch} ({model.config.model_type}): transformers' conversion rules for this architecture "
                            f"cannot be applied one tensor at a time, which roll-ckpt needs to write and read the hub's "
                            f"layout; keys: {_listed(odd)}. Save this model with save_pretrained instead")
    hub = {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}

    def size(name: str) -> int:
        if name in storage:
            return storage[name][1]
        shape, dtype = hub[name]
        n = 1
        for d in shape:
            n *= d
        return n * dtype.itemsize

    plan = split_state_dict_into_shards_factory(  # the factory save_pretrained's split calls, given names
        {n: _Name(n) for n in hub}, get_storage_size=lambda ref: size(ref.name),
        get_storage_id=lambda ref: storage[ref.name][0] if ref.name in storage else None,
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    total = int(model.num_parameters()) if index_has_total_parameters() else None
    return HubLayout(arch, outputs, hub, plan, total, model, module_sizes=dict(sizes))
