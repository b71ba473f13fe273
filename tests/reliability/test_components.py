"""Steps made of several components, saved by separate processes and process groups.

One RL job, three components (see ``_components_child.py``), each with its own processes
and its own ``CheckpointManager(config, component=...)``, saving the same steps into
``<run>/checkpoint-<step>/<component>/`` of one shared run folder:

* ``actor_train`` - FSDP2 on a 2-rank gloo process group, asynchronous saves;
* ``critic``      - one process without a process group, synchronous saves;
* ``pipeline``    - the driver's ``DriverState`` (JSON, no pickle), asynchronous saves.

The tests:

* ``reference`` (fixture) - an uninterrupted launch of the job: the losses (``float.hex``)
  and final states every other launch is compared with, and each step committed by
  exactly one process of the three.
* ``test_a_component_killed_mid_save_*`` - one component SIGKILLs itself halfway through
  writing a file of step ``KILL_STEP`` (local disk: rank 0 of the actor, launched by a
  real ``torchrun``, in its temporary folder; S3: the critic, written in place). Then:
  the step has no manifest, ``layout.latest`` never returns it (watched while the job
  runs), the other components' parts of it are committed, no process can commit it;
  a relaunch (new ``run_name``, ``resume_from_checkpoint: latest``) resumes every
  component from the step before and ends with the losses and final states of the
  reference, bit for bit. On S3 with ``max_ckpt_to_keep: 2``, retention then removes
  the step that can no longer complete (and the dead launch's emptied run folder).
* ``test_the_last_part_killed_before_it_commits_the_step`` - the pipeline commits its
  part last, then dies before creating the step's manifest: the step is complete but not
  committed; the relaunch commits it from its parts and every component resumes it.
* ``test_more_kill_points`` - the same cycle with other victims, ranks (a non-coordinator
  rank), files and retention; only with ``ROLL_CKPT_KILLS >= 20`` (make test-reliability).
* ``test_concurrent_step_commits_have_one_winner`` - 8 processes call
  ``components.try_complete`` on the same complete step at once (released together,
  and held at the create of the step's manifest until all 8 are there), on local disk
  and on S3: exactly one wins, and the manifest is the one the components' own commit
  wrote, byte for byte.

Every launch also checks that each step was committed by exactly one process.

Processes are forked from a warm fork server (``_components_child.py serve``): a forked
actor rank joins a real gloo group through the same env:// rendezvous torchrun sets up,
without paying a torch import per process. The killed launch on local disk runs the
actor under ``torchrun --standalone --nproc_per_node 2`` itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import forkserver
from helpers.forkserver import read_events
from helpers.launch import free_port, kill_group, start_torchrun
from helpers.training import config
from roll_ckpt import CheckpointManager, DriverState, new_run_name
from roll_ckpt.format import layout
from roll_ckpt.format.commit import MARKER_PREFIX
from roll_ckpt.format.components import complete_pending, try_complete
from roll_ckpt.format.layout import TMP_PREFIX
from roll_ckpt.format.manifest import MANIFEST_NAME, Manifest
from roll_ckpt.format.manifest import verify
from roll_ckpt_fs import open_storage

from ._support import kills_per_mode

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_components_child.py"
COMPONENTS = ("actor_train", "critic", "pipeline")
ACTOR_RANKS = 2
STEPS, EVERY, KILL_STEP = 8, 2, 6
RESUME_STEP = KILL_STEP - EVERY
SAVED = list(range(EVERY, STEPS + 1, EVERY))
LAUNCH_TIMEOUT_S = 150.0
KILLS = kills_per_mode()  # >= 20 (make test-reliability): more kill points, see test_more_kill_points

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- processes


def ForkServer(env: dict[str, str]) -> forkserver.ForkServer:  # noqa: N802 - builds the shared class
    """``_components_child.py serve``: forks warm component processes on request."""
    return forkserver.ForkServer(CHILD, dict(env, OMP_NUM_THREADS="1"))


@dataclass
class Proc:
    """One process of a launch (forked), or a whole torchrun job (``popen``)."""

    component: str
    rank: int | None
    pid: int
    popen: subprocess.Popen | None = None
    signal: int | None = None
    code: int | None = None

    @property
    def label(self) -> str:
        return f"{self.component}[{'torchrun' if self.popen else self.rank}]"

    @property
    def ended(self) -> bool:
        return self.signal is not None or self.code is not None

    def poll(self, server: ForkServer) -> bool:
        if self.ended:
            return True
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is None:
                return False
            self.signal, self.code = (-rc, None) if rc < 0 else (None, rc)
            return True
        status = server.poll(self.pid)
        if status is None:
            return False
        if os.WIFSIGNALED(status):
            self.signal = os.WTERMSIG(status)
        else:
            self.code = os.WEXITSTATUS(status)
        return True

    def kill(self) -> None:
        if self.ended:
            return
        try:
            if self.popen is not None:
                kill_group(self.popen)  # torchrun and its workers
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Launch:
    """One launch of the job: every component's processes, started together."""

    def __init__(self, server: ForkServer, folder: Path, name: str, *, out: str, options: dict[str, Any],
                 run_name: str, env: dict[str, str], keep: int = 0, stop_after: int | None = None,
                 kill: tuple[str, dict[str, Any]] | None = None, torchrun_actor: bool = False) -> None:
        self.server, self.folder, self.name = server, folder, name
        self.base = {"out": out, "storage_options": options, "run_name": run_name, "steps": STEPS,
                     "every": EVERY, "keep": keep, "stop_after": stop_after}
        self.env = env
        self.kill_spec = kill
        self.torchrun_actor = torchrun_actor
        self.procs: list[Proc] = []

    def _files(self, component: str, rank: Any = "{rank}") -> dict[str, str]:
        stem = self.folder / f"{self.name}-{component}-r{rank}"
        return {"log": f"{stem}.log", "result": f"{stem}.json", "stderr": f"{stem}.err"}

    def spec(self, component: str) -> dict[str, Any]:
        spec = dict(self.base, component=component, **self._files(component))
        if self.kill_spec is not None and self.kill_spec[0] == component:
            spec["kill"] = dict(self.kill_spec[1], logs=[  # the other components' processes
                self._files(c, rank)["log"] for c in COMPONENTS if c != component for rank in self.ranks(c)])
        return spec

    def ranks(self, component: str) -> list[int]:
        return list(range(ACTOR_RANKS)) if component == "actor_train" else [0]

    def start(self) -> "Launch":
        for component in COMPONENTS:
            spec = self.spec(component)
            if component == "actor_train" and self.torchrun_actor:
                self.procs.append(self._torchrun(spec))
            elif component == "actor_train":
                port = free_port()
                for rank in range(ACTOR_RANKS):
                    rank_spec = dict(spec, rank=rank, world_size=ACTOR_RANKS, master_port=port,
                                     stderr=spec["stderr"].format(rank=rank))
                    self.procs.append(Proc(component, rank, self.server.fork(rank_spec)))
            else:
                spec["stderr"] = spec["stderr"].format(rank=0)
                self.procs.append(Proc(component, 0, self.server.fork(spec)))
        return self

    def _torchrun(self, spec: dict[str, Any]) -> Proc:
        with open(self.folder / f"{self.name}-actor_train-torchrun.out", "wb") as out:
            popen = start_torchrun(CHILD, "run", json.dumps(spec), nproc=ACTOR_RANKS, env=self.env, stdout=out)
        return Proc("actor_train", None, popen.pid, popen)

    def wait(self, timeout: float = LAUNCH_TIMEOUT_S) -> "Launch":
        """Wait for every process. When a rank of a forked group ends abnormally, the other
        ranks of its group are killed, as torchrun does; at the deadline, everything is."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                running = [p for p in self.procs if not p.poll(self.server)]
                for p in self.procs:
                    if p.ended and (p.signal or p.code):
                        for q in running:
                            if q.component == p.component and q.popen is None:
                                q.kill()
                if not running:
                    return self
                if time.monotonic() > deadline:
                    raise AssertionError(f"launch {self.name} did not end within {timeout:.0f}s; "
                                         f"still running: {[p.label for p in running]}\n{self.diagnostics()}")
                time.sleep(0.02)
        finally:
            for p in self.procs:
                p.kill()
            for p in self.procs:
                if p.popen is not None:
                    kill_group(p.popen)  # torchrun's workers too, should any outlive it
                    try:
                        p.popen.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    for _ in range(500):
                        if p.poll(self.server):
                            break
                        time.sleep(0.01)

    # ----------------------------------------------------------- what the processes wrote

    def timed_events(self, component: str, rank: int = 0) -> list[tuple[str, list[str], float]]:
        return read_events(self._files(component, rank)["log"])

    def events(self, component: str, rank: int = 0) -> list[tuple[str, list[str]]]:
        return [(kind, rest) for kind, rest, _ in self.timed_events(component, rank)]

    def all_events(self) -> Iterator[tuple[str, int, str, list[str]]]:
        for component in COMPONENTS:
            for rank in self.ranks(component):
                for kind, rest in self.events(component, rank):
                    yield component, rank, kind, rest

    def losses(self, component: str, rank: int) -> dict[int, str]:
        return {int(rest[0]): rest[1] for kind, rest in self.events(component, rank) if kind == "loss"}

    def result(self, component: str, rank: int) -> dict[str, Any]:
        return json.loads(Path(self._files(component, rank)["result"]).read_text())

    def proc(self, component: str, rank: int | None = None) -> Proc:
        for p in self.procs:
            if p.component == component and (p.popen is not None or rank is None or p.rank == rank):
                return p
        raise KeyError((component, rank))

    def diagnostics(self) -> str:
        parts = []
        for p in self.procs:
            parts.append(f"--- {p.label}: pid {p.pid}, signal {p.signal}, exit {p.code}")
        for f in sorted(self.folder.glob(f"{self.name}-*")):
            if f.suffix in (".log", ".err", ".out"):
                text = f.read_text(errors="replace")
                parts.append(f"--- {f.name}:\n{text[-3000:]}")
        return "\n".join(parts)

    def assert_clean(self, components: tuple[str, ...] = COMPONENTS) -> None:
        for p in self.procs:
            if p.component in components:
                assert p.code == 0 and p.signal is None, f"{self.name}: {p.label} failed\n{self.diagnostics()}"
        for component in components:
            for rank in self.ranks(component):
                assert self.events(component, rank)[-1][0] == "done", self.diagnostics()

    def step_commits(self) -> dict[int, list[str]]:
        """``step -> [who]``: the processes that committed each whole step."""
        out: dict[int, list[str]] = {}
        for component, rank, kind, rest in self.all_events():
            if kind == "step":
                out.setdefault(int(rest[0]), []).append(f"{component}[{rank}]")
        return out

    def part_commits(self, component: str) -> list[int]:
        return [int(rest[0]) for kind, rest in self.events(component, 0) if kind == "part"]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(offline_aws: dict[str, str]) -> Iterator[ForkServer]:
    fs = ForkServer(offline_aws)
    try:
        yield fs
    finally:
        fs.close()


@dataclass
class Reference:
    losses: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)
    final: dict[tuple[str, int], dict[str, str]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def reference(server: ForkServer, offline_aws: dict[str, str],
              tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted job, saving on the same schedule."""
    folder = tmp_path_factory.mktemp("components-reference")
    out = str(folder / "ckpt")
    run = new_run_name()
    t0 = time.monotonic()
    launch = Launch(server, folder, "ref", out=out, options={}, run_name=run, env=offline_aws).start().wait()
    launch.assert_clean()
    ref = Reference()
    for component in COMPONENTS:
        for rank in launch.ranks(component):
            losses = launch.losses(component, rank)
            assert sorted(losses) == list(range(1, STEPS + 1)), launch.diagnostics()
            ref.losses[(component, rank)] = losses
            ref.final[(component, rank)] = launch.result(component, rank)["final"]
        assert launch.part_commits(component) == SAVED, launch.diagnostics()
    # the two actor ranks hold the same full state at the end (their generators differ)
    a, b = (dict(ref.final[("actor_train", r)]) for r in (0, 1))
    assert a.pop("rank_rng") != b.pop("rank_rng") and a == b
    commits = launch.step_commits()
    assert sorted(commits) == SAVED and all(len(who) == 1 for who in commits.values()), commits
    storage = open_storage(out, {})
    latest = layout.latest(storage, storage.root)
    assert latest is not None and latest.path.endswith(f"{run}/checkpoint-{STEPS}")
    assert set(verify(storage, latest.path).manifest.parts) == set(COMPONENTS)
    print(f"\n[reference] job of {len(COMPONENTS)} components, {STEPS} steps, saved {SAVED}: "
          f"{time.monotonic() - t0:.1f}s; steps committed by {commits}")
    return ref


# --------------------------------------------------------------------------- checks


class LatestWatcher:
    """Polls ``layout.latest`` in a thread while a launch runs; remembers every answer."""

    def __init__(self, storage: Any, interval: float) -> None:
        self.storage = storage
        self.interval = interval
        self.seen: list[Any] = []
        self.errors: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "LatestWatcher":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ref = layout.latest(self.storage, self.storage.root)
            except Exception as exc:  # noqa: BLE001 - checked by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                self.polls += 1
                if ref is not None and (not self.seen or self.seen[-1].path != ref.path):
                    self.seen.append(ref)
                    self._check_parts(ref)
            self._stop.wait(self.interval)

    def _check_parts(self, ref: Any) -> None:
        """A step ``latest`` returns lists every component's part (unless retention removed it since)."""
        try:
            data = _read(self.storage, self.storage.join(ref.path, MANIFEST_NAME))
        except FileNotFoundError:
            return
        parts = set(Manifest.from_bytes(data)[0].parts)
        if parts != set(COMPONENTS):
            self.errors.append(f"{ref.path} is the latest step, but its manifest lists the parts {sorted(parts)}")

    def check(self, never: str) -> None:
        assert not self.errors, f"layout.latest failed while the job ran: {self.errors[:3]}"
        paths = [r.path for r in self.seen]
        assert never not in paths, f"layout.latest returned the step that was never committed: {paths}"
        orders = [r.order for r in self.seen]
        assert orders == sorted(orders), f"layout.latest went back: {paths}"
        assert all(r.committed for r in self.seen)


def _read(storage: Any, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def _names(storage: Any, path: str) -> dict[str, bool]:
    return {e.name: e.is_dir for e in storage.list(path)}


def _committed_steps(storage: Any) -> list[tuple[str, int]]:
    return [(r.run, r.step) for r in layout.committed(storage, storage.root)]


def _location(backend: str, name: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Where a test's checkpoints go, and the storage options: ``tmp_path/ckpt`` (``local``), or
    a fresh ``s3://<bucket>/<name>-<id>`` on the session's S3 server (``s3``)."""
    if backend == "s3":
        s3 = request.getfixturevalue("s3")
        return f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:10]}", s3.storage_options
    return str(tmp_path / "ckpt"), {}


def _next_run_name(after: str) -> str:
    """A relaunch's run name: ``new_run_name()`` once it is newer than ``after`` (1 ms resolution)."""
    deadline = time.monotonic() + 5
    while True:
        name = new_run_name()
        if layout.run_key(name) > layout.run_key(after):
            return name
        assert time.monotonic() < deadline, (name, after)
        time.sleep(0.05)


def _assert_same_as_reference(reference: Reference, launch: Launch, steps: range, where: str) -> None:
    for component in COMPONENTS:
        for rank in launch.ranks(component):
            got = launch.losses(component, rank)
            want = {s: reference.losses[(component, rank)][s] for s in steps}
            assert {s: got.get(s) for s in steps} == want, (
                f"{where}: {component} rank {rank} losses differ from the uninterrupted run")


def _kill_cycle(server: ForkServer, reference: Reference, folder: Path, env: dict[str, str], *, out: str,
                options: dict[str, Any], victim: str, victim_rank: int, at: str, suffix: str = "",
                torchrun_actor: bool = False, keep: int = 0, backend: str) -> dict[str, Any]:
    """Launch; SIGKILL ``victim`` in its save of ``KILL_STEP`` (``at``: ``write``, halfway
    through writing a file of its part; ``step_commit``, after committing its part last,
    before committing the step); check the storage; relaunch; check that every component
    resumed from the same step and ended exactly like the reference."""
    storage = open_storage(out, options)
    root = storage.root
    others = [c for c in COMPONENTS if c != victim]
    timings: dict[str, float] = {}
    # a step whose part died mid-write is lost (resume from the step before); a step whose
    # parts are all committed is committed by the relaunch (complete_pending) and resumed
    resume_step = RESUME_STEP if at == "write" else KILL_STEP

    # -- launch 1: the victim dies in its save of KILL_STEP; the others save it and stop
    run1 = new_run_name()
    t0 = time.monotonic()
    watcher = LatestWatcher(storage, interval=0.03 if storage.atomic_rename else 0.25)
    kill = {"rank": victim_rank, "step": KILL_STEP, "at": at, "suffix": suffix}
    with watcher:
        first = Launch(server, folder, "first", out=out, options=options, run_name=run1, env=env, keep=keep,
                       stop_after=KILL_STEP, kill=(victim, kill), torchrun_actor=torchrun_actor).start().wait()
    timings["killed launch"] = time.monotonic() - t0
    where = f"[{backend}] launch 1 ({victim} killed in its save of step {KILL_STEP}, at {at})"
    dying = [rest for kind, rest in first.events(victim, victim_rank) if kind == "dying"]
    assert len(dying) == 1, f"{where}: the victim never reached its kill point\n{first.diagnostics()}"
    assert int(dying[0][0]) == KILL_STEP and suffix in dying[0][2].rsplit("/", 1)[-1], dying
    victim_proc = first.proc(victim, victim_rank)
    if victim_proc.popen is None:
        assert victim_proc.signal == signal.SIGKILL, f"{where}: {victim_proc}\n{first.diagnostics()}"
    else:  # torchrun reports the SIGKILLed worker and fails
        assert victim_proc.code not in (None, 0) or victim_proc.signal, first.diagnostics()
        text = (folder / "first-actor_train-torchrun.out").read_text(errors="replace")
        assert "SIGKILL" in text or "Signal 9" in text, text[-3000:]
    assert not any(kind == "done" for kind, _ in first.events(victim, victim_rank))
    first.assert_clean(tuple(others))
    _assert_same_as_reference(reference, first, range(1, KILL_STEP + 1), where)
    commits = first.step_commits()
    assert sorted(commits) == [s for s in SAVED if s < KILL_STEP], f"{where}: steps committed: {commits}"
    assert all(len(who) == 1 for who in commits.values()), f"{where}: a step committed twice: {commits}"

    # -- the step on storage: no manifest; the others' parts committed; the victim's not, or last
    run1_dir = storage.join(root, run1)
    step_path = storage.join(run1_dir, layout.checkpoint_name(KILL_STEP))
    before_path = storage.join(run1_dir, layout.checkpoint_name(RESUME_STEP))
    assert not storage.exists(storage.join(step_path, MANIFEST_NAME)), f"{where}: step {KILL_STEP} has a manifest"
    for component in others + ([victim] if at == "step_commit" else []):
        report = verify(storage, storage.join(step_path, component))
        assert (report.manifest.step, report.manifest.component) == (KILL_STEP, component)
    entries = _names(storage, step_path)
    markers = [n for n, is_dir in entries.items() if n.startswith(f"{MARKER_PREFIX}{victim}-") and not is_dir]
    if at == "write":
        assert not storage.exists(storage.join(step_path, victim, MANIFEST_NAME))
    # What the victim left, unless someone may have removed it already: the coordinator of
    # its own group (when another rank died, it may abort the save), or a component whose
    # first save (which removes the leftovers of processes that are gone) came after the death.
    died_at = [t for kind, _, t in first.timed_events(victim, victim_rank) if kind == "dying"][0]
    later_first_save = any(next(t for kind, _, t in first.timed_events(c) if kind == "part") > died_at
                           for c in others)
    if at == "write" and victim_rank == 0 and not later_first_save:
        assert len(markers) == 1, f"{where}: no owner marker of the victim's save in {step_path}: {entries}"
        if storage.atomic_rename:  # POSIX: the victim wrote into a temporary sibling of its part
            tmp = [n for n, is_dir in entries.items() if n.startswith(f"{TMP_PREFIX}{victim}-") and is_dir]
            assert len(tmp) == 1 and victim not in entries, f"{where}: {entries}"
            assert f"/{tmp[0]}/" in dying[0][2], dying
        elif suffix == ".metadata":  # object store, written in place: the data file is there
            assert storage.exists(storage.join(step_path, victim, "dcp", "__0_0.distcp")), entries
    elif at == "step_commit":
        assert sorted(entries) == sorted(COMPONENTS), f"{where}: {entries}"
        assert [rest for kind, rest in first.events(victim, victim_rank) if kind == "last"] == [[str(KILL_STEP)]]
        assert first.part_commits(victim)[-1] == KILL_STEP
    latest = layout.latest(storage, root)
    assert latest is not None and latest.path.rstrip("/") == before_path.rstrip("/"), (
        f"{where}: latest is {latest}, not the step before the killed one")
    assert _committed_steps(storage) == [(run1, s) for s in SAVED if s < KILL_STEP], _committed_steps(storage)
    assert set(verify(storage, before_path).manifest.parts) == set(COMPONENTS)
    if at == "write":
        assert not try_complete(storage, step_path, KILL_STEP, COMPONENTS)
        assert complete_pending(storage, root, COMPONENTS) == []
        assert not storage.exists(storage.join(step_path, MANIFEST_NAME))
    watcher.check(never=step_path)

    # -- launch 2: a relaunch resumes every component from the same step and runs to the end
    run2 = _next_run_name(run1)
    resume_path = storage.join(run1_dir, layout.checkpoint_name(resume_step))
    t0 = time.monotonic()
    with watcher:
        second = Launch(server, folder, "second", out=out, options=options, run_name=run2, env=env,
                        keep=keep).start().wait()
    timings["relaunch"] = time.monotonic() - t0
    where = f"[{backend}] relaunch after {victim} was killed (at {at})"
    second.assert_clean()
    for component in COMPONENTS:
        for rank in second.ranks(component):
            ready = [rest for kind, rest in second.events(component, rank) if kind == "ready"]
            assert ready and int(ready[0][0]) == resume_step, f"{where}: {component}[{rank}] {ready}"
            assert ready[0][1].rstrip("/").endswith(f"{run1}/{layout.checkpoint_name(resume_step)}"), ready
            result = second.result(component, rank)
            assert result["start"] == resume_step
            assert result["final"] == reference.final[(component, rank)], (
                f"{where}: the final state of {component} rank {rank} differs from the uninterrupted run: "
                f"{sorted(k for k in result['final'] if result['final'][k] != reference.final[(component, rank)].get(k))}")
        assert second.part_commits(component) == [s for s in SAVED if s > resume_step]
    _assert_same_as_reference(reference, second, range(resume_step + 1, STEPS + 1), where)
    commits = second.step_commits()
    # a step whose parts were all committed is committed (and announced) by the first resume
    pending = [resume_step] if at == "step_commit" else []
    assert sorted(commits) == pending + [s for s in SAVED if s > resume_step], f"{where}: {commits}"
    assert all(len(who) == 1 for who in commits.values()), f"{where}: a step committed twice: {commits}"
    final = storage.join(root, run2, layout.checkpoint_name(STEPS))
    latest = layout.latest(storage, root)
    assert latest is not None and latest.path.rstrip("/") == final.rstrip("/"), latest
    assert set(verify(storage, final).manifest.parts) == set(COMPONENTS)
    if at == "write":
        watcher.check(never=step_path)
    else:
        watcher.check(never="")
        if storage.exists(resume_path):  # committed by the relaunch, from the parts alone
            assert set(verify(storage, resume_path).manifest.parts) == set(COMPONENTS)
    # what is left: the newest `keep` (all without retention); a step that can no longer
    # complete is removed by retention, else left with the others' parts only: the
    # relaunch's first save removed what the victim left (its owner is gone)
    expected = ([(run1, s) for s in SAVED if s < KILL_STEP or (at == "step_commit" and s == KILL_STEP)]
                + [(run2, s) for s in SAVED if s > resume_step])
    assert _committed_steps(storage) == (expected[-keep:] if keep else expected)
    if at == "write" and keep:
        assert not storage.exists(step_path) or not _names(storage, step_path), (
            f"{where}: retention left the step that can no longer complete: {_names(storage, step_path)}")
    elif at == "write":
        assert sorted(_names(storage, step_path)) == sorted(others), _names(storage, step_path)
    if keep and all(run != run1 for run, _ in expected[-keep:]):
        assert run1 not in _names(storage, root), f"{where}: the dead launch's empty run folder is left"
    print(f"\n[{backend}, {victim} killed at {at}] layout.latest polled {watcher.polls} times, answers: "
          f"{[r.path[len(root):] for r in watcher.seen]}; {timings}")
    return {"storage": storage, "run1": run1, "run2": run2, "step_path": step_path, "timings": timings,
            "victim": victim}


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(420)
def test_a_component_killed_mid_save_on_local_disk(server: ForkServer, reference: Reference, tmp_path: Path,
                                                   offline_aws: dict[str, str]) -> None:
    """The actor (torchrun, 2 ranks) SIGKILLs rank 0 halfway through writing its shard of
    the step, in its temporary folder; the critic and the pipeline commit their parts."""
    _kill_cycle(server, reference, tmp_path, offline_aws, out=str(tmp_path / "ckpt"), options={},
                victim="actor_train", victim_rank=0, at="write", suffix=".distcp", torchrun_actor=True,
                keep=0, backend="local")


@pytest.mark.timeout(420)
def test_a_component_killed_mid_save_on_s3(server: ForkServer, reference: Reference, tmp_path: Path,
                                           s3: Any, offline_aws: dict[str, str]) -> None:
    """The critic SIGKILLs itself halfway through writing DCP's ``.metadata`` (its data file
    is on the server, written in place); with ``max_ckpt_to_keep: 2`` the relaunch's
    retention then removes the step that can no longer complete."""
    _kill_cycle(server, reference, tmp_path, offline_aws, out=f"s3://{s3.bucket}/components-{uuid.uuid4().hex[:10]}",
                options=s3.storage_options, victim="critic", victim_rank=0, at="write", suffix=".metadata",
                keep=2, backend="s3")


def test_the_last_part_killed_before_it_commits_the_step(server: ForkServer, reference: Reference,
                                                         tmp_path: Path, offline_aws: dict[str, str]) -> None:
    """The pipeline commits its part of the step last, then dies before creating the step's
    manifest: every part is there, the step is not committed, ``latest`` is the step
    before. The relaunch commits it from its parts (``complete_pending``) and every
    component, resuming concurrently, resumes that step."""
    _kill_cycle(server, reference, tmp_path, offline_aws, out=str(tmp_path / "ckpt"), options={},
                victim="pipeline", victim_rank=0, at="step_commit", keep=0, backend="local")


MORE = [  # (backend, victim, rank, at, suffix, keep)
    pytest.param("s3", "actor_train", 1, "write", ".distcp", 0, id="s3-actor-rank1-mid-shard"),
    pytest.param("s3", "pipeline", 0, "step_commit", "", 2, id="s3-pipeline-before-step-commit-keep2"),
    pytest.param("local", "critic", 0, "write", ".metadata", 2, id="local-critic-mid-metadata-keep2"),
    pytest.param("local", "pipeline", 0, "write", "state.json", 0, id="local-pipeline-mid-state-json"),
    pytest.param("local", "actor_train", 1, "write", ".distcp", 2, id="local-actor-rank1-mid-shard-keep2"),
]


@pytest.mark.skipif(KILLS < 20, reason="more kill points: make test-reliability (ROLL_CKPT_KILLS >= 20)")
@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend,victim,rank,at,suffix,keep", MORE)
def test_more_kill_points(backend: str, victim: str, rank: int, at: str, suffix: str, keep: int,
                          server: ForkServer, reference: Reference, tmp_path: Path, offline_aws: dict[str, str],
                          request: pytest.FixtureRequest) -> None:
    """The same cycle with other victims, ranks, files and retention (forked process groups)."""
    out, options = _location(backend, "components", tmp_path, request)
    _kill_cycle(server, reference, tmp_path, offline_aws, out=out, options=options, victim=victim,
                victim_rank=rank, at=at, suffix=suffix, keep=keep, backend=backend)


def _driver_step(url: str, options: dict[str, Any], run: str, step: int) -> tuple[Any, str, bytes]:
    """Every component saves its part of ``step`` (DriverState values); returns the step's
    path and the manifest the last part's commit wrote."""
    cfg = config(url, storage_options=options, components=list(COMPONENTS), run_name=run)
    for i, component in enumerate(COMPONENTS):
        m = CheckpointManager(cfg, component=component, quiet=True)
        m.save(step, {"state": DriverState({"component": component, "values": [i, 0.1 * i, None]}, rng=False)})
        m.close()
    storage = open_storage(url, options)
    step_path = storage.join(storage.root, run, layout.checkpoint_name(step))
    return storage, step_path, _read(storage, storage.join(step_path, MANIFEST_NAME))


def _race(server: ForkServer, folder: Path, *, url: str, options: dict[str, Any], step_path: str, step: int,
          barrier: str, n: int) -> list[dict[str, Any]]:
    sync = folder / f"sync-{barrier}"
    sync.mkdir()
    procs = []
    t0 = time.monotonic()
    for i in range(n):
        spec = {"mode": "complete", "out": url, "storage_options": options, "step_path": step_path, "step": step,
                "expected": list(COMPONENTS), "sync": str(sync), "index": i, "n": n, "barrier": barrier,
                "result": str(folder / f"race-{barrier}-{i}.json"), "stderr": str(folder / f"race-{barrier}-{i}.err")}
        procs.append(Proc("complete", i, server.fork(spec)))
    t_forked = t_ready = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while len(list(sync.glob("ready-*"))) < n:
            assert time.monotonic() < deadline and not any(p.poll(server) for p in procs), [
                (folder / f"race-{barrier}-{i}.err").read_text(errors="replace")[-2000:] for i in range(n)]
            time.sleep(0.01)
        t_ready = time.monotonic()
        (sync / "go").touch()
        deadline = time.monotonic() + 60
        while not all(p.poll(server) for p in procs):
            assert time.monotonic() < deadline, "a try_complete process did not end within 60s"
            time.sleep(0.01)
    finally:
        for p in procs:
            p.kill()
            for _ in range(500):
                if p.poll(server):
                    break
                time.sleep(0.01)
    print(f"  race [{barrier}]: forked {t_forked - t0:.2f}s, all ready {t_ready - t0:.2f}s, "
          f"all ended {time.monotonic() - t0:.2f}s")
    errors = [(folder / f"race-{barrier}-{i}.err").read_text(errors="replace") for i in range(n)]
    assert all(p.code == 0 for p in procs), errors
    return [json.loads((folder / f"race-{barrier}-{i}.json").read_text()) for i in range(n)]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_step_commits_have_one_winner(backend: str, server: ForkServer, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    """8 processes find the same step complete at once: one create of its manifest wins."""
    url, options = _location(backend, "race", tmp_path, request)
    n, step, run = 8, 3, new_run_name()
    storage, step_path, original = _driver_step(url, options, run, step)
    for barrier in ("create", "start"):
        t0 = time.monotonic()
        storage.remove(storage.join(step_path, MANIFEST_NAME))  # the last part died before the step's commit
        assert layout.latest(storage, storage.root) is None
        results = _race(server, tmp_path, url=url, options=options, step_path=step_path, step=step,
                        barrier=barrier, n=n)
        assert not [r for r in results if "error" in r], results
        winners = [i for i, r in enumerate(results) if r["won"]]
        assert len(winners) == 1, f"[{backend}, {barrier}] {len(winners)} processes committed the step: {results}"
        data = _read(storage, storage.join(step_path, MANIFEST_NAME))
        assert data == original, f"[{backend}, {barrier}] the step's manifest differs from the one first committed"
        manifest = verify(storage, step_path).manifest
        assert isinstance(manifest, Manifest) and manifest.step == step
        assert set(manifest.parts) == set(COMPONENTS)
        latest = layout.latest(storage, storage.root)
        assert latest is not None and latest.path.rstrip("/") == step_path.rstrip("/")
        run_dir = storage.join(storage.root, run)
        stray = [n for n in _names(storage, run_dir) if n.startswith(TMP_PREFIX)]
        assert not stray, f"[{backend}, {barrier}] temporary files of the creates were left: {stray}"
        print(f"[{backend}, {barrier}] {n} processes, process {winners[0]} committed the step "
              f"({time.monotonic() - t0:.1f}s)")
