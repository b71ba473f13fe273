"""Every ``roll-ckpt`` command and option, read from the parser the command line itself
builds (``roll_ckpt.cli.build_parser``, plugins' commands included).

argparse has no public way to list a parser's arguments; ``_actions``, ``_action_groups``
and ``_choices_actions`` are what sphinx-argparse and argparse's own help formatter read,
unchanged since Python 3.2.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import sources


@dataclass(frozen=True)
class Option:
    names: str
    """``--out``, ``-f, --force, --overwrite``, or a positional's metavar (``PATH``)."""
    help: str
    group: str
    """The argument group's title (``--format hf``), ``""`` for the usual ones."""


@dataclass(frozen=True)
class Command:
    name: str
    """``roll-ckpt`` itself, or ``roll-ckpt ls``."""
    help: str
    usage: str
    options: tuple[Option, ...]


def _expand(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if action.help is argparse.SUPPRESS:
        return ""
    params = {**vars(action), "prog": prog}
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    try:
        return text % params  # as argparse's formatter expands %(default)s and friends
    except (KeyError, TypeError, ValueError):
        return text


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    out = []
    for group in parser._action_groups:
        title = "" if group.title in ("positional arguments", "options", "optional arguments") else group.title
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            names = ", ".join(action.option_strings) or str(action.metavar or action.dest)
            extra = []
            if action.choices is not None and "choices" not in (action.help or ""):
                extra.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
            if action.required and action.option_strings:
                extra.append("required")
            help_text = _expand(action, parser.prog)
            out.append(Option(names=names, help=help_text + (f" ({'; '.join(extra)})" if extra else ""),
                              group=title or ""))
    return tuple(out)


def commands() -> list[Command]:
    parser = sources.cli_parser()
    found = [Command(name=parser.prog, help=parser.description or "", usage=parser.format_usage().strip(),
                     options=_options(parser))]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, p in sorted(sub.choices.items()):
        found.append(Command(name=p.prog, help=helps.get(name, ""), usage=p.format_usage().strip(),
                             options=_options(p)))
    return found
