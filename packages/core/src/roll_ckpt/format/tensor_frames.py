"""Tensors written as ``torch.save`` writes them, without running ``torch.save`` each time.

DCP's format frames every tensor of a ``.distcp`` file as a small ``torch.save`` zip: a
pickle naming the dtype, shape and stride, a few records, the tensor's bytes, a central
directory. ``torch.save`` builds that frame anew for every tensor: about 40 small writes
and a pickle, 150-250 µs of Python and GIL per tensor on this machine, which made the
many small tensors of a transformer (norms, biases, AdamW's step counters) cost more to
write than their bytes. The frame depends only on what the pickle names, so
:class:`TensorFrames` keeps, for each key (dtype, shape, stride), the bytes
``torch.save`` wrote before and after the tensor's bytes the first time, and writes a
later tensor of that key as three writes: that prefix, its own bytes, that suffix. The
result is byte for byte what ``torch.save`` (with roll-ckpt's CRC-32 setting) writes
(``tests/core/test_tensor_frames.py`` compares them), so ``dcp.load`` and ``torch.load``
read it as before.

The same frames make the way back short: :func:`tensor_frame` gives the frame of a key (kept,
or made once from an uninitialised tensor of that layout), and a reader whose item is exactly
that frame around the target's size takes the bytes between as the tensor's, unpickling
nothing (:func:`roll_ckpt.format.verified_files.load_tensor`); anything else is loaded the
general way.

Only plain tensors are framed from memory (:func:`roll_ckpt.runtime.torch_compat.serializes_plainly`:
contiguous, strided, on the CPU, no subclass, no conjugate or negative bit); anything else
goes through ``torch.save`` every time.
"""

from __future__ import annotations

import threading
from typing import Any

from ..runtime.memory import exact_alias, writable_view
from ..runtime.torch_compat import save_tensor_without_crc, serializes_plainly

__all__ = ["TensorFrames", "write_tensor", "tensor_frame"]

_LOCAL_HEADER = b"PK\x03\x04"
_HEADER_SIZE = 30  # a zip local file header before its name and extra field
_MAX_FRAMES = 4096
"""Distinct keys kept; a job whose shapes keep changing starts over rather than growing."""


def _u16(b: bytes, at: int) -> int:
    return b[at] | b[at + 1] << 8


class _Recorder:
    """Passes ``torch.save``'s writes on to ``stream`` and keeps them (the payload's length only)."""

    def __init__(self, stream: Any, payload: int) -> None:
        self.stream = stream
        self.payload = payload
        self.parts: list[tuple[int, bytes | None]] = []  # (length, bytes kept or None)

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        n = mv.nbytes
        # a write of the payload's size may be the payload: its bytes are not needed
        self.parts.append((n, None if n == self.payload and n > 256 else bytes(mv)))
        self.stream.write(mv)
        return n

    def frame(self) -> tuple[bytes, bytes] | None:
        """``(prefix, suffix)`` around the one write that is the payload of the record
        ``.../data/0``, found by the zip header just before it; ``None`` if not found."""
        head = b""
        for k, (n, data) in enumerate(self.parts):
            if n == self.payload:
                h = head.rfind(_LOCAL_HEADER)
                if h >= 0 and len(head) - h >= _HEADER_SIZE:
                    name_len, extra_len = _u16(head, h + 26), _u16(head, h + 28)
                    name = head[h + _HEADER_SIZE:h + _HEADER_SIZE + name_len]
                    if h + _HEADER_SIZE + name_len + extra_len == len(head) and name.endswith(b"/data/0"):
                        rest = self.parts[k + 1:]
                        if any(d is None for _, d in rest):
                            return None
                        return head, b"".join(d for _, d in rest)  # type: ignore[misc]
            if data is None:
                return None
            head += data
        return None


class TensorFrames:
    """The frames ``torch.save`` wrote around plain tensors, by key (thread-safe)."""

    def __init__(self) -> None:
        self._frames: dict[tuple, tuple[bytes, bytes] | None] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._frames)

    def write(self, tensor: Any, stream: Any) -> None:
        """Write ``tensor`` (detached, CPU) to ``stream`` in ``torch.save``'s format, CRC-32 off."""
        if not serializes_plainly(tensor):
            save_tensor_without_crc(_own_storage(tensor), stream)
            return
        key = (tensor.dtype, tuple(tensor.shape), tensor.stride())
        nbytes = tensor.nbytes
        frame = self._frames.get(key, False)
        if frame is False:
            self._first(key, tensor, nbytes, stream)
        elif frame is None:  # torch framed this key in a way we could not take apart
            save_tensor_without_crc(_own_storage(tensor), stream)
        else:
            stream.write(frame[0])
            stream.write(writable_view(tensor, nbytes))
            stream.write(frame[1])

    def frame(self, dtype: Any, shape: tuple, stride: tuple) -> tuple[bytes, bytes] | None:
        """``(prefix, suffix)`` that ``torch.save`` writes around a plain tensor of this layout;
        ``None`` where it is not framed so (made once per key from an uninitialised tensor:
        with CRC-32 off the frame does not depend on the values)."""
        key = (dtype, tuple(shape), tuple(stride))
        frame = self._frames.get(key, False)
        if frame is False:
            import torch

            tensor = torch.empty_strided(key[1], key[2], dtype=dtype)
            if not serializes_plainly(tensor):
                return None
            self._first(key, tensor, tensor.nbytes, _Discard())
            frame = self._frames.get(key)
        return frame

    def _first(self, key: tuple, tensor: Any, nbytes: int, stream: Any) -> None:
        recorder = _Recorder(stream, nbytes)
        save_tensor_without_crc(_own_storage(tensor), recorder)
        frame = recorder.frame()
        with self._lock:
            if len(self._frames) >= _MAX_FRAMES:
                self._frames.clear()
            self._frames[key] = frame


class _Discard:
    """A stream that keeps nothing: a frame is made from what ``torch.save`` writes around."""

    def write(self, b: Any) -> int:
        return memoryview(b).nbytes


def _own_storage(tensor: Any) -> Any:
    """``tensor``, or the same values over a storage of their own size: of a view (an arena's
    slice, a padded shard) ``torch.save`` would write the whole storage; an exact-size alias
    of the same memory needs no copy (a clone where the view is not contiguous)."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return exact_alias(tensor) if tensor.is_contiguous() else tensor.clone()


_FRAMES = TensorFrames()


def write_tensor(tensor: Any, stream: Any) -> None:
    """Write ``tensor`` as ``torch.save`` would (CRC-32 off), through the process's kept frames."""
    _FRAMES.write(tensor, stream)


def tensor_frame(dtype: Any, shape: tuple, stride: tuple) -> tuple[bytes, bytes] | None:
    """The frame ``torch.save`` (CRC-32 off) writes around a plain tensor of this layout, or ``None``."""
    return _FRAMES.frame(dtype, shape, stride)
