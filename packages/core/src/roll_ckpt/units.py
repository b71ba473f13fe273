"""Quantities as people read them."""

from __future__ import annotations

__all__ = ["human_bytes"]


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
