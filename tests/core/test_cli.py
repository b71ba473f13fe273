"""The ``roll-ckpt`` command line: every command's success and user-error paths.

User errors must print one line ``roll-ckpt: error: ...`` on stderr, exit non-zero
(2 for usage, 1 otherwise) and never show a traceback.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.damage import flip_byte
from helpers.launch import run_python
from helpers.training import config, train_step
from roll_ckpt.format.manifest import seal
from roll_ckpt import CheckpointManager
from roll_ckpt.cli import main

TIMEOUT = 120


# --------------------------------------------------------------------------- helpers

class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)).double())


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "optimizer": opt, "scheduler": sched, "counters": {"seen": 0}}


def _save_steps(output_dir: str, steps: list[int], state: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Train and save ``steps`` (synchronously) into one run folder under ``output_dir``."""
    state = state or _state()
    paths = []
    with CheckpointManager.from_config(config(output_dir, exp_name="cli"), quiet=True) as manager:
        for step in steps:
            train_step(state, (8, 4), scheduler=True, count=("counters", "seen", 8))
            paths.append(manager.save(step, state, final=True, metadata={"loss": 0.5}))
    return state, paths


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any], list[Path]]:
    """Three committed checkpoints (steps 1, 2, 10) under tmp_path/ckpt; the final state."""
    root = tmp_path / "ckpt"
    state, paths = _save_steps(str(root), [1, 2, 10])
    return root, state, [Path(p) for p in paths]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, expected_rc: int = 1, *needles: str) -> None:
    assert rc == expected_rc, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("roll-ckpt: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def subprocess_cli(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_python(["-m", "roll_ckpt.cli", *argv], env=env, timeout=TIMEOUT, cwd=cwd)


# --------------------------------------------------------------------------- general

def test_import_is_cheap() -> None:
    code = ("import sys, roll_ckpt.cli; roll_ckpt.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'torch.distributed', 'fsspec') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = run_python(code, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("plugins", "ls", "verify", "inspect", "prune", "export", "demo"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "roll-ckpt" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["ls"],
    ["export", "somewhere"],
    ["prune", "somewhere"],
    ["prune", "somewhere", "--keep", "many"],
    ["ls", "somewhere", "--storage-option", "novalue"],
    ["demo", "--resume", "--fresh"],
    ["demo", "--nproc", "0"],
])
def test_usage_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert_one_line_error(rc, err, 2)
    assert "--help" in err


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    for cmd in (["verify", str(tmp_path / "nope")], ["ls", str(tmp_path / "nope")]):
        proc = subprocess_cli(*cmd)
        assert_one_line_error(proc.returncode, proc.stderr, 1, str(tmp_path / "nope"))
        assert proc.stdout == ""


@pytest.mark.parametrize("argv", [
    ["verify", "{nope}"], ["ls", "{nope}"], ["inspect", "{nope}"], ["export", "{nope}", "--out", "{tmp}/x.st"],
    ["prune", "{nope}", "--keep", "1"], ["ls", "{tmp}", "--type", "file_sytem"],
])
def test_missing_path_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]) -> None:
    argv = [a.format(nope=tmp_path / "nope", tmp=tmp_path) for a in argv]
    rc, out, err = run_cli(capsys, *argv)
    assert_one_line_error(rc, err, 1)
    assert out == ""


def test_quiet_sets_environment(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLL_CKPT_QUIET", raising=False)
    rc, _, _ = run_cli(capsys, "--quiet", "plugins")
    assert rc == 0 and os.environ["ROLL_CKPT_QUIET"] == "1"


def test_unknown_backend_type(capsys: pytest.CaptureFixture[str], saved) -> None:
    root, _, _ = saved
    rc, _, err = run_cli(capsys, "ls", str(root), "--type", "file_sytem")
    assert_one_line_error(rc, err, 1, "file_sytem", "file_system")


# --------------------------------------------------------------------------- plugins

def test_plugins_lists_everything(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "plugins")
    assert rc == 0, err
    for needle in ("backends", "file_system", "roll-ckpt-fs", "strategies", "dcp", "roll-ckpt-core",
                   "fsdp2", "roll-ckpt-fsdp2", "staging policies", "regular"):
        assert needle in out, needle
    assert "broken" not in out


def test_broken_plugin_is_reported_and_harmless(tmp_path: Path, saved) -> None:
    site = tmp_path / "site"
    info = site / "roll_ckpt_broken_example-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: roll-ckpt-broken-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[roll_ckpt]\nbroken = roll_ckpt_no_such_module_xyz.plugin\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess_cli("plugins", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "broken plugins" in proc.stdout
    assert "roll-ckpt-broken-example" in proc.stdout and "ModuleNotFoundError" in proc.stdout
    assert "file_system" in proc.stdout  # the others still load
    root, _, _ = saved
    proc = subprocess_cli("ls", str(root), env=env)  # unrelated commands are not affected
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint" in proc.stdout


# --------------------------------------------------------------------------- ls

def test_ls_committed_and_uncommitted(capsys: pytest.CaptureFixture[str], saved) -> None:
    root, _, paths = saved
    # a save that never finished: same files, no manifest
    (paths[1] / "manifest.json").unlink()
    run = paths[0].parent
    (run / ".tmp-checkpoint-11-abcdef").mkdir()
    rc, out, err = run_cli(capsys, "ls", str(root))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "RUN", "CREATED", "SIZE", "COMMITTED"]
    rows = {int(ln.split()[0]): ln for ln in lines[1:4]}
    assert set(rows) == {1, 2, 10}
    assert rows[1].split()[-1] == "yes" and rows[10].split()[-1] == "yes"
    assert rows[2].split()[-1] == "NO"
    assert all(run.name in ln for ln in rows.values())
    assert "KiB" in rows[1]
    assert "3 checkpoints (2 committed" in out
    assert f"newest committed: {paths[2]}" in out
    assert ".tmp-checkpoint-11-abcdef" in out  # in-flight or crashed saves are shown


def test_ls_json_and_run_folder(capsys: pytest.CaptureFixture[str], saved) -> None:
    root, _, paths = saved
    rc, out, _ = run_cli(capsys, "ls", str(paths[0].parent), "--json")
    assert rc == 0
    body = json.loads(out)
    assert [c["step"] for c in body["checkpoints"]] == [1, 2, 10]
    assert all(c["committed"] and c["bytes"] > 0 and c["created"] for c in body["checkpoints"])


def test_ls_empty_and_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = run_cli(capsys, "ls", str(tmp_path))
    assert rc == 0 and "no checkpoints" in out
    rc, _, err = run_cli(capsys, "ls", str(tmp_path / "missing"))
    assert_one_line_error(rc, err, 1, "no such folder")


def test_ls_on_an_fsspec_url(capsys: pytest.CaptureFixture[str], memory_url: str) -> None:
    _save_steps(memory_url, [3, 4])
    rc, out, err = run_cli(capsys, "ls", memory_url)
    assert rc == 0, err
    assert "2 checkpoints (2 committed" in out
    rc, out, err = run_cli(capsys, "verify", memory_url)
    assert rc == 0, err
    assert out.count("OK  ") == 2


# --------------------------------------------------------------------------- verify

def test_verify_ok(capsys: pytest.CaptureFixture[str], saved) -> None:
    _, _, paths = saved
    rc, out, err = run_cli(capsys, "verify", str(paths[2]))
    assert rc == 0, err
    assert out.startswith(f"OK  {paths[2]}  step 10: 3 files")
    assert "checksums match" in out


def test_verify_names_the_damaged_file(capsys: pytest.CaptureFixture[str], saved) -> None:
    _, _, paths = saved
    flip_byte(paths[2] / "dcp" / "__0_0.distcp", 100)
    rc, out, err = run_cli(capsys, "verify", str(paths[2]))
    assert_one_line_error(rc, err, 1, "damaged", str(paths[2]))
    assert f"DAMAGED  {paths[2]}" in out
    assert "dcp/__0_0.distcp: checksum mismatch" in out


def test_verify_reports_every_fault(capsys: pytest.CaptureFixture[str], saved) -> None:
    _, _, paths = saved
    ckpt = paths[0]
    (ckpt / "trainer_state.json").write_text("{}")  # wrong size
    (ckpt / "dcp" / ".metadata").unlink()  # missing
    (ckpt / "dcp" / "extra.bin").write_bytes(b"x")  # not in the manifest
    rc, out, err = run_cli(capsys, "verify", str(ckpt))
    assert_one_line_error(rc, err, 1, "3 bad file")
    assert "trainer_state.json: size" in out
    assert "dcp/.metadata: missing" in out
    assert "dcp/extra.bin: unexpected file" in out


def test_verify_a_folder_of_checkpoints(capsys: pytest.CaptureFixture[str], saved) -> None:
    root, _, paths = saved
    (paths[1] / "manifest.json").unlink()
    rc, out, err = run_cli(capsys, "verify", str(root))
    assert rc == 0, err
    assert out.count("OK  ") == 2 and f"SKIP  {paths[1]}" in out
    flip_byte(paths[0] / "dcp" / "__0_0.distcp", 0)
    rc, out, err = run_cli(capsys, "verify", str(root))
    assert_one_line_error(rc, err, 1, "1 damaged checkpoint", str(paths[0]))


def test_verify_uncommitted_and_missing(capsys: pytest.CaptureFixture[str], saved, tmp_path: Path) -> None:
    _, _, paths = saved
    (paths[1] / "manifest.json").unlink()
    rc, _, err = run_cli(capsys, "verify", str(paths[1]))
    assert_one_line_error(rc, err, 1, "not a committed checkpoint")
    rc, _, err = run_cli(capsys, "verify", str(tmp_path / "nope"))
    assert_one_line_error(rc, err, 1, "does not exist")
    rc, _, err = run_cli(capsys, "verify", str(tmp_path))  # an empty folder
    assert_one_line_error(rc, err, 1, "neither a checkpoint nor a folder of checkpoints")


# --------------------------------------------------------------------------- inspect

def test_inspect(capsys: pytest.CaptureFixture[str], saved) -> None:
    _, _, paths = saved
    rc, out, err = run_cli(capsys, "inspect", str(paths[2]))
    assert rc == 0, err
    assert f"checkpoint   {paths[2]}" in out
    assert "step         10" in out and "world size   1" in out and "strategy     dcp" in out
    assert "roll-ckpt-core" in out  # plugin versions
    assert '"loss": 0.5' in out  # trainer_state.json, user metadata
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert lines["model.fc1.weight"].split()[1:] == ["[6,", "4]", "float32"]
    assert lines["model.fc2.bias"].split()[1:] == ["[3]", "float64"]
    assert "optimizer.state.fc1.weight.exp_avg" in lines
    assert lines["optimizer.param_groups.0.lr"].split()[1] == "bytes"
    assert any(k.startswith("per_rank.0.") for k in lines)


def test_inspect_verifies_before_unpickling(capsys: pytest.CaptureFixture[str], saved, tmp_path: Path) -> None:
    """A .metadata that would run code is never unpickled: not when damaged, not even when
    the manifest was forged to match it."""
    from roll_ckpt.format.manifest import hash_bytes

    _, _, paths = saved
    ckpt = paths[2]
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    (ckpt / "dcp" / ".metadata").write_bytes(payload)
    rc, _, err = run_cli(capsys, "inspect", str(ckpt))
    assert_one_line_error(rc, err, 1, "damaged", "dcp/.metadata")
    assert not marker.exists()

    manifest = json.loads((ckpt / "manifest.json").read_text())
    size, digest = hash_bytes(payload)
    manifest["files"]["dcp/.metadata"] = {"size": size, "checksum": digest}
    (ckpt / "manifest.json").write_bytes(seal(manifest))
    rc, _, err = run_cli(capsys, "inspect", str(ckpt))
    assert_one_line_error(rc, err, 1, "refused to unpickle")
    assert not marker.exists()
    rc, _, err = run_cli(capsys, "export", str(ckpt), "--out", str(tmp_path / "x.safetensors"))
    assert_one_line_error(rc, err, 1, "refused to unpickle")
    assert not marker.exists() and not (tmp_path / "x.safetensors").exists()


# --------------------------------------------------------------------------- prune

def test_prune_keep_1(capsys: pytest.CaptureFixture[str], saved) -> None:
    root, _, paths = saved
    stale = paths[0].parent / ".tmp-checkpoint-11-deadbeef0000"
    (stale / "dcp").mkdir(parents=True)
    old = time.time() - 3600
    os.utime(stale, (old, old))

    rc, out, err = run_cli(capsys, "prune", str(root), "--keep", "1", "--dry-run")
    assert rc == 0, err
    assert f"would remove {paths[0]}" in out and f"would remove {paths[1]}" in out
    assert all(p.exists() for p in paths) and stale.exists()

    rc, out, err = run_cli(capsys, "prune", str(root), "--keep", "1")
    assert rc == 0, err
    assert f"removed {paths[0]}" in out and f"removed {paths[1]}" in out
    assert f"removed stale temporary folder {stale}" in out
    assert f"newest: {paths[2]}" in out
    assert not paths[0].exists() and not paths[1].exists() and not stale.exists()
    assert (paths[2] / "manifest.json").exists()

    rc, out, _ = run_cli(capsys, "prune", str(root), "--keep", "1")  # nothing left to do
    assert rc == 0 and "removed 0 checkpoint(s); 1 committed kept" in out


def test_prune_never_removes_newest_and_orders_by_number(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _, paths = _save_steps(str(root), [9, 10, 100])  # by name, "100" < "9"
    rc, out, err = run_cli(capsys, "prune", str(root), "--keep", "2")
    assert rc == 0, err
    assert not Path(paths[0]).exists()
    assert Path(paths[1]).exists() and Path(paths[2]).exists()


def test_prune_user_errors(capsys: pytest.CaptureFixture[str], saved, tmp_path: Path) -> None:
    root, _, paths = saved
    rc, _, err = run_cli(capsys, "prune", str(root), "--keep", "0")
    assert_one_line_error(rc, err, 2, "--keep", "keep at least 1")
    rc, _, err = run_cli(capsys, "prune", str(paths[2]), "--keep", "1")
    assert_one_line_error(rc, err, 1, "is one checkpoint")
    rc, _, err = run_cli(capsys, "prune", str(tmp_path / "nope"), "--keep", "1")
    assert_one_line_error(rc, err, 1, "no such folder")


# --------------------------------------------------------------------------- export

def test_export_equals_the_model(capsys: pytest.CaptureFixture[str], saved, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    _, state, paths = saved
    out_file = tmp_path / "out" / "all.safetensors"
    rc, out, err = run_cli(capsys, "export", str(paths[2]), "--out", str(out_file))
    assert rc == 0, err
    assert f"of step 10 to {out_file}" in out and "non-tensor values" in out
    tensors = load_file(str(out_file))
    for name, value in state["model"].state_dict().items():
        assert torch.equal(tensors[f"model.{name}"], value), name
        assert tensors[f"model.{name}"].dtype == value.dtype
    opt_state = state["optimizer"].state[state["model"].fc1.weight]
    assert torch.equal(tensors["optimizer.state.fc1.weight.exp_avg"], opt_state["exp_avg"])
    with safe_open(str(out_file), "pt") as f:
        assert f.metadata()["step"] == "10"
    assert not list(out_file.parent.glob("*.tmp-*"))

    # --only model --strip-prefix: loadable by a fresh model
    model_file = tmp_path / "model.safetensors"
    rc, out, err = run_cli(capsys, "export", str(paths[2]), "--out", str(model_file), "--only", "model", "--strip-prefix")
    assert rc == 0, err
    fresh = Model()
    fresh.load_state_dict(load_file(str(model_file)), strict=True)
    for name, value in state["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_export_user_errors(capsys: pytest.CaptureFixture[str], saved, tmp_path: Path) -> None:
    _, _, paths = saved
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"keep me")
    rc, _, err = run_cli(capsys, "export", str(paths[2]), "--out", str(target))
    assert_one_line_error(rc, err, 1, "already exists", "--force")
    assert target.read_bytes() == b"keep me"
    rc, _, err = run_cli(capsys, "export", str(paths[2]), "--out", str(target), "--force")
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", str(paths[2]), "--out", str(tmp_path / "x.safetensors"), "--only", "critic")
    assert_one_line_error(rc, err, 1, "critic", "model, optimizer, per_rank")
    rc, _, err = run_cli(capsys, "export", str(paths[2]), "--out", str(tmp_path / "y.safetensors"), "--strip-prefix")
    assert_one_line_error(rc, err, 1, "--strip-prefix")
    flip_byte(paths[2] / "dcp" / "__0_0.distcp", 10)
    rc, _, err = run_cli(capsys, "export", str(paths[2]), "--out", str(tmp_path / "z.safetensors"))
    assert_one_line_error(rc, err, 1, "damaged", "dcp/__0_0.distcp")
    assert not (tmp_path / "z.safetensors").exists()


def test_type_and_storage_options_reach_the_backend(capsys: pytest.CaptureFixture[str], saved,
                                                    example_backend: Path) -> None:
    """Any backend plugin can be used: here the test fixture backend, with its ``prefix`` option."""
    root, _, paths = saved
    rc, out, err = run_cli(capsys, "ls", str(root.parent), "--type", "example_dir",
                           "--storage-option", f"prefix={root.name}")
    assert rc == 0, err
    assert "3 checkpoints (3 committed" in out
    rc, out, err = run_cli(capsys, "verify", str(paths[2].parent), "--type", "example_dir",
                           "--storage-option", f"prefix={paths[2].name}")
    assert rc == 0, err
    assert out.startswith("OK  ")
