"""Kept torch.save frames (roll_ckpt.dcp.files): the bytes are torch.save's, for every
tensor that takes the fast path and every one that does not."""

from __future__ import annotations

import io

import pytest
import torch

from roll_ckpt.dcp.files import TensorFrames
from roll_ckpt.runtime.torch_compat import save_tensor_without_crc, serializes_plainly


class _Counting(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, b) -> int:  # type: ignore[override]
        self.calls += 1
        return super().write(b)


def _torch_bytes(t: torch.Tensor) -> bytes:
    """What torch.save writes for ``t`` (an own-size copy: torch.save writes whole storages)."""
    buf = io.BytesIO()
    save_tensor_without_crc(t.clone() if t.untyped_storage().nbytes() != t.nbytes else t, buf)
    return buf.getvalue()


def _plain_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    arena = torch.randn(1000, generator=g)
    return [
        torch.randn(3, 4, generator=g),
        torch.tensor(7.0),                                    # 0-dim (AdamW's step)
        torch.randn(300, 300, generator=g).bfloat16(),
        torch.randint(0, 9, (17,), generator=g),
        torch.randn(1, 5, generator=g),
        torch.randn(5, 1, generator=g),
        torch.randn(2, 3, generator=g).to(torch.float16),
        torch.rand(6, generator=g) > 0.5,
        torch.randn(2, 2, dtype=torch.complex64, generator=g),
        arena[100:340].view(4, 60),                           # a view into a larger storage
        torch.randn(8, generator=g).to(torch.float8_e4m3fn),
    ]


@pytest.mark.parametrize("k", range(len(_plain_cases())))
def test_a_kept_frame_writes_what_torch_save_writes(k: int) -> None:
    frames = TensorFrames()
    t = _plain_cases()[k]
    assert serializes_plainly(t)
    other = t.clone()
    if other.dtype == torch.bool:
        other = ~other
    else:
        other.reshape(-1).view(torch.uint8).add_(1)  # other bytes, same key
    for x in (t, other):  # the first write records the frame, the second uses it
        out = _Counting()
        frames.write(x, out)
        assert out.getvalue() == _torch_bytes(x)
        loaded = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
        assert loaded.dtype == x.dtype and loaded.shape == x.shape
        assert torch.equal(loaded.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))
    assert len(frames) == 1
    assert out.calls == 3, "a tensor of a known shape is three writes: prefix, bytes, suffix"


def test_other_keys_get_frames_of_their_own() -> None:
    frames = TensorFrames()
    a, b = torch.zeros(4), torch.zeros(2, 2)
    for t in (a, b, a + 1, b + 1, torch.zeros(4, dtype=torch.float64)):
        out = io.BytesIO()
        frames.write(t, out)
        assert out.getvalue() == _torch_bytes(t)
    assert len(frames) == 3


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4).t(),                                         # not contiguous
    lambda: torch.randn(2, dtype=torch.complex64).conj(),                  # lazy conjugate bit
    lambda: torch.randn(2, dtype=torch.complex64)._neg_view(),             # lazy negative bit
    lambda: torch.randn(3, requires_grad=True),                            # autograd
    lambda: torch.empty(0),                                                # no bytes
    lambda: torch.nn.Parameter(torch.randn(2)),                            # a subclass
    lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
], ids=["transposed", "conj", "neg", "requires_grad", "empty", "parameter", "quantized"])
def test_tensors_torch_frames_its_own_way_go_through_torch_save(make) -> None:
    frames = TensorFrames()
    t = make()
    assert not serializes_plainly(t)
    for _ in range(2):
        out = io.BytesIO()
        frames.write(t, out)
        expected = io.BytesIO()
        save_tensor_without_crc(t if t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes else t.clone(),
                                expected)
        assert out.getvalue() == expected.getvalue()
        back = torch.load(io.BytesIO(out.getvalue()), weights_only=False)
        if t.is_quantized:
            assert torch.equal(back.int_repr(), t.int_repr())
        else:
            assert torch.equal(back.resolve_conj().resolve_neg(), t.detach().resolve_conj().resolve_neg())
    assert len(frames) == 0


def test_a_zero_tensor_never_reads_memory_it_does_not_have() -> None:
    z = torch._efficientzerotensor(4)
    assert not serializes_plainly(z)
    with pytest.raises(RuntimeError, match="ZeroTensor"):
        TensorFrames().write(z, io.BytesIO())  # torch's own refusal, not a read at address 0


def test_the_frames_start_over_past_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import roll_ckpt.dcp.files as tf

    monkeypatch.setattr(tf, "_MAX_FRAMES", 3)
    frames = TensorFrames()
    for n in range(1, 6):
        frames.write(torch.zeros(n), io.BytesIO())
    assert 1 <= len(frames) <= 3


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _file_of(*parts: bytes, tmp_path) -> tuple:
    """A Verified file of ``parts`` laid end to end, and each part's (offset, length)."""
    from roll_ckpt.dcp.checked import Verified

    path = tmp_path / "items.distcp"
    path.write_bytes(b"".join(parts))
    spans, at = [], 0
    for p in parts:
        spans.append((at, len(p)))
        at += len(p)
    return Verified(open(path, "rb")), spans


@pytest.mark.parametrize("k", range(len(_plain_cases())))
def test_an_item_in_a_kept_frame_is_read_without_unpickling(k: int, tmp_path, monkeypatch) -> None:
    """The reader takes an item that is exactly the frame of the target's layout as the target's
    bytes: nothing unpickled, the values bit-equal, straight into the target's memory."""
    import roll_ckpt.dcp.checked as vf

    src = _plain_cases()[k]
    blob = io.BytesIO()
    TensorFrames().write(src, blob)
    data, spans = _file_of(b"x" * 7, blob.getvalue(), tmp_path=tmp_path)

    def no_unpickling(*a, **kw):
        raise AssertionError("unpickled")

    monkeypatch.setattr(vf.torch_compat, "weights_only_load", no_unpickling)
    target = torch.empty_like(src, memory_format=torch.contiguous_format)
    got = vf.load_tensor(data, *spans[1], target)
    assert got is target
    assert torch.equal(_raw(got), _raw(src))
    data.file.close()


def test_an_item_in_another_frame_is_loaded_the_general_way(tmp_path) -> None:
    """An item whose ends are not the kept frame's (torch.save with its CRC-32 on, or a shape
    other than the target's) is unpickled as before, and still gives the right values."""
    import roll_ckpt.dcp.checked as vf

    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    with_crc = io.BytesIO()
    torch.save(src, with_crc)
    other_shape = io.BytesIO()
    TensorFrames().write(src.view(4, 3), other_shape)
    data, spans = _file_of(with_crc.getvalue(), other_shape.getvalue(), tmp_path=tmp_path)
    calls = []
    real = vf.torch_compat.weights_only_load

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    import unittest.mock as mock

    with mock.patch.object(vf.torch_compat, "weights_only_load", counting):
        a = vf.load_tensor(data, *spans[0], torch.empty(3, 4))
        after_first = len(calls)
        b = vf.load_tensor(data, *spans[1], torch.empty(3, 4))
    assert after_first >= 1 and len(calls) > after_first  # each unpickled
    assert torch.equal(a, src) and torch.equal(b, src.view(4, 3))
    data.file.close()
