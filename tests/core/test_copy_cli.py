"""`roll-ckpt copy SRC DST` and copy_checkpoint: one checkpoint or a whole run between
local disk and memory:// (S3 in test_replication_s3.py), streamed, verified at the
destination, committed at the end; damaged sources are refused; interrupted copies leave
nothing committed and can be rerun."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from helpers.damage import flip_byte
from helpers.training import config
from roll_ckpt import CheckpointManager
from roll_ckpt.format import layout
from roll_ckpt.cli import main
from roll_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from roll_ckpt.plugins import get_plugins
from roll_ckpt.manager import open_storage
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
from roll_ckpt.tiers.transfer import CopyInterrupted, committed_manifest, copy_checkpoint
from roll_ckpt.format.manifest import verify

from ._backup_helpers import COPYING_CHILD, kill_when_busy, leftovers, save_steps


def _storage(url: str):
    return open_storage(get_plugins(), "file_system", url, {})


def _saved_run(root: Path, steps=(1, 2)) -> tuple[Path, dict]:
    with CheckpointManager.from_config(config(root), quiet=True) as m:
        snaps = save_steps(m, tiny_state(2), steps)
        run = Path(m.run_dir)
    return run, snaps


def _resume(url: str, target: str) -> tuple[int, dict]:
    fresh = tiny_state(99)
    with CheckpointManager.from_config(config(url, resume_from_checkpoint=target), quiet=True) as m:
        return m.resume(fresh), state_snapshot(fresh)


def test_copy_a_whole_run_local_to_memory_to_local(tmp_path: Path, memory_url: str, capsys) -> None:
    run, snaps = _saved_run(tmp_path / "src")
    assert main(["-q", "copy", str(tmp_path / "src"), memory_url]) == 0
    out = capsys.readouterr().out
    assert out.count("verified at the destination and committed") == 2 and "2 checkpoint(s) copied" in out
    mem = _storage(memory_url)
    assert [(r.run, r.step) for r in layout.committed(mem, mem.root)] == [(run.name, 1), (run.name, 2)]
    for r in layout.committed(mem, mem.root):
        verify(mem, r.path)
        assert committed_manifest(mem, r.path) == (run / f"checkpoint-{r.step}" / "manifest.json").read_bytes()

    back = tmp_path / "back"
    assert main(["-q", "copy", memory_url, str(back)]) == 0
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("manifest.json")) == \
        [f"{run.name}/checkpoint-1/manifest.json", f"{run.name}/checkpoint-2/manifest.json"]
    step, snap = _resume(str(back), str(back / run.name / "checkpoint-2"))
    assert step == 2
    assert_same_state(snap, snaps[2])

    # a rerun copies nothing: what is there is this very checkpoint
    capsys.readouterr()
    assert main(["-q", "copy", str(tmp_path / "src"), memory_url]) == 0
    out = capsys.readouterr().out
    assert "0 checkpoint(s) copied" in out and "2 already there" in out


def test_copy_one_checkpoint(tmp_path: Path, capsys) -> None:
    run, snaps = _saved_run(tmp_path / "src")
    src = run / "checkpoint-1"
    assert main(["-q", "copy", str(src), str(tmp_path / "dst")]) == 0  # into the folder, keeping its name
    assert (tmp_path / "dst" / "checkpoint-1" / "manifest.json").is_file()
    assert main(["-q", "copy", str(src), str(tmp_path / "other" / "checkpoint-1")]) == 0  # to that name
    verify(_storage(str(tmp_path / "other")), str(tmp_path / "other" / "checkpoint-1"))
    step, snap = _resume(str(tmp_path / "dst"), str(tmp_path / "dst" / "checkpoint-1"))
    assert step == 1
    assert_same_state(snap, snaps[1])
    capsys.readouterr()
    # a destination named for another step is refused; so is a copy onto itself
    assert main(["-q", "copy", str(src), str(tmp_path / "x" / "checkpoint-7")]) == 1
    assert "named for step 7" in capsys.readouterr().err
    assert main(["-q", "copy", str(src), str(src)]) == 1
    assert "same location" in capsys.readouterr().err
    # the same checkpoint again is skipped; a different one committed there is never overwritten
    assert main(["-q", "copy", str(tmp_path / "other" / "checkpoint-1"), str(tmp_path / "dst")]) == 0
    assert "already holds this checkpoint" in capsys.readouterr().out
    other_run, _ = _saved_run(tmp_path / "src2", steps=(1,))
    before = (tmp_path / "dst" / "checkpoint-1" / "manifest.json").read_bytes()
    assert main(["-q", "copy", str(other_run / "checkpoint-1"), str(tmp_path / "dst")]) == 1
    assert "a different checkpoint is already committed" in capsys.readouterr().err
    assert (tmp_path / "dst" / "checkpoint-1" / "manifest.json").read_bytes() == before
    assert main(["-q", "copy", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 1
    assert "no such checkpoint or folder" in capsys.readouterr().err


def test_a_damaged_source_is_refused_and_nothing_is_committed(tmp_path: Path, memory_url: str, capsys) -> None:
    run, _ = _saved_run(tmp_path / "src")
    flip_byte(run / "checkpoint-2" / "dcp" / "__0_0.distcp", 100)
    assert main(["-q", "copy", str(run / "checkpoint-2"), memory_url]) == 1
    err = capsys.readouterr().err
    assert "dcp/__0_0.distcp" in err and "checksum mismatch" in err
    mem = _storage(memory_url)
    assert layout.scan(mem, mem.root) == [] and leftovers(mem, mem.root) == []
    # copying the whole run copies the sound checkpoint, reports the damaged one and fails
    assert main(["-q", "copy", str(tmp_path / "src"), memory_url]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "1 checkpoint(s) could not be copied" in captured.err
    assert [r.step for r in layout.committed(mem, mem.root)] == [1]
    assert leftovers(mem, mem.root) == []
    # an uncommitted source folder is skipped, never copied
    (run / "checkpoint-2" / "manifest.json").unlink()
    capsys.readouterr()
    assert main(["-q", "copy", str(tmp_path / "src"), str(tmp_path / "d2")]) == 0
    assert "SKIP" in capsys.readouterr().out
    with pytest.raises(CheckpointNotFoundError):
        copy_checkpoint(_storage(str(run)), str(run / "checkpoint-2"), _storage(str(tmp_path / "d3")),
                        str(tmp_path / "d3" / "checkpoint-2"))


def test_copy_streams_verifies_and_stops_cleanly(tmp_path: Path, memory_url: str) -> None:
    run, _ = _saved_run(tmp_path / "src", steps=(1,))
    src = _storage(str(run))
    path = str(run / "checkpoint-1")
    total = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and p.name != "manifest.json")
    copied, checked = [], []
    for dst_url in (str(tmp_path / "dst"), memory_url):
        dst = _storage(dst_url)
        stop = threading.Event()
        calls = []

        def progress(n: int) -> None:
            calls.append(n)
            if len(calls) == 2:
                stop.set()  # interrupted after the first chunks

        with pytest.raises(CopyInterrupted):
            copy_checkpoint(src, path, dst, dst.join(dst.root, "checkpoint-1"), progress, stop=stop, chunk=4096)
        assert layout.scan(dst, dst.root) == [] and leftovers(dst, dst.root) == [], "nothing left behind"

        report = copy_checkpoint(src, path, dst, dst.join(dst.root, "checkpoint-1"), copied.append,
                                 verify_progress=checked.append, chunk=4096)
        listed = json.loads((Path(path) / "manifest.json").read_text())["files"]
        assert report.bytes == total and not report.skipped and report.files == len(listed)
        assert max(copied) <= 4096  # streamed in chunks
        verify(dst, dst.join(dst.root, "checkpoint-1"))
        assert sum(copied) == sum(checked) == total  # every byte read back at the destination
        copied.clear()
        checked.clear()


def test_a_source_changed_during_the_copy_is_caught(tmp_path: Path) -> None:
    run, _ = _saved_run(tmp_path / "src", steps=(1,))
    src = _storage(str(run))
    path = run / "checkpoint-1"
    dst = _storage(str(tmp_path / "dst"))
    (path / "dcp" / "__0_0.distcp").write_bytes((path / "dcp" / "__0_0.distcp").read_bytes() + b"tail")
    with pytest.raises(CheckpointCorruptError, match="truncated or altered"):
        copy_checkpoint(src, str(path), dst, dst.join(dst.root, "checkpoint-1"))
    assert layout.scan(dst, dst.root) == [] and leftovers(dst, dst.root) == []


def test_a_killed_copy_commits_nothing_and_the_rerun_completes(tmp_path: Path, capsys) -> None:
    run, snaps = _saved_run(tmp_path / "src")
    dst = tmp_path / "dst"
    flag = tmp_path / "copying"
    kill_when_busy(COPYING_CHILD, "copy", str(tmp_path / "src"), str(dst), flag=flag, delay=0.3,
                   env={"COPY_FLAG": str(flag), "SLOW_URL": str(dst)})
    storage = _storage(str(dst))
    assert layout.committed(storage, storage.root) == []
    assert leftovers(storage, storage.root), "the killed copy left its temporary folder"

    assert main(["-q", "copy", str(tmp_path / "src"), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "left by an interrupted copy" in out
    assert [r.step for r in layout.committed(storage, storage.root)] == [1, 2]
    assert leftovers(storage, storage.root) == []
    step, snap = _resume(str(dst), str(dst / run.name / "checkpoint-2"))
    assert step == 2
    assert_same_state(snap, snaps[2])


def test_copy_help_and_ls_json_of_the_copy(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["copy", "--help"])
    assert "DST" in capsys.readouterr().out
    _saved_run(tmp_path / "src", steps=(3,))
    assert main(["-q", "copy", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    capsys.readouterr()
    assert main(["ls", "--json", str(tmp_path / "dst")]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["committed"]) for c in listing["checkpoints"]] == [(3, True)]
    assert listing["in_flight"] == []
