"""``checkpoint_config.hf_weights``: the model as Hugging Face files inside every checkpoint
(see :mod:`roll_ckpt.hf.export`), and ``save_only_model``.

::

    checkpoint_config:
      hf_weights: true             # or a mapping:
      # hf_weights: {key: model, config_dir: /models/qwen3, dtype: bfloat16, max_shard_size: 5GB}

``save_only_model`` (ROLL's ``strategy_config`` key, top level or a worker's) and
Megatron's ``<worker>.training_args.save_hf_model`` turn it on too, and save the weights
and the trainer state only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .values import expect, field_names, location, reject_unknown, string
from ..errors import ConfigError

__all__ = ["HFWeightsConfig", "parse_hf_weights"]

_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class HFWeightsConfig:
    """The module ``state[key]`` written as a Hugging Face folder into each checkpoint."""

    key: str = "model"
    """The state key of the module (a transformers model, plain or FSDP2)."""
    config_dir: str | None = None
    """A folder whose ``config.json``, ``generation_config.json`` and tokenizer/processor files
    are copied; by default ``config.json`` comes from the model's own config."""
    dtype: str | None = None
    """``bfloat16``, ``float16`` or ``float32``; by default the dtype each tensor was saved in."""
    max_shard_size: str | int = "5GB"
    """As ``save_pretrained``'s (the same shards)."""
    subdir: str = ""
    """A folder of the checkpoint to write them into (``huggingface``, as verl keeps them);
    empty: the checkpoint's own folder, beside ``dcp/`` (as ROLL keeps them)."""
    step_root: bool = False
    """With components: the files are published at the step's folder too
    (``checkpoint-<step>/config.json``...), where ROLL keeps the actor's model for rollout
    engines and ``from_pretrained``; one component per step may ask for it."""


def parse_hf_weights(value: Any) -> HFWeightsConfig | None:
    key = "checkpoint_config.hf_weights"
    if value is None or value is False:
        return None
    if value is True:
        return HFWeightsConfig()
    expect(key, value, Mapping, "true, false, or a mapping with key, config_dir, dtype, max_shard_size, subdir, "
                                "step_root")
    reject_unknown(key, value, field_names(HFWeightsConfig))
    config_dir = value.get("config_dir")
    if config_dir is not None:
        config_dir = location(f"{key}.config_dir", config_dir)
        if "://" in config_dir and not config_dir.startswith("file://"):
            raise ConfigError(f"{key}.config_dir", "must be a local folder", config_dir)
        config_dir = config_dir.removeprefix("file://")
    dtype = value.get("dtype")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"{key}.dtype", "is not a dtype the Hugging Face folder is written in", dtype,
                          ", ".join(_DTYPES))
    size = value.get("max_shard_size", "5GB")
    from ..runtime.units import parse_size

    try:
        parse_size(size)
    except ValueError:
        raise ConfigError(f"{key}.max_shard_size", "is not a size", size, "a size such as 5GB or 500MB") from None
    step_root = expect(f"{key}.step_root", value.get("step_root", False), bool, "true or false")
    subdir = value.get("subdir", "") or ""
    if subdir and (not isinstance(subdir, str) or not subdir.replace("_", "").replace("-", "").isalnum()):
        raise ConfigError(f"{key}.subdir", "is not a plain folder name", subdir, "e.g. huggingface")
    if subdir and step_root:
        raise ConfigError(f"{key}.subdir", "and step_root both set: files in a sub-folder are not published at "
                          "the step's folder", subdir, "one of them")
    return HFWeightsConfig(key=string(f"{key}.key", value.get("key", "model")), config_dir=config_dir,
                           dtype=dtype, max_shard_size=size, subdir=subdir, step_root=step_root)
