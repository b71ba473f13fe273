"""Damage done to checkpoint files on purpose."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """Invert the byte at ``offset`` (modulo the size) of a file, in place: same size, other content."""
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))
