"""The ``roll-ckpt`` command line on steps made of components (``checkpoint_config.components``).

Real checkpoints, written in this process by two managers sharing one run folder: the
``actor`` part (a ``torch.nn.Linear`` with AdamW, DCP) and the ``pipeline`` part (a
``DriverState``, JSON). ``ls``, ``verify``, ``inspect`` and ``export`` on whole steps, on one
part (``--component`` or the part's folder), on uncommitted steps and on damaged parts.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.damage import flip_byte
from helpers.launch import run_python
from helpers.training import config, train_step
from roll_ckpt import CheckpointManager, DriverState, new_run_name
from roll_ckpt.cli import main
from roll_ckpt.format.manifest import hash_bytes
from roll_ckpt.format.manifest import seal

from .test_cli import assert_one_line_error as one_line_error

TIMEOUT = 120
COMPONENTS = ["actor", "pipeline"]

pytestmark = pytest.mark.timeout(TIMEOUT)


# --------------------------------------------------------------------------- helpers

def _actor_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt}


def _snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors an export of the actor's part holds, by DCP key (a few of them)."""
    model = state["model"]
    opt = state["optimizer"].state[model.weight]
    return {"model.weight": model.weight.detach().clone(), "model.bias": model.bias.detach().clone(),
            "optimizer.state.weight.exp_avg": opt["exp_avg"].clone()}


def save_components(output_dir: str, steps: list[int],
                    actor_only: list[int] = ()) -> tuple[Path, dict[int, dict[str, torch.Tensor]], DriverState]:
    """Both parts of ``steps`` (committed), then the actor's part only of ``actor_only``
    (steps left uncommitted). Returns the run folder, the actor's tensors as saved at each
    step, and the driver's state."""
    run = new_run_name()
    actor_state = _actor_state()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    driver = DriverState(step=0, consumed=0, history=[], loss=float("nan"), note="hello")
    with CheckpointManager(config(output_dir, exp_name="cli-components", components=COMPONENTS, run_name=run),
                           component="actor", quiet=True) as actor, \
            CheckpointManager(config(output_dir, exp_name="cli-components", components=COMPONENTS, run_name=run),
                              component="pipeline", quiet=True) as pipeline:
        for step in steps:
            train_step(actor_state, (8, 4))
            driver.update(step=step, consumed=8 * step)
            driver["history"].append(step / 2)
            actor.save(step, actor_state, final=True)
            saved[step] = _snapshot(actor_state)
            pipeline.save(step, {"driver": driver}, final=True)
        for step in actor_only:
            train_step(actor_state, (8, 4))
            actor.save(step, actor_state, final=True)
            saved[step] = _snapshot(actor_state)
    return Path(output_dir) / run, saved, driver


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]], DriverState]:
    """Steps 1 and 2 committed (actor + pipeline), step 3 with the actor's part only."""
    return save_components(str(tmp_path / "ckpt"), [1, 2], actor_only=[3])


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["--quiet", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    one_line_error(rc, err, 1, *needles)


def reseal(path: Path, **changes: Any) -> None:
    """Rewrite a manifest with ``changes`` applied to its body, with a valid own checksum."""
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_bytes(seal(body))


def record_in_step(step: Path, rel: str) -> None:
    """Make the step's manifest record the current bytes of ``rel`` (a forged, consistent step)."""
    body = json.loads((step / "manifest.json").read_text())
    size, digest = hash_bytes((step / rel).read_bytes())
    body["files"][rel] = {"size": size, "checksum": digest}
    (step / "manifest.json").write_bytes(seal(body))


def table_rows(out: str) -> dict[int, str]:
    """The rows of ``ls``'s table, by step."""
    table = out.split("\n\n", 1)[0].splitlines()[1:]
    return {int(ln.split()[0]): ln for ln in table}


# --------------------------------------------------------------------------- ls

def test_ls_shows_components_and_missing_parts(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    root = run.parent
    rc, out, err = run_cli(capsys, "ls", str(root))
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["STEP", "RUN", "CREATED", "SIZE", "COMMITTED", "COMPONENTS"]
    rows = table_rows(out)
    assert set(rows) == {1, 2, 3}
    assert rows[1].endswith("yes        actor, pipeline") and rows[2].endswith("actor, pipeline")
    assert " NO " in rows[3] and rows[3].endswith("actor; pipeline missing")
    assert "3 checkpoints (2 committed" in out
    assert f"newest committed: {run / 'checkpoint-2'}" in out  # step 3 has a part only: not a checkpoint
    assert "counts once every part is committed" in out

    rc, out, err = run_cli(capsys, "ls", str(root), "--json")
    assert rc == 0, err
    rows_json = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert rows_json[2]["committed"] and rows_json[2]["components"] == COMPONENTS
    assert rows_json[2]["missing_components"] == []
    assert not rows_json[3]["committed"]
    assert rows_json[3]["components"] == ["actor"] and rows_json[3]["missing_components"] == ["pipeline"]
    assert rows_json[3]["created"] and rows_json[3]["bytes"] > 0


def test_ls_without_components_has_no_extra_column(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with CheckpointManager.from_config(config(tmp_path / "plain"), quiet=True) as manager:
        manager.save(1, _actor_state(), final=True)
    rc, out, err = run_cli(capsys, "ls", str(tmp_path / "plain"))
    assert rc == 0, err
    assert out.splitlines()[0].split() == ["STEP", "RUN", "CREATED", "SIZE", "COMMITTED"]
    assert "COMPONENTS" not in out and "every part" not in out


def test_ls_unfinished_part_and_a_step_missing_only_its_manifest(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step3 = run / "checkpoint-3"
    (step3 / ".tmp-pipeline-0123456789ab" / "state").mkdir(parents=True)  # a part being written
    (run / "checkpoint-2" / "manifest.json").unlink()  # the last part's process died before the step's commit
    rc, out, err = run_cli(capsys, "ls", str(run.parent))
    assert rc == 0, err
    rows = table_rows(out)
    assert rows[3].endswith("actor; pipeline unfinished")
    assert " NO " in rows[2] and rows[2].endswith("actor, pipeline; step manifest missing")
    assert f"newest committed: {run / 'checkpoint-1'}" in out
    assert f"step 2 ({run / 'checkpoint-2'}): every part is committed but not the step" in out
    assert "next resume of any component commits it" in out
    assert str(step3 / ".tmp-pipeline-0123456789ab") in out  # listed with the saves in flight

    rc, _, err = run_cli(capsys, "verify", str(run / "checkpoint-2"))
    assert_one_line_error(rc, err, "is not a committed step", "every part is committed (actor, pipeline)",
                          "next resume")


def test_ls_first_step_of_a_run_not_committed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """No committed step beside it says which parts a step needs: the listing says so."""
    run, _, _ = save_components(str(tmp_path / "ckpt"), [], actor_only=[1])
    rc, out, err = run_cli(capsys, "ls", str(tmp_path / "ckpt"))
    assert rc == 0, err
    rows = table_rows(out)
    assert " NO " in rows[1] and rows[1].endswith("actor; others unknown")
    assert "newest committed" not in out
    rc, _, err = run_cli(capsys, "verify", str(run / "checkpoint-1"))
    assert_one_line_error(rc, err, "not a committed step", "parts committed: actor", "unknown")


def test_ls_on_a_part_folder_and_copy_skips(capsys: pytest.CaptureFixture[str], run_dir, tmp_path: Path) -> None:
    run, _, _ = run_dir
    rc, out, err = run_cli(capsys, "ls", str(run / "checkpoint-3" / "actor"))
    assert rc == 0, err
    assert out.startswith(f"{run / 'checkpoint-3' / 'actor'} is the part of component 'actor' of step 3")
    assert "its step is not committed: actor; pipeline missing" in out and f"roll-ckpt ls {run}" in out
    rc, out, err = run_cli(capsys, "ls", str(run / "checkpoint-2" / "pipeline"))
    assert rc == 0, err
    assert "its step is committed" in out

    rc, out, err = run_cli(capsys, "copy", str(run.parent), str(tmp_path / "copy"))  # whole steps only
    assert rc == 0, err
    assert f"SKIP  {run / 'checkpoint-3'}  not committed (a save that never finished; parts: actor; " \
           "pipeline missing)" in out
    assert "2 checkpoint(s) copied" in out
    rc, out, err = run_cli(capsys, "verify", str(tmp_path / "copy"))
    assert rc == 0, err
    assert out.count("2 components (actor, pipeline)") == 2


def test_ls_and_verify_on_an_object_store(capsys: pytest.CaptureFixture[str], memory_url: str) -> None:
    """fsspec's memory:// commits in place (manifest last, create-only): same listing."""
    save_components(memory_url, [1], actor_only=[2])
    rc, out, err = run_cli(capsys, "ls", memory_url)
    assert rc == 0, err
    rows = table_rows(out)
    assert rows[1].endswith("actor, pipeline") and rows[2].endswith("actor; pipeline missing")
    rc, out, err = run_cli(capsys, "verify", memory_url, "--component", "pipeline")
    assert rc == 0, err
    assert out.count("OK  ") == 1 and "component pipeline" in out


# --------------------------------------------------------------------------- verify

def test_verify_a_step_and_each_part(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    rc, out, err = run_cli(capsys, "verify", str(step))
    assert rc == 0, err
    assert out.startswith(f"OK  {step}  step 2: 7 files")
    assert "2 components (actor, pipeline), each part's manifest matches the step's" in out

    rc, out, err = run_cli(capsys, "verify", str(step), "--component", "actor")
    assert rc == 0, err
    assert out.startswith(f"OK  {step / 'actor'}  step 2, component actor: 3 files")

    rc, out, err = run_cli(capsys, "verify", str(step / "pipeline"))  # a part's folder is a checkpoint
    assert rc == 0, err
    assert out.startswith(f"OK  {step / 'pipeline'}  step 2, component pipeline: 2 files")
    assert "note" not in out


def test_verify_a_folder_of_steps(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    rc, out, err = run_cli(capsys, "verify", str(run.parent))
    assert rc == 0, err
    assert out.count("OK  ") == 2 and "2 components" in out
    assert f"SKIP  {run / 'checkpoint-3'}  not committed: a step that never committed (parts: actor; " \
           "pipeline missing)" in out

    rc, out, err = run_cli(capsys, "verify", str(run), "--component", "pipeline")
    assert rc == 0, err
    assert f"OK  {run / 'checkpoint-1' / 'pipeline'}  step 1, component pipeline" in out
    assert f"OK  {run / 'checkpoint-2' / 'pipeline'}  step 2, component pipeline" in out

    rc, _, err = run_cli(capsys, "verify", str(run), "--component", "critic")
    assert_one_line_error(rc, err, "no committed step", "component 'critic'")


def test_verify_names_a_damaged_part_file(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    flip_byte(step / "actor" / "dcp" / "__0_0.distcp", 100)
    rc, out, err = run_cli(capsys, "verify", str(step))
    assert_one_line_error(rc, err, "damaged", str(step))
    assert f"DAMAGED  {step}" in out and "actor/dcp/__0_0.distcp: checksum mismatch" in out

    rc, out, err = run_cli(capsys, "verify", str(step), "--component", "actor")
    assert_one_line_error(rc, err, "damaged", str(step / "actor"))
    assert "  dcp/__0_0.distcp: checksum mismatch" in out

    rc, out, err = run_cli(capsys, "verify", str(step), "--component", "pipeline")  # the other part is sound
    assert rc == 0, err

    rc, out, err = run_cli(capsys, "verify", str(run.parent))
    assert_one_line_error(rc, err, "1 damaged checkpoint", str(step))


def test_verify_a_part_manifest_that_names_another_step(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    """Each part's manifest must name its own component and step, even when the step's
    manifest was made to record its bytes."""
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    shutil.copy(run / "checkpoint-1" / "pipeline" / "manifest.json", step / "pipeline" / "manifest.json")
    record_in_step(step, "pipeline/manifest.json")
    rc, out, err = run_cli(capsys, "verify", str(step))
    assert_one_line_error(rc, err, "damaged")
    assert "pipeline/manifest.json: names component 'pipeline' at step 1, but it is the part 'pipeline' of step 2" \
        in out

    reseal(step / "pipeline" / "manifest.json", component="actor", step=2)
    record_in_step(step, "pipeline/manifest.json")
    rc, out, err = run_cli(capsys, "verify", str(step))
    assert_one_line_error(rc, err, "damaged")
    assert "names component 'actor' at step 2" in out


def test_verify_a_part_the_step_did_not_commit(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    """A part whose files match its own manifest, but whose manifest is not the one the step
    recorded (replaced after the step's commit)."""
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    part = step / "actor"
    body = json.loads((part / "manifest.json").read_text())
    reseal(part / "manifest.json", extra={**body["extra"], "note": "edited"})

    rc, out, err = run_cli(capsys, "verify", str(part))  # the part's folder: checked against the step
    assert_one_line_error(rc, err, "damaged", str(part))
    assert "manifest.json: is not the part's manifest its step committed" in out

    rc, out, err = run_cli(capsys, "verify", str(step), "--component", "actor")
    assert_one_line_error(rc, err, "damaged", str(step))
    assert "actor/manifest.json: is not the part's manifest the step committed" in out

    rc, out, err = run_cli(capsys, "verify", str(step))
    assert_one_line_error(rc, err, "damaged")
    assert "actor/manifest.json: size" in out  # the step's record of the part's manifest


def test_verify_an_uncommitted_step(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step3 = run / "checkpoint-3"
    rc, out, err = run_cli(capsys, "verify", str(step3))
    assert_one_line_error(rc, err, f"{step3} is not a committed step", "parts committed: actor",
                          "missing: pipeline", "--component actor")
    assert out == ""

    rc, _, err = run_cli(capsys, "verify", str(step3), "--component", "pipeline")
    assert_one_line_error(rc, err, "missing: pipeline", "--component pipeline: that part is not committed")

    rc, out, err = run_cli(capsys, "verify", str(step3), "--component", "actor")  # the committed part alone
    assert rc == 0, err
    assert f"OK  {step3 / 'actor'}  step 3, component actor" in out
    assert "note: its step" in out and "is not committed yet (actor; pipeline missing)" in out

    (step3 / "pipeline").mkdir()  # a part written in place whose manifest never came
    (step3 / "pipeline" / "trainer_state.json").write_text("{}")
    rc, _, err = run_cli(capsys, "verify", str(step3))
    assert_one_line_error(rc, err, "missing: pipeline (unfinished)")
    rc, _, err = run_cli(capsys, "verify", str(step3 / "pipeline"))
    assert_one_line_error(rc, err, "not committed (no manifest.json)", "component 'pipeline' of step 3")


def test_verify_component_user_errors(capsys: pytest.CaptureFixture[str], run_dir, tmp_path: Path) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    rc, _, err = run_cli(capsys, "verify", str(step), "--component", "critic")
    assert_one_line_error(rc, err, "no part for component 'critic'", "its components: actor, pipeline")
    rc, _, err = run_cli(capsys, "verify", str(step / "pipeline"), "--component", "actor")
    assert_one_line_error(rc, err, "is the part of component 'pipeline', not of 'actor'", str(step))
    rc, out, err = run_cli(capsys, "verify", str(step / "pipeline"), "--component", "pipeline")
    assert rc == 0, err

    with CheckpointManager.from_config(config(tmp_path / "plain"), quiet=True) as manager:
        plain = manager.save(5, _actor_state(), final=True)
    rc, _, err = run_cli(capsys, "verify", plain, "--component", "actor")
    assert_one_line_error(rc, err, "saved without components", "drop --component")


# --------------------------------------------------------------------------- inspect

def test_inspect_a_step_lists_its_components(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    rc, out, err = run_cli(capsys, "inspect", str(step))
    assert rc == 0, err
    assert f"checkpoint   {step}" in out and "step         2" in out
    assert "files        7 (" in out
    assert "components: 2 parts, each part's manifest matches the step's" in out
    table = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("  ")}
    assert table["NAME"][:3] == ["NAME", "WORLD", "SIZE"]
    assert table["actor"][1:4] == ["1", "dcp", "4"]
    assert table["pipeline"][1:4] == ["1", "json", "3"]
    assert f"roll-ckpt inspect {step} --component NAME" in out
    assert "DCP keys" not in out  # the parts are shown one at a time


def test_inspect_a_dcp_part(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    rc, out, err = run_cli(capsys, "inspect", str(step), "--component", "actor")
    assert rc == 0, err
    assert f"checkpoint   {step / 'actor'}" in out
    assert "component    actor" in out and "strategy     dcp" in out
    assert '"component": "actor"' in out  # trainer_state.json
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert lines["model.weight"].split()[1:] == ["[3,", "4]", "float32"]
    assert "optimizer.state.weight.exp_avg" in lines

    rc, out2, err = run_cli(capsys, "inspect", str(step / "actor"))  # the part's folder: the same report
    assert rc == 0, err
    assert out2 == out


def test_inspect_a_json_part_reads_json_only(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, driver = run_dir
    step = run / "checkpoint-2"
    rc, out, err = run_cli(capsys, "inspect", str(step), "--component", "pipeline")
    assert rc == 0, err
    assert "component    pipeline" in out and "strategy     json" in out
    assert "driver state (state/state.json, JSON): 1 key(s)" in out
    assert "driver: 5 values, RNG state (numpy, python)" in out
    values = {ln.split()[0]: ln.split(None, 2)[1:] for ln in out.splitlines() if ln.startswith("    ")}
    assert values["step"] == ["int", "2"]
    assert values["consumed"] == ["int", "16"]
    assert values["history"] == ["list[2]", "[0.5, 1.0]"]
    assert values["loss"] == ["float", "NaN"] and math.isnan(driver["loss"])
    assert values["note"] == ["str", '"hello"']
    assert "DCP keys" not in out

    # No torch needed (and none imported) to look at a driver's state.
    code = ("import sys; from roll_ckpt.cli import main; "
            f"rc = main(['--quiet', 'inspect', {str(step)!r}, '--component', 'pipeline']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    proc = run_python(code, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr


def test_inspect_a_damaged_json_part(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    flip_byte(step / "pipeline" / "state" / "state.json", 3)
    rc, _, err = run_cli(capsys, "inspect", str(step), "--component", "pipeline")
    assert_one_line_error(rc, err, "damaged", "state/state.json: checksum mismatch")
    rc, _, err = run_cli(capsys, "inspect", str(step))
    assert_one_line_error(rc, err, "damaged", "pipeline/state/state.json: checksum mismatch")


def test_inspect_an_uncommitted_step(capsys: pytest.CaptureFixture[str], run_dir) -> None:
    run, _, _ = run_dir
    step3 = run / "checkpoint-3"
    rc, _, err = run_cli(capsys, "inspect", str(step3))
    assert_one_line_error(rc, err, "not a committed step", "missing: pipeline")
    rc, out, err = run_cli(capsys, "inspect", str(step3), "--component", "actor")
    assert rc == 0, err
    assert out.startswith("note: step 3 is not committed (actor; pipeline missing)")
    assert "component    actor" in out
    rc, out, err = run_cli(capsys, "inspect", str(step3 / "actor"))  # the part's folder: the same note
    assert rc == 0, err
    assert out.startswith(f"note: its step {step3} is not committed yet (actor; pipeline missing)")


# --------------------------------------------------------------------------- export

def test_export_one_component(capsys: pytest.CaptureFixture[str], run_dir, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, saved, _ = run_dir
    step = run / "checkpoint-2"
    out_file = tmp_path / "actor.safetensors"
    rc, out, err = run_cli(capsys, "export", str(step), "--component", "actor", "--out", str(out_file))
    assert rc == 0, err
    assert f"of step 2 (component actor) to {out_file}" in out
    tensors = load_file(str(out_file))
    for key, value in saved[2].items():
        assert torch.equal(tensors[key], value), key
    assert not torch.equal(saved[2]["model.weight"], saved[3]["model.weight"])  # step 2's, not the newest
    with safe_open(str(out_file), "pt") as f:
        assert f.metadata()["step"] == "2" and f.metadata()["component"] == "actor"

    model_file = tmp_path / "model.safetensors"
    rc, _, err = run_cli(capsys, "export", str(step / "actor"), "--out", str(model_file), "--only", "model",
                         "--strip-prefix")  # the part's folder, without --component
    assert rc == 0, err
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(load_file(str(model_file)), strict=True)
    assert torch.equal(fresh.weight.detach(), saved[2]["model.weight"])
    assert torch.equal(fresh.bias.detach(), saved[2]["model.bias"])


def test_export_user_errors(capsys: pytest.CaptureFixture[str], run_dir, tmp_path: Path) -> None:
    run, _, _ = run_dir
    step = run / "checkpoint-2"
    target = tmp_path / "x.safetensors"
    rc, _, err = run_cli(capsys, "export", str(step), "--out", str(target))
    assert_one_line_error(rc, err, "made of components (actor, pipeline)", "--component NAME",
                          "tensors are in actor")
    rc, _, err = run_cli(capsys, "export", str(step), "--component", "pipeline", "--out", str(target))
    assert_one_line_error(rc, err, "holds no tensors", "component 'pipeline'", "DriverState",
                          str(step / "pipeline" / "state" / "state.json"))
    rc, _, err = run_cli(capsys, "export", str(step / "pipeline"), "--out", str(target))
    assert_one_line_error(rc, err, "holds no tensors", "state/state.json")
    rc, _, err = run_cli(capsys, "export", str(step), "--component", "critic", "--out", str(target))
    assert_one_line_error(rc, err, "no part for component 'critic'")
    rc, _, err = run_cli(capsys, "export", str(run / "checkpoint-3"), "--out", str(target))
    assert_one_line_error(rc, err, "not a committed step", "missing: pipeline")
    flip_byte(step / "actor" / "dcp" / "__0_0.distcp", 10)
    rc, _, err = run_cli(capsys, "export", str(step), "--component", "actor", "--out", str(target))
    assert_one_line_error(rc, err, "damaged", "dcp/__0_0.distcp")
    assert not target.exists()
