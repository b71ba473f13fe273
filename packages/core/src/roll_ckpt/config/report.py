"""The resolved checkpoint settings of a config, per worker, and where each came from
(``roll-ckpt config PATH``).

Each setting is one :class:`Setting`: its dotted key, its resolved value and its source --
``the file`` (with the key that set it, when it is not the setting's own), ``ROLL's default``
(with where ROLL sets it, :mod:`roll_ckpt.config.roll_defaults`), or ``roll-ckpt's default`` (a
plugin's key: that plugin's default). The first group is what every process of the job
reads; then one group per ROLL worker section and per ``checkpoint_config.components``
entry, as :meth:`Config.for_component` resolves it for that worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .roll_keys import WORKER_STRATEGY

__all__ = ["Setting", "ConfigReport", "config_report", "FILE", "ROLL_CKPT_DEFAULT"]

FILE = "the file"
ROLL_CKPT_DEFAULT = "roll-ckpt's default"

# (dotted key shown, where the file may set it (first found wins), attribute path in Config)
_TOP: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("checkpoint_config.type", ("checkpoint_config.type",), "checkpoint_config.type"),
    ("checkpoint_config.output_dir", ("checkpoint_config.output_dir",), "checkpoint_config.output_dir"),
    ("checkpoint_config.timestamp_subdir", ("checkpoint_config.timestamp_subdir",),
     "checkpoint_config.timestamp_subdir"),
    ("max_ckpt_to_keep", ("max_ckpt_to_keep", "checkpoint_config.max_ckpt_to_keep"),
     "checkpoint_config.max_ckpt_to_keep"),
    ("save_steps", ("save_steps",), "save_steps"),
    ("max_steps", ("max_steps",), "max_steps"),
    ("resume_from_checkpoint", ("resume_from_checkpoint",), "resume_from_checkpoint"),
    ("checkpoint_config.async_upload", ("checkpoint_config.async_upload",), "checkpoint_config.async_upload"),
    ("checkpoint_config.keep_local_file", ("checkpoint_config.keep_local_file",),
     "checkpoint_config.keep_local_file"),
    ("checkpoint_config.backup.output_dir", ("checkpoint_config.backup.output_dir",),
     "checkpoint_config.backup.output_dir"),
    ("checkpoint_config.backup.keep_local", ("checkpoint_config.backup.keep_local",
                                             "checkpoint_config.keep_local_file"), "checkpoint_config.backup.keep_local"),
    ("checkpoint_config.components", ("checkpoint_config.components",), "checkpoint_config.components"),
    ("checkpoint_config.hf_weights", ("checkpoint_config.hf_weights",), "checkpoint_config.hf_weights"),
    ("checkpoint_config.initial_load", ("checkpoint_config.initial_load",), "checkpoint_config.initial_load"),
)
_STRATEGY_KEYS = ("async_save_ckpt", "max_staging_bytes", "keep_staging_buffers", "save_only_model")


@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    source: str


@dataclass(frozen=True)
class ConfigReport:
    defaults: str
    """``roll`` (a ROLL pipeline config) or ``roll-ckpt``."""
    groups: dict[str, list[Setting]]
    """``"*"`` (every process), then each worker by name."""
    strategies: dict[str, str | None]
    """Each worker's ROLL ``strategy_name`` (``None``: a component that is not a ROLL worker)."""


def _lookup(root: Any, dotted: str) -> tuple[bool, Any]:
    node = root
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _attr(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return None
        node = getattr(node, part)
    return node


def _source(raw: Mapping[str, Any], where: tuple[str, ...], shown: str, roll: Mapping[str, str]) -> str:
    for dotted in where:
        found, value = _lookup(raw, dotted)
        if found and value is not None:
            return FILE if dotted == shown else f"{FILE} ({dotted})"
    for dotted in where:
        if dotted in roll:
            return f"ROLL's default ({roll[dotted]})"
    return ROLL_CKPT_DEFAULT


def _plain(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _strategy_group(cfg: Any, raw: Mapping[str, Any], worker: str | None, plugin_keys: Mapping[str, Any],
                    base: dict[str, Setting]) -> list[Setting]:
    """Settings a process of ``worker`` (None: the top level) reads from strategy_config and the plugins' keys."""
    from .roll_defaults import WORKER_ASYNC_DEFAULT, worker_async_default

    rows: list[Setting] = []
    own = (worker, *WORKER_STRATEGY) if worker else ()
    section = _lookup(raw, ".".join(own))[1] if worker else None
    section = section if isinstance(section, Mapping) else {}
    for name in _STRATEGY_KEYS:
        shown = f"strategy_config.{name}"
        value = _attr(cfg, shown)
        if worker and name == "save_only_model" and _lookup(raw, f"{worker}.training_args.save_hf_model")[1] is not None:
            source = f"{FILE} ({worker}.training_args.save_hf_model)"
        elif worker and name in section:
            source = f"{FILE} ({'.'.join(own)}.{name})"
        elif worker and name == "async_save_ckpt" and cfg.defaults == "roll" and \
                isinstance(raw.get(worker), Mapping) and worker_async_default(raw[worker]):
            source = f"ROLL's default ({WORKER_ASYNC_DEFAULT[1]})"
        elif worker:
            source = base[shown].source
        else:
            source = _source(raw, (shown,), shown, cfg.roll_defaults)
        rows.append(Setting(shown, _plain(value), source))
    for record in plugin_keys.values():
        where, _, short = record.key.rpartition(".")
        value = cfg.options.get(short, record.default)
        if worker and short in section:
            source = f"{FILE} ({'.'.join(own)}.{short})"
        elif worker:
            source = base[record.key].source
        else:
            found, given = _lookup(raw, record.key)
            source = FILE if found and given is not None else f"{record.distribution}'s default"
        rows.append(Setting(record.key, _plain(value), source))
    rows.append(Setting("async save (effective)", bool(cfg.async_save),
                        "strategy_config.async_save_ckpt or checkpoint_config.async_upload"))
    return rows


def config_report(source: Any, *, plugins: Any = None, defaults: str | None = None) -> ConfigReport:
    """The resolved checkpoint settings of ``source`` (a path, a mapping or a DictConfig)."""
    from .schema import load_config, plugin_keys, read_source
    from .roll_defaults import roll_workers

    raw = read_source(source)
    cfg = load_config(raw, plugins=plugins, defaults=defaults)
    keys = plugin_keys(plugins)
    top = [Setting(shown, _plain(_attr(cfg, attr)), _source(raw, where, shown, cfg.roll_defaults))
           for shown, where, attr in _TOP]
    top += _strategy_group(cfg, raw, None, keys, {})
    base = {s.key: s for s in top}
    groups = {"*": top}
    strategies = dict(roll_workers(raw))
    for part in cfg.checkpoint_config.components or ():
        strategies.setdefault(part, None)
    for name in strategies:
        groups[name] = _strategy_group(cfg.for_component(name, plugins=plugins), raw, name, keys, base)
    return ConfigReport(cfg.defaults, groups, strategies)
