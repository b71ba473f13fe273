"""roll-ckpt plugins: installed backends, strategies, staging policies, config keys, checkpoint
formats of other frameworks, commands."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ._common import say, format_table


def cmd_plugins(args: argparse.Namespace) -> int:
    from importlib import metadata

    from ..contracts import BackendRecord, CommandRecord, StrategyRecord
    from ..errors import PluginError
    from ..plugins import get_plugins

    plugins = get_plugins()

    def version(dist: str) -> str:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            return dist

    status = 0
    sections = [("backends (checkpoint_config.type)", plugins.backends),
                ("strategies", plugins.strategies),
                ("staging policies (asked in this order; the first that claims a tensor stages it)",
                 _in_staging_order(plugins)),
                ("config keys", plugins.config_keys),
                ("other frameworks' checkpoint formats (resumed read-only; export --format NAME)", plugins.formats),
                ("commands", plugins.commands)]
    for title, collect in sections:
        say(f"{title}:")
        try:
            records = collect()
        except PluginError as exc:  # two plugins claim one name: show it, keep going
            say(f"  CONFLICT  {exc}")
            status = 1
            continue
        if not records:
            say("  (none)")
        rows = []
        for name, rec in records.items():
            text = rec.help if isinstance(rec, CommandRecord) else rec.description
            if isinstance(rec, StrategyRecord):
                text = f"priority {rec.priority}; {text}"
            if isinstance(rec, BackendRecord) and rec.storage_classes:
                text = f"{text}; optional features: {_features(rec)}"
            rows.append([name, version(rec.distribution), text])
        say(*("  " + ln for ln in (format_table(["NAME", "DISTRIBUTION", "DESCRIPTION"], rows) if rows else [])))
    broken = list(plugins.broken)
    if broken:
        say("broken plugins (not loaded; everything else works):")
        say(*("  " + ln for ln in format_table(["ENTRY POINT", "DISTRIBUTION", "ERROR"],
                                           [[b.name, version(b.distribution), b.error] for b in broken])))
    return status


def _features(rec: Any) -> str:
    """Each storage class of a backend record and the optional features it has (``contracts.capabilities``)."""
    import importlib

    from ..contracts import capabilities

    parts = []
    for path in rec.storage_classes:
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as exc:  # a listing, not a load: say what is wrong and go on
            parts.append(f"{name} (cannot import {path}: {type(exc).__name__})")
            continue
        parts.append(f"{name} ({', '.join(capabilities(cls)) or 'none'})")
    return "; ".join(parts)


def _in_staging_order(plugins: Any) -> Callable[[], dict[str, Any]]:
    """The staging policy records, in the order a save asks them (the same objects it asks)."""

    def collect() -> dict[str, Any]:
        records = plugins.staging_policies()
        return {policy.name: records[policy.name] for policy in plugins.staging_order()}

    return collect


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="installed backends, strategies, staging policies, config keys, "
                                       "other frameworks' formats, commands, broken plugins")
    p.set_defaults(func=cmd_plugins)
