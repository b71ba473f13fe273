"""The third-party ``example_dir`` backend (tests/plugins/example_backend, installed as its own
distribution for these tests only: the ``example_backend`` fixture of tests/conftest.py)
passes the conformance suite and is selected through the entry point."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from roll_ckpt.testing import BackendConformance

pytestmark = pytest.mark.usefixtures("example_backend")

SCRIPT = textwrap.dedent("""
    import sys, json, torch
    from roll_ckpt import CheckpointManager, load_config
    from roll_ckpt.testing import tiny_state, state_snapshot
    cfg = load_config(sys.argv[1])
    mgr = CheckpointManager.from_config(cfg, quiet=True)
    print("storage", type(mgr.storage).__module__, type(mgr.storage).__name__)
    state = tiny_state(seed=int(sys.argv[2]))
    start = mgr.resume(state)
    print("start", start)
    for step in range(start + 1, cfg.max_steps + 1):
        mgr.maybe_save(step, state)
    mgr.save(cfg.max_steps, state, final=True)
    mgr.close()
    torch.save(state_snapshot(state), sys.argv[3])
""")


class TestExampleDirBackend(BackendConformance):
    backend_type = "example_dir"

    @pytest.fixture
    def storage(self, tmp_path: Path):
        from roll_ckpt.plugins import Plugins

        record = Plugins().backend("example_dir")
        assert record.distribution == "roll-ckpt-example-backend"
        return record.factory(str(tmp_path / "root"), {})


def test_yaml_type_selects_the_entry_point_and_resumes(tmp_path: Path, py) -> None:
    out = tmp_path / "store"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        exp_name: third-party
        checkpoint_config:
          type: example_dir
          output_dir: {out}/${{exp_name}}
        save_steps: 2
        max_steps: 5
        resume_from_checkpoint: latest
    """))
    first = py(["-c", SCRIPT, str(cfg), "1", str(tmp_path / "a.pt")])
    assert first.returncode == 0, first.stderr
    assert "storage roll_ckpt_example_backend.store DirStore" in first.stdout
    assert "start 0" in first.stdout
    root = out / "third-party"
    steps = sorted(int(p.name.split("-")[1]) for p in root.glob("*/checkpoint-*") if (p / "manifest.json").exists())
    assert steps == [2, 4, 5]
    # manifest-last commit (no rename): no temporary folders were ever used
    assert not list(root.glob("*/.tmp-*"))

    # A second process with a different init resumes from checkpoint-5 through the same YAML.
    second = py(["-c", SCRIPT, str(cfg), "7", str(tmp_path / "b.pt")])
    assert second.returncode == 0, second.stderr
    assert "start 5" in second.stdout
    import torch

    from roll_ckpt.testing import assert_same_state

    assert_same_state(torch.load(tmp_path / "a.pt", weights_only=False),
                      torch.load(tmp_path / "b.pt", weights_only=False))


def test_blocking_the_distribution_hides_the_backend(tmp_path: Path, py) -> None:
    code = textwrap.dedent(f"""
        from roll_ckpt import CheckpointManager, load_config
        from roll_ckpt.errors import UnknownPluginError
        try:
            CheckpointManager.from_config(load_config({{"checkpoint_config": {{"type": "example_dir",
                                                       "output_dir": {str(tmp_path)!r}}}}}))
        except UnknownPluginError as e:
            print("ERR", e)
    """)
    res = py(code, env={"ROLL_CKPT_BLOCKED_PLUGINS": "roll-ckpt-example-backend"})
    assert res.returncode == 0, res.stderr
    assert "ERR checkpoint_config.type" in res.stdout and "'example_dir'" in res.stdout
    assert "installed: file_system" in res.stdout
