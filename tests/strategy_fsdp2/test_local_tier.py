"""The fast recovery tier (``checkpoint_config.local``) on 2 and 4 gloo ranks playing 2 nodes.

Each job trains an FSDP2 MLP with persistent async saves every 4 steps and local saves
every step (``local_tier_workers.py``). A reference job runs to the end; the others lose a
node (its ranks killed with SIGKILL, its local folder wiped) and are launched again: they
must resume from the newest whole local step and end bit-exactly where the reference does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import launch

WORKERS = Path(__file__).with_name("local_tier_workers.py")
pytestmark = pytest.mark.timeout(420)
STEPS = 9


def run(out: Path, local: Path, die_at: int = 0, options: str = "", nproc: int = 2, timeout: float = 150) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("result-*.json"):
        f.unlink()
    launch.torchrun(WORKERS, out, local, STEPS, die_at, options, nproc=nproc, timeout=timeout)
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(nproc)]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return True


def run_and_lose_node1(out: Path, local: Path, die_at: int, options: str = "", nproc: int = 2,
                       wait_for_node0: bool = True, timeout: float = 150) -> None:
    """Run until node1's ranks are killed at ``die_at``; then end the rest (a scheduler would)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = launch.start_torchrun(WORKERS, out, local, STEPS, die_at, options, nproc=nproc,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    node1 = [r for r in range(nproc) if r * 2 // nproc == 1]
    node0 = [r for r in range(nproc) if r not in node1]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            pids = [out / f"pid-{r}" for r in node1]
            dead = all(p.exists() and p.read_text() and _gone(int(p.read_text())) for p in pids)
            waiting = not wait_for_node0 or all((out / f"waiting-{r}").exists() for r in node0)
            if dead and waiting:
                break
            if proc.poll() is not None:
                raise AssertionError(f"the job ended before node1 was lost:\n{proc.stdout.read()[-4000:]}")
            time.sleep(0.2)
        else:
            raise AssertionError("node1's ranks were not killed in time")
    finally:
        for r in range(nproc):  # torchrun's workers live in sessions of their own
            pid_file = out / f"pid-{r}"
            if pid_file.exists() and pid_file.read_text():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        launch.kill_group(proc)
        proc.communicate(timeout=30)
    for f in [*out.glob("pid-*"), *out.glob("waiting-*")]:
        f.unlink()


def persistent_steps(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (out / "persist").glob("*/checkpoint-*/manifest.json"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """The uninterrupted jobs, by number of ranks (run once per module)."""
    cache: dict[int, list[dict]] = {}

    def get(nproc: int) -> list[dict]:
        if nproc not in cache:
            base = tmp_path_factory.mktemp(f"reference-{nproc}")
            cache[nproc] = run(base / "out", base / "local", nproc=nproc)
        return cache[nproc]

    return get  # type: ignore[return-value]


def assert_continues_exactly(resumed: list[dict], ref: list[dict], start: int) -> None:
    for r, (got, want) in enumerate(zip(resumed, ref)):
        assert got["start"] == start, (r, got["start"], got["resumed_from"])
        assert got["losses"] == {k: v for k, v in want["losses"].items() if int(k) > start}, r
        assert got["params"] == want["params"] and got["optim"] == want["optim"], r


@pytest.mark.parametrize("nproc,options,die_at", [(2, "", 6), (4, "", 6), (2, "offload", 6), (2, "sync", 6),
                                                  (2, "", 8)])
def test_lost_node_resumes_from_the_newest_local_step_bit_exactly(tmp_path: Path, reference, nproc: int,
                                                                 options: str, die_at: int) -> None:
    """``offload``: every save is staged from the offload store (zero-copy), the local ones too.
    ``sync``: synchronous saves (the exchange runs in the training thread). Step 8 is saved by
    both tiers from one staging: the local copy is taken (the same step, read from tmpfs)."""
    out, local = tmp_path / "out", tmp_path / "local"
    run_and_lose_node1(out, local, die_at=die_at, nproc=nproc, options=options)
    assert persistent_steps(out) == ([4] if die_at < 8 else [4, 8])
    shutil.rmtree(local / "node1")  # the node is replaced: its tmpfs is empty
    resumed = run(out, local, nproc=nproc, options=options)
    if options == "offload":
        assert resumed[0]["local_last"]["policies"].get("zero_copy"), resumed[0]["local_last"]
    assert_continues_exactly(resumed, reference(nproc), start=die_at)
    assert all("/local/" in r["resumed_from"] for r in resumed)
    assert persistent_steps(out) == [4, 8]
    last = resumed[0]["local_last"]
    assert last["step"] == STEPS and last["ok"] and last["replicated_to"] and last["replicas_kept"]
    assert resumed[0]["local_bytes"] > 0


def test_a_damaged_replica_is_refused_and_the_next_whole_step_is_used(tmp_path: Path, reference) -> None:
    out, local = tmp_path / "out", tmp_path / "local"
    run_and_lose_node1(out, local, die_at=6)
    shutil.rmtree(local / "node1")
    data = local / "node0" / "checkpoint-6" / "rank-1" / "dcp" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert_continues_exactly(run(out, local), reference(2), start=5)


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("where,start", [("kill_in_local_save", 5), ("kill_in_replication", 6)])
def test_killed_inside_a_local_save(tmp_path: Path, reference, where: str, start: int, nproc: int) -> None:
    """Killed once its own unit is committed but before the exchange: node0 holds no copy of
    node1's step 6, so with node1's folder gone step 5 is the newest whole one. Killed while
    keeping the replica it received: node0 kept node1's copy, so step 6 is whole."""
    out, local = tmp_path / "out", tmp_path / "local"
    run_and_lose_node1(out, local, die_at=6, options=where, nproc=nproc, wait_for_node0=where == "kill_in_replication")
    shutil.rmtree(local / "node1")
    assert_continues_exactly(run(out, local, nproc=nproc), reference(nproc), start=start)


def test_a_full_tmpfs_fails_the_local_save_cleanly_and_persistent_saves_go_on(tmp_path: Path) -> None:
    out, local = tmp_path / "out", tmp_path / "local"
    results = run(out, local, options="full_local")
    node0, node1 = results
    assert node1["local_failed"] == STEPS and node0["local_failed"] == 0
    assert node0["local_last"]["ok"] and not node1["local_last"]["ok"]
    assert node0["local_last"]["replicas_kept"] == []  # node1 had nothing to send
    assert all(r["failed_saves"] == 0 and r["persistent_last"] == 8 for r in results)
    assert persistent_steps(out) == [4, 8]
    assert not os.path.exists(local / "node1" / "checkpoint-9" / "rank-1")


def test_another_world_size_resumes_from_the_persistent_tier(tmp_path: Path) -> None:
    """Units are one rank's shard of one world size: 4 ranks never load the units 2 wrote."""
    out, local = tmp_path / "out", tmp_path / "local"
    run(out, local)
    assert sorted(p.name for p in (local / "node0").iterdir()) == ["checkpoint-8", "checkpoint-9"]
    resumed = run(out, local, nproc=4)
    assert all(r["start"] == 8 and "/persist/" in r["resumed_from"] for r in resumed)
    last = resumed[0]["local_last"]
    assert last["step"] == 9 and last["ok"]  # the new world's own unit of step 9


def test_a_really_full_tmpfs(tmp_path: Path) -> None:
    """node1's folder on a 64 KiB tmpfs (a unit is ~160 KiB): where mounting is allowed (root)."""
    out, local = tmp_path / "out", tmp_path / "local"
    node1 = local / "node1"
    node1.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(node1)], capture_output=True,
                           text=True, timeout=30)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        node0, node1_result = run(out, local)
        assert node1_result["local_failed"] == STEPS and node0["local_failed"] == 0
        assert node0["local_last"]["ok"] and node0["local_last"]["replicas_kept"] == []
        assert all(r["failed_saves"] == 0 and r["persistent_last"] == 8 for r in (node0, node1_result))
        assert persistent_steps(out) == [4, 8]
        assert not list(node1.glob("*/rank-*")) and not list(node1.glob("*/.tmp-*"))  # nothing half-written
    finally:
        subprocess.run(["umount", str(node1)], capture_output=True, timeout=30)
