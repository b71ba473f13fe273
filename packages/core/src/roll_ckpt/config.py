"""Configuration: ROLL-compatible keys, ``${...}`` interpolation and validation.

A training config holds many keys roll-ckpt does not own (model, data, rollout...);
those are kept in :attr:`Config.extra` untouched. Keys inside ``checkpoint_config`` are
ours alone, so an unknown one there is an error that names it. Plugins own keys of their
own (``roll_ckpt_config_keys``: fsdp2's offload store): core validates them with the
plugin's record and keeps them in :attr:`Config.options`, never interpreting them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .interpolation import interpolate, key_path
from .layout import RUN_RE

__all__ = ["Config", "CheckpointConfig", "BackupConfig", "InitialLoadConfig", "StrategyConfig", "load_config",
           "read_yaml"]


@dataclass(frozen=True)
class BackupConfig:
    """A second location every committed checkpoint is replicated to."""

    type: str = "file_system"
    """Backend plugin of the replica."""
    output_dir: str = ""
    """Path or fsspec URL of the replica's root."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the replica's backend (``endpoint_url``, ``key``...)."""
    keep_local: int = 0
    """Local checkpoints kept once their replica is committed (the newest ones); 0 keeps them all.

    Only checkpoints whose replica is committed (and identical) are ever removed, and never
    the newest local one."""
    max_wait_s: float = 5.0
    """The most ``close()`` waits for replication still in flight (seconds); 0 does not wait.

    Saves never wait for replication. A copy cut off by this bound is removed from the
    replica (nothing of it is committed) and made again by the next run's first save."""
    retries: int = 3
    """Further attempts after a failed copy, with exponential backoff (1 s, 2 s, 4 s...)."""


@dataclass(frozen=True)
class InitialLoadConfig:
    """Weights a fresh start loads into the state, when no checkpoint is resumed."""

    path: str = ""
    """A local Hugging Face folder: ``model.safetensors``, or shards and ``model.safetensors.index.json``."""
    format: str = "hf"
    """The folder's format; ``hf`` is the only one."""
    key: str = "model"
    """The state key of the module the weights go into."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint_config``: where and how checkpoints are stored."""

    type: str = "file_system"
    """Backend plugin name (``roll-ckpt plugins`` lists the installed ones)."""
    output_dir: str = "./output/checkpoints"
    """Root path or fsspec URL (``s3://bucket/prefix``, ``memory://x``...)."""
    timestamp_subdir: bool = True
    """Write each run into ``<output_dir>/<YYYYmmdd-HHMMSS>/`` so runs never mix."""
    max_ckpt_to_keep: int = 0
    """Committed checkpoints kept under ``output_dir`` (newest by run, then step); 0 keeps all."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the backend (fsspec ``storage_options``)."""
    backup: BackupConfig | None = None
    """Optional second location, replicated in the background."""
    components: tuple[str, ...] | None = None
    """Parts that must all commit a step before it counts (actor, critic, pipeline...).

    Each part is saved by its own manager (``CheckpointManager(config, component=...)``)
    into ``checkpoint-<step>/<component>/``; the last part to commit commits the step."""
    run_name: str | None = None
    """The run folder to write (``YYYYmmdd-HHMMSS[-n]``, as :func:`roll_ckpt.new_run_name`
    makes); by default each manager claims a new one. Components of one job must share it:
    the driver picks it once per launch and passes it to every worker (e.g. through
    ``${env:ROLL_CKPT_RUN_NAME}``)."""
    initial_load: InitialLoadConfig | None = None
    """``{path: DIR, format: hf}``: loaded into ``state['model']`` (``key:`` another) by
    ``resume`` when there is no checkpoint to resume from; ``resume`` then returns 0.
    Checked as a resume is: missing and unexpected names, shapes; dtypes are converted."""


@dataclass(frozen=True)
class StrategyConfig:
    """``strategy_config``: the keys roll-ckpt reads; the rest are kept in ``extra``."""

    async_save_ckpt: bool = False
    """Return from ``save`` once the state is staged; write in the background."""
    strategy_name: str | None = None
    """Force a strategy (``dcp``, ``fsdp2``); by default it is chosen from the state."""
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    """A resolved, validated training config (the keys roll-ckpt uses)."""

    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    exp_name: str = "roll-ckpt"
    seed: int = 42
    output_dir: str = "./output"
    resume_from_checkpoint: bool | str = False
    """``false``; ``true`` or ``"latest"`` (newest committed under output_dir); or a checkpoint path/URL."""
    max_steps: int = 0
    save_steps: int = 0
    """Save every N steps; 0 disables periodic saves (final and manual saves still happen)."""
    strategy_config: StrategyConfig = field(default_factory=StrategyConfig)
    options: Mapping[str, Any] = field(default_factory=dict)
    """The keys plugins own (``roll_ckpt_config_keys``), validated by them, by key; each is
    also an attribute (``config.<key>``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other top-level key of the file, interpolated but not interpreted."""

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options") or {}
        if name in options:
            return options[name]
        raise AttributeError(f"'Config' object has no attribute {name!r}")

    @property
    def resume_target(self) -> str | None:
        """``None`` (fresh start), ``"latest"`` or an explicit checkpoint path."""
        r = self.resume_from_checkpoint
        if r is False:
            return None
        if r is True:
            return "latest"
        return r


# --------------------------------------------------------------------------- loading

def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds, or a ConfigError saying why it cannot be read."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist", None,
                          "a readable YAML file; see examples/") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"config file {path} cannot be read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"config file {path} is not valid YAML: {exc}".replace("\n", " ")) from None
    except RecursionError:
        raise ConfigError("<file>", f"config file {path} is nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<file>", f"config file {path} must hold a mapping at top level",
                          type(data).__name__)
    return data


def load_config(source: str | os.PathLike[str] | Mapping[str, Any], *, plugins: Any = None) -> Config:
    """Read (a YAML path) or take (a mapping), interpolate and validate a config.

    ``plugins`` (default: the process's plugin manager) provides the keys plugins own.
    """
    if isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        raw = read_yaml(Path(source))
    else:
        raise ConfigError("<config>", "must be a path to a YAML file or a mapping",
                          type(source).__name__)
    for k in raw:
        if not isinstance(k, str):
            raise ConfigError(key_path("", k), "top-level keys must be strings", k)
    if plugins is None:
        from .plugins import get_plugins

        plugins = get_plugins()
    try:
        return _build(interpolate(raw), plugins.config_keys())
    except RecursionError:
        raise ConfigError("<config>", "is nested too deeply, or its ${...} references chain too far") from None


# --------------------------------------------------------------------------- validation


def _expect(key: str, value: Any, kind: type | tuple[type, ...], allowed: str) -> Any:
    # bool is an int in Python; a YAML `true` where a count is expected is a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(key, "has the wrong type", value, allowed)
    if not isinstance(value, kind):
        raise ConfigError(key, "has the wrong type", value, allowed)
    return value


def _count(key: str, value: Any) -> int:
    _expect(key, value, int, "an integer >= 0")
    if value < 0:
        raise ConfigError(key, "must not be negative", value, "an integer >= 0")
    return value


def _string(key: str, value: Any, *, empty_ok: bool = False) -> str:
    _expect(key, value, str, "a string")
    if not empty_ok and not value.strip():
        raise ConfigError(key, "must not be empty", value, "a non-empty string")
    return value


def _location(key: str, value: Any) -> str:
    """A path or URL: a non-empty string without NUL characters (no file system takes one)."""
    _string(key, value)
    if "\x00" in value:
        raise ConfigError(key, "contains a NUL character", value, "a path or URL")
    return value


def _options(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    _expect(key, value, Mapping, "a mapping of options")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(key_path(key, k), "option names must be strings", k)
    return dict(value)


def _reject_unknown(section: str, given: Mapping[str, Any], known: list[str]) -> None:
    for k in given:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(key_path(section, k), f"unknown key; {hint}known keys are {', '.join(known)}")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _backup(value: Any) -> BackupConfig | None:
    if value is None:
        return None
    key = "checkpoint_config.backup"
    _expect(key, value, Mapping, "a mapping with type, output_dir, storage_options, keep_local, "
                                 "max_wait_s, retries")
    _reject_unknown(key, value, _field_names(BackupConfig))
    if "output_dir" not in value:
        raise ConfigError(f"{key}.output_dir", "is required when a backup is configured")
    return BackupConfig(
        type=_string(f"{key}.type", value.get("type", "file_system")),
        output_dir=_location(f"{key}.output_dir", value["output_dir"]),
        storage_options=_options(f"{key}.storage_options", value.get("storage_options")),
        keep_local=_count(f"{key}.keep_local", value.get("keep_local", 0)),
        max_wait_s=_seconds(f"{key}.max_wait_s", value.get("max_wait_s", 5.0)),
        retries=_count(f"{key}.retries", value.get("retries", 3)),
    )


def _initial_load(value: Any) -> InitialLoadConfig | None:
    if value is None:
        return None
    key = "checkpoint_config.initial_load"
    _expect(key, value, Mapping, "a mapping with path, format (hf) and optionally key")
    _reject_unknown(key, value, _field_names(InitialLoadConfig))
    if "path" not in value:
        raise ConfigError(f"{key}.path", "is required: the Hugging Face folder to load")
    path = _location(f"{key}.path", value["path"])
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(f"{key}.path", "must be a local folder (safetensors files are memory-mapped)", path,
                          "a local path; copy the folder from the store first")
    if "format" not in value:
        raise ConfigError(f"{key}.format", "is required", None, "hf")
    if value["format"] != "hf":
        raise ConfigError(f"{key}.format", "is not a format roll-ckpt loads", value["format"], "hf")
    return InitialLoadConfig(path=path.removeprefix("file://"), format="hf",
                             key=_string(f"{key}.key", value.get("key", "model")))


def _seconds(key: str, value: Any) -> float:
    _expect(key, value, (int, float), "a number of seconds >= 0")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(key, "must be a finite number >= 0", value, "a number of seconds >= 0")
    return float(value)


def _same_location(a: str, b: str) -> bool:
    def norm(u: str) -> str:
        if "://" not in u or u.startswith("file://"):
            try:
                return os.path.normpath(os.path.abspath(os.path.expanduser(u.removeprefix("file://"))))
            except ValueError:  # a user name ~x that cannot be looked up
                return u
        return u.rstrip("/")

    return norm(a) == norm(b)


def _checkpoint(value: Any, default_root: str) -> CheckpointConfig:
    key = "checkpoint_config"
    if value is None:
        value = {}
    _expect(key, value, Mapping, "a mapping (type, output_dir, ...)")
    _reject_unknown(key, value, _field_names(CheckpointConfig))
    components = value.get("components")
    if components is not None:
        _expect(f"{key}.components", components, list, "a list of component names")
        names = tuple(_string(f"{key}.components[{i}]", c) for i, c in enumerate(components))
        if len(set(names)) != len(names):
            raise ConfigError(f"{key}.components", "lists a component twice", components)
        for n in names:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", n) or n in (".", ".."):
                raise ConfigError(f"{key}.components", f"component name '{n}' is not a plain folder name",
                                  components, "letters, digits, '_', '-', '.'")
        components = names or None
    timestamp_subdir = value.get("timestamp_subdir", True)
    _expect(f"{key}.timestamp_subdir", timestamp_subdir, bool, "true or false")
    run_name = value.get("run_name")
    if run_name in ("", None):
        run_name = None
    else:
        run_name = _string(f"{key}.run_name", run_name)
        if not RUN_RE.match(run_name):
            raise ConfigError(f"{key}.run_name", "is not a run folder name", run_name,
                              "YYYYmmdd-HHMMSS or YYYYmmdd-HHMMSS-<n> (roll_ckpt.new_run_name() makes one)")
        if not timestamp_subdir:
            raise ConfigError(f"{key}.run_name", "names a run folder, but timestamp_subdir is false",
                              run_name, "timestamp_subdir: true, or no run_name")
    output_dir = _location(f"{key}.output_dir", value.get("output_dir", default_root))
    backup = _backup(value.get("backup"))
    if backup is not None and _same_location(backup.output_dir, output_dir):
        raise ConfigError(f"{key}.backup.output_dir", "is the same location as checkpoint_config.output_dir",
                          backup.output_dir, "a second location (another disk, a bucket...)")
    return CheckpointConfig(
        type=_string(f"{key}.type", value.get("type", "file_system")),
        output_dir=output_dir,
        timestamp_subdir=timestamp_subdir,
        max_ckpt_to_keep=_count(f"{key}.max_ckpt_to_keep", value.get("max_ckpt_to_keep", 0)),
        storage_options=_options(f"{key}.storage_options", value.get("storage_options")),
        backup=backup,
        components=components,
        run_name=run_name,
        initial_load=_initial_load(value.get("initial_load")),
    )


def _strategy(value: Any, owned: Mapping[str, Any]) -> StrategyConfig:
    key = "strategy_config"
    if value is None:
        value = {}
    _expect(key, value, Mapping, "a mapping")
    asv = value.get("async_save_ckpt", False)
    _expect(f"{key}.async_save_ckpt", asv, bool, "true or false")
    name = value.get("strategy_name")
    if name is not None:
        name = _string(f"{key}.strategy_name", name)
    extra = {k: v for k, v in value.items() if k not in ("async_save_ckpt", "strategy_name") and k not in owned}
    return StrategyConfig(async_save_ckpt=asv, strategy_name=name, extra=extra)


def _plugin_options(raw: Mapping[str, Any], keys: Mapping[str, Any]) -> tuple[dict[str, Any], set[str], set[str]]:
    """The values of the keys plugins own (validated by them); and which top-level and
    ``strategy_config`` keys those were."""
    options: dict[str, Any] = {}
    top: set[str] = set()
    in_strategy: set[str] = set()
    strategy = raw.get("strategy_config")
    strategy = strategy if isinstance(strategy, Mapping) else {}
    for record in keys.values():
        where, _, name = record.key.rpartition(".")
        if where not in ("", "strategy_config"):
            raise ConfigError(record.key, f"plugin {record.distribution} declares a key roll-ckpt cannot place "
                              "(a top-level key or one inside strategy_config)")
        section = strategy if where else raw
        (in_strategy if where else top).add(name)
        if name in section:
            options[name] = record.validate(record.key, section[name])
        else:
            options.setdefault(name, record.default)
    return options, top, in_strategy


def _resume(value: Any) -> bool | str:
    key = "resume_from_checkpoint"
    allowed = 'false, true, "latest", or the path/URL of a checkpoint-<step> folder'
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(key, "must not be empty", value, allowed)
        if value.strip().lower() in ("false", "no", "none", "off"):
            return False
        if value.strip().lower() in ("true", "latest"):
            return "latest" if value.strip().lower() == "latest" else True
        return value
    raise ConfigError(key, "has the wrong type", value, allowed)


def _build(raw: dict[str, Any], plugin_keys: Mapping[str, Any]) -> Config:
    options, top, in_strategy = _plugin_options(raw, plugin_keys)
    known = {"exp_name", "seed", "output_dir", "checkpoint_config", "resume_from_checkpoint",
             "max_steps", "save_steps", "strategy_config"} | top
    exp_name = raw.get("exp_name", "roll-ckpt")
    if not isinstance(exp_name, (str, int)) or isinstance(exp_name, bool):
        raise ConfigError("exp_name", "has the wrong type", exp_name, "a string")
    output_dir = _location("output_dir", raw.get("output_dir", "./output"))
    seed = raw.get("seed", 42)
    _expect("seed", seed, int, "an integer")
    default_root = f"{output_dir.rstrip('/')}/checkpoints/{exp_name}"
    return Config(
        checkpoint_config=_checkpoint(raw.get("checkpoint_config"), default_root),
        exp_name=str(exp_name),
        seed=seed,
        output_dir=output_dir,
        resume_from_checkpoint=_resume(raw.get("resume_from_checkpoint", False)),
        max_steps=_count("max_steps", raw.get("max_steps", 0)),
        save_steps=_count("save_steps", raw.get("save_steps", 0)),
        strategy_config=_strategy(raw.get("strategy_config"), in_strategy),
        options=options,
        extra={k: v for k, v in raw.items() if k not in known},
    )
