"""Quantities as people read and write them."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "parse_size"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


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


def parse_size(text: str | int, *, minimum: int = 1) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"200KB"``, ``"1024"`` (bytes).

    KB/MB/GB/TB (and K/M/G/T) are powers of 1000, as Hugging Face's ``max_shard_size``
    reads them; KiB/MiB/GiB/TiB are powers of 1024. Raises ``ValueError`` with a message
    saying what is accepted, or when the size is below ``minimum`` bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if m is None:
            raise ValueError(f"{text!r} is not a size; write e.g. 5GB, 500MB, 200KB, 2GiB or a number of bytes")
        value, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    n = int(value * base ** _POWERS[unit.rstrip("b")[:1]])
    if n < minimum or value < 0:
        raise ValueError(f"{text!r}: a size must be at least {minimum} byte(s)")
    return n
