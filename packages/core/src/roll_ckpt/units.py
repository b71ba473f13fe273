"""Quantities as people read them."""

from __future__ import annotations

__all__ = ["human_bytes", "parse_bytes"]


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``1.5 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} PiB"  # pragma: no cover


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """``512MB`` -> 512000000, ``2GiB`` -> 2147483648, ``1024`` -> 1024; ``ValueError`` otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    raw = str(text).strip().lower().replace(" ", "").replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if not number or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 512MB, 2GiB, 1048576)")
    value = float(number) * _UNITS[unit]
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value)
