"""Damage: every kind of file of a checkpoint (.distcp, .metadata, trainer_state.json,
manifest.json) truncated, with one byte flipped, deleted, or joined by an unexpected file.

``verify`` (API and ``roll-ckpt verify``) names the file and the fault; ``resume`` refuses
with the same words and leaves the state untouched. Every single-byte flip anywhere in
``manifest.json`` is reported as damage to ``manifest.json`` itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_ckpt import CheckpointCorruptError, CheckpointManager, CheckpointNotFoundError, load_config
from roll_ckpt.cli import main as cli
from roll_ckpt.testing import tiny_state
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage

from ._support import copy_of, save_template
from ._support import resume_untouched as _resume

KINDS = ["distcp", "metadata", "trainer_state", "manifest"]
FAULTS = ["truncated", "flipped", "deleted", "extra"]

# An unexpected file of each kind, where it does not belong.
EXTRA = {"distcp": "dcp/__7_0.distcp", "metadata": ".metadata", "trainer_state": "dcp/trainer_state.json",
         "manifest": "dcp/manifest.json"}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_template(tmp_path_factory.mktemp("damage"), 3)


@pytest.fixture
def ckpt(template: Path, tmp_path: Path) -> Path:
    return copy_of(template, tmp_path)


def _file_of(ckpt: Path, kind: str) -> str:
    if kind == "distcp":
        return sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "dcp").glob("*.distcp"))[0]
    return {"metadata": "dcp/.metadata", "trainer_state": "trainer_state.json", "manifest": "manifest.json"}[kind]


def _flip_offset(data: bytes, kind: str) -> int:
    if kind == "manifest":  # inside a checksum value: still valid JSON, only the content changed
        return data.index(b'"checksum": "') + len(b'"checksum": "') + 5
    return len(data) // 2


def damage(ckpt: Path, kind: str, fault: str) -> tuple[str, tuple[str, ...]]:
    """Damage ``ckpt``; return the file that must be named and the words that must describe it."""
    rel = _file_of(ckpt, kind)
    target = ckpt / rel
    if fault == "extra":
        extra = ckpt / EXTRA[kind]
        extra.write_bytes(target.read_bytes())  # a plausible copy, just not listed
        return EXTRA[kind], ("unexpected file",)
    if fault == "deleted":
        target.unlink()
        return rel, ("no manifest.json", "not a committed checkpoint") if kind == "manifest" else ("missing",)
    data = target.read_bytes()
    if fault == "truncated":
        target.write_bytes(data[: len(data) * 2 // 3])
        return rel, ("not valid JSON",) if kind == "manifest" else ("truncated",)
    i = _flip_offset(data, kind)
    target.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    return rel, ("checksum mismatch",)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", KINDS)
def test_damage_is_named_by_verify_and_refused_by_resume(ckpt: Path, kind: str, fault: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    name, words = damage(ckpt, kind, fault)
    storage = LocalStorage(str(ckpt.parent))

    # verify (the API): the error names the file and the fault
    with pytest.raises((CheckpointCorruptError, CheckpointNotFoundError)) as info:
        verify(storage, str(ckpt))
    err = info.value
    message = str(err)
    assert name in message and any(w in message for w in words), message
    if isinstance(err, CheckpointCorruptError):
        named = [f for f in err.faults if f[0] == name]
        assert named and any(w in named[0][1] for w in words), err.faults
        expected_fault = f"{named[0][0]}: {named[0][1]}"
    else:
        expected_fault = "no manifest.json"

    # roll-ckpt verify: exit 1, the file and the fault on the terminal, no traceback
    code = cli(["verify", str(ckpt)])
    out, errout = capsys.readouterr()
    assert code == 1, (out, errout)
    assert name in out + errout and any(w in out + errout for w in words), (out, errout)
    assert "Traceback" not in out + errout

    # resume: refuses with the same words, loads nothing
    rerr, untouched = _resume(ckpt)
    assert isinstance(rerr, (CheckpointCorruptError, CheckpointNotFoundError)), repr(rerr)
    assert expected_fault in str(rerr), (expected_fault, str(rerr))
    assert untouched, "a refused resume must not change the state"


def test_resume_latest_refuses_a_damaged_newest_checkpoint(ckpt: Path) -> None:
    """``latest`` is never silently replaced by an older or a fresh start when the newest is damaged."""
    damage(ckpt, "distcp", "flipped")
    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": str(ckpt.parent),
                                             "timestamp_subdir": False},
                       "resume_from_checkpoint": "latest"})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        with pytest.raises(CheckpointCorruptError, match=r"__\d_\d\.distcp: checksum mismatch"):
            m.resume(tiny_state(seed=7))


def test_every_single_byte_flip_in_the_manifest_is_damage_to_the_manifest(ckpt: Path) -> None:
    storage = LocalStorage(str(ckpt.parent))
    path = ckpt / "manifest.json"
    data = path.read_bytes()
    kinds: dict[str, int] = {}
    for i in range(len(data)):
        for bit in (0x01, 0x20):
            path.write_bytes(data[:i] + bytes([data[i] ^ bit]) + data[i + 1:])
            with pytest.raises(CheckpointCorruptError) as info:
                verify(storage, str(ckpt))
            faults = info.value.faults
            assert [f[0] for f in faults] == ["manifest.json"] * len(faults), (i, bit, faults)
            what = faults[0][1].split(" (")[0]
            kinds[what] = kinds.get(what, 0) + 1
    path.write_bytes(data)
    verify(storage, str(ckpt))
    assert "checksum mismatch" in kinds and "not valid JSON" in kinds, kinds


@pytest.mark.parametrize("kind", ["distcp", "metadata", "trainer_state"])
def test_every_truncation_length_is_caught(ckpt: Path, kind: str) -> None:
    """A file cut anywhere (a crash of a copy, a full disk) is never taken for whole."""
    storage = LocalStorage(str(ckpt.parent))
    rel = _file_of(ckpt, kind)
    data = (ckpt / rel).read_bytes()
    for n in sorted({0, 1, len(data) // 3, len(data) // 2, len(data) - 1}):
        (ckpt / rel).write_bytes(data[:n])
        with pytest.raises(CheckpointCorruptError, match=rel.replace(".", r"\.") + ": size"):
            verify(storage, str(ckpt))
    (ckpt / rel).write_bytes(data)
    verify(storage, str(ckpt))
