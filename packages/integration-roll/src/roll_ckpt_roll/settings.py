"""The roll-ckpt configuration of one ROLL component, from ROLL's pipeline config object.

Every ROLL process holds the same pipeline config (the driver's, handed to each worker's
``initialize``). ROLL has already appended the launch's timestamp to
``checkpoint_config.output_dir`` (``roll/configs/base_config.py``); that folder becomes
roll-ckpt's run folder (``run_name``), so every component of a launch writes the same one
and ``latest`` looks across every launch's, ROLL's own checkpoints included.

Only the keys roll-ckpt reads are taken from the object: ``exp_name``, ``seed``, ``output_dir``,
``max_ckpt_to_keep``, ``save_steps``, ``max_steps``, ``checkpoint_config`` (``type``,
``output_dir``, ``async_upload``, ``keep_local_file`` and any roll-ckpt key), and each
component's ``strategy_args`` (``strategy_name``, ``strategy_config``: ``async_save_ckpt``,
``save_only_model``, ``offload_backend``...). ROLL's own engine settings stay ROLL's.
"""

from __future__ import annotations

from typing import Any

from roll_ckpt import Config, load_config
from roll_ckpt.plugin import ConfigError

__all__ = ["config_for", "checkpoint_root"]

_TOP = ("exp_name", "seed", "output_dir", "max_ckpt_to_keep", "save_steps", "max_steps")


def _checkpoint_config(pipeline_config: Any) -> dict[str, Any] | None:
    cc = getattr(pipeline_config, "checkpoint_config", None)
    if not cc or not cc.get("type"):
        return None
    return dict(cc)


def checkpoint_root(pipeline_config: Any) -> tuple[str, str] | None:
    """``(root, run_name)``: ROLL's ``checkpoint_config.output_dir`` without the launch's
    timestamp, and that timestamp; ``None`` when ROLL is not configured to checkpoint."""
    from roll_ckpt.plugin import RUN_RE

    cc = _checkpoint_config(pipeline_config)
    if cc is None:
        return None
    out = str(cc.get("output_dir", "")).rstrip("/")
    root, _, run = out.rpartition("/")
    if not RUN_RE.match(run):
        raise ConfigError("checkpoint_config.output_dir", "does not end with the launch's timestamp folder ROLL "
                          "adds to it (roll/configs/base_config.py), so the components of this launch cannot "
                          "agree on a run folder", out, "a pipeline config built by ROLL (its __post_init__)")
    return root or "/", run


def config_for(pipeline_config: Any, components: list[str], *, hf_step_root: bool | None = None) -> Config:
    """The roll-ckpt config of a manager for one of ``components`` (every part it knows of).

    ``hf_step_root``: the component's Hugging Face files are written into its part (``False``)
    and published at the step's folder too (``True``), as ROLL keeps the actor's there;
    ``None``: none (the driver)."""
    cc = _checkpoint_config(pipeline_config)
    if cc is None:
        raise ConfigError("checkpoint_config.type", "is not set, so ROLL saves no checkpoints", None,
                          "checkpoint_config: {type: file_system, output_dir: ...}")
    root, run = checkpoint_root(pipeline_config)  # type: ignore[misc]
    cc.update(output_dir=root, run_name=run, components=list(components))
    if hf_step_root is not None:
        cc["hf_weights"] = {**(cc.get("hf_weights") or {}), "step_root": hf_step_root}
    raw: dict[str, Any] = {k: getattr(pipeline_config, k) for k in _TOP if getattr(pipeline_config, k, None) is not None}
    raw.update(checkpoint_config=cc, resume_from_checkpoint=False)
    for name in components:
        worker = getattr(pipeline_config, name, None)
        args = getattr(worker, "strategy_args", None)
        if args is None:
            continue
        raw[name] = {"strategy_args": {"strategy_name": getattr(args, "strategy_name", None),
                                       "strategy_config": dict(getattr(args, "strategy_config", None) or {})}}
    return load_config(raw)
