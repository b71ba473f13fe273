"""roll-ckpt config PATH: the resolved checkpoint settings, per worker, and where each came from."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import format_table, say


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def cmd_config(args: argparse.Namespace) -> int:
    from ..config.report import config_report

    report = config_report(args.path, defaults=args.defaults)
    if args.json:
        say(json.dumps({"defaults": report.defaults, "workers": report.strategies,
                        "settings": {group: [{"key": s.key, "value": s.value, "source": s.source} for s in rows]
                                     for group, rows in report.groups.items()}}, indent=1, sort_keys=True))
        return 0
    which = ("a ROLL pipeline config: unset keys take ROLL's defaults" if report.defaults == "roll"
             else "unset keys take roll-ckpt's defaults")
    say(f"{args.path}: {which}")
    for group, rows in report.groups.items():
        if group == "*":
            title = "every process"
        else:
            strategy = report.strategies.get(group)
            title = f"worker {group}" + (f" ({strategy})" if strategy else " (component)")
        say("", f"[{title}]")
        say(*format_table(["key", "value", "source"], [[s.key, _shown(s.value), s.source] for s in rows]))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="the resolved checkpoint settings of a config, per worker, and where each "
                                      "came from")
    p.add_argument("path", metavar="PATH", help="a YAML config (a Hydra defaults list is composed with the "
                                                "hydra extra)")
    p.add_argument("--defaults", choices=("roll", "roll-ckpt"), default=None,
                   help="whose defaults fill unset keys (default: ROLL's for a ROLL pipeline config)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_config)
