"""Crash consistency: a training job is SIGKILLed at random moments while it saves.

Each mode (local disk / S3, sync / async save, with or without retention) runs
``ROLL_CKPT_KILLS`` rounds (default 5; ``make test-reliability`` runs 50). A round starts
one worker (``_crash_child.py``) that resumes from ``latest`` and then trains and saves
every step; after a random, seeded delay (printed, so a failure can be replayed with
``ROLL_CKPT_CRASH_SEED``) the worker is SIGKILLed. Then, in the test process:

* every checkpoint committed before is still committed with the same manifest bytes and
  files (all re-hashed at the end); with retention, one may only vanish once ``keep``
  newer committed checkpoints exist;
* every save the worker saw return committed is committed on disk;
* ``layout.latest`` is the newest committed checkpoint, it verifies, it never goes back,
  and layout functions never return a temporary or uncommitted folder;
* the worker of the next round resumes exactly that checkpoint (same step, same digest
  of weights, optimizer state and RNG as when it was saved);
* the temporary folders, owner markers (and on S3 manifest-less folders) a killed worker
  left are gone once the next worker has committed its first save (``commit.clean_stale``).

A final worker resumes (with a timeout) and must load the newest checkpoint.

Workers are forked from a warm fork server (see ``_crash_child.py``) so a round costs
about a second instead of a torch import; ``ROLL_CKPT_CRASH_EXEC=1`` starts each worker
as a fresh interpreter instead (slower, same checks).

The S3 part also kills the S3 server (SeaweedFS) in the middle of a save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers.launch import child_env
from roll_ckpt import CheckpointManager, RollCkptError, load_config
from roll_ckpt.format import layout
from roll_ckpt.format.manifest import MANIFEST_NAME
from roll_ckpt.testing import tiny_state
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import open_storage

from ._support import (CHILD, ForkServer, Snapshot, WorkerLog, assert_unchanged, kills_per_mode,
                       leftovers, offline_aws, restart_seaweed, s3_unavailable_reason,
                       s3server_module, snapshot)

KILLS = kills_per_mode()
CKPT_NAME = re.compile(r"^checkpoint-\d+$")
USE_EXEC = os.environ.get("ROLL_CKPT_CRASH_EXEC", "") not in ("", "0")

MODES = [
    pytest.param("local", False, 0, id="local-sync"),
    pytest.param("local", True, 0, id="local-async"),
    pytest.param("local", True, 2, id="local-async-keep2"),
    pytest.param("s3", False, 0, id="s3-sync"),
    pytest.param("s3", True, 0, id="s3-async"),
]


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str] | None]:
    """The offline AWS environment when an S3 server can run here, else ``None``."""
    if s3_unavailable_reason() is not None:
        yield None
        return
    with offline_aws() as env:
        yield env


@pytest.fixture(scope="module")
def seaweed(s3_env: dict[str, str] | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = s3_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    mod = s3server_module()
    with mod.seaweed(tmp_path_factory.mktemp("crash-s3") / "data", bucket="roll-ckpt-crash") as server:
        yield server
        server.proc.kill()  # its data is thrown away: no need for its slow graceful stop


@pytest.fixture(scope="module")
def workers(s3_env: dict[str, str] | None) -> Iterator[Any]:
    """Starts crash workers: a warm fork server, or fresh interpreters (ROLL_CKPT_CRASH_EXEC=1)."""
    if USE_EXEC:
        yield _ExecWorkers(s3_env or {})
        return
    server = ForkServer(env=s3_env or {})
    try:
        yield server
    finally:
        server.close()


class _ExecWorkers:
    """The fork server's interface, one fresh interpreter per worker."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = child_env(env)
        self.procs: dict[int, subprocess.Popen] = {}

    def fork(self, spec: dict[str, Any]) -> int:
        err = open(spec["log"] + ".err", "ab")
        proc = subprocess.Popen([sys.executable, str(CHILD), "worker", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=self.env)
        err.close()
        self.procs[proc.pid] = proc
        return proc.pid

    def reap(self, pid: int, timeout: float = 60) -> int:
        proc = self.procs.pop(pid)
        code = proc.wait(timeout=timeout)
        return (-code) & 0x7F if code < 0 else (code << 8)


# --------------------------------------------------------------------------- the crash rounds

class CrashRun:
    """The state the test keeps across the rounds of one mode, and the invariants it checks."""

    def __init__(self, storage: Any, keep: int, backend: str, tag: str) -> None:
        self.storage = storage
        self.root = storage.root
        self.keep = keep
        self.backend = backend
        self.tag = tag
        self.history: dict[str, Snapshot] = {}
        self.order: dict[str, tuple] = {}
        self.digests: dict[int, str] = {}
        self.latest: Any = None
        self.pending_stale: set[str] = set()
        self.stats = {"rounds": 0, "commits": 0, "killed_before_ready": 0, "killed_mid_save": 0,
                      "stale_cleaned": 0, "retention_removed": 0, "retention_leftovers": 0}

    def _exists(self, path: str) -> bool:
        return self.storage.exists(path)

    def check_round(self, log: WorkerLog, expected: Any, where: str, killed: bool = True) -> None:
        st = self.stats
        st["rounds"] += killed
        ready = log.first("ready")
        if ready is None:
            st["killed_before_ready"] += killed
        else:
            step, dig = int(ready[0][0]), ready[0][1]
            want = expected.step if expected is not None else 0
            assert step == want, f"{where}: the worker resumed step {step}, latest committed was {want}"
            if expected is not None:
                assert self.digests.get(want) == dig, (
                    f"{where}: the state resumed from step {want} differs from the state that was saved")
        for rest, _ in log.all("step"):
            step, dig = int(rest[0]), rest[1]
            assert self.digests.setdefault(step, dig) == dig, (
                f"{where}: step {step} trained to a different state than in an earlier run (inexact resume)")

        refs = layout.committed(self.storage, self.root)
        scanned = layout.scan(self.storage, self.root)
        for r in scanned:
            name = r.path.rstrip("/").rsplit("/", 1)[-1]
            assert CKPT_NAME.match(name), f"{where}: layout returned {r.path}"
        now = {r.path: r for r in refs}
        newest_order = max((r.order for r in refs), default=None)

        # acknowledged saves are committed (or legitimately removed by retention)
        for rest, _ in log.all("committed"):
            step, path = int(rest[0]), rest[1]
            st["commits"] += 1
            if path in now:
                continue
            assert self.keep, f"{where}: save of step {step} returned committed, but {path} is not committed"
            self._assert_retention_may_remove(path, refs, where)

        # nothing committed earlier is lost or altered
        for path, snap in list(self.history.items()):
            if path in now:
                assert_unchanged(self.storage, snap, checksums=False)
                continue
            assert self.keep, f"{where}: committed checkpoint {path} (step {snap.step}) was lost"
            self._assert_retention_may_remove(path, refs, where, self.order[path])
            del self.history[path]
            st["retention_removed"] += 1
        for path, ref in now.items():
            if path not in self.history:
                self.history[path] = snapshot(self.storage, path, ref.step)
                self.order[path] = ref.order

        latest = layout.latest(self.storage, self.root)
        if refs:
            assert latest is not None and latest.committed and latest.order == newest_order, where
            assert self._exists(self.storage.join(latest.path, MANIFEST_NAME))
            verify(self.storage, latest.path)
            if self.latest is not None:
                assert latest.order >= self.latest.order, f"{where}: latest went back from {self.latest.path} to {latest.path}"
        else:
            assert latest is None, where
        self.latest = latest

        # leftovers of the killed save; those of the worker before must be gone now
        lo = leftovers(self.storage, self.root)
        if killed and (lo["tmp"] or lo["markers"]):
            st["killed_mid_save"] += 1
        if self.backend == "local" and self.keep == 0:
            # only a rename publishes a folder named checkpoint-N there, and nothing removes one
            assert not lo["uncommitted"], f"{where}: uncommitted checkpoint folders: {lo['uncommitted']}"
        if log.first("committed") is not None:
            still = sorted(p for p in self.pending_stale if self._exists(p))
            assert not still, (f"{where}: the worker committed a save, but the leftovers of the killed "
                               f"worker before it are still there: {still}")
            st["stale_cleaned"] += len(self.pending_stale)
            self.pending_stale = set()
        # manifest-less folders: a save in place (S3) or a removal by retention that was cut short
        self.pending_stale |= set(lo["tmp"]) | set(lo["markers"]) | set(lo["uncommitted"])

    def _assert_retention_may_remove(self, path: str, refs: list[Any], where: str,
                                     order: tuple | None = None) -> None:
        if order is None:
            run = path.rstrip("/").rsplit("/", 2)[-2]
            step = int(path.rstrip("/").rsplit("-", 1)[-1])
            order = layout.CheckpointRef(path, step, run, True).order
        newer = [r for r in refs if r.order > order]
        assert len(newer) >= self.keep, (
            f"{where}: {path} is gone although only {len(newer)} newer committed checkpoints exist "
            f"(max_ckpt_to_keep {self.keep})")

    def final_check(self) -> None:
        for snap in self.history.values():
            assert_unchanged(self.storage, snap, checksums=True)


def _wait_for(log: WorkerLog, kind: str, deadline: float) -> float | None:
    while time.monotonic() < deadline:
        hit = log.read().first(kind)
        if hit is not None:
            return hit[1]
        if log.errors():
            return None
        time.sleep(0.005)
    return None


@pytest.mark.timeout(180 + 20 * KILLS)
@pytest.mark.parametrize("backend,is_async,keep", MODES)
def test_sigkill_while_training(backend: str, is_async: bool, keep: int, request: pytest.FixtureRequest,
                                tmp_path: Path, workers: Any) -> None:
    tag = request.node.callspec.id
    if backend == "s3":
        server = request.getfixturevalue("seaweed")
        url = f"s3://{server.bucket}/crash-{tag}-{uuid.uuid4().hex[:8]}"
        options = server.storage_options
        window = 1.2
    else:
        url, options, window = str(tmp_path / "ckpt"), {}, 0.6
    storage = open_storage(url, options)
    seed = int(os.environ.get("ROLL_CKPT_CRASH_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(f"{seed}-{tag}")
    print(f"[{tag}] ROLL_CKPT_CRASH_SEED={seed} kills={KILLS} output={url}")
    run = CrashRun(storage, keep, backend, tag)
    base = {"out": url, "storage_options": options, "async": is_async, "keep": keep}
    t_start = time.monotonic()

    for rnd in range(KILLS):
        log = WorkerLog(tmp_path / f"round-{rnd:03d}.log")
        expected = layout.latest(storage, storage.root)
        # Round 0 waits for a first commit, so every later round resumes a real checkpoint;
        # some kills land while the worker starts and resumes, most while it trains and saves.
        anchor = "committed" if rnd == 0 else ("start" if rng.random() < 0.15 else "ready")
        delay = rng.uniform(0.0, 0.3 if anchor == "start" else window)
        plan = f"{delay:.3f}s after {anchor}"
        where = f"[{tag}] round {rnd} (seed {seed}, kill {plan})"
        pid = workers.fork(dict(base, log=str(log.path)))
        t0 = time.time()
        if anchor == "start":
            time.sleep(delay)
        else:
            at = _wait_for(log, anchor, time.monotonic() + 120)
            assert at is not None, f"{where}: the worker never reported '{anchor}':\n{log.errors()}"
            time.sleep(max(0.0, at + delay - time.time()))
        os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        status = workers.reap(pid)
        log.read()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"{where}: the worker ended on its own (status {status}) before the kill:\n{log.errors()}")
        last = log.last()
        phase = "before any event" if last is None else f"{t_kill - last[2]:.3f}s after '{last[0]} {' '.join(last[1])[:24]}'"
        print(f"{where}: killed {t_kill - t0:.3f}s after start, {phase}; "
              f"{len(log.all('committed'))} saves committed in this round")
        run.check_round(log, expected, where)

    # a last worker resumes (and is not killed): it must load the newest checkpoint
    log = WorkerLog(tmp_path / "final.log")
    expected = layout.latest(storage, storage.root)
    pid = workers.fork(dict(base, log=str(log.path), resume_only=True))
    status = workers.reap(pid, timeout=180)
    assert status == 0, f"[{tag}] the final resume failed (status {status}):\n{log.read().errors()}"
    run.check_round(log.read(), expected, f"[{tag}] final resume", killed=False)
    assert log.first("ready") is not None
    run.final_check()
    st = run.stats
    print(f"[{tag}] {st['rounds']} kills in {time.monotonic() - t_start:.1f}s: {st['commits']} saves "
          f"committed, {len(run.history)} checkpoints kept and re-verified, {st['killed_mid_save']} kills "
          f"left a save in flight, {st['killed_before_ready']} landed before resume finished, "
          f"{st['stale_cleaned']} leftovers cleaned by the next start, "
          f"{st['retention_removed']} removed by retention; latest {run.latest.path if run.latest else None}")
    assert run.latest is not None, f"[{tag}] no checkpoint was ever committed in {KILLS} rounds"
    if backend == "local":
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)  # 50 rounds leave hundreds of MB


SWEEP_MODES = [
    pytest.param("local", False, 1, id="local-sync-keep1"),
    pytest.param("local", True, 1, id="local-async-keep1"),  # make test-reliability
    pytest.param("s3", False, 1, id="s3-sync-keep1"),  # make test-reliability
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,is_async,keep", SWEEP_MODES)
def test_sigkill_before_every_storage_operation(backend: str, is_async: bool, keep: int,
                                                 request: pytest.FixtureRequest, tmp_path: Path,
                                                 workers: Any) -> None:
    """Deterministic companion of the random kills: the worker SIGKILLs itself just before
    its 1st, 2nd, ... storage operation (file open / close, create-only write, mkdir,
    rename, fsync of a folder, remove) of a save and of the retention that follows it
    (max_ckpt_to_keep 1), until a worker gets through. Every kill point of the commit
    protocol and of a removal by retention is hit; after each, the same invariants as above."""
    tag = request.node.callspec.id
    if (backend == "s3" or is_async) and KILLS < 20:
        pytest.skip("this sweep runs in make test-reliability (ROLL_CKPT_KILLS >= 20); make test sweeps "
                    "local-sync and covers the other modes with random kills")
    if backend == "s3":
        server = request.getfixturevalue("seaweed")
        url = f"s3://{server.bucket}/sweep-{tag}-{uuid.uuid4().hex[:8]}"
        options = server.storage_options
    else:
        url, options = str(tmp_path / "ckpt"), {}
    storage = open_storage(url, options)
    run = CrashRun(storage, keep, backend, tag)
    base = {"out": url, "storage_options": options, "async": is_async, "keep": keep, "saves": 1}
    t_start = time.monotonic()
    seen_ops: dict[str, int] = {}
    n = 0
    while True:
        n += 1
        assert n < 300, f"[{tag}] the saves never finished"
        log = WorkerLog(tmp_path / f"sweep-{n:03d}.log")
        expected = layout.latest(storage, storage.root)
        pid = workers.fork(dict(base, log=str(log.path), kill_op=n))
        status = workers.reap(pid, timeout=180)
        log.read()
        dying = log.first("dying")
        where = f"[{tag}] kill before storage operation {n}"
        if dying is None:
            assert status == 0, f"{where}: the worker failed (status {status}):\n{log.errors()}"
            run.check_round(log, expected, where, killed=False)
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, log.errors())
        op = dying[0][1]
        seen_ops[op] = seen_ops.get(op, 0) + 1
        print(f"{where}: {dying[0][1]} {dying[0][2]}")
        run.check_round(log, expected, where)
    log = WorkerLog(tmp_path / "final.log")
    expected = layout.latest(storage, storage.root)
    pid = workers.fork(dict(base, log=str(log.path), resume_only=True))
    assert workers.reap(pid, timeout=180) == 0, log.read().errors()
    run.check_round(log.read(), expected, f"[{tag}] final resume", killed=False)
    run.final_check()
    print(f"[{tag}] {n - 1} kill points in {time.monotonic() - t_start:.1f}s: {seen_ops}; "
          f"{run.stats['stale_cleaned']} leftovers cleaned by the next start")
    commit_op = "rename_dir" if backend == "local" else "write_create"
    for op in ("open_write", "close", commit_op, "remove", "remove_tree"):
        assert seen_ops.get(op), f"[{tag}] no kill landed before a {op}: {seen_ops}"


# --------------------------------------------------------------------------- the S3 server dies


class _ServerKiller:
    """The manager's storage; kills the S3 server just before the chosen operation of a save."""

    def __init__(self, inner: Any, server: Any) -> None:
        self._inner, self._server = inner, server
        self.armed: str | None = None
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def network_counts(self) -> Any:
        # forwarded as a method of its own: the capability Protocols' isinstance does not call
        # __getattr__ from Python 3.12 on (the manager's storage setter says so)
        return self._inner.network_counts()

    def _maybe_kill(self, point: str) -> None:
        if self.armed == point and not self.fired:
            self.fired = True
            self._server.proc.kill()  # SIGKILL: no clean shutdown
            self._server.proc.wait(timeout=30)

    def open_write(self, path: str) -> Any:
        if path.endswith(".distcp"):
            self._maybe_kill("data")
        return self._inner.open_write(path)

    def write_create(self, path: str, data: bytes) -> None:
        if path.endswith(MANIFEST_NAME):
            self._maybe_kill("manifest")
        return self._inner.write_create(path, data)


@pytest.mark.timeout(600)
def test_s3_server_killed_in_the_middle_of_a_save(seaweed: Any) -> None:
    """SIGKILL the S3 server while a save writes its data (sync and async) and just before
    its manifest: the save fails with a clear error, nothing half-written is listed as
    committed, and once the server is back every earlier checkpoint is intact, the failed
    step can be saved again, and resume takes the newest."""
    server = seaweed  # restarted with the same ports and data after each kill
    scenarios = [("data", False), ("manifest", True)]
    if KILLS >= 20:
        scenarios += [("manifest", False), ("data", True)]
    url = f"s3://{server.bucket}/kill-{uuid.uuid4().hex[:8]}"
    # bounded retries (botocore's max_attempts: the retries after the first attempt), so a dead
    # server is reported after 3 attempts of a request, each refused at once
    retries = 2
    options = dict(server.storage_options,
                   config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": retries}})
    snaps: dict[str, Snapshot] = {}
    step = 0
    for point, is_async in scenarios:
        cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": url,
                                                 "storage_options": options},
                           "strategy_config": {"async_save_ckpt": is_async}})
        m = CheckpointManager.from_config(cfg, quiet=True)
        state = tiny_state(seed=step)
        for _ in range(2):
            step += 1
            path = m.save(step, state)
            m.wait()
            snaps[path] = snapshot(m.storage, path, step)
        killer = m.storage = _ServerKiller(m.storage, server)
        killer.armed = point
        step += 1
        gave_up: list[tuple[str, Any]] = []  # each request that failed for good: its error, its attempts

        def failed_call(exception: Any = None, context: Any = None, **_: Any) -> None:
            gave_up.append((type(exception).__name__, ((context or {}).get("retries") or {}).get("attempt")))

        killer.fs.s3.meta.events.register("after-call-error.s3", failed_call, unique_id="test-crash-gave-up")
        before = m.stats.network
        t0 = time.monotonic()
        with pytest.raises(RollCkptError) as info:
            m.save(step, state)
            m.wait()  # async: the write fails in the background and surfaces here
        took = time.monotonic() - t0
        assert killer.fired
        msg = str(info.value)
        print(f"[s3 server killed before the {point} of step {step}, {'async' if is_async else 'sync'}] "
              f"save failed after {took:.1f}s: {msg[:300]}")
        assert f"checkpoint-{step}" in msg and "nothing of it was committed" in msg, msg
        assert "Traceback" not in msg and "\n" not in msg, f"not one clear line: {msg}"
        assert "EndpointConnectionError" in msg or "connect" in msg.lower(), msg
        # Reported, not waited for: every request met a refused connection, each attempt counted
        # as one, and each request was given up after its 1 + `retries` attempts.
        net = m.stats.network.since(before)
        assert net.faults and set(net.kinds) == {"connection error (EndpointConnectionError)"}, net
        assert gave_up and all(g == ("EndpointConnectionError", 1 + retries) for g in gave_up), gave_up
        # the counts follow botocore's bound too: every attempt but each request's last was retried
        assert net.retries == net.faults - len(gave_up), (net, gave_up)
        killer.fs.s3.meta.events.unregister("after-call-error.s3", unique_id="test-crash-gave-up")

        restart_seaweed(server)
        storage = open_storage(url, options)
        refs = layout.committed(storage, storage.root)
        assert {r.path for r in refs} == set(snaps), f"committed after the kill: {[r.path for r in refs]}"
        for snap in snaps.values():
            assert_unchanged(storage, snap, checksums=True)
        failed = m.storage.join(m.run_dir, f"checkpoint-{step}")
        assert not storage.exists(storage.join(failed, MANIFEST_NAME))
        assert layout.latest(storage, storage.root).step == step - 1

        # the server is back: the same manager saves the failed step again
        m.storage = killer._inner
        path = m.save(step, state)
        m.close()
        snaps[path] = snapshot(storage, path, step)
        assert not leftovers(storage, storage.root)["markers"], leftovers(storage, storage.root)

    cfg = load_config({"checkpoint_config": {"type": "file_system", "output_dir": url, "storage_options": options},
                       "resume_from_checkpoint": "latest"})
    with CheckpointManager.from_config(cfg, quiet=True) as r:
        assert r.resume(tiny_state(seed=99)) == step
