"""Markdown for the generated pages: the configuration, command-line and API references."""

from __future__ import annotations

import re

import cli_reference
import config_keys
import sources

_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc):`~?([^`]+)`")


def md(text: str) -> str:
    """A docstring (reST-flavoured, as roll-ckpt writes them) as one Markdown table cell."""
    text = _ROLE.sub(lambda m: f"``{m.group(1)}``", text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "<br><br>".join(_cell(p) for p in paragraphs)


def _cell(text: str) -> str:
    """Outside code spans, '<dir>' would be read as an HTML tag and '|' as a column; inside
    them the table extension leaves '|' alone and shows a backslash as written."""
    parts = re.split(r"(``[^`]+``|`[^`]+`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return "".join(parts)


def configuration_page() -> str:
    keys = config_keys.config_keys()
    lines = ["# Configuration reference", "",
             "Generated from the config definitions when the site is built (`docs/_hooks/config_keys.py`):",
             "each key's type and meaning are the field's annotation and docstring in the source; its default",
             "is what `load_config` yields when the key is unset; *ROLL* gives ROLL's name for it where ROLL",
             "has the key, and ROLL's default where a ROLL pipeline config takes another one (see",
             "[From a ROLL config](../operations/roll.md)); `—` there: a key of roll-ckpt's own, which ROLL's",
             "files do not have. How the keys are written, interpolated and checked:",
             "[Configuration](../guide/configuration.md).", ""]
    order = []
    for k in keys:
        if k.section not in order:
            order.append(k.section)
    titles = {"": "Top level", "plugins": "Keys plugins own",
              config_keys.STORAGE_OPTIONS: "`checkpoint_config.storage_options` on `s3://`"}
    for section in order:
        rows = [k for k in keys if k.section == section]
        lines += [f"## {titles.get(section, f'`{section}`')}", ""]
        head = next((k for k in keys if k.key == section and k.kind == "section"), None)
        if head is not None:
            lines += [md(head.doc), ""]
        if section == config_keys.STORAGE_OPTIONS:
            lines += ["The keys of `checkpoint_config.storage_options` (and of `backup.storage_options`) that the",
                      "`file_system` backend reads on `s3://`: its retry policy (the fields of `RetryPolicy`). Its",
                      "other keys go to fsspec as they are; on a local path the backend reads `direct_io` alone",
                      "(see [Configuration](../guide/configuration.md) and [Faulty networks](../operations/faults.md)).",
                      ""]
        if section == "plugins":
            lines += ["Declared through the `roll_ckpt_config_keys` hook by the installed plugins (`roll-ckpt plugins`",
                      "lists them), validated by the plugin, kept in `cfg.options` and as `cfg.<key>`.", ""]
        for kind, title in (("key", None), ("attribute", "Attributes of the resolved `Config` (not keys of the file)")):
            chosen = [k for k in rows if k.kind in ((kind, "section") if kind == "key" else (kind,))]
            if not chosen:
                continue
            if title:
                lines += [f"{title}:", ""]
            lines += ["| key | type | default | ROLL | meaning |", "|---|---|---|---|---|"]
            for k in chosen:
                name = f"[`{k.key}`](#{_anchor(k.key)})" if k.kind == "section" else f"`{k.key}`"
                kind = _cell("`" + k.type + "`")
                lines.append(f"| {name} | {kind} | {_cell(k.default)} | {_cell(k.roll)} | {md(k.doc)} |")
            lines.append("")
    return "\n".join(lines)


def _anchor(section: str) -> str:
    # The slug MkDocs' toc extension gives the heading "`checkpoint_config.backup`".
    return re.sub(r"[^\w\- ]", "", section).strip().lower().replace(" ", "-")


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Generated from the parser `roll-ckpt` builds (`docs/_hooks/cli_reference.py`), with the commands",
             "the installed plugins add. How the commands are used: [Command line](../guide/command-line.md).", ""]
    for c in cli_reference.commands():
        lines += [f"## `{c.name}`", "", md(c.help), "", "```", c.usage, "```", ""]
        if c.options:
            lines += ["| argument | group | help |", "|---|---|---|"]
            lines += [f"| `{o.names}` | {_cell(o.group)} | {md(o.help)} |" for o in c.options]
            lines.append("")
    return "\n".join(lines)


def api_names() -> dict[str, list[str]]:
    """``{package: [public name, ...]}``: each package's ``__all__``, dunders left out."""
    out = {}
    for package in sources.API_PACKAGES:
        names = getattr(sources.module(package), "__all__", [])
        out[package] = [n for n in names if not n.startswith("__")]
    return out


def api_page() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings of the public names: each package's `__all__`, read when the site",
             "is built. Anything else is internal and may move.", ""]
    for package, names in api_names().items():
        lines += [f"## `{package}`", ""]
        if not names:
            lines += [f"`{package}` exports no names of its own: it is used through its plugin hooks "
                      "(entry-point group `roll_ckpt`).", ""]
        for name in names:
            lines += [f"::: {package}.{name}", "    options:", "      heading_level: 3", ""]
    lines += ["## Hooks", "", "The hooks a plugin implements (`@roll_ckpt.plugin.hookimpl`), as `roll_ckpt` specifies them.", "",
              f"::: {sources.HOOKSPECS}", "    options:", "      heading_level: 3", "      show_root_heading: false",
              "      members_order: source", ""]
    return "\n".join(lines)
