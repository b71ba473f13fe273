"""``${...}`` interpolation in config values: ``${key}``, ``${a.b}`` (dotted keys) and
``${env:VAR}`` / ``${env:VAR,default}``. A lone reference keeps its type."""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["interpolate", "key_path"]

_INTERP = re.compile(r"\$\{([^${}]+)\}")


def key_path(where: str, key: Any) -> str:
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


def interpolate(root: dict[str, Any]) -> dict[str, Any]:
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
            return {k: resolve(x, key_path(where, k), stack) for k, x in v.items()}
        if isinstance(v, list):
            return [resolve(x, f"{where}[{i}]", stack) for i, x in enumerate(v)]
        return v

    return resolve(root, "", ())
