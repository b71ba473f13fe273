"""resume() verifies a checkpoint against its manifest before torch reads any of it, and
refuses — naming the file — anything damaged, missing, uncommitted or not a checkpoint."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from roll_ckpt.format.manifest import seal
from roll_ckpt import CheckpointCorruptError, CheckpointManager, CheckpointNotFoundError
from roll_ckpt.errors import UnsafeCheckpointError
from roll_ckpt.format.manifest import hash_bytes
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.format.manifest import verify


@pytest.fixture
def saved(ckpt_config) -> Path:
    with CheckpointManager.from_config(ckpt_config(), quiet=True) as m:
        path = m.save(4, tiny_state(seed=1))
    return Path(path)


def _resume(ckpt_config, target) -> tuple[BaseException | None, bool]:
    """Resume ``target`` into a fresh state; return the error and whether the state was untouched."""
    s = tiny_state(seed=2)
    before = state_snapshot(s)
    err = None
    with CheckpointManager.from_config(ckpt_config(resume_from_checkpoint=str(target)), quiet=True) as m:
        try:
            m.resume(s)
        except Exception as exc:  # noqa: BLE001 - the caller checks the type
            err = exc
    try:
        assert_same_state(state_snapshot(s), before)
        untouched = True
    except AssertionError:
        untouched = False
    return err, untouched


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_checkpoint_verifies_and_resumes(saved: Path, ckpt_config) -> None:
    from roll_ckpt_fs import LocalStorage

    report = verify(LocalStorage(str(saved.parent)), str(saved))
    assert report.files == 3 and report.bytes > 0
    err, untouched = _resume(ckpt_config, saved)
    assert err is None and not untouched


@pytest.mark.parametrize("rel,damage,fragment", [
    ("dcp/__0_0.distcp", "truncate", "truncated or altered"),
    ("dcp/__0_0.distcp", "flip", "checksum mismatch"),
    ("dcp/.metadata", "flip", "checksum mismatch"),
    ("trainer_state.json", "flip", "checksum mismatch"),
    ("dcp/__0_0.distcp", "delete", "missing"),
    ("dcp/.metadata", "delete", "missing"),
    ("trainer_state.json", "delete", "missing"),
    ("dcp/__1_0.distcp", "extra", "unexpected file"),
    ("notes.txt", "extra", "unexpected file"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(saved: Path, ckpt_config, rel, damage, fragment) -> None:
    target = saved / rel
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "flip":
        _flip(target)
    elif damage == "delete":
        target.unlink()
    elif damage == "extra":
        target.write_bytes(b"surprise")
    err, untouched = _resume(ckpt_config, saved)
    assert isinstance(err, CheckpointCorruptError), err
    msg = str(err)
    assert f"{rel}: " in msg and fragment in msg and str(saved) in msg
    assert (rel, ) == tuple(f[0] for f in err.faults if f[0] == rel)
    assert untouched, "nothing may be loaded from a damaged checkpoint"


def test_latest_refuses_damaged_newest(saved: Path, ckpt_config) -> None:
    _flip(saved / "dcp" / "__0_0.distcp", offset=10)
    s = tiny_state(seed=3)
    with CheckpointManager.from_config(ckpt_config(resume_from_checkpoint="latest"), quiet=True) as m:
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: checksum mismatch"):
            m.resume(s)


def test_non_existing_path(tmp_path: Path, ckpt_config) -> None:
    target = tmp_path / "nowhere" / "checkpoint-3"
    err, untouched = _resume(ckpt_config, target)
    assert isinstance(err, CheckpointNotFoundError) and isinstance(err, FileNotFoundError)
    assert str(target) in str(err) and "does not exist" in str(err)
    assert untouched


def test_folder_that_is_not_a_checkpoint(tmp_path: Path, ckpt_config) -> None:
    folder = tmp_path / "random"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\0" * 10)
    err, untouched = _resume(ckpt_config, folder)
    assert isinstance(err, CheckpointNotFoundError)
    assert str(folder) in str(err) and "manifest.json" in str(err)
    assert untouched


def test_uncommitted_checkpoint(saved: Path, ckpt_config) -> None:
    uncommitted = saved.parent / "checkpoint-5"
    shutil.copytree(saved, uncommitted)
    (uncommitted / "manifest.json").unlink()
    err, untouched = _resume(ckpt_config, uncommitted)
    assert isinstance(err, CheckpointNotFoundError)
    assert "not a committed checkpoint" in str(err) and str(uncommitted) in str(err)
    assert untouched


def test_garbled_manifest(saved: Path, ckpt_config) -> None:
    (saved / "manifest.json").write_text("{not json")
    err, untouched = _resume(ckpt_config, saved)
    assert isinstance(err, CheckpointCorruptError) and "manifest.json" in str(err)
    assert untouched


class _Boom:
    def __reduce__(self):
        return (print, ("PWNED",))


def test_metadata_pickle_with_code_is_never_run(saved: Path, ckpt_config, capsys) -> None:
    """Even with a manifest that matches (an attacker rewrote both), .metadata is not unpickled freely."""
    payload = pickle.dumps(_Boom())
    (saved / "dcp" / ".metadata").write_bytes(payload)
    manifest = json.loads((saved / "manifest.json").read_text())
    size, digest = hash_bytes(payload)
    manifest["files"]["dcp/.metadata"] = {"size": size, "checksum": digest}
    (saved / "manifest.json").write_bytes(seal(manifest))
    err, untouched = _resume(ckpt_config, saved)
    assert isinstance(err, UnsafeCheckpointError), err
    assert "PWNED" not in capsys.readouterr().out
    assert untouched


def test_manifest_path_escaping_the_checkpoint(saved: Path, ckpt_config) -> None:
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "checksum": "0"}
    (saved / "manifest.json").write_bytes(seal(manifest))
    err, untouched = _resume(ckpt_config, saved)
    assert isinstance(err, CheckpointCorruptError) and "leaves the checkpoint folder" in str(err)
    assert untouched


@pytest.mark.parametrize("entry", ["listed", "unlisted", "size", "checksum"])
def test_both_readers_of_metadata_judge_it_alike(saved: Path, entry: str) -> None:
    """``.metadata`` is read by the job's coordinator (``SafeReader.metadata_bytes``, handed to
    every process by ``decide``) or by DCP's reader (``SafeReader.read_metadata``): the same
    bytes and manifest entry give the same verdict (``format.manifest.content_fault``, the one
    comparison)."""
    import dataclasses
    import types

    from roll_ckpt.format.manifest import read_manifest
    from roll_ckpt.dcp.checked import safe_load_metadata
    from roll_ckpt.dcp.reader import SafeReader
    from roll_ckpt.runtime.distributed import decide
    from roll_ckpt_fs import LocalStorage

    storage = LocalStorage(str(saved.parent))
    files = {k[len("dcp/"):]: v for k, v in read_manifest(storage, str(saved)).files.items() if k.startswith("dcp/")}
    md = files[".metadata"]
    if entry == "unlisted":
        del files[".metadata"]
    elif entry == "size":
        files[".metadata"] = dataclasses.replace(md, size=md.size + 1)
    elif entry == "checksum":
        files[".metadata"] = dataclasses.replace(md, checksum="0" * len(md.checksum))
    coordinator = types.SimpleNamespace(is_coordinator=True, rank=0, broadcast=lambda value: value,
                                        collective_timeout_s=60.0)
    dcp = str(saved / "dcp")
    verdicts = []
    def reader() -> SafeReader:
        return SafeReader(storage, dcp, files=files, checkpoint=str(saved))

    # the job's path (DCPStrategy._load_job), then DCP's
    for read in (lambda: safe_load_metadata(decide(coordinator, reader().metadata_bytes, where=dcp), dcp),
                 lambda: reader().read_metadata()):
        try:
            verdicts.append(type(read()).__name__)
        except CheckpointCorruptError as exc:
            verdicts.append(exc.faults)
    expected = {"listed": "Metadata", "unlisted": [("dcp/.metadata", "not listed in the manifest")],
                "size": [("dcp/.metadata", f"read {md.size} bytes, the manifest says {md.size + 1}")],
                "checksum": [("dcp/.metadata", "checksum mismatch (the content changed after it was written)")]}
    assert verdicts == [expected[entry]] * 2, verdicts
