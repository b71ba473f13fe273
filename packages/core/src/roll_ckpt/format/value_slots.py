"""Byte values written into slots of a fixed size, so that a later save of the same
structure keeps every offset of the file.

DCP writes each non-tensor value (RNG state, a scheduler's or a data loader's state, a
counter) as a ``torch.save`` zip. Its pickled size varies from save to save; were it to
move the offsets of what follows, ``.metadata`` would change with every save. roll-ckpt's
writer therefore puts the tensors of a file first (their sizes are a function of dtype,
shape and stride) and the values last, each in a *slot*: the value's zip, padded to the
slot's capacity with a zip comment. The padded bytes are still one valid zip (the comment
is part of the format, up to 65,535 bytes), so ``torch.load`` and plain ``dcp.load`` read
them as before, and ``.metadata`` records the slot's length. A later value that fits its
slot is written padded to the same length; one that grew past it makes the save take the
full path (a new ``.metadata``).
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["slot_capacity", "slot_slack", "padded_value"]

_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22
_MAX_COMMENT = 0xFFFF


def _ends_with_bare_eocd(buf: memoryview) -> bool:
    """The zip's end-of-central-directory record is its last 22 bytes, without a comment."""
    n = buf.nbytes
    return n >= _EOCD_SIZE and bytes(buf[n - _EOCD_SIZE:n - _EOCD_SIZE + 4]) == _EOCD \
        and bytes(buf[n - 2:]) == b"\0\0"


def slot_slack(n: int) -> int:
    """The room a slot leaves a value of ``n`` bytes to grow: a quarter more (512 bytes at
    least, a zip comment's limit at most)."""
    return min(_MAX_COMMENT, max(512, n // 4))


def slot_capacity(buf: Any) -> int:
    """The slot a value of these bytes gets at a full save: a quarter more (512 bytes at
    least, a zip comment's limit at most); the bytes exactly when they cannot be padded."""
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if not _ends_with_bare_eocd(mv):
        return n
    return n + slot_slack(n)


def padded_value(buf: Any, capacity: int) -> list[Any] | None:
    """The pieces that write ``buf`` padded to ``capacity`` bytes; ``None`` when it does not fit."""
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    pad = capacity - n
    if pad == 0:
        return [mv]
    if pad < 0 or pad > _MAX_COMMENT or not _ends_with_bare_eocd(mv):
        return None
    return [mv[:n - 2], struct.pack("<H", pad), bytes(pad)]
