"""Every transformers API whose behaviour differs between the releases roll-ckpt supports.

transformers 4.x and 5.x write the same hub layout, but hold it differently in memory:
transformers 5 fuses an MoE layer's experts (``mlp.experts.gate_up_proj``) and turns them back
into one tensor per expert when it saves (``core_model_loading.revert_weight_conversion``);
transformers 4 holds one module per expert, so its state dict already has the hub's names,
and only renames keys for the few models with a ``_checkpoint_conversion_mapping``. The two
also find tied weights differently, and 4.53 added ``total_parameters`` to the index.

Each accessor names the releases it ran on (:data:`CHECKED_ON`, the matrix's legs). Importing
this module imports neither transformers nor torch; the accessors import transformers.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["CHECKED_ON", "version", "converts_weights", "revert_weight_conversion", "drop_tied_weights",
           "saved_config", "ATTN_AUTOSET", "as_saved", "index_has_total_parameters", "dtype_argument"]

CHECKED_ON = ("4.51", "4.57", "5.2", "5.25")
"""transformers releases the suite ran on (the legs of ``make test-matrix``; a test keeps them equal)."""


def version() -> tuple[int, int]:
    """The installed transformers' (major, minor): ``(4, 51)``... on 4.51-4.57 and 5.2-5.25."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def converts_weights() -> bool:
    """Whether this transformers holds some weights in another form than the hub's and
    converts them when it saves: 5.x (checked on 5.2, 5.25); not 4.x (4.51, 4.57)."""
    return version() >= (5, 0)


def revert_weight_conversion(model: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` (the module's names) as ``save_pretrained`` names and shapes it.

    transformers 5 (5.2, 5.25): ``core_model_loading.revert_weight_conversion``, which splits
    fused experts into the hub's one tensor per expert. transformers 4 (4.51, 4.57): the same
    tensors, renamed by the model's ``_checkpoint_conversion_mapping`` when it has one, as
    ``save_pretrained`` renames them."""
    if converts_weights():
        from transformers.core_model_loading import revert_weight_conversion as revert

        return revert(model, dict(state_dict))
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    if not mapping:
        return dict(state_dict)
    reverse = {v: k for k, v in mapping.items()}
    out = {}
    for key, value in state_dict.items():
        for pattern, replacement in reverse.items():  # save_pretrained's own loop (4.51-4.57)
            replacement = re.sub(r"\(.*\)", "", replacement.lstrip("^"))
            key, n = re.subn(pattern, replacement, key)
            if n:
                break
        out[key] = value
    return out


def drop_tied_weights(state_dict: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """``state_dict`` without the tied weights ``save_pretrained`` leaves out.

    transformers 5 (5.2, 5.25): ``modeling_utils.remove_tied_weights_from_state_dict``.
    transformers 4 (4.51, 4.57) finds them by shared storage, which a checkpoint's tensors do not
    have: the names that share one parameter in ``model`` (tied by its ``tie_weights``, on the
    meta device too) are the groups, and in each the names matching the model's
    ``_tied_weights_keys`` are left out but the last, as its ``save_pretrained`` does."""
    if converts_weights():
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return remove_tied_weights_from_state_dict(dict(state_dict), model)
    from transformers.modeling_utils import _get_tied_weight_keys

    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    patterns = _get_tied_weight_keys(model)
    dropped: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        found = 0
        for name in sorted(names):
            if any(re.search(p, name) for p in patterns) and name in state_dict:
                found += 1
                if found < len(names):
                    dropped.add(name)
    return {k: v for k, v in state_dict.items() if k not in dropped}


def saved_config(model: Any, architecture: str) -> Any:
    """A copy of ``model.config`` as ``save_pretrained`` writes it: ``architectures`` names the
    model's class; and on transformers 4.51, ``_attn_implementation_autoset`` reset as its
    ``save_pretrained`` resets it (a config.json that says it is set makes ``from_pretrained``
    keep the eager attention instead of choosing SDPA). 4.57 and 5.2-5.25 have no such field."""
    import copy

    config = copy.deepcopy(model.config)
    config.architectures = [architecture]
    if getattr(config, ATTN_AUTOSET, False):
        setattr(config, ATTN_AUTOSET, False)
    return config


ATTN_AUTOSET = "_attn_implementation_autoset"
"""transformers 4.51's flag that its ``save_pretrained`` clears and a ``config.save_pretrained``
of a live model's config writes set (4.57 and 5.2-5.25 have none)."""


def as_saved(config_json: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s values as ``save_pretrained`` writes them: without transformers
    4.51's :data:`ATTN_AUTOSET` set, which makes ``from_pretrained`` keep the eager attention
    (a config saved from a live 4.51 model by ``config.save_pretrained`` holds it); 4.57 and
    5.2-5.25 write no such key. Reads nothing of transformers."""
    if config_json.get(ATTN_AUTOSET):
        config_json = {k: v for k, v in config_json.items() if k != ATTN_AUTOSET}
    return config_json


def index_has_total_parameters() -> bool:
    """Whether ``save_pretrained``'s index holds ``metadata.total_parameters``: since 4.53
    (checked: 4.51 has not, 4.57, 5.2 and 5.25 have)."""
    return version() >= (4, 53)


def dtype_argument() -> str:
    """The name of ``from_pretrained``'s dtype argument: ``dtype`` since 4.56 (5.x warns for the
    old one), ``torch_dtype`` before (checked: 4.51; 4.57, 5.2, 5.25 take ``dtype``)."""
    return "dtype" if version() >= (4, 56) else "torch_dtype"
