"""Find, load and query roll-ckpt plugins.

Plugins are found through the entry-point group ``roll_ckpt``. Loading an entry point
only imports the plugin's small ``plugin`` module; whatever is heavy is imported by the
record's factory when it is used.

Environment:

``ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD=1``
    do not load entry points (core's own hooks stay); ``ROLL_CKPT_PLUGINS`` can then
    name the ones to load anyway.
``ROLL_CKPT_PLUGINS=a,b``
    with autoload disabled, load just these entry points.
``ROLL_CKPT_BLOCKED_PLUGINS=a,b``
    never load these entry points (by entry-point name or distribution name).
"""

from __future__ import annotations

import difflib
import os
import threading
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, Iterable, TypeVar

import pluggy

from . import hookspecs
from .contracts import (BackendRecord, CommandRecord, ConfigKeyRecord, FormatRecord, StagingPolicy,
                        StagingPolicyRecord, StrategyRecord)
from .errors import PluginError, UnknownPluginError

__all__ = ["Plugins", "BrokenPlugin", "get_plugins", "KNOWN_EXTRAS"]

ENTRY_POINT_GROUP = "roll_ckpt"

# Names of plugins roll-ckpt ships, with the extra that installs each: the unknown-type
# error can then say what to install even when nothing provides the name.
KNOWN_EXTRAS = {
    "file_system": 'pip install "roll-ckpt[fs]"',
    "fsdp2": 'pip install "roll-ckpt[fsdp2]"',
    "roll": 'pip install "roll-ckpt[roll]"',
}

R = TypeVar("R", BackendRecord, StrategyRecord, StagingPolicyRecord, ConfigKeyRecord, CommandRecord, FormatRecord)


_KIND_NAMES: dict[type, str] = {BackendRecord: "backend", StrategyRecord: "strategy",
                                StagingPolicyRecord: "staging policy", ConfigKeyRecord: "config key",
                                CommandRecord: "command", FormatRecord: "checkpoint format"}


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that failed to load or whose registration hook raised."""

    name: str
    distribution: str
    error: str


def _env_list(var: str) -> set[str]:
    return {p.strip() for p in os.environ.get(var, "").split(",") if p.strip()}


def _truthy(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no")


class Plugins:
    """A pluggy manager with roll-ckpt's hooks plus typed access to the records."""

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.broken: list[BrokenPlugin] = []
        self._dist_of: dict[str, str] = {}
        self._records: dict[str, dict[str, Any]] = {}
        self.hook: Any = self.pm.hook
        """The hooks, to call (``plugins.hook.roll_ckpt_save(save=...)``): pluggy's relay, which
        a plugin registered later joins."""
        self.generation = 0
        """Counts the changes to the registered plugins (:meth:`register`, :meth:`unregister`):
        what is derived from them is derived again when it moves."""
        from . import _builtin

        self.pm.register(_builtin, name="core")
        self._dist_of["core"] = "roll-ckpt-core"
        if autoload is None:
            autoload = not _truthy("ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD")
        self._load_entry_points(autoload)

    # ------------------------------------------------------------------ loading

    def _load_entry_points(self, autoload: bool) -> None:
        blocked = _env_list("ROLL_CKPT_BLOCKED_PLUGINS")
        wanted = _env_list("ROLL_CKPT_PLUGINS")
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            if ep.name in blocked or dist in blocked:
                continue
            if not autoload and ep.name not in wanted:
                continue
            name = ep.name
            if self.pm.has_plugin(name):
                if self._dist_of.get(name) == dist:
                    continue  # the same distribution found twice on sys.path
                # Another distribution uses the same entry-point name: load it too, so that
                # records claiming the same name are reported with both distributions.
                name = f"{ep.name}@{dist}"
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=name)
            except Exception as exc:  # a broken plugin must not break unrelated commands
                self.broken.append(BrokenPlugin(name, dist, f"{type(exc).__name__}: {exc}"))
                continue
            self._dist_of[name] = dist

    def register(self, plugin: object, name: str, distribution: str = "") -> None:
        """Register a plugin object by hand (tests, embedded use)."""
        self.pm.register(plugin, name=name)
        self._dist_of[name] = distribution or name
        self._records.clear()
        self.generation += 1

    def unregister(self, plugin: object) -> None:
        """Unregister a plugin registered by hand (:meth:`register`); nothing when it is not."""
        name = self.pm.get_name(plugin)
        if name is None:
            return
        self.pm.unregister(plugin)
        self._dist_of.pop(name, None)
        self._records.clear()
        self.generation += 1

    def distributions(self) -> list[str]:
        """The distributions of every registered plugin."""
        return sorted(set(self._dist_of.values()))

    def distribution_of(self, plugin_name: str) -> str:
        return self._dist_of.get(plugin_name, plugin_name)

    # ------------------------------------------------------------------ records

    def _collect(self, hook_name: str, kind: type[R]) -> dict[str, R]:
        """Every record a registration hook returns, by name; collected once (until a plugin is
        registered by hand), so the objects records hold are the same for every caller."""
        cached = self._records.get(hook_name)
        if cached is None:
            cached = self._records[hook_name] = self._gather(hook_name, kind)
        return dict(cached)

    def _gather(self, hook_name: str, kind: type[R]) -> dict[str, R]:
        found: dict[str, R] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            dist = self.distribution_of(impl.plugin_name)
            try:
                records: Iterable[Any] = impl.function() or []
                records = list(records)
            except Exception as exc:
                self._note_broken(impl.plugin_name, dist, exc)
                continue
            for rec in records:
                if not isinstance(rec, kind):
                    self._note_broken(impl.plugin_name, dist,
                                      TypeError(f"{hook_name} returned {type(rec).__name__}, not {kind.__name__}"))
                    continue
                rec = replace(rec, distribution=dist)
                other = found.get(rec.name)
                if other is not None and other.distribution != dist:
                    raise PluginError(
                        f"two plugins provide the {_KIND_NAMES.get(kind, kind.__name__)} "
                        f"'{rec.name}': {other.distribution} and {dist}. Uninstall one, or block it "
                        f"with ROLL_CKPT_BLOCKED_PLUGINS={dist}"
                    )
                found[rec.name] = rec
        return found

    def _note_broken(self, name: str, dist: str, exc: BaseException) -> None:
        entry = BrokenPlugin(name, dist, f"{type(exc).__name__}: {exc}")
        if entry not in self.broken:
            self.broken.append(entry)

    def backends(self) -> dict[str, BackendRecord]:
        return self._collect("roll_ckpt_backends", BackendRecord)

    def strategies(self) -> dict[str, StrategyRecord]:
        return self._collect("roll_ckpt_strategies", StrategyRecord)

    def staging_policies(self) -> dict[str, StagingPolicyRecord]:
        return self._collect("roll_ckpt_staging_policies", StagingPolicyRecord)

    def staging_order(self) -> list[StagingPolicy]:
        """The staging policies in the order a save asks them (highest priority first;
        core's ``regular`` copy, the lowest, last)."""
        records = sorted(self.staging_policies().values(), key=lambda r: -r.priority)
        return [r.policy for r in records]

    def config_keys(self) -> dict[str, ConfigKeyRecord]:
        return self._collect("roll_ckpt_config_keys", ConfigKeyRecord)

    def commands(self) -> dict[str, CommandRecord]:
        return self._collect("roll_ckpt_commands", CommandRecord)

    def formats(self) -> dict[str, FormatRecord]:
        return self._collect("roll_ckpt_formats", FormatRecord)

    def backend(self, name: str) -> BackendRecord:
        return self._pick("backend", "checkpoint_config.type", name, self.backends())

    def strategy(self, name: str) -> StrategyRecord:
        return self._pick("strategy", "strategy_config.strategy_name", name, self.strategies())

    def _pick(self, what: str, key: str, name: str, found: dict[str, R]) -> R:
        if name in found:
            return found[name]
        installed = ", ".join(sorted(found)) or "none"
        msg = f"{key}: no installed plugin provides the {what} '{name}' (installed: {installed})"
        close = difflib.get_close_matches(name, list(found) + list(KNOWN_EXTRAS), n=1, cutoff=0.5)
        if close and close[0] != name:
            msg += f"; did you mean '{close[0]}'?"
        if name in KNOWN_EXTRAS:
            msg += f"; install it with: {KNOWN_EXTRAS[name]}"
        else:
            msg += f"; roll-ckpt's own plugins come with {KNOWN_EXTRAS['file_system']}"
        broken = [b for b in self.broken if b.name == name]
        if broken:
            msg += f"; the plugin '{name}' from {broken[0].distribution} failed to load: {broken[0].error}"
        raise UnknownPluginError(msg)


_lock = threading.Lock()
_shared: Plugins | None = None


def get_plugins(*, reload: bool = False) -> Plugins:
    """The process-wide plugin manager, created on first use."""
    global _shared
    with _lock:
        if _shared is None or reload:
            _shared = Plugins()
        return _shared
