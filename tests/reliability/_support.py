"""Helpers shared by the reliability tests: the crash workers' fork server and logs, checkpoint
snapshots, leftovers of crashed saves, and the S3 test server (SeaweedFS)."""

from __future__ import annotations

import re

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers import forkserver
from helpers.forkserver import read_events
from helpers.training import config
from roll_ckpt.format import layout
from roll_ckpt.format.commit import MARKER_PREFIX
from roll_ckpt.format.layout import TMP_PREFIX
from roll_ckpt.format.manifest import MANIFEST_NAME
from roll_ckpt.contracts import Storage
from roll_ckpt.format.manifest import list_files, verify

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_crash_child.py"


def kills_per_mode() -> int:
    """``ROLL_CKPT_KILLS`` (default 5): SIGKILLs per crash mode (``make test-reliability``: 50)."""
    try:
        n = int(os.environ.get("ROLL_CKPT_KILLS", "5"))
    except ValueError:
        raise pytest.UsageError("ROLL_CKPT_KILLS must be a whole number") from None
    return max(1, n)


# --------------------------------------------------------------------------- S3 (SeaweedFS)

def s3server_module() -> Any:
    """``tests/backend_fs/s3server.py`` (the SeaweedFS fixture), or ``None`` when it is missing."""
    try:
        from backend_fs import s3server  # tests/ is on sys.path (pytest's rootdir-relative import)

        return s3server
    except ImportError:
        pass
    import importlib.util

    path = HERE.parent / "backend_fs" / "s3server.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_roll_ckpt_tests_s3server", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def s3_unavailable_reason() -> str | None:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return "s3fs is not installed (pip install 'roll-ckpt[s3]')"
    mod = s3server_module()
    if mod is None:
        return "the SeaweedFS fixture tests/backend_fs/s3server.py does not exist"
    try:
        mod.check_runs(mod.weed_binary())
    except mod.SeaweedUnavailable as exc:
        return f"no S3 server for these tests: {exc}"
    return None


def save_template(folder: Path, step: int) -> Path:
    """One committed checkpoint of ``tiny_state(seed=1)`` at ``step``, straight under
    ``folder/ckpt`` (no run folder): the original the damage tests copy."""
    from roll_ckpt import CheckpointManager
    from roll_ckpt.testing import tiny_state

    with CheckpointManager.from_config(config(folder / "ckpt", timestamp_subdir=False), quiet=True) as m:
        return Path(m.save(step, tiny_state(seed=1)))


def copy_of(template: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint folder ``template`` under ``tmp_path/ckpt``, to damage."""
    dst = tmp_path / "ckpt" / template.name
    shutil.copytree(template, dst)
    return dst


def resume_untouched(ckpt: Path) -> tuple[BaseException | None, bool]:
    """Resume a fresh state from the checkpoint folder ``ckpt``: the error it raised (or
    ``None``), and whether the state is still exactly as it was before."""
    from roll_ckpt import CheckpointManager
    from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state

    state = tiny_state(seed=7)
    before = state_snapshot(state)
    cfg = config(ckpt.parent, timestamp_subdir=False, resume_from_checkpoint=str(ckpt))
    err = None
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        try:
            m.resume(state)
        except BaseException as exc:  # noqa: BLE001 - the caller checks it
            err = exc
    try:
        assert_same_state(state_snapshot(state), before)
        return err, True
    except AssertionError:
        return err, False


def offline_aws() -> contextlib.AbstractContextManager[dict[str, str]]:
    """The environment of test_s3.py: dummy AWS credentials, no metadata service, dead default endpoint."""
    return s3server_module().offline_aws()


def restart_seaweed(server: Any) -> None:
    """Start ``weed mini`` again with the same ports and data folder (after it was killed)."""
    mod = s3server_module()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=mod.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=mod.SECRET_KEY,
               AWS_EC2_METADATA_DISABLED="true", HOME=str(server.data_dir))
    for sock in ("filer.sock", "s3.sock"):
        with contextlib.suppress(FileNotFoundError):
            (server.data_dir / sock).unlink()
    with open(server.log_path, "ab") as log:
        server.proc = subprocess.Popen(server.proc.args, cwd=server.data_dir, env=env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=mod._die_with_parent)
    mod._wait_ready(server, time.monotonic() + 2 * mod.START_TIMEOUT_S)


# --------------------------------------------------------------------------- crash workers

def ForkServer(env: dict[str, str] | None = None) -> forkserver.ForkServer:  # noqa: N802 - builds the shared class
    """``_crash_child.py serve``: forks warm crash workers on request."""
    return forkserver.ForkServer(CHILD, env)


_PASSED_OVER = re.compile(r"roll-ckpt: (?:resuming from an older checkpoint|starting fresh \(step 0\)); passed over "
                          r"\d+ folder\(s\).*?\(checkpoint_config\.on_unusable_checkpoint: raise makes this an error\)\n?",
                          re.S)


@dataclass
class WorkerLog:
    """The events a crash worker wrote (see ``_crash_child.py``)."""

    path: Path
    events: list[tuple[str, list[str], float]] = field(default_factory=list)

    def read(self) -> "WorkerLog":
        self.events = read_events(self.path)
        return self

    def first(self, kind: str) -> tuple[list[str], float] | None:
        for k, rest, t in self.events:
            if k == kind:
                return rest, t
        return None

    def all(self, kind: str) -> list[tuple[list[str], float]]:
        return [(rest, t) for k, rest, t in self.events if k == kind]

    def last(self) -> tuple[str, list[str], float] | None:
        return self.events[-1] if self.events else None

    def errors(self) -> str:
        """What the worker wrote on stderr, but for the WARNING that names the folders a resume
        of ``latest`` passed over (after a kill: the save it cut short, which is expected)."""
        err = Path(str(self.path) + ".err")
        text = err.read_text(errors="replace") if err.exists() else ""
        return re.sub(_PASSED_OVER, "", text)[-4000:]


# --------------------------------------------------------------------------- checkpoints

@dataclass(frozen=True)
class Snapshot:
    """A committed checkpoint as it was: its manifest bytes and the sizes of its files."""

    path: str
    step: int
    manifest: bytes
    sizes: dict[str, int]


def read_bytes(storage: Storage, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def snapshot(storage: Storage, path: str, step: int) -> Snapshot:
    """Verify the committed checkpoint at ``path`` fully and remember it."""
    manifest = read_bytes(storage, storage.join(path, MANIFEST_NAME))
    verify(storage, path)
    sizes = list_files(storage, path)
    return Snapshot(path, step, manifest, sizes)


def assert_unchanged(storage: Storage, snap: Snapshot, *, checksums: bool) -> None:
    """The checkpoint is still committed, with the same manifest bytes and files.

    With ``checksums`` every file is hashed (verify); otherwise names and sizes are compared.
    """
    manifest_path = storage.join(snap.path, MANIFEST_NAME)
    assert storage.exists(manifest_path), f"committed checkpoint {snap.path} lost its manifest"
    assert read_bytes(storage, manifest_path) == snap.manifest, f"the manifest of {snap.path} changed"
    if checksums:
        verify(storage, snap.path)
    sizes = list_files(storage, snap.path)
    assert sizes == snap.sizes, f"the files of {snap.path} changed: {sizes} != {snap.sizes}"


def leftovers(storage: Storage, root: str) -> dict[str, list[str]]:
    """Traces of saves that never finished: temporary folders, owner markers, manifest-less
    checkpoint folders (root and every run folder)."""
    out: dict[str, list[str]] = {"tmp": [], "markers": [], "uncommitted": []}
    folders = [root] + [p for _, p in layout.run_folders(storage, root)]
    for folder in folders:
        for e in storage.list(folder):
            if e.is_dir and e.name.startswith(TMP_PREFIX):
                out["tmp"].append(e.path)
            elif not e.is_dir and e.name.startswith(MARKER_PREFIX):
                out["markers"].append(e.path)
    out["uncommitted"] = [r.path for r in layout.scan(storage, root) if not r.committed]
    return {k: sorted(v) for k, v in out.items()}
