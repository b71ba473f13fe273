"""CheckpointManager over the local disk: layout, when saves happen, resume targets,
retention, stale temporaries, unwritable output_dir."""

from __future__ import annotations

import json
import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from roll_ckpt import CheckpointManager, RollCkptError, StorageError, load_config

from roll_ckpt.format import layout
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state

RUN_RE = re.compile(r"^\d{8}-\d{6}(-\d+)?$")


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("**/checkpoint-*") if (p / "manifest.json").is_file())


def _manager(cfg) -> CheckpointManager:
    return CheckpointManager.from_config(cfg, quiet=True)


def test_the_manifest_names_the_plugins_registered_at_each_commit(ckpt_config, tmp_path: Path) -> None:
    """The versions are looked up once, then again only when the plugins change: a plugin
    registered between two saves is in the second manifest."""
    from roll_ckpt.plugins import Plugins

    plugins = Plugins()
    state = tiny_state(seed=1)
    with CheckpointManager(ckpt_config(exp_name="plugins"), plugins=plugins, quiet=True) as m:
        first = m.save(1, state)
        plugins.register(object(), name="by-hand", distribution="pluggy")  # a distribution with a version
        second = m.save(2, state)
        third = m.save(3, state)
    names = [set(json.loads((Path(p) / "manifest.json").read_text())["plugins"]) for p in (first, second, third)]
    assert "roll-ckpt-core" in names[0] and "pluggy" not in names[0]
    assert "pluggy" in names[1] and names[2] == names[1]


def test_on_disk_layout_and_plain_dcp_load(ckpt_config, tmp_path: Path) -> None:
    state = tiny_state(seed=1)
    with _manager(ckpt_config(exp_name="layout")) as m:
        path = m.save(5, state, metadata={"loss": 0.25, "tag": "manual"})
    root = tmp_path / "ckpt"
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1 and RUN_RE.match(runs[0].name), runs
    ckpt = runs[0] / "checkpoint-5"
    assert path == str(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["dcp", "manifest.json", "trainer_state.json"]
    assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]
    assert not [p for p in runs[0].iterdir() if p.name.startswith((".tmp-", ".inflight-"))]

    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "roll-ckpt" and manifest["step"] == 5 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"dcp/.metadata", "dcp/__0_0.distcp", "trainer_state.json"}
    for rel, ent in manifest["files"].items():
        assert (ckpt / rel).stat().st_size == ent["size"]
    assert "roll-ckpt-core" in manifest["plugins"] and "roll-ckpt-fs" in manifest["plugins"]
    ts = json.loads((ckpt / "trainer_state.json").read_text())
    assert ts["step"] == 5 and ts["world_size"] == 1 and ts["exp_name"] == "layout"
    assert ts["user"] == {"loss": 0.25, "tag": "manual"}

    # the dcp folder is a standard DCP checkpoint: plain torch.distributed.checkpoint.load reads it
    import torch.distributed.checkpoint as dcp

    model = state["model"]
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(ckpt / "dcp"))
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k


def test_timestamp_subdir_false(ckpt_config, tmp_path: Path) -> None:
    with _manager(ckpt_config({"timestamp_subdir": False})) as m:
        m.save(1, tiny_state())
        assert m.run_dir == str(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-1"]


def test_periodic_final_and_manual_saves(ckpt_config, tmp_path: Path) -> None:
    state = tiny_state()
    cfg = ckpt_config(save_steps=3, max_steps=10)
    saved = {}
    with _manager(cfg) as m:
        for step in range(1, cfg.max_steps + 1):
            saved[step] = m.maybe_save(step, state)
            if step == 4:
                m.save(step, state, metadata={"why": "manual"})
        m.save(cfg.max_steps, state, final=True)
        # saving a step already committed by this manager is a no-op returning its path
        again = m.save(cfg.max_steps, state)
        assert again.endswith("checkpoint-10")
    assert [s for s, p in saved.items() if p] == [3, 6, 9]
    assert saved[3].endswith("checkpoint-3")
    assert _committed_steps(tmp_path / "ckpt") == [3, 4, 6, 9, 10]


def test_save_steps_zero_disables_periodic_saves(ckpt_config, tmp_path: Path) -> None:
    with _manager(ckpt_config(save_steps=0)) as m:
        assert all(m.maybe_save(s, tiny_state()) is None for s in range(1, 5))
    assert _committed_steps(tmp_path / "ckpt") == []


def test_invalid_steps_and_closed_manager(ckpt_config) -> None:
    m = _manager(ckpt_config())
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(RollCkptError, match="step must be an integer"):
            m.save(bad, tiny_state())  # type: ignore[arg-type]
    with pytest.raises(RollCkptError, match="JSON"):
        m.save(1, tiny_state(), metadata={"x": object()})
    m.close()
    with pytest.raises(RollCkptError, match="closed"):
        m.save(2, tiny_state())


# ------------------------------------------------------------------------- resume targets


def _two_runs(ckpt_config) -> tuple[str, str, dict, dict]:
    """Run 1 saves steps 2 and 4; run 2 resumes from checkpoint-2 and saves 3."""
    s = tiny_state(seed=10)
    with _manager(ckpt_config()) as m:
        p2 = m.save(2, s)
        snap2 = state_snapshot(s)
        for prm in s["model"].parameters():
            prm.data.mul_(2)
        m.save(4, s)
        run1 = m.run_dir
    s2 = tiny_state(seed=11)
    with _manager(ckpt_config(resume_from_checkpoint=p2)) as m:
        assert m.resume(s2) == 2
        s2["counter"]["seen"] = 333
        p3 = m.save(3, s2)
        snap3 = state_snapshot(s2)
        assert m.run_dir != run1
    return p2, p3, snap2, snap3


def test_resume_false_starts_fresh_even_with_checkpoints(ckpt_config) -> None:
    _two_runs(ckpt_config)
    s = tiny_state(seed=5)
    before = state_snapshot(s)
    with _manager(ckpt_config(resume_from_checkpoint=False)) as m:
        assert m.resume(s) == 0
    assert_same_state(state_snapshot(s), before)


@pytest.mark.parametrize("value", [True, "latest"])
def test_resume_latest_across_run_folders(ckpt_config, tmp_path: Path, value) -> None:
    p2, p3, snap2, snap3 = _two_runs(ckpt_config)
    root = tmp_path / "ckpt"
    # a newer run folder holding a folder that never committed is ignored
    fake = root / "20991231-235959" / "checkpoint-999"
    shutil.copytree(p3, fake)
    (fake / "manifest.json").unlink()
    s = tiny_state(seed=6)
    with _manager(ckpt_config(resume_from_checkpoint=value)) as m:
        assert m.resume(s) == 3
        assert m.resumed.path == p3
        assert m.resumed.trainer_state["resumed_from"] == p2
    assert_same_state(state_snapshot(s), snap3)
    assert s["counter"] == {"seen": 333}


def test_latest_with_nothing_committed_starts_fresh(ckpt_config) -> None:
    s = tiny_state()
    with _manager(ckpt_config(resume_from_checkpoint="latest")) as m:
        assert m.resume(s) == 0


def test_resume_explicit_path(ckpt_config) -> None:
    p2, _, snap2, _ = _two_runs(ckpt_config)
    s = tiny_state(seed=7)
    with _manager(ckpt_config(resume_from_checkpoint=p2)) as m:
        assert m.resume(s) == 2
    assert_same_state(state_snapshot(s), snap2)


def test_resume_explicit_path_from_yaml(tmp_path: Path) -> None:
    state = tiny_state(seed=3)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(textwrap.dedent(f"""
        exp_name: yamlrun
        checkpoint_config:
          type: file_system
          output_dir: {tmp_path}/models/${{exp_name}}
        save_steps: 2
    """))
    with _manager(load_config(cfg_path)) as m:
        m.maybe_save(2, state)
        path = m.save(3, state, final=True)
    cfg_path.write_text(cfg_path.read_text() + f"resume_from_checkpoint: {path}\n")
    s = tiny_state(seed=4)
    with _manager(load_config(cfg_path)) as m:
        assert m.resume(s) == 3
    assert_same_state(state_snapshot(s), state_snapshot(state))


# ------------------------------------------------------------------------- retention


def test_retention_sorts_steps_numerically(ckpt_config, tmp_path: Path) -> None:
    s = tiny_state()
    with _manager(ckpt_config({"max_ckpt_to_keep": 2})) as m:
        for step in (9, 10, 100):
            m.save(step, s)
    assert _committed_steps(tmp_path / "ckpt") == [10, 100]


def test_retention_keeps_newest_and_spans_runs(ckpt_config, tmp_path: Path) -> None:
    s = tiny_state()
    with _manager(ckpt_config({"max_ckpt_to_keep": 1})) as m:
        for step in (1, 2, 3):
            m.save(step, s)
            assert _committed_steps(tmp_path / "ckpt") == [step]
    with _manager(ckpt_config({"max_ckpt_to_keep": 2}, resume_from_checkpoint=True)) as m:
        assert m.resume(s) == 3
        m.save(1, s)  # a newer run: its step 1 is newer than the older run's step 3
        m.save(2, s)
        newest = m.save(3, s)
    refs = layout.committed(m.storage, m.storage.root)
    assert [r.step for r in refs] == [2, 3] and refs[-1].path == newest
    assert {r.run for r in refs} == {Path(newest).parent.name}


def test_retention_zero_keeps_all(ckpt_config, tmp_path: Path) -> None:
    s = tiny_state()
    with _manager(ckpt_config({"max_ckpt_to_keep": 0})) as m:
        for step in range(1, 6):
            m.save(step, s)
    assert _committed_steps(tmp_path / "ckpt") == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------------- crashed saves

CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    from roll_ckpt import CheckpointManager, load_config
    from roll_ckpt.format.commit import PendingCheckpoint
    from roll_ckpt.testing import tiny_state
    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": sys.argv[1]}})
    m = CheckpointManager.from_config(cfg, quiet=True)
    s = tiny_state()
    m.save(1, s)
    def die(*a, **k):  # everything is written; the process dies before the commit
        print("dying", flush=True)
        os._exit(3)
    PendingCheckpoint.commit = die
    m.save(2, s)
""")


def test_stale_temp_from_dead_process_is_ignored_then_cleaned(ckpt_config, tmp_path: Path, py) -> None:
    root = tmp_path / "ckpt"
    res = py(["-c", CRASH_SCRIPT, str(root)])
    assert res.returncode == 3 and "dying" in res.stdout, res.stderr
    run = next(p for p in root.iterdir() if p.is_dir())
    tmp = [p.name for p in run.iterdir() if p.name.startswith(".tmp-checkpoint-2-")]
    marker = [p.name for p in run.iterdir() if p.name.startswith(".inflight-checkpoint-2-")]
    assert len(tmp) == 1 and len(marker) == 1, sorted(p.name for p in run.iterdir())
    assert (run / tmp[0] / "dcp" / ".metadata").exists(), "the crashed save had written its data"
    owner = json.loads((run / marker[0]).read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(owner["pid"], 0)

    s = tiny_state(seed=9)
    with _manager(ckpt_config(resume_from_checkpoint="latest")) as m:
        assert m.resume(s) == 1, "the uncommitted step 2 is never resumed from"
        assert (run / tmp[0]).exists()
        m.save(5, s)
    assert not (run / tmp[0]).exists() and not (run / marker[0]).exists()
    assert _committed_steps(root) == [1, 5]


def test_orphan_temp_without_marker_is_cleaned_when_old(ckpt_config, tmp_path: Path) -> None:
    with _manager(ckpt_config()) as m:
        m.save(1, tiny_state())
        run = Path(m.run_dir)
    orphan = run / ".tmp-checkpoint-7-abcdef"
    (orphan / "dcp").mkdir(parents=True)
    (orphan / "dcp" / "__0_0.distcp").write_bytes(b"x" * 100)
    recent = run / ".tmp-checkpoint-8-fedcba"
    recent.mkdir()
    now = os.stat(orphan).st_mtime
    os.utime(orphan, (now - 3600, now - 3600))
    os.utime(recent, (now + 60, now + 60))  # "just created", however slow this machine is
    with _manager(ckpt_config()) as m:
        m.save(1, tiny_state())
    assert not orphan.exists()
    assert recent.exists(), "a temporary folder just created may belong to a writer that is starting"


def test_existing_committed_step_is_never_overwritten(ckpt_config, tmp_path: Path) -> None:
    with _manager(ckpt_config({"timestamp_subdir": False})) as m:
        m.save(1, tiny_state(seed=1))
    before = (tmp_path / "ckpt" / "checkpoint-1" / "manifest.json").read_bytes()
    with _manager(ckpt_config({"timestamp_subdir": False})) as m:
        with pytest.raises(RollCkptError, match="already exists"):
            m.save(1, tiny_state(seed=2))
    assert (tmp_path / "ckpt" / "checkpoint-1" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-1"]


# ------------------------------------------------------------------------- unwritable


def test_output_dir_below_a_file(ckpt_config, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    cfg = ckpt_config({"output_dir": str(tmp_path / "afile" / "ckpts")})
    with _manager(cfg) as m:
        with pytest.raises(StorageError) as info:
            m.save(1, tiny_state())
    msg = str(info.value)
    assert "checkpoint_config.output_dir" in msg and str(tmp_path / "afile" / "ckpts") in msg
    assert "writable" in msg


def test_output_dir_on_read_only_mount(ckpt_config, tmpfs) -> None:
    ro = tmpfs("1m", readonly=True)
    cfg = ckpt_config({"output_dir": str(ro / "ckpts")})
    with _manager(cfg) as m:
        with pytest.raises(StorageError, match=r"cannot write under checkpoint_config.output_dir .*Read-only file system"):
            m.save(1, tiny_state())


def test_retention_leaves_another_live_run_alone(ckpt_config, tmp_path: Path) -> None:
    """Two jobs sharing an output_dir: one's retention never removes the other's checkpoints
    while that job runs; once it is gone, its checkpoints count like any older ones."""
    import subprocess
    import sys

    s = tiny_state()
    with _manager(ckpt_config()) as other:
        other.save(1, s)
        other.save(2, s)
        other_run = Path(other.run_dir)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        record = json.loads((other_run / ".run.json").read_text())
        record["pid"] = sleeper.pid  # the other job's process: alive, not us
        (other_run / ".run.json").write_text(json.dumps(record))
        with _manager(ckpt_config({"max_ckpt_to_keep": 1})) as m:
            m.save(10, s)
            m.save(11, s)
            mine = Path(m.run_dir)
            assert sorted(p.name for p in other_run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
            assert sorted(p.name for p in mine.glob("checkpoint-*")) == ["checkpoint-11"]
            sleeper.kill()
            sleeper.wait(timeout=30)
            m.save(12, s)
        assert _committed_steps(tmp_path / "ckpt") == [12]
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
