"""Configuration: ROLL-compatible keys, ``${...}`` interpolation and validation.

A training config holds many keys roll-ckpt does not own (model, data, rollout...);
those are kept in :attr:`Config.extra` untouched. Keys inside ``checkpoint_config`` are
ours alone, so an unknown one there is an error that names it.
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
from .layout import RUN_RE

__all__ = ["Config", "CheckpointConfig", "BackupConfig", "StrategyConfig", "load_config"]

OFFLOAD_BACKENDS = ("local", "local_dedup")


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
    offload_backend: str = "local"
    """FSDP2 offload store: ``local`` (flat buffers per dtype) or ``local_dedup``."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other top-level key of the file, interpolated but not interpreted."""

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

_INTERP = re.compile(r"\$\{([^${}]+)\}")


def _key_path(where: str, key: Any) -> str:
    """``where.key``, the key quoted when it would not show (empty, blank or padded)."""
    name = str(key)
    if not name.strip() or name != name.strip():
        name = repr(key)
    return f"{where}.{name}" if where else name


def _lookup(root: Mapping[str, Any], dotted: str) -> Any:
    node: Any = root
    for part in dotted.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            raise KeyError(dotted)
    return node


def _interpolate(root: dict[str, Any]) -> dict[str, Any]:
    """Resolve ``${key.path}`` and ``${env:VAR}`` / ``${env:VAR,default}`` everywhere."""

    def resolve_str(s: str, where: str, stack: tuple[str, ...]) -> Any:
        def one(expr: str) -> Any:
            expr = expr.strip()
            if expr.startswith("env:"):
                name, _, default = expr[4:].partition(",")
                val = os.environ.get(name.strip())
                if val is None:
                    if default:
                        return default.strip()
                    raise ConfigError(where, f"environment variable '{name.strip()}' is not set", s,
                                      "set it, or give a default: ${env:VAR,default}")
                return val
            if expr in stack:
                raise ConfigError(where, "interpolation refers to itself", s,
                                  " -> ".join(stack + (expr,)))
            try:
                target = _lookup(root, expr)
            except KeyError:
                raise ConfigError(where, f"interpolation '${{{expr}}}' names no key", s,
                                  "a top-level or dotted key of this config, or ${env:VAR}") from None
            return resolve(target, expr, stack + (expr,))

        whole = _INTERP.fullmatch(s)
        if whole:  # keep the type of a lone reference: ${max_steps} stays an int
            return one(whole.group(1))
        return _INTERP.sub(lambda m: str(one(m.group(1))), s)

    def resolve(v: Any, where: str, stack: tuple[str, ...]) -> Any:
        if isinstance(v, str) and "${" in v:
            return resolve_str(v, where, stack)
        if isinstance(v, Mapping):
            return {k: resolve(x, _key_path(where, k), stack) for k, x in v.items()}
        if isinstance(v, list):
            return [resolve(x, f"{where}[{i}]", stack) for i, x in enumerate(v)]
        return v

    return resolve(root, "", ())


def _read_file(path: Path) -> dict[str, Any]:
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


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> Config:
    """Read (a YAML path) or take (a mapping), interpolate and validate a config."""
    if isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        raw = _read_file(Path(source))
    else:
        raise ConfigError("<config>", "must be a path to a YAML file or a mapping",
                          type(source).__name__)
    for k in raw:
        if not isinstance(k, str):
            raise ConfigError(_key_path("", k), "top-level keys must be strings", k)
    try:
        return _build(_interpolate(raw))
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
            raise ConfigError(_key_path(key, k), "option names must be strings", k)
    return dict(value)


def _reject_unknown(section: str, given: Mapping[str, Any], known: list[str]) -> None:
    for k in given:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(_key_path(section, k), f"unknown key; {hint}known keys are {', '.join(known)}")


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
    )


def _strategy(value: Any) -> StrategyConfig:
    key = "strategy_config"
    if value is None:
        value = {}
    _expect(key, value, Mapping, "a mapping")
    asv = value.get("async_save_ckpt", False)
    _expect(f"{key}.async_save_ckpt", asv, bool, "true or false")
    name = value.get("strategy_name")
    if name is not None:
        name = _string(f"{key}.strategy_name", name)
    extra = {k: v for k, v in value.items() if k not in ("async_save_ckpt", "strategy_name")}
    return StrategyConfig(async_save_ckpt=asv, strategy_name=name, extra=extra)


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


def _build(raw: dict[str, Any]) -> Config:
    known = {"exp_name", "seed", "output_dir", "checkpoint_config", "resume_from_checkpoint",
             "max_steps", "save_steps", "strategy_config", "offload_backend"}
    exp_name = raw.get("exp_name", "roll-ckpt")
    if not isinstance(exp_name, (str, int)) or isinstance(exp_name, bool):
        raise ConfigError("exp_name", "has the wrong type", exp_name, "a string")
    output_dir = _location("output_dir", raw.get("output_dir", "./output"))
    seed = raw.get("seed", 42)
    _expect("seed", seed, int, "an integer")
    offload = raw.get("offload_backend", "local")
    if offload not in OFFLOAD_BACKENDS:
        raise ConfigError("offload_backend", "is not a known offload store", offload,
                          ", ".join(OFFLOAD_BACKENDS))
    default_root = f"{output_dir.rstrip('/')}/checkpoints/{exp_name}"
    return Config(
        checkpoint_config=_checkpoint(raw.get("checkpoint_config"), default_root),
        exp_name=str(exp_name),
        seed=seed,
        output_dir=output_dir,
        resume_from_checkpoint=_resume(raw.get("resume_from_checkpoint", False)),
        max_steps=_count("max_steps", raw.get("max_steps", 0)),
        save_steps=_count("save_steps", raw.get("save_steps", 0)),
        strategy_config=_strategy(raw.get("strategy_config")),
        offload_backend=offload,
        extra={k: v for k, v in raw.items() if k not in known},
    )
