"""Checks of single config values: each returns the value or raises a ConfigError naming
the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Mapping

from ..errors import ConfigError
from .interpolation import key_path

__all__ = ["expect", "count", "nice", "choice", "string", "location", "options", "seconds", "reject_unknown", "field_names",
           "section"]


def expect(key: str, value: Any, kind: type | tuple[type, ...], allowed: str) -> Any:
    # bool is an int in Python; a YAML `true` where a count is expected is a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(key, "has the wrong type", value, allowed)
    if not isinstance(value, kind):
        raise ConfigError(key, "has the wrong type", value, allowed)
    return value


def nice(key: str, value: Any) -> int:
    if count(key, value) > 19:
        raise ConfigError(key, "is not a nice value", value, "an integer from 0 to 19")
    return value


def choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(key, "is not one of the allowed values", value, " or ".join(allowed))
    return value


def count(key: str, value: Any) -> int:
    expect(key, value, int, "an integer >= 0")
    if value < 0:
        raise ConfigError(key, "must not be negative", value, "an integer >= 0")
    return value


def string(key: str, value: Any, *, empty_ok: bool = False) -> str:
    expect(key, value, str, "a string")
    if not empty_ok and not value.strip():
        raise ConfigError(key, "must not be empty", value, "a non-empty string")
    return value


def location(key: str, value: Any) -> str:
    """A path or URL: a non-empty string without NUL characters (no file system takes one)."""
    string(key, value)
    if "\x00" in value:
        raise ConfigError(key, "contains a NUL character", value, "a path or URL")
    return value


def options(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    expect(key, value, Mapping, "a mapping of options")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(key_path(key, k), "option names must be strings", k)
    return dict(value)


def staging_budget(key: str, value: Any) -> int:
    """``max_staging_bytes``: bytes (``512MB``, ``2GiB`` or a number); 0 means no bound."""
    from ..runtime.units import parse_size

    try:
        return parse_size(value, minimum=0)
    except ValueError:
        raise ConfigError(key, "is not a size", value,
                          "a number of bytes >= 0, or a size such as 512MB or 2GiB (0: no bound)") from None


def seconds(key: str, value: Any) -> float:
    expect(key, value, (int, float), "a number of seconds >= 0")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(key, "must be a finite number >= 0", value, "a number of seconds >= 0")
    return float(value)


def reject_unknown(where: str, given: Mapping[str, Any], known: list[str]) -> None:
    for k in given:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(key_path(where, k), f"unknown key; {hint}known keys are {', '.join(known)}")


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def section(root: Mapping[str, Any], path: tuple[str, ...]) -> tuple[Mapping[str, Any], str]:
    """The mapping at ``path`` below ``root`` (empty where a level is absent or null) and
    its dotted key; a level that is not a mapping is an error naming it."""
    node: Any = root
    where = ""
    for name in path:
        where = key_path(where, name)
        node = node.get(name) if node is not None else None
        if node is not None:
            expect(where, node, Mapping, "a mapping")
    return node or {}, where
