"""Configuration: ROLL's keys, ``${...}`` interpolation (OmegaConf) and validation.

A training config holds many keys roll-ckpt does not own (model, data, rollout, ROLL's
worker sections...); those are kept in :attr:`Config.extra` untouched. Keys inside
``checkpoint_config`` are ours alone, so an unknown one there is an error that names it.
Plugins own keys of their own (``roll_ckpt_config_keys``: fsdp2's offload store): core
validates them with the plugin's record and keeps them in :attr:`Config.options`, never
interpreting them. :meth:`Config.for_component` applies a ROLL worker section's
``strategy_args.strategy_config`` over the top-level one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .values import (choice, count, expect, nice, field_names, location, options as options_map, reject_unknown, seconds,
                            staging_budget, string)
from .backup import BackupConfig, parse_backup, same_location
from .file import read_config_file, read_yaml
from ..errors import ConfigError
from .interpolation import interpolate, key_path
from ..format.layout import NAME_FORMATS, RUN_RE
from .hf_weights import HFWeightsConfig, parse_hf_weights
from .initial_load import InitialLoadConfig, parse_initial_load
from .local import LocalTierConfig, parse_local
from ..runtime.preemption import PreemptionConfig, parse_preemption
from .roll_defaults import ROLL, apply_roll_defaults, recognize
from .roll_keys import keep_local_file, log_keys_without_effect, max_ckpt_to_keep, worker_overrides

__all__ = ["Config", "CheckpointConfig", "BackupConfig", "InitialLoadConfig", "LocalTierConfig", "PreemptionConfig",
           "StrategyConfig", "load_config", "read_yaml"]  # read_yaml: config_file's, kept importable from here


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint_config``: where and how checkpoints are stored."""

    type: str = "file_system"
    """Backend plugin name (``roll-ckpt plugins`` lists the installed ones)."""
    output_dir: str = "./output/checkpoints"
    """Root path or fsspec URL (``s3://bucket/prefix``, ``memory://x``...)."""
    timestamp_subdir: bool = True
    """Write each run into ``<output_dir>/<YYYYmmdd-HHMMSS>/`` so runs never mix."""
    name_format: str = "checkpoint-{step}"
    """How each checkpoint's folder is named: ``checkpoint-{step}`` (roll-ckpt's, ROLL's),
    ``global_step_{step}`` (verl's) or ``step-{step}`` (torchtitan's). Every listing, ``latest``
    and retention find all three."""
    max_ckpt_to_keep: int = 0
    """Committed checkpoints kept under ``output_dir`` (newest by run, then step); 0 keeps all.

    ROLL's top-level ``max_ckpt_to_keep`` sets it too (both set differently is an error)."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the backend (fsspec ``storage_options``)."""
    backup: BackupConfig | None = None
    """Optional second location, replicated in the background."""
    components: tuple[str, ...] | None = None
    """Parts that must all commit a step before it counts (actor, critic, pipeline...).

    Each part is saved by its own manager (``CheckpointManager(config, component=...)``)
    into ``checkpoint-<step>/<component>/``; the last part to commit commits the step."""
    commit_steps: bool = True
    """With components: ``true``, the last part to commit commits the step; ``false``, something
    that knows when a step is whole commits it, with ``manager.commit_step`` (a framework
    integration: verl's trainer decides which roles a step has)."""
    beside: tuple[str, ...] = ()
    """Names (glob patterns) of files another program writes into a checkpoint's folder once it
    is committed (verl's dataloader state, ``data_*.pt``): ``verify`` names them as not covered by
    the manifest instead of calling the checkpoint damaged; retention removes them with it; a copy
    (``roll-ckpt copy``, a backup) does not carry them."""
    run_name: str | None = None
    """The run folder to write (``YYYYmmdd-HHMMSS[-n]``, as :func:`roll_ckpt.new_run_name`
    makes); by default each manager claims a new one. Components of one job must share it:
    the driver picks it once per launch and passes it to every worker (e.g. through
    ``${env:ROLL_CKPT_RUN_NAME}``)."""
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    """What a preemption signal does."""
    on_save_error: str = "raise"
    """``raise`` (a failed save raises) or ``warn``: a failed periodic save is logged and
    counted in ``manager.stats.failed``, and training goes on; final and preemption saves
    always raise."""
    on_unusable_checkpoint: str = "warn"
    """What a resume of ``latest`` (or ``true``) does with the folders it passes over: a save
    that never committed, a damaged one, another framework's that was never finished, one no
    installed format reads. ``warn``: a WARNING names each, with the reason, and the resume
    takes the newest usable checkpoint (0, a fresh start, when there is none). ``raise``:
    the resume stops with :class:`~roll_ckpt.errors.CheckpointNotFoundError` naming them --
    for jobs that must never start over or go back. Only folders newer than the checkpoint
    resumed from are passed over."""
    async_upload: bool = False
    """ROLL's key. roll-ckpt writes straight to ``output_dir``: that write is the upload, so
    ``true`` makes every save asynchronous, as ``strategy_config.async_save_ckpt: true`` does
    (replication to a ``backup`` always runs in the background). ``false`` changes nothing
    (logged)."""
    keep_local_file: bool | None = None
    """ROLL's key, meaningful with a ``backup``: ``false`` keeps only the newest local
    checkpoint once replicated (``backup.keep_local: 1``), ``true`` keeps them all
    (``backup.keep_local: 0``). Without a backup there is no local copy apart from
    ``output_dir`` itself, and it has no effect (logged). ``None``: not set."""
    background_nice: int = 10
    """Nice value (0-19) of the threads that write asynchronous saves and replicate to the
    backup: the training loop's threads win the CPU when both want it, and the write uses
    what the loop leaves idle (it takes longer under a CPU-bound loop). 0 keeps them at the
    loop's priority."""
    pause_gc: bool = True
    """Hold Python's cyclic garbage collector off while a save stages the state and while
    DCP plans, gathers and writes its metadata (not while it writes the data): DCP
    allocates ~20 short-lived objects per tensor, which on a training process's heap set off
    full collections of 150-250 ms, in ``save`` or in the writer thread (holding the GIL the
    loop needs). Nothing is touched when the process disabled the collector itself.
    ``false``: leave it running."""
    verify_before_load: bool = True
    """``true``: resume checks every file it loads before any of the state changes (a
    damaged checkpoint leaves the state untouched; a checkpoint larger than the page cache
    is read twice). ``false``: one pass, each 8 MiB piece checked just before its bytes are
    used, memory bounded; damage then raises ``PartlyLoadedError`` with the state partly
    loaded (resume falls back to a backup replica when there is one, which overwrites it)."""
    incremental: bool = True
    """Write only the data files that changed since the newest committed checkpoint of the
    run; each unchanged one (proved by its checksum) is taken over from it by the storage: a
    hard link on POSIX disks, a server-side copy on S3, a plain copy elsewhere. Every
    checkpoint stays whole (:mod:`roll_ckpt.dcp.writer`). ``false``: write every file."""
    collective_timeout_s: float = 600.0
    """The longest any collective of a save, commit or resume waits for the other ranks (a
    rank stopped or cut off): then every waiting rank raises ``CollectiveTimeoutError``."""
    initial_load: InitialLoadConfig | None = None
    """``{path: DIR, format: hf}``: loaded into ``state['model']`` (``key:`` another) by
    ``resume`` when there is no checkpoint to resume from; ``resume`` then returns 0.
    Checked as a resume is: missing and unexpected names, shapes; dtypes are converted."""
    local: LocalTierConfig | None = None
    """The fast recovery tier (node-local checkpoints and peer replicas); ``None``: off."""
    hf_weights: HFWeightsConfig | None = None
    """The model as Hugging Face files in every checkpoint (beside ``dcp/``, as ROLL writes them),
    written off the loop (:mod:`roll_ckpt.hf.export`); ``true`` or a mapping."""


@dataclass(frozen=True)
class StrategyConfig:
    """``strategy_config``: the keys roll-ckpt reads; the rest are kept in ``extra``."""

    async_save_ckpt: bool = False
    """Return from ``save`` once the state is staged; write in the background."""
    strategy_name: str | None = None
    """Force a strategy (``dcp``, ``fsdp2``); by default it is chosen from the state."""
    max_staging_bytes: int = 0
    """The most regular staging holds at once (``2GiB``, ``512MB`` or bytes); 0: no bound. An
    asynchronous save then stages in waves and returns once the last is staged."""
    keep_staging_buffers: bool = False
    """Keep the regular staging buffers allocated between saves (the state's size in host memory
    for the whole job; nothing allocated at a save). False: their memory is freed once a save is
    written and made again off the loop before the next save the manager knows of."""
    save_only_model: bool = False
    """ROLL's key: checkpoints hold the model's weights (``dcp/`` and the HF files) and the trainer state
    only; a resume loads the weights and starts the optimizer afresh (with a warning)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other key of ``strategy_config`` (ROLL's engine settings), kept but not read."""


@dataclass(frozen=True)
class Config:
    """A resolved, validated training config (the keys roll-ckpt uses)."""

    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    exp_name: str = "roll-ckpt"
    """The experiment's name: the default ``checkpoint_config.output_dir`` and ``local.dir`` end with it."""
    seed: int = 42
    """The job's seed (an integer), for the job to read (``cfg.seed``); roll-ckpt seeds nothing with it."""
    output_dir: str = "./output"
    """The job's output folder (path or URL): the default ``checkpoint_config.output_dir`` is below it."""
    resume_from_checkpoint: bool | str = False
    """``false``; ``true`` or ``"latest"`` (newest committed under output_dir); or a checkpoint path/URL."""
    max_steps: int = 0
    """The training loop's last step (an integer >= 0), for the loop to read: ``cfg.max_steps``."""
    save_steps: int = 0
    """Save every N steps; 0 disables periodic saves (final and manual saves still happen)."""
    strategy_config: StrategyConfig = field(default_factory=StrategyConfig)
    options: Mapping[str, Any] = field(default_factory=dict)
    """The keys plugins own (``roll_ckpt_config_keys``), validated by them, by key; each is
    also an attribute (``config.<key>``)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other top-level key of the file, interpolated but not interpreted."""
    defaults: str = "roll-ckpt"
    """Whose defaults filled the unset keys: ``roll`` (a ROLL pipeline config) or ``roll-ckpt``."""
    roll_defaults: Mapping[str, str] = field(default_factory=dict)
    """The keys that took ROLL's default, with where ROLL sets it (:mod:`roll_ckpt.config.roll_defaults`)."""

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options") or {}
        if name in options:
            return options[name]
        raise AttributeError(f"'Config' object has no attribute {name!r}")

    @property
    def async_save(self) -> bool:
        """Whether periodic saves are asynchronous: ``strategy_config.async_save_ckpt`` (a
        worker's own, after :meth:`for_component`) or ``checkpoint_config.async_upload``."""
        return self.strategy_config.async_save_ckpt or self.checkpoint_config.async_upload
    def for_component(self, name: str, *, plugins: Any = None) -> "Config":
        """This config as the processes of component ``name`` (a ROLL worker section such as
        ``actor_train``) see it: ``<name>.strategy_args.strategy_config.async_save_ckpt`` and
        the plugins' keys there (fsdp2's offload store...) win over the top-level ones.

        Other keys of the worker's ``strategy_config`` (Megatron's parallel sizes...) and its
        ``strategy_args.strategy_name`` (ROLL's engine, not a roll-ckpt strategy) are not read.
        A config without that section is returned unchanged.
        """
        strategy, opts = worker_overrides(self.extra, name, self.strategy_config, self.options,
                                          plugin_keys(plugins), roll=self.defaults == ROLL)
        return dataclasses.replace(self, strategy_config=strategy, options=opts)

    @property
    def resume_target(self) -> str | None:
        """``None`` (fresh start), ``"latest"`` or an explicit checkpoint path."""
        r = self.resume_from_checkpoint
        if r is False:
            return None
        if r is True:
            return "latest"
        return r


def load_config(source: str | os.PathLike[str] | Mapping[str, Any], *, plugins: Any = None,
                defaults: str | None = None) -> Config:
    """Read (a YAML path; a Hydra ``defaults:`` list composed by Hydra, :mod:`roll_ckpt.config.file`)
    or take (a mapping, an OmegaConf ``DictConfig`` as Hydra composes it), interpolate and
    validate a config.

    ``defaults``: whose defaults fill the unset keys: ``"roll"`` (ROLL's,
    :mod:`roll_ckpt.config.roll_defaults`), ``"roll-ckpt"`` (ours), or ``None``: ROLL's for a ROLL
    pipeline config, ours otherwise. ``plugins`` (default: the process's plugin manager)
    provides the keys plugins own. Keys that have no effect here are named in one log line each.
    """
    raw = read_source(source)
    which = recognize(raw, defaults)
    given, applied = (apply_roll_defaults(raw) if which == ROLL else (raw, {}))
    try:
        cfg = _build(interpolate(given), plugin_keys(plugins))
    except RecursionError:
        raise ConfigError("<config>", "is nested too deeply, or its ${...} references chain too far") from None
    cfg = dataclasses.replace(cfg, defaults=which, roll_defaults=applied)
    log_keys_without_effect(cfg, raw)
    return cfg


def read_source(source: Any) -> dict[str, Any]:
    """The raw (not yet interpolated) mapping of a path, a mapping or a DictConfig."""
    if _is_omegaconf(source):
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(source, resolve=False)  # resolved later, with errors naming the key
    elif isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        raw = read_config_file(Path(source))
    else:
        raise ConfigError("<config>", "must be a path to a YAML file or a mapping",
                          type(source).__name__)
    for k in raw:
        if not isinstance(k, str):
            raise ConfigError(key_path("", k), "top-level keys must be strings", k)
    if isinstance(raw.get("defaults"), list):  # a mapping (a file's is composed by read_config_file)
        raise ConfigError("defaults", "is a Hydra defaults list: roll-ckpt reads one composed config, not the "
                          "files it lists", None, "compose it with Hydra first: pass the DictConfig your @hydra.main "
                          "function gets (or hydra.compose(...)), or the path of the file (composed with the "
                          "hydra extra)")
    return raw


def _is_omegaconf(source: Any) -> bool:
    omegaconf = sys.modules.get("omegaconf")  # a DictConfig exists only once omegaconf is imported
    return omegaconf is not None and isinstance(source, omegaconf.DictConfig)


def plugin_keys(plugins: Any) -> Mapping[str, Any]:
    """The config keys the plugins declare (``plugins``, or the installed ones when ``None``)."""
    if plugins is None:
        from ..plugins import get_plugins

        plugins = get_plugins()
    return plugins.config_keys()


def _patterns(key: str, value: Any) -> tuple[str, ...]:
    expect(key, value, list, "a list of file names or glob patterns, e.g. [data.pt, data_*.pt]")
    out = tuple(string(f"{key}[{i}]", v) for i, v in enumerate(value))
    for i, v in enumerate(out):
        if "/" in v or v in (".", "..") or v.startswith("."):
            raise ConfigError(f"{key}[{i}]", "is not a file name in the checkpoint's folder", v,
                              "a plain name or glob pattern, e.g. data_*.pt")
    return out


def _checkpoint(value: Any, default_root: str, raw: Mapping[str, Any]) -> CheckpointConfig:
    key = "checkpoint_config"
    if value is None:
        value = {}
    expect(key, value, Mapping, "a mapping (type, output_dir, ...)")
    reject_unknown(key, value, field_names(CheckpointConfig))
    components = value.get("components")
    if components is not None:
        expect(f"{key}.components", components, list, "a list of component names")
        names = tuple(string(f"{key}.components[{i}]", c) for i, c in enumerate(components))
        if len(set(names)) != len(names):
            raise ConfigError(f"{key}.components", "lists a component twice", components)
        for n in names:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", n) or n in (".", ".."):
                raise ConfigError(f"{key}.components", f"component name '{n}' is not a plain folder name",
                                  components, "letters, digits, '_', '-', '.'")
        components = names or None
    timestamp_subdir = value.get("timestamp_subdir", True)
    expect(f"{key}.timestamp_subdir", timestamp_subdir, bool, "true or false")
    run_name = value.get("run_name")
    if run_name in ("", None):
        run_name = None
    else:
        run_name = string(f"{key}.run_name", run_name)
        if not RUN_RE.match(run_name):
            raise ConfigError(f"{key}.run_name", "is not a run folder name", run_name,
                              "YYYYmmdd-HHMMSS or YYYYmmdd-HHMMSS-<n> (roll_ckpt.new_run_name() makes one)")
        if not timestamp_subdir:
            raise ConfigError(f"{key}.run_name", "names a run folder, but timestamp_subdir is false",
                              run_name, "timestamp_subdir: true, or no run_name")
    output_dir = location(f"{key}.output_dir", value.get("output_dir", default_root))
    backup = parse_backup(value.get("backup"))
    if backup is not None and same_location(backup.output_dir, output_dir):
        raise ConfigError(f"{key}.backup.output_dir", "is the same location as checkpoint_config.output_dir",
                          backup.output_dir, "a second location (another disk, a bucket...)")
    keep_local, backup = keep_local_file(value, backup)
    return CheckpointConfig(
        type=string(f"{key}.type", value.get("type", "file_system")),
        output_dir=output_dir,
        timestamp_subdir=timestamp_subdir,
        name_format=choice(f"{key}.name_format", value.get("name_format", "checkpoint-{step}"), NAME_FORMATS),
        max_ckpt_to_keep=max_ckpt_to_keep(raw, value),
        storage_options=options_map(f"{key}.storage_options", value.get("storage_options")),
        backup=backup,
        components=components,
        commit_steps=expect(f"{key}.commit_steps", value.get("commit_steps", True), bool, "true or false"),
        beside=_patterns(f"{key}.beside", value.get("beside", [])),
        run_name=run_name,
        preemption=parse_preemption(value.get("preemption")),
        on_save_error=choice(f"{key}.on_save_error", value.get("on_save_error", "raise"), ("raise", "warn")),
        on_unusable_checkpoint=choice(f"{key}.on_unusable_checkpoint", value.get("on_unusable_checkpoint", "warn"),
                                      ("warn", "raise")),
        async_upload=expect(f"{key}.async_upload", value.get("async_upload", False), bool, "true or false"),
        background_nice=nice(f"{key}.background_nice", value.get("background_nice", 10)),
        pause_gc=expect(f"{key}.pause_gc", value.get("pause_gc", True), bool, "true or false"),
        verify_before_load=expect(f"{key}.verify_before_load", value.get("verify_before_load", True), bool,
                                  "true or false"),
        keep_local_file=keep_local,
        incremental=expect(f"{key}.incremental", value.get("incremental", True), bool, "true or false"),
        collective_timeout_s=seconds(f"{key}.collective_timeout_s", value.get("collective_timeout_s", 600.0)),
        initial_load=parse_initial_load(value.get("initial_load")),
        local=parse_local(value.get("local"), str(raw.get("exp_name", "roll-ckpt"))),
        hf_weights=parse_hf_weights(value.get("hf_weights")),
    )


def _strategy(value: Any, owned: Mapping[str, Any]) -> StrategyConfig:
    key = "strategy_config"
    if value is None:
        value = {}
    expect(key, value, Mapping, "a mapping")
    asv = value.get("async_save_ckpt", False)
    expect(f"{key}.async_save_ckpt", asv, bool, "true or false")
    name = value.get("strategy_name")
    if name is not None:
        name = string(f"{key}.strategy_name", name)
    budget = staging_budget(f"{key}.max_staging_bytes", value.get("max_staging_bytes", 0))
    only = expect(f"{key}.save_only_model", value.get("save_only_model", False), bool, "true or false")
    keep = expect(f"{key}.keep_staging_buffers", value.get("keep_staging_buffers", False), bool, "true or false")
    ours = ("async_save_ckpt", "strategy_name", "max_staging_bytes", "keep_staging_buffers", "save_only_model")
    extra = {k: v for k, v in value.items() if k not in ours and k not in owned}
    return StrategyConfig(async_save_ckpt=asv, strategy_name=name, max_staging_bytes=budget,
                          keep_staging_buffers=keep, save_only_model=only, extra=extra)


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
        place = strategy if where else raw
        (in_strategy if where else top).add(name)
        if name in place:
            options[name] = record.validate(record.key, place[name])
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
             "max_steps", "save_steps", "max_ckpt_to_keep", "strategy_config"} | top
    exp_name = raw.get("exp_name", "roll-ckpt")
    if not isinstance(exp_name, (str, int)) or isinstance(exp_name, bool):
        raise ConfigError("exp_name", "has the wrong type", exp_name, "a string")
    output_dir = location("output_dir", raw.get("output_dir", "./output"))
    seed = raw.get("seed", 42)
    expect("seed", seed, int, "an integer")
    default_root = f"{output_dir.rstrip('/')}/checkpoints/{exp_name}"
    return Config(
        checkpoint_config=_checkpoint(raw.get("checkpoint_config"), default_root, raw),
        exp_name=str(exp_name),
        seed=seed,
        output_dir=output_dir,
        resume_from_checkpoint=_resume(raw.get("resume_from_checkpoint", False)),
        max_steps=count("max_steps", raw.get("max_steps", 0)),
        save_steps=count("save_steps", raw.get("save_steps", 0)),
        strategy_config=_strategy(raw.get("strategy_config"), in_strategy),
        options=options,
        extra={k: v for k, v in raw.items() if k not in known},
    )
