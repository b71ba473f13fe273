"""roll-ckpt inside ROLL, driven as ROLL drives its checkpoints: the ROLL test double
(tests/integration_roll/roll_double: ROLL's module paths, classes, signatures and call order,
see its docstring) runs its pipeline on a local Ray cluster -- the driver a Ray driver, each
worker rank a Ray actor, FSDP2 on 2 gloo ranks -- with ``roll_ckpt_roll.enable()`` called at
the top of the entry script (``_double_job.py --roll-ckpt``), or without it (ROLL's own
checkpoints). What was checked against ROLL's own source is in
docs/operations/roll-integration.md.

Every launch is a driver process of its own, bounded, in its own process group, killed by its
id when it ends; its Ray cluster is shut down by the driver (and killed with the group).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

from integration_roll._checks import HF_FILES, N_PARAMS, check_roll_keys, files_under, rank0  # noqa: E402
from roll_ckpt.cli import main as cli  # noqa: E402

pytestmark = pytest.mark.timeout(420)

PARTS = {"actor_train", "critic", "pipeline"}
DIGESTS = ("params", "optimizer", "optimizer_entries", "scheduler", "lr", "rng", "rng_numpy", "rng_random")


def _same(resumed: dict, saved: dict, fields: tuple[str, ...] = DIGESTS) -> None:
    """Every cluster, every rank: the named digests equal."""
    assert set(resumed) == set(saved)
    for cluster, ranks in saved.items():
        for rank, (r, s) in enumerate(zip(resumed[cluster], ranks)):
            differ = [f for f in fields if r[f] != s[f]]
            assert not differ, f"{cluster} rank {rank}: {differ} differ"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_inside_roll_a_step_is_committed_whole_and_resumes_exactly(launch, tmp_path: Path, capsys) -> None:
    # A: the actor and the critic (2 ranks each) and the driver; checkpoint-2 asynchronous,
    # checkpoint-3 the last step's, synchronous.
    a = launch("--roll-ckpt", "--critic", "--max-steps", "4", "--save-steps", "2")
    run = Path(a["checkpoint_output_dir"])  # ROLL's launch folder is roll-ckpt's run folder
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["checkpoint-2", "checkpoint-3"]
    step = run / "checkpoint-2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert set(manifest["extra"]["components"]) == PARTS
    for part in PARTS:
        assert (step / part / "manifest.json").exists()
    # the actor's Hugging Face files and tokenizer at the step (for rollout engines), linked from its part
    for name in HF_FILES:
        assert (step / name).stat().st_ino == (step / "actor_train" / name).stat().st_ino, name
        assert manifest["files"][name] == manifest["files"][f"actor_train/{name}"]
    assert (step / "critic" / "model.safetensors").exists() and not (step / "critic" / "config.json").samefile(
        step / "config.json")
    state = json.loads((step / "pipeline" / "state" / "state.json").read_text())["state"]["driver"]["values"]
    assert state["step"] == 2 and state["kv"] == {"scheduler_state_default": {"dataset_iter_count": 3}}
    assert cli(["verify", str(step)]) == 0
    assert not (tmp_path / "out" / "actor_train-0").exists()  # nothing staged in ROLL's local folders
    capsys.readouterr()

    # B: ROLL's resume_from_checkpoint: that step's folder. Every worker loads its part, the
    # driver its WorkerState; the state is the one saved, to the bit, RNG and Adam included,
    # and step 3 ends exactly where A's did.
    b = launch("--roll-ckpt", "--critic", "--max-steps", "4", "--save-steps", "2", "--resume", str(step))
    assert b["state_after_init"] == {"step": 2, "log_history": 3,
                                     "kv": {"scheduler_state_default": {"dataset_iter_count": 3}}}
    assert rank0(b["after_init"])["optimizer_entries"] == 3 * N_PARAMS
    _same(b["after_init"], a["digests"]["2"])
    assert list(b["digests"]) == ["3"]
    _same(b["digests"]["3"], a["digests"]["3"])

    # C: ROLL's resume_from_checkpoint: true, across launches: the newest committed step is
    # B's checkpoint-3 (its run folder is newer than A's).
    c = launch("--roll-ckpt", "--critic", "--max-steps", "5", "--save-steps", "2", "--resume", "true")
    newest = Path(b["checkpoint_output_dir"]) / "checkpoint-3"
    assert c["resume_from_checkpoint"] == str(newest)
    assert c["state_after_init"]["step"] == 3
    _same(c["after_init"], b["digests"]["3"])


def test_the_driver_announces_each_save_so_no_worker_allocates_in_it(launch) -> None:
    """Between saves a worker's staging buffers hold no memory; the driver's do_checkpoint of the
    step before a save step has every actor rank make them ready during that step, so the save
    itself only copies (checkpoint-4). checkpoint-2, the first, lays them out in the call."""
    a = launch("--roll-ckpt", "--max-steps", "6", "--save-steps", "2")
    first, announced = a["policies"]["2"], a["policies"]["4"]
    assert all(p.get("regular", 0) > 0 and p["bytes_allocated"] > 0 for p in first), first
    assert all(p.get("regular", 0) > 0 and p["bytes_allocated"] == 0 for p in announced), announced


def test_a_checkpoint_roll_wrote_resumes_with_every_optimizer_state(launch, tmp_path: Path, capsys) -> None:
    # A: ROLL's own checkpoints (the integration off), checkpoint-2 and checkpoint-3.
    a = launch("--critic", "--max-steps", "4", "--save-steps", "2")
    roll_run = Path(a["checkpoint_output_dir"])
    roll_step = roll_run / "checkpoint-2"
    check_roll_keys(roll_step / "dcp", roll_step)
    # a ROLL save that never finished, newer than everything: passed over, named
    unfinished = tmp_path / "ckpt" / "29990101-000000" / "checkpoint-9"
    shutil.copytree(roll_step, unfinished)
    (unfinished / "critic" / "dcp" / ".metadata").unlink()

    assert cli(["ls", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "n/a: ROLL checkpoint" in out and "UNFINISHED" in out
    assert cli(["verify", str(roll_step)]) == 0
    assert "NO checksums to verify" in capsys.readouterr().out
    assert cli(["verify", str(roll_step / "critic")]) == 0  # one part's folder: the step it belongs to
    assert f"is the part 'critic' of {roll_step}" in capsys.readouterr().out
    assert cli(["verify", str(unfinished)]) == 1
    assert cli(["inspect", str(roll_step)]) == 0
    out = capsys.readouterr().out
    assert f"optimizer: {3 * N_PARAMS} state tensors for {N_PARAMS} parameters" in out
    assert "worker_state_pipeline.json: step 2" in out

    # B: roll-ckpt inside ROLL resumes ROLL's checkpoint-2 (an explicit path, as a user moving a
    # running job would give it): parameters, scheduler, every Adam state tensor (ROLL's own
    # load restores none), the pipeline's WorkerState; one RNG for all ranks, as ROLL saved one.
    b = launch("--roll-ckpt", "--critic", "--max-steps", "4", "--save-steps", "2", "--resume", str(roll_step))
    assert b["state_after_init"] == {"step": 2, "log_history": 3,
                                     "kv": {"scheduler_state_default": {"dataset_iter_count": 3}}}
    _same(b["after_init"], a["digests"]["2"], ("params", "optimizer", "optimizer_entries", "scheduler", "lr"))
    assert rank0(b["after_init"], "critic")["optimizer_entries"] == rank0(a["digests"]["2"], "critic")["optimizer_entries"]
    for cluster, ranks in b["after_init"].items():
        saved = {r["rng"] for r in a["digests"]["2"][cluster]}
        assert all(r["rng"] in saved for r in ranks), cluster
    _same(b["digests"]["3"], a["digests"]["3"], ("params", "optimizer", "optimizer_entries", "scheduler"))
    # its next step is a roll-ckpt step in B's launch folder; ROLL's folders are untouched
    assert (Path(b["checkpoint_output_dir"]) / "checkpoint-3" / "manifest.json").exists()
    assert not (roll_step / "manifest.json").exists() and (unfinished / "dcp" / ".metadata").exists()

    # C: resumed on 1 rank (ROLL saved on 2): resharded, the same full tensors
    c = launch("--roll-ckpt", "--critic", "--world-size", "1", "--max-steps", "3", "--resume", str(roll_step))
    for cluster in ("actor_train", "critic"):
        for field in ("params", "optimizer", "optimizer_entries", "scheduler"):
            assert c["after_init"][cluster][0][field] == a["digests"]["2"][cluster][0][field], (cluster, field)

    # latest over that output_dir: ROLL's newest finished step, the unfinished one passed over
    from roll_ckpt import CheckpointManager, load_config

    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path / "ckpt"), "components": list(PARTS),
                                             "run_name": "29990101-000001"}})
    with CheckpointManager(cfg, component="pipeline", quiet=True) as m:
        from roll_ckpt import DriverState

        driver = DriverState()
        assert m.resume({"driver": driver}, "latest") == 3
    assert m.resumed.path == str(Path(b["checkpoint_output_dir"]) / "checkpoint-3")


def test_export_to_rolls_layout_is_read_by_rolls_own_load(launch, tmp_path: Path, capsys) -> None:
    # A: roll-ckpt inside ROLL, the actor's state in roll-ckpt's offload store between steps:
    # its asynchronous saves are zero-copy from the store (step 2; step 3, the last, is synchronous).
    a = launch("--roll-ckpt", "--critic", "--offload-backend", "local", "--max-steps", "4", "--save-steps", "2")
    assert a["policies"]["1"] == [{}, {}]  # no save at step 1
    policies = a["policies"]["2"]
    assert all(p.get("zero_copy", 0) >= 3 * N_PARAMS for p in policies), policies  # params and Adam moments
    step = Path(a["checkpoint_output_dir"]) / "checkpoint-2"
    out = tmp_path / "exported" / "for-roll"  # any name: ROLL loads the folder it is given
    assert cli(["export", str(step), "--format", "roll", "--out", str(out)]) == 0
    assert "exported step 2 in ROLL's layout" in capsys.readouterr().out
    assert cli(["verify", str(out)]) == 0  # a ROLL checkpoint, its step from the driver's WorkerState
    assert "ROLL checkpoint, step 2" in capsys.readouterr().out
    assert HF_FILES <= files_under(out) and (out / "critic" / "model.safetensors").exists()
    check_roll_keys(out / "dcp", out)
    check_roll_keys(out / "critic" / "dcp", out / "critic")
    worker_state = json.loads((out / "pipeline" / "worker_state_pipeline.json").read_text())
    assert worker_state["step"] == 2 and len(worker_state["log_history"]) == 3

    # D: ROLL's own load_checkpoint (the integration off) reads it: parameters bit for bit
    d = launch("--critic", "--max-steps", "3", "--save-steps", "2", "--resume", str(out))
    _same(d["after_init"], a["digests"]["2"], ("params", "scheduler", "lr"))
    assert d["state_after_init"]["step"] == 2


def test_sigterm_to_the_ray_driver_commits_the_step_for_every_component(launcher, launch, tmp_path: Path) -> None:
    job = launcher("--roll-ckpt", "--max-steps", "50", "--save-steps", "100")
    workers = [int(p) for p in job.wait_line("PIDS actor_train").split()[2:]]
    job.wait_line("STEP 1")
    os.kill(job.proc.pid, signal.SIGTERM)  # the Ray driver: ray.init installed its sys.exit handler
    rc, result = job.finish()
    assert rc == 15, job.output[-4000:]  # Ray's handler ended it, after the save
    assert result["ended"] == "Preempted(15)"  # with the status of the handler it held the signal back from
    saved = sorted(int(s) for s in result["digests"])[-1]
    step = Path(result["checkpoint_output_dir"]) / f"checkpoint-{saved}"
    assert set(json.loads((step / "manifest.json").read_text())["extra"]["components"]) == {"actor_train", "pipeline"}
    assert cli(["verify", str(step)]) == 0
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)

    resumed = launch("--roll-ckpt", "--max-steps", str(saved + 2), "--save-steps", "100", "--resume", "true")
    assert resumed["state_after_init"]["step"] == saved
    _same(resumed["after_init"], {"actor_train": result["digests"][str(saved)]["actor_train"]})


def test_sigterm_to_one_worker_actor_commits_the_step_for_every_component(launcher, tmp_path: Path) -> None:
    job = launcher("--roll-ckpt", "--max-steps", "50", "--save-steps", "100")
    workers = [int(p) for p in job.wait_line("PIDS actor_train").split()[2:]]
    job.wait_line("STEP 1")
    os.kill(workers[1], signal.SIGTERM)  # one rank's actor: Ray's handler there would end it at once
    rc, result = job.finish()
    assert rc == 0 and result["ended"] == "Preempted(0)", job.output[-4000:]
    saved = sorted(int(s) for s in result["digests"])[-1]
    step = Path(result["checkpoint_output_dir"]) / f"checkpoint-{saved}"
    assert (step / "manifest.json").exists() and cli(["verify", str(step)]) == 0
    deadline = time.monotonic() + 30
    while _alive(workers[1]) and time.monotonic() < deadline:  # its held SIGTERM ended it once saved
        time.sleep(0.2)
    assert not _alive(workers[1])
