"""Untrusted checkpoints: loading one never runs code, never reads outside its folder, and
with ``ROLL_CKPT_SIGNING_KEY`` only checkpoints signed with that key are accepted.

* DCP's ``.metadata`` is a pickle. One that would run code (create a file) when unpickled
  is planted - with the manifest left alone (its checksum no longer matches) and with a
  manifest rewritten to match - and ``roll-ckpt verify``, ``inspect``, ``export`` and
  ``manager.resume`` are run on it: the file is never created.
* A non-tensor value in a ``.distcp`` whose ``torch.load`` would run code: weights_only
  refuses it, naming the file and the key.
* A manifest listing ``../x``, ``/etc/passwd``... and links planted in the folder.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from roll_ckpt import CheckpointCorruptError, CheckpointManager, load_config
from roll_ckpt.errors import UnsafeCheckpointError
from roll_ckpt.cli import main as cli
from roll_ckpt.format.manifest import hash_bytes
from roll_ckpt.format.manifest import seal
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import LocalStorage

from ._support import copy_of, save_template
from ._support import resume_untouched as _resume

SIGNING = "ROLL_CKPT_SIGNING_KEY"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_template(tmp_path_factory.mktemp("untrusted"), 5)


@pytest.fixture
def ckpt(template: Path, tmp_path: Path) -> Path:
    return copy_of(template, tmp_path)


def _reduce_pickle(module: str, name: str, args: tuple) -> bytes:
    """A protocol-2 pickle that calls ``module.name(*args)`` when loaded (GLOBAL + REDUCE)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + pickle.dumps(args, protocol=2)[2:-1] + b"R."


def _stack_global_pickle(module: str, name: str, args: tuple) -> bytes:
    """The same with protocol 4's STACK_GLOBAL, which resolves dotted names (``os.system``)."""
    def text(x: str) -> bytes:
        return b"\x8c" + bytes([len(x.encode())]) + x.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + pickle.dumps(args, protocol=2)[2:-1] + b"R."


def payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that create ``marker`` when unpickled without restrictions."""
    m = str(marker)
    return {
        "os.system": _reduce_pickle("os", "system", (f"touch {m}",)),
        "posix.system": _reduce_pickle("posix", "system", (f"touch {m}",)),
        "builtins.exec": _reduce_pickle("builtins", "exec", (f"open({m!r}, 'w').close()",)),
        "subprocess.call": _reduce_pickle("subprocess", "call", (["touch", m],)),
        # torch is partly admitted (dtypes, layouts); its functions are not
        "torch.save": _reduce_pickle("torch", "save", ({}, m)),
        # an admitted module, reaching further through a dotted name
        "torch.serialization.os.system": _stack_global_pickle("torch.serialization", "os.system", (f"touch {m}",)),
    }


@pytest.fixture(scope="module")
def exploits_work(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every payload really creates its file under a plain unpickler (they only touch a file
    in a temporary folder): otherwise the tests below would prove nothing."""
    folder = tmp_path_factory.mktemp("exploits")
    missing = []
    for name in payloads(folder / "x"):
        marker = folder / name.replace(".", "_")
        pickle.loads(payloads(marker)[name])  # noqa: S301 - the point: this one is unrestricted
        if not marker.exists():
            missing.append(name)
    assert not missing, f"payloads that do not run code: {missing}"


def _rewrite_manifest(ckpt: Path, **files: bytes) -> None:
    """What an attacker with write access does: list the planted files with matching sizes
    and checksums, and reseal the manifest (its own checksum is not a secret)."""
    body = json.loads((ckpt / "manifest.json").read_text())
    for rel, data in files.items():
        size, digest = hash_bytes(data)
        body["files"][rel] = {"size": size, "checksum": digest}
    (ckpt / "manifest.json").write_bytes(seal(body))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli(["--quiet", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


@pytest.mark.parametrize("manifest", ["left-alone", "rewritten"])
@pytest.mark.parametrize("payload", list(payloads(Path("/x"))))
def test_metadata_pickle_that_runs_code_is_never_unpickled(ckpt: Path, tmp_path: Path, payload: str,
                                                           manifest: str, exploits_work: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "PWNED"
    data = payloads(marker)[payload]
    (ckpt / "dcp" / ".metadata").write_bytes(data)
    if manifest == "rewritten":
        _rewrite_manifest(ckpt, **{"dcp/.metadata": data})
    storage = LocalStorage(str(ckpt.parent))

    code, out = _cli(capsys, "verify", str(ckpt))
    if manifest == "left-alone":  # the checksum no longer matches: refused before any unpickling
        assert code == 1 and "dcp/.metadata" in out, out
        with pytest.raises(CheckpointCorruptError, match=r"dcp/\.metadata"):
            verify(storage, str(ckpt))
    else:  # verify compares bytes with the manifest; it never unpickles anything
        assert code == 0, out
    assert not marker.exists()

    code, out = _cli(capsys, "inspect", str(ckpt))
    assert code == 1 and ".metadata" in out, out
    if manifest == "rewritten":
        assert "refused to unpickle" in out, out
    assert not marker.exists()

    target = tmp_path / "out.safetensors"
    code, out = _cli(capsys, "export", str(ckpt), "--out", str(target))
    assert code == 1 and ".metadata" in out and not target.exists(), out
    assert not marker.exists()

    err, untouched = _resume(ckpt)
    assert isinstance(err, CheckpointCorruptError), repr(err)
    assert ".metadata" in str(err)
    if manifest == "rewritten":
        assert isinstance(err, UnsafeCheckpointError) and "refused to unpickle" in str(err)
    assert untouched and not marker.exists()


def test_installed_cli_never_runs_a_metadata_pickle(ckpt: Path, tmp_path: Path) -> None:
    """The same through the console script, in a fresh process."""
    marker = tmp_path / "PWNED"
    data = payloads(marker)["os.system"]
    (ckpt / "dcp" / ".metadata").write_bytes(data)
    _rewrite_manifest(ckpt, **{"dcp/.metadata": data})
    exe = Path(sys.executable).with_name("roll-ckpt")
    args = [str(exe)] if exe.exists() else [sys.executable, "-m", "roll_ckpt.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLL_CKPT_")}
    proc = subprocess.run([*args, "--quiet", "inspect", str(ckpt)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refused to unpickle" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


class _Evil:
    """A value whose pickle calls ``os.system`` when loaded (pickling it runs nothing)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_non_tensor_value_that_runs_code_is_refused_by_weights_only(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "PWNED"
    out = tmp_path / "ckpt"
    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": str(out),
                                             "timestamp_subdir": False}})
    state = tiny_state(seed=1)
    state["extra"] = _Evil(marker)  # written by DCP with torch.save: a full pickle in the .distcp
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        path = m.save(1, state)
    assert not marker.exists()
    storage = LocalStorage(str(out))
    verify(storage, path)  # the bytes are the ones written: only loading can tell

    victim = tiny_state(seed=2)
    victim["extra"] = None
    before = state_snapshot({k: v for k, v in victim.items() if k != "extra"})
    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": str(out),
                                             "timestamp_subdir": False}, "resume_from_checkpoint": path})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        with pytest.raises(UnsafeCheckpointError) as info:
            m.resume(victim)
    assert not marker.exists()
    msg = str(info.value)
    assert "refused to unpickle" in msg and "per_rank.0.extra" in msg and ".distcp" in msg, msg
    assert "system" in msg, msg  # says what it refused
    assert_same_state(state_snapshot({k: v for k, v in victim.items() if k != "extra"}), before)

    # inspect lists the key without reading it; export leaves non-tensors out: neither runs it
    code, text = _cli(capsys, "inspect", path)
    assert code == 0 and "per_rank.0.extra" in text, text
    code, text = _cli(capsys, "export", path, "--out", str(tmp_path / "m.safetensors"))
    assert code == 0, text
    assert not marker.exists()


@pytest.mark.parametrize("bad", ["../x", "../../outside.bin", "/etc/passwd", "dcp/../../x", "dcp//x",
                                 "./trainer_state.json", "C:/x", "dcp\\..\\x", ""])
def test_manifest_path_that_leaves_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path, bad: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # a real file at the escaping path with a matching checksum: following it would "verify"
    outside = tmp_path / "ckpt" / "x"
    outside.write_bytes(b"outside data")
    _rewrite_manifest(ckpt, **{bad: outside.read_bytes()})
    storage = LocalStorage(str(ckpt.parent))
    with pytest.raises(UnsafeCheckpointError) as info:
        verify(storage, str(ckpt))
    assert ("manifest.json", f"lists the path {bad!r}, which leaves the checkpoint folder") in info.value.faults
    code, out = _cli(capsys, "verify", str(ckpt))
    assert code == 1 and "leaves the checkpoint folder" in out
    err, untouched = _resume(ckpt)
    assert isinstance(err, UnsafeCheckpointError) and "leaves the checkpoint folder" in str(err)
    assert untouched


def test_a_link_in_place_of_a_data_file_is_refused(ckpt: Path, tmp_path: Path) -> None:
    rel = sorted((ckpt / "dcp").glob("*.distcp"))[0]
    copy = tmp_path / "elsewhere.distcp"
    shutil.copy(rel, copy)  # same bytes: only the link itself is wrong
    rel.unlink()
    rel.symlink_to(copy)
    name = f"dcp/{rel.name}"
    with pytest.raises(CheckpointCorruptError) as info:
        verify(LocalStorage(str(ckpt.parent)), str(ckpt))
    assert name in [f[0] for f in info.value.faults], info.value.faults
    err, untouched = _resume(ckpt)
    assert isinstance(err, CheckpointCorruptError) and name in str(err) and untouched


def test_a_link_planted_as_an_extra_file_is_refused(ckpt: Path) -> None:
    (ckpt / "dcp" / "__9_0.distcp").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointCorruptError) as info:
        verify(LocalStorage(str(ckpt.parent)), str(ckpt))
    assert ("dcp/__9_0.distcp", "unexpected file, not listed in the manifest") in info.value.faults
    err, _ = _resume(ckpt)
    assert isinstance(err, CheckpointCorruptError) and "dcp/__9_0.distcp" in str(err)


def test_a_linked_dcp_folder_is_refused(ckpt: Path, tmp_path: Path) -> None:
    shutil.move(str(ckpt / "dcp"), str(tmp_path / "real-dcp"))
    (ckpt / "dcp").symlink_to(tmp_path / "real-dcp", target_is_directory=True)
    with pytest.raises(CheckpointCorruptError) as info:
        verify(LocalStorage(str(ckpt.parent)), str(ckpt))
    names = [f[0] for f in info.value.faults]
    assert "dcp/.metadata" in names and "dcp" in names, info.value.faults
    err, untouched = _resume(ckpt)
    assert isinstance(err, CheckpointCorruptError) and untouched


def test_a_link_in_place_of_the_manifest_is_refused(ckpt: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "manifest-copy.json"
    shutil.copy(ckpt / "manifest.json", copy)
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").symlink_to(copy)
    with pytest.raises(UnsafeCheckpointError, match=r"manifest\.json: is a symbolic link"):
        verify(LocalStorage(str(ckpt.parent)), str(ckpt))
    code, out = _cli(capsys, "verify", str(ckpt))
    assert code == 1 and "manifest.json: is a symbolic link" in out
    err, untouched = _resume(ckpt)
    assert isinstance(err, UnsafeCheckpointError) and untouched


# --------------------------------------------------------------------------- signing


def _save(out: Path, step: int, seed: int) -> str:
    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": str(out),
                                             "timestamp_subdir": False}})
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        return m.save(step, tiny_state(seed=seed))


def test_signed_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    unsigned = _save(out, 1, seed=1)
    monkeypatch.setenv(SIGNING, "key-of-another-team")
    other_key = _save(out, 2, seed=2)
    monkeypatch.setenv(SIGNING, "our-signing-key")
    signed = _save(out, 3, seed=3)
    assert json.loads(Path(signed, "manifest.json").read_text())["signature"]["algorithm"] == "hmac-sha256"
    storage = LocalStorage(str(out))

    verify(storage, signed)
    err, untouched = _resume(Path(signed))
    assert err is None and not untouched  # the signed one loads

    for path, words in ((unsigned, "unsigned, but ROLL_CKPT_SIGNING_KEY is set"),
                        (other_key, "signature does not match")):
        with pytest.raises(UnsafeCheckpointError, match=words):
            verify(storage, path)
        err, untouched = _resume(Path(path))
        assert isinstance(err, UnsafeCheckpointError) and words in str(err) and untouched
        code, text = _cli(capsys, "verify", path)
        assert code == 1 and words in text

    # an attacker without the key rewrites the manifest of a signed checkpoint (resealing its
    # checksum, keeping the old signature) to list a planted .metadata: refused
    marker = tmp_path / "PWNED"
    data = payloads(marker)["os.system"]
    Path(signed, "dcp", ".metadata").write_bytes(data)
    body = json.loads(Path(signed, "manifest.json").read_text())
    sig = body["signature"]
    size, digest = hash_bytes(data)
    body["files"]["dcp/.metadata"] = {"size": size, "checksum": digest}
    monkeypatch.delenv(SIGNING)
    resealed = json.loads(seal(body))
    resealed["signature"] = sig
    Path(signed, "manifest.json").write_text(json.dumps(resealed, indent=1, sort_keys=True))
    monkeypatch.setenv(SIGNING, "our-signing-key")
    with pytest.raises(UnsafeCheckpointError, match="signature does not match"):
        verify(storage, signed)
    err, untouched = _resume(Path(signed))
    assert isinstance(err, UnsafeCheckpointError) and untouched and not marker.exists()

    # without a key set, signatures are not required (and the unsigned one loads)
    monkeypatch.delenv(SIGNING)
    verify(storage, unsigned)
