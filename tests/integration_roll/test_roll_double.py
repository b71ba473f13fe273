"""The ROLL test double (tests/integration_roll/roll_double) behaves as ROLL does, with
roll-ckpt's integration off: a launch of its ToyPipeline on a local Ray cluster (an
``actor_train`` cluster of 2 FSDP2 ranks) writes ROLL's tree and DCP keys, and a second
launch resuming from it gets ROLL's semantics: parameters, scheduler and the pipeline's
WorkerState back, Adam's state and the RNG not (ROLL's DCP templates are a fresh optimizer's
state dict and ``{}``).

Each launch is its own driver process (``_double_job.py``, bounded, in a process group of
its own, killed by its id), with its own Ray cluster, shut down when it ends.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

from integration_roll._checks import (DCP_FILES, HF_FILES, N_PARAMS, PIPELINE_FILES,  # noqa: E402
                                       check_roll_keys, files_under, hf_keys, rank0)

pytestmark = pytest.mark.timeout(240)


def test_double_writes_roll_tree_and_resumes_with_rolls_semantics(launch, tmp_path: Path) -> None:
    t0 = time.monotonic()
    # Launch 1: 4 steps, save_steps 2: checkpoint-2 (async DCP save, upload after it) and
    # checkpoint-3 (the last step: synchronous save).
    first = launch("--max-steps", "4", "--save-steps", "2")
    root = Path(first["checkpoint_output_dir"])
    assert root.parent == tmp_path / "ckpt" and re.fullmatch(r"\d{8}-\d{6}", root.name)   # the launch's timestamp
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    for step in (2, 3):
        ckpt = root / f"checkpoint-{step}"
        files = files_under(ckpt)
        assert HF_FILES | DCP_FILES | PIPELINE_FILES <= files, sorted(files)
        assert {p.name for p in ckpt.iterdir() if p.is_dir()} == {"dcp", "pipeline"}
        check_roll_keys(ckpt / "dcp", ckpt)
        state = json.loads((ckpt / "pipeline" / "worker_state_pipeline.json").read_text())
        assert state["step"] == step and len(state["log_history"]) == step + 1
        assert state["kv"] == {"scheduler_state_default": {"dataset_iter_count": step + 1}}
        # The local copies were removed after the upload (keep_local_file false).
        for part in ("actor_train-0", "actor_train-1", "pipeline"):
            assert not (tmp_path / "out" / part / f"checkpoint-{step}").exists()
    saved = rank0(first["digests"]["2"])
    assert saved["optimizer_entries"] == 3 * N_PARAMS

    # Launch 2 resumes from checkpoint-2 (resume_from_checkpoint: the folder).
    second = launch("--max-steps", "4", "--save-steps", "2", "--resume", str(root / "checkpoint-2"))
    assert second["state_after_init"] == {"step": 2, "log_history": 3,
                                          "kv": {"scheduler_state_default": {"dataset_iter_count": 3}}}
    resumed = rank0(second["after_init"])
    assert resumed["params"] == saved["params"]                 # parameters: bit for bit
    assert resumed["scheduler"] == saved["scheduler"] and resumed["lr"] == saved["lr"]
    assert resumed["optimizer_entries"] == 0                    # ROLL's bug: no Adam state restored
    assert resumed["rng"] != saved["rng"]                       # nor the RNG (its DCP template is {})
    assert list(second["digests"]) == ["3"]                     # steps 0..2 skipped
    # Adam's moments started over, so step 3 does not end where launch 1's did.
    assert rank0(second["digests"]["3"])["params"] != rank0(first["digests"]["3"])["params"]
    root2 = Path(second["checkpoint_output_dir"])
    assert root2 != root and sorted(p.name for p in root2.iterdir()) == ["checkpoint-3"]
    print(f"test body {time.monotonic() - t0:.1f}s")


def test_double_critic_saves_below_the_step(launch, tmp_path: Path) -> None:
    """With a critic cluster (2 ranks), its HF files and DCP shards land in critic/."""
    run = launch("--max-steps", "2", "--save-steps", "1", "--critic")
    ckpt = Path(run["checkpoint_output_dir"]) / "checkpoint-1"
    files = files_under(ckpt)
    critic = {f"critic/{f}" for f in (HF_FILES - {"generation_config.json"}) | DCP_FILES}
    assert HF_FILES | DCP_FILES | PIPELINE_FILES | critic <= files, sorted(files)
    assert {p.name for p in ckpt.iterdir() if p.is_dir()} == {"dcp", "pipeline", "critic"}
    check_roll_keys(ckpt / "critic" / "dcp", ckpt / "critic")
    assert "score.weight" in hf_keys(ckpt / "critic") and "lm_head.weight" in hf_keys(ckpt)
    assert rank0(run["digests"]["1"], "critic")["optimizer_entries"] == 3 * len(hf_keys(ckpt / "critic"))
