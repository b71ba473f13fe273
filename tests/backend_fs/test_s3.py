"""The ``file_system`` backend on a real S3 server: SeaweedFS (``weed mini``) on loopback.

One server for the whole session (see :mod:`s3server`: free ports, data in a temp folder,
always stopped). Each test works under its own ``s3://<bucket>/<unique prefix>``.
Nothing here can reach AWS: the module runs with dummy AWS credentials, metadata lookups
off and a dead default endpoint, so only the ``storage_options`` under test reach the server.
"""

from __future__ import annotations

import datetime as _dt
import threading
import uuid
from typing import Any

import pytest
import torch

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'roll-ckpt[s3]')")

from helpers.training import config, drift  # noqa: E402
from roll_ckpt import CheckpointManager  # noqa: E402
from roll_ckpt.format import layout  # noqa: E402
from roll_ckpt.errors import CheckpointCorruptError  # noqa: E402
from roll_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from roll_ckpt.testing import BackendConformance, assert_same_state, state_snapshot, tiny_state  # noqa: E402
from roll_ckpt.format.manifest import verify  # noqa: E402
from roll_ckpt_fs import FsspecStorage, open_storage  # noqa: E402

from . import s3server  # noqa: E402


# ``s3`` (one ``weed mini`` for the session) and ``offline_aws`` come from tests/conftest.py.
pytestmark = pytest.mark.usefixtures("offline_aws")


@pytest.fixture
def s3_url(s3: s3server.SeaweedServer) -> str:
    return f"s3://{s3.bucket}/t-{uuid.uuid4().hex[:12]}"


def _raw_fs(s3: s3server.SeaweedServer) -> Any:
    """An independent S3 client (its own instance, no listing cache): "another process"."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3.storage_options)


class TestSeaweedS3(BackendConformance):
    """``s3://`` URLs with ``storage_options`` against SeaweedFS: committed by a create-only manifest."""

    @pytest.fixture
    def storage(self, s3: s3server.SeaweedServer, s3_url: str) -> FsspecStorage:
        s = open_storage(s3_url, s3.storage_options)
        assert isinstance(s, FsspecStorage) and not s.atomic_rename
        return s

    @pytest.fixture
    def checkpoint_config(self, storage: FsspecStorage, s3: s3server.SeaweedServer) -> dict[str, Any]:
        return {"type": "file_system", "output_dir": storage.url, "storage_options": s3.storage_options}

    def test_join_builds_usable_paths(self, storage: FsspecStorage) -> None:  # type: ignore[override]
        """As the suite's, except that S3 has no empty folders: ``makedirs`` creates nothing
        (s3fs only creates buckets) and a folder exists once an object is below it. Nothing
        in roll-ckpt needs an empty folder to exist."""
        p = storage.join(storage.root, "a", "b")
        assert p.startswith(storage.root.rstrip("/")) and p.endswith("b") and "a" in p
        assert storage.join(storage.root, "a", "b") == storage.join(storage.join(storage.root, "a"), "b")
        storage.makedirs(p)
        with storage.open_write(storage.join(p, "f")) as f:
            f.write(b"f")
        assert storage.isdir(p) and storage.exists(p)
        assert [e.name for e in storage.list(storage.join(storage.root, "a"))] == ["b"]


# --------------------------------------------------------------------------- server facts


def test_server_enforces_credentials(s3: s3server.SeaweedServer, s3_url: str) -> None:
    """The server checks signatures, so passing only through storage_options proves they are used."""
    wrong = {**s3.storage_options, "key": "nobody", "skip_instance_cache": True}
    with pytest.raises(PermissionError):
        open_storage(s3_url, wrong).list(s3_url[len("s3://"):])
    # Without storage_options the client gets the module's dummy env (and dead endpoint).
    bare = open_storage(s3_url, {"skip_instance_cache": True, "config_kwargs": {
        "connect_timeout": 1, "retries": {"max_attempts": 1}}})
    with pytest.raises(Exception):
        bare.list(bare.root)


# --------------------------------------------------------------------------- create-only


def test_write_create_is_refused_by_the_server(s3: s3server.SeaweedServer, s3_url: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SeaweedFS honours ``If-None-Match: *`` (s3fs mode ``"xb"``) and answers 412.

    Its 412 carries no ``Condition`` element, so s3fs raises ``OSError(EINVAL)`` instead
    of ``FileExistsError``; FsspecStorage must still report ``FileExistsError``. The
    existence pre-check is disabled here, as in a race where two writers both pass it.
    """
    storage = open_storage(s3_url, s3.storage_options)
    path = storage.join(storage.root, MANIFEST_NAME)
    storage.write_create(path, b"first")
    monkeypatch.setattr(storage.fs, "exists", lambda *a, **k: False)
    with pytest.raises(FileExistsError):
        storage.write_create(path, b"second")
    monkeypatch.undo()
    assert _raw_fs(s3).cat_file(path) == b"first"


def test_write_create_without_server_support_falls_back_to_the_check(
        s3: s3server.SeaweedServer, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers 501 to ``If-None-Match`` (s3fs: ``OSError(ENOSYS)``) gets a
    plain write after the existence check, which still refuses an existing file."""
    import errno

    storage = open_storage(s3_url, s3.storage_options)
    real_write = storage._write
    modes: list[str] = []

    def no_conditional_writes(path: str, data: bytes, mode: str) -> None:
        modes.append(mode)
        if "x" in mode:
            raise OSError(errno.ENOSYS, "A header you provided implies functionality that is not implemented")
        real_write(path, data, mode)

    monkeypatch.setattr(storage, "_write", no_conditional_writes)
    path = storage.join(storage.root, ".run.json")
    storage.write_create(path, b"one")
    assert modes == ["xb", "wb"]
    with pytest.raises(FileExistsError):
        storage.write_create(path, b"two")
    assert _raw_fs(s3).cat_file(path) == b"one"


def test_write_create_race_has_one_winner(s3: s3server.SeaweedServer, s3_url: str) -> None:
    """Four writers at once, through separate clients: exactly one creates the file."""
    import s3fs

    path = f"{s3_url[len('s3://'):]}/.run.json"
    stores = [open_storage(s3_url, {**s3.storage_options, "skip_instance_cache": True}) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    results: list[Any] = [None] * len(stores)

    def go(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            stores[i].write_create(path, f"writer {i}".encode())
            results[i] = "won"
        except Exception as exc:  # noqa: BLE001 - recorded and checked below
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results.count("won") == 1, results
    losers = [r for r in results if r != "won"]
    assert all(isinstance(r, FileExistsError) for r in losers), losers
    winner = results.index("won")
    assert s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options).cat_file(path) == \
        f"writer {winner}".encode()


# --------------------------------------------------------------------------- listing freshness


def test_listing_and_exists_are_never_stale(s3: s3server.SeaweedServer, s3_url: str) -> None:
    """Another client's writes and deletes are seen at once (s3fs caches listings)."""
    storage = open_storage(s3_url, s3.storage_options)
    other = _raw_fs(s3)
    ckpt = storage.join(storage.root, "20240101-000000", "checkpoint-1")
    manifest = storage.join(ckpt, MANIFEST_NAME)
    with storage.open_write(storage.join(ckpt, "trainer_state.json")) as f:
        f.write(b"{}")
    # warm every cache this storage could use
    assert [e.name for e in storage.list(ckpt)] == ["trainer_state.json"]
    assert not storage.exists(manifest)
    assert [r.committed for r in layout.scan(storage, storage.root)] == [False]

    other.pipe_file(manifest, b"{}")  # committed by someone else
    assert storage.exists(manifest), "exists() answered from a stale listing"
    assert {e.name for e in storage.list(ckpt)} == {"trainer_state.json", MANIFEST_NAME}
    assert [r.committed for r in layout.scan(storage, storage.root)] == [True]

    other.rm_file(manifest)  # un-committed by someone else (retention of another process)
    assert not storage.exists(manifest), "exists() answered from a stale listing"
    assert layout.latest(storage, storage.root) is None
    # removed by another process (retention of another job): its remove_tree, seen here
    open_storage(s3_url, {**s3.storage_options, "skip_instance_cache": True}).remove_tree(ckpt)
    assert storage.list(ckpt) == [] and not storage.isdir(ckpt) and not storage.exists(ckpt)
    assert layout.scan(storage, storage.root) == []


# --------------------------------------------------------------------------- full cycle


class _FrozenNow(_dt.datetime):
    """``datetime`` whose ``now()`` is one fixed second: two runs start "at once"."""

    FIXED = _dt.datetime(2030, 1, 2, 3, 4, 5)

    @classmethod
    def now(cls, tz: Any = None) -> "_dt.datetime":  # type: ignore[override]
        return cls.FIXED.replace(tzinfo=tz) if tz is not None else cls.FIXED


def test_full_cycle_over_s3(s3: s3server.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import roll_ckpt.format.commit as runs_mod

    # Both runs claim their run folder within the same "second": the second claim must be
    # refused create-only by the server and fall back to "<stamp>-1".
    monkeypatch.setattr(runs_mod, "datetime", _FrozenNow)
    prefix = f"run-{uuid.uuid4().hex[:10]}"
    url = f"s3://{s3.bucket}/{prefix}"

    def run_config(**top: Any) -> Any:
        return config(url, storage_options=s3.storage_options, max_ckpt_to_keep=2, save_steps=2, **top)

    # run 1, synchronous saves at 2, 4, 6; retention keeps two
    state = tiny_state(seed=11)
    snaps: dict[int, Any] = {}
    with CheckpointManager.from_config(run_config(), quiet=True) as m:
        assert m.resume(state) == 0
        for step in range(1, 7):
            drift(state, step)
            if m.maybe_save(step, state):
                snaps[step] = state_snapshot(state)
        storage = m.storage
        run1 = m.run_dir
    assert isinstance(storage, FsspecStorage)
    assert [r.step for r in layout.committed(storage, storage.root)] == [4, 6]
    assert [r.step for r in layout.scan(storage, storage.root)] == [4, 6], "step 2 is gone"

    # run 2 resumes from latest (exact), saves asynchronously at 8 and 10
    state2 = tiny_state(seed=12)
    with CheckpointManager.from_config(run_config(resume_from_checkpoint="latest", async_save=True),
                                       quiet=True) as m2:
        assert m2.resume(state2) == 6
        assert_same_state(state_snapshot(state2), snaps[6])
        for step in range(7, 11):
            drift(state2, step)
            if m2.maybe_save(step, state2):
                snaps[step] = state_snapshot(state2)
                drift(state2, 100)  # changes after save() returns are not in the checkpoint
                assert m2.stats.last is None or m2.stats.last.step < step
        m2.wait()
        assert m2.stats.last is not None and m2.stats.last.is_async and m2.stats.last.step == 10
        run2 = m2.run_dir
    assert run1 and run2 and run1 != run2
    assert run2.rstrip("/").endswith(run1.rstrip("/").rsplit("/", 1)[-1] + "-1")
    refs = layout.committed(storage, storage.root)
    assert [r.step for r in refs] == [8, 10]
    assert all(r.run == run2.rstrip("/").rsplit("/", 1)[-1] for r in refs)
    for r in refs:
        assert verify(storage, r.path).files >= 3

    # an uncommitted folder (data, no manifest) is never chosen by latest: a newer step in
    # the newest run, and a newer run holding only an uncommitted checkpoint
    raw = _raw_fs(s3)
    for folder in (f"{run2}/checkpoint-12", f"{storage.root}/20990101-000000/checkpoint-99"):
        raw.pipe_file(f"{folder}/dcp/__0_0.distcp", b"partial data")
        raw.pipe_file(f"{folder}/trainer_state.json", b'{"step": 12}')
    scanned = layout.scan(storage, storage.root)
    assert [(r.step, r.committed) for r in scanned] == [(8, True), (10, True), (12, False), (99, False)]
    assert layout.latest(storage, storage.root).step == 10
    fresh = tiny_state(seed=13)
    with CheckpointManager.from_config(run_config(resume_from_checkpoint="latest"), quiet=True) as m3:
        assert m3.resume(fresh) == 10
    assert_same_state(state_snapshot(fresh), snaps[10])

    # a flipped byte in a .distcp uploaded over the latest checkpoint is detected
    latest = layout.latest(storage, storage.root)
    shards = [p for p in raw.find(latest.path) if p.endswith(".distcp")]
    assert shards
    data = bytearray(raw.cat_file(shards[0]))
    data[len(data) // 2] ^= 0x01
    raw.pipe_file(shards[0], bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp|\.distcp"):
        verify(storage, latest.path)
    fresh2 = tiny_state(seed=14)
    untouched = state_snapshot(fresh2)
    with CheckpointManager.from_config(run_config(resume_from_checkpoint="latest"), quiet=True) as m4:
        with pytest.raises(CheckpointCorruptError, match="distcp"):
            m4.resume(fresh2)
    assert_same_state(state_snapshot(fresh2), untouched)
    verify(storage, refs[0].path)  # the older one is intact

    raw.rm(f"{s3.bucket}/{prefix}", recursive=True)


def _count_requests(storage: FsspecStorage) -> list[tuple[str, str]]:
    """Every HTTP request the storage's S3 client sends from now on: (method, query)."""
    from urllib.parse import urlsplit

    seen: list[tuple[str, str]] = []

    def before_send(request: Any, **_: Any) -> None:
        seen.append((request.method, urlsplit(request.url).query))

    storage.fs.s3.meta.events.register("before-send.s3", before_send)
    return seen


def test_a_save_costs_the_same_requests_whatever_the_checkpoints_kept(s3: s3server.SeaweedServer, s3_url: str) -> None:
    """A save's requests do not grow with the checkpoints already there: the only listing on
    the save path (other writers' markers) asks for a key prefix."""
    from collections import Counter
    from urllib.parse import parse_qs

    state = tiny_state(seed=3)
    per_save: dict[int, Counter] = {}
    with CheckpointManager.from_config(config(s3_url, storage_options=s3.storage_options, timestamp_subdir=False),
                                       quiet=True) as m:
        seen = _count_requests(m.storage)  # type: ignore[arg-type]
        for step in range(1, 13):
            drift(state, step)
            del seen[:]
            m.save(step, state)
            per_save[step] = Counter(method for method, _ in seen)
            prefixes = [parse_qs(q).get("prefix", [""])[0] for method, q in seen if method == "GET" and "list-type" in q]
            # one checkpoint's keys, or its writers' markers: never the run folder, which grows
            assert step == 1 or (prefixes and all("checkpoint-" in p for p in prefixes)), prefixes
    assert per_save[3] == per_save[12], (per_save[3], per_save[12])  # 2 checkpoints there, then 11


def test_incremental_saves_copy_the_frozen_base_on_the_server(s3: s3server.SeaweedServer, s3_url: str) -> None:
    """A LoRA-shaped state on S3: from the second save on, the frozen base's file is a
    CopyObject (``x-amz-copy-source``) and its bytes never cross the wire again; with the
    older checkpoints deleted the newest verifies and resumes bit-exactly."""
    from core.test_incremental import frozen_bytes, lora, step

    model, opt = lora()
    sent: list[tuple[str, int]] = []

    def before_send(request: Any, **_: Any) -> None:
        copy = "copy" if request.headers.get("x-amz-copy-source") else request.method
        sent.append((copy, int(request.headers.get("Content-Length") or 0)))

    cfg = config(s3_url, storage_options=s3.storage_options, timestamp_subdir=False)
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        m.storage.fs.s3.meta.events.register("before-send.s3", before_send)  # type: ignore[attr-defined]
        uploaded = []
        for s in (1, 2, 3):
            step(model, opt)
            del sent[:]
            m.save(s, {"model": model, "optimizer": opt})
            uploaded.append(sum(n for method, n in sent if method in ("PUT", "POST")))
            assert (s > 1) == any(method == "copy" for method, _ in sent), sent
            assert (m.stats.last.bytes_taken_over > 0) == (s > 1), m.stats.last
        assert m.stats.last.bytes_taken_over >= frozen_bytes(model)
        storage = m.storage
        for k in (1, 2):
            storage.remove_tree(storage.join(storage.root, f"checkpoint-{k}"))
        verify(storage, storage.join(storage.root, "checkpoint-3"))  # every file there, whole
    assert uploaded[0] > frozen_bytes(model) > 4 * max(uploaded[1:]), uploaded
    other, other_opt = lora(seed=9)
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        assert m.resume({"model": other, "optimizer": other_opt}, "latest") == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
