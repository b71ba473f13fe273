"""Every configuration key, read from the config definitions themselves.

The keys are the fields of :class:`roll_ckpt.config.schema.Config` and of the section dataclasses
its fields hold (found by walking the type hints, so a new section is found too), plus the
keys plugins own (``roll_ckpt_config_keys``). For each key:

* **type**: the field's annotation as written in the source;
* **default**: what ``load_config`` actually yields when the key is unset, so a default
  computed by the validation code (``${output_dir}/checkpoints/${exp_name}``) is shown as
  computed, not as the dataclass's placeholder;
* **meaning**: the attribute docstring under the field, read from the source with ``ast``
  (a section field without one takes its class's docstring);
* **ROLL**: ROLL's name for it and ROLL's default. Worker-section overrides are found by
  probing ``Config.for_component``; the few renamed keys are listed in :data:`RENAMED`,
  each with a probe that the build runs, so a stale entry fails the build.

Nothing here is written by hand but :data:`RENAMED`, :data:`ROLL_OWN` and
:data:`SECTION_MINIMAL`, and each of those is checked against the code at build time.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import sources

# The smallest value of each optional section that load_config accepts: its keys are the
# section's required ones (checked by tests/docs/test_site.py: each one dropped is an error).
SECTION_MINIMAL: dict[str, Any] = {
    "checkpoint_config.backup": {"output_dir": "/roll-ckpt-docs/backup"},
    "checkpoint_config.initial_load": {"path": "/roll-ckpt-docs/model", "format": "hf"},
    "checkpoint_config.local": {},
    "checkpoint_config.hf_weights": {},
}

# Keys ROLL's own config files hold under the same name (roll/configs/base_config.py:
# BaseConfig; checkpoint_config's keys read by BaseConfig.__post_init__ and ROLL's FSDP2
# strategy's save_checkpoint, see roll_ckpt.config.roll_defaults).
ROLL_OWN = frozenset({"exp_name", "seed", "output_dir", "max_steps", "save_steps", "resume_from_checkpoint",
                      "checkpoint_config", "checkpoint_config.type", "checkpoint_config.output_dir",
                      "checkpoint_config.async_upload", "checkpoint_config.keep_local_file"})


def _cfg(raw: Mapping[str, Any], component: str | None = None) -> Any:
    cfg = sources.config().load_config(dict(raw), defaults="roll-ckpt")
    return cfg.for_component(component) if component else cfg


_FSDP2_WORKER = {"strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {}}}

# ROLL's names that differ from ours (roll_ckpt.config.roll_keys), each with the probe that shows it:
# ``probe()`` is true when the ROLL key does what the text says.
RENAMED: dict[str, tuple[str, Callable[[], bool]]] = {
    "checkpoint_config.max_ckpt_to_keep": (
        "`max_ckpt_to_keep` at top level (ROLL's place; both set differently is an error)",
        lambda: _cfg({"max_ckpt_to_keep": 3}).checkpoint_config.max_ckpt_to_keep == 3),
    "checkpoint_config.backup.keep_local": (
        "`checkpoint_config.keep_local_file`: `false` is `1`, `true` is `0`",
        lambda: _cfg({"checkpoint_config": {"keep_local_file": False,
                                            "backup": SECTION_MINIMAL["checkpoint_config.backup"]}}
                     ).checkpoint_config.backup.keep_local == 1),
    "strategy_config.save_only_model": (
        "Megatron's `<worker>.training_args.save_hf_model`",
        lambda: _cfg({"actor_train": {"training_args": {"save_hf_model": True}}},
                     "actor_train").strategy_config.save_only_model is True),
    "strategy_config.async_save_ckpt": (
        "`checkpoint_config.async_upload: true` makes saves asynchronous too",
        lambda: _cfg({"checkpoint_config": {"async_upload": True}}).async_save is True),
}


@dataclass(frozen=True)
class Key:
    key: str
    """Dotted key as written in a config file (``checkpoint_config.backup.retries``)."""
    section: str
    """The section it sits in (``""``: top level)."""
    kind: str
    """``key``, ``section`` (a mapping of further keys) or ``attribute`` (of the resolved
    ``Config`` only, not a key of the file)."""
    type: str
    default: str
    roll: str
    doc: str
    owner: str
    """Where it is defined: ``BackupConfig.retries``, or ``plugin <distribution>``."""


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}``: the string literal right under each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _section_class(hint: Any) -> type | None:
    """The config dataclass a field holds (``X`` or ``X | None``), else None."""
    candidates = [hint, *typing.get_args(hint)]
    found = [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if found else None


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _shown(value: Any) -> str:
    """A value as a YAML file would write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _with(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = dict(raw)
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = dict(node.get(part) or {})
        node = node[part]
    node[parts[-1]] = value
    return out


_MARKS = {"exp_name": "ROLLCKPTDOCSEXPNAME", "output_dir": "ROLLCKPTDOCSOUTPUTDIR"}


class _Defaults:
    """The loaded configs the defaults are read from."""

    def __init__(self, optional_sections: list[str]) -> None:
        missing = [s for s in optional_sections if s not in SECTION_MINIMAL]
        if missing:
            raise RuntimeError(f"docs/_hooks/config_keys.py: no SECTION_MINIMAL entry for the optional "
                               f"section(s) {missing}: add the smallest mapping load_config accepts")
        raw: dict[str, Any] = {}
        for dotted in optional_sections:
            raw = _with(raw, dotted, SECTION_MINIMAL[dotted])
        self.plain = _cfg({})
        self.filled = _cfg(raw)
        self.marked = _cfg({**raw, **_MARKS})
        roll = sources.config().load_config
        self.roll_bare = roll({}, defaults="roll").roll_defaults
        self.roll_filled = roll(raw, defaults="roll")

    def default(self, dotted: str, section: str, optional_section: bool) -> str:
        if section in SECTION_MINIMAL and dotted.rpartition(".")[2] in (SECTION_MINIMAL[section] or {}):
            return "(required)"
        if optional_section:
            return f"`{_shown(_get(self.plain, dotted))}` (off)"
        value = _get(self.filled, dotted)
        marked = _get(self.marked, dotted)
        if dotted not in _MARKS and marked != value:
            text = str(marked)
            for name, mark in _MARKS.items():
                text = text.replace(mark, "${" + name + "}")
            return f"`{text}`"
        return f"`{_shown(value)}`"

    def roll(self, dotted: str) -> str | None:
        where = self.roll_filled.roll_defaults.get(dotted)
        if where is None:
            return None
        note = "" if dotted in self.roll_bare else ", with a `backup`"
        return f"`{_shown(_get(self.roll_filled, dotted))}`{note} ({where})"


def _is_attribute(cls: type, prefix: str, name: str, default: Any) -> bool:
    """A field of a dataclass that keeps unknown keys in ``extra`` (Config, StrategyConfig)
    is a key of the file only if setting it keeps it out of that ``extra``."""
    if "extra" not in {f.name for f in dataclasses.fields(cls)}:
        return False
    cfg = _cfg(_with({}, prefix + name, _plain(default)))
    holder = _get(cfg, prefix.rstrip(".")) if prefix else cfg
    return name in holder.extra


def _worker_override(name: str, default: Any) -> bool:
    """Whether a ROLL worker's ``strategy_args.strategy_config.<name>`` sets it for that worker."""
    probe = (not default) if isinstance(default, bool) else (default + 1) if isinstance(default, int) else "dcp"
    raw = {"w": {"strategy_args": {"strategy_name": "x", "strategy_config": {name: probe}}}}
    try:
        return _get(_cfg(raw, "w"), f"strategy_config.{name}") == probe
    except sources.config_error():  # validated there: read there
        return True


def _worker_path(name: str) -> str:
    return "`<worker>." + ".".join(sources.worker_strategy()) + f".{name}`"


def config_keys() -> list[Key]:
    """Every key of the config, sections first within their parent, then plugins' keys."""
    cfgmod = sources.config()
    sections: list[tuple[type, str, bool]] = []  # (class, prefix, optional)

    def collect(cls: type, prefix: str, optional: bool) -> None:
        sections.append((cls, prefix, optional))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            sub = _section_class(hints[f.name])
            if sub is not None:
                collect(sub, f"{prefix}{f.name}.", _optional(hints[f.name]))

    collect(cfgmod.Config, "", False)
    defaults = _Defaults([p.rstrip(".") for _, p, opt in sections if opt])
    for dotted, (_, probe) in RENAMED.items():
        if not probe():
            raise RuntimeError(f"docs/_hooks/config_keys.py: RENAMED[{dotted!r}] no longer does what it says")
    keys: list[Key] = []
    for cls, prefix, optional in sections:
        hints = typing.get_type_hints(cls)
        docs = attribute_docs(cls)
        section = prefix.rstrip(".")
        for f in dataclasses.fields(cls):
            dotted = prefix + f.name
            sub = _section_class(hints[f.name])
            plain_default = _get(defaults.plain, dotted) if not optional else None
            kind = "section" if sub else "attribute" if _is_attribute(cls, prefix, f.name, plain_default) else "key"
            doc = docs.get(f.name) or (inspect.cleandoc(sub.__doc__ or "") if sub else "")
            roll = []
            if dotted in ROLL_OWN:
                roll.append("the same key")
            if section == "strategy_config" and kind == "key" and _worker_override(f.name, plain_default):
                roll.append(_worker_path(f.name) + " (for that worker's managers)")
            if dotted in RENAMED:
                roll.append(RENAMED[dotted][0])
            roll_default = defaults.roll(dotted)
            if dotted == "strategy_config.async_save_ckpt":
                value, where = sources.roll_defaults().WORKER_ASYNC_DEFAULT
                roll_default = f"`{_shown(value)}` ({where})"
            if roll_default:
                roll.append("ROLL's default: " + roll_default)
            keys.append(Key(
                key=dotted, section=section, kind=kind, type="section" if sub else str(f.type),
                default="—" if sub and not _optional(hints[f.name]) else
                defaults.default(dotted, section, sub is not None),
                roll="; ".join(roll) or "—", doc=doc, owner=f"{cls.__name__}.{f.name}"))
    keys += _s3_storage_options()
    for record in sources.plugin_config_keys().values():
        short = record.key.rpartition(".")[2]
        keys.append(Key(
            key=record.key, section="plugins", kind="key", type="(validated by the plugin)",
            default=f"`{_shown(record.default)}`", roll=_worker_path(short) + " (for that worker's managers)",
            doc=record.description, owner=f"plugin {record.distribution}"))
    return keys


STORAGE_OPTIONS = "checkpoint_config.storage_options"


def _s3_storage_options() -> list[Key]:
    """The ``storage_options`` keys the ``file_system`` backend reads on ``s3://``: the fields of
    its retry policy (the backend reads exactly the keys named in ``RETRY_KEYS``)."""
    policy = sources.s3_retry_policy()
    names = [f.name for f in dataclasses.fields(policy)]
    read = list(inspect.getmodule(policy).RETRY_KEYS)
    if names != read:
        raise RuntimeError(f"{policy.__qualname__}'s fields {names} are not the keys the backend reads {read}")
    docs = attribute_docs(policy)
    return [Key(key=f"{STORAGE_OPTIONS}.{f.name}", section=STORAGE_OPTIONS, kind="key", type=str(f.type),
                default=f"`{_shown(f.default)}`", roll="—", doc=docs.get(f.name, ""),
                owner=f"{policy.__name__}.{f.name}") for f in dataclasses.fields(policy)]
