"""Network faults between a job and a real S3 server (SeaweedFS), through a fault-injecting
proxy (:mod:`faultproxy`): retried, bounded, counted, and never a damaged checkpoint."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from typing import Any, Iterator

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'roll-ckpt[s3]')")

from helpers.training import config, drift  # noqa: E402
from roll_ckpt import CheckpointManager  # noqa: E402
from roll_ckpt.plugin import NetworkCounts  # noqa: E402
from roll_ckpt.format import layout  # noqa: E402
from roll_ckpt.errors import RollCkptError, SaveError  # noqa: E402
from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state  # noqa: E402
from roll_ckpt.format.manifest import verify  # noqa: E402
from roll_ckpt_fs import FsspecStorage  # noqa: E402

from . import s3server  # noqa: E402
from .faultproxy import FaultProxy, fault_proxy  # noqa: E402

pytestmark = [pytest.mark.usefixtures("offline_aws"), pytest.mark.timeout(120)]

FAST = {"connect_timeout": 2, "read_timeout": 2, "max_attempts": 4, "retry_backoff": 0.05, "retry_backoff_max": 0.2}
"""Short bounds for the tests (the defaults are 5 s, 10 s, 5 attempts, 0.25 s, 5 s); not
shorter: on a loaded machine the server itself can take a second to answer."""


@pytest.fixture
def proxy(s3: s3server.SeaweedServer) -> Iterator[FaultProxy]:
    with fault_proxy(s3.endpoint) as p:
        yield p


def _options(s3: s3server.SeaweedServer, proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    opts = s3.storage_options
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint}
    return {**opts, **FAST, **extra}


def _url(s3: s3server.SeaweedServer) -> str:
    return f"s3://{s3.bucket}/faults-{uuid.uuid4().hex[:10]}"


def _uploads(storage: FsspecStorage, prefix: str) -> list[Any]:
    bucket, key, _ = storage.fs.split_path(prefix)
    return storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads") or []


def test_each_fault_is_retried_counted_and_logged_once_per_save(
        s3: s3server.SeaweedServer, proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    url = _url(s3)
    state = tiny_state(seed=3)
    cfg = config(url, storage_options=_options(s3, proxy))
    snaps = {}
    # two resets in a row: aiohttp re-sends the first on a fresh connection by itself
    # (unseen), the second reaches the retry policy
    plan = {1: ("503", 1), 2: ("500", 2), 3: ("reset_upload", 2), 4: ("hang", 1), 5: ("slow", 1)}
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        for step, (kind, count) in plan.items():
            drift(state, step)
            proxy.inject(kind, method="PUT", path=".distcp", count=count)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="roll_ckpt"):
                m.save(step, state)
            snaps[step] = state_snapshot(state)
            net = m.stats.last.network
            assert net is not None
            lines = [r.getMessage() for r in caplog.records if "network fault" in r.getMessage()]
            if kind == "slow":
                assert net.faults == 0 and not lines
                continue
            assert net.faults >= 1 and net.retries == net.faults, (kind, net)
            assert len(lines) == 1 and f"checkpoint-{step} committed" in lines[0], lines
            if kind == "hang":  # ended by the client's read timeout (2 s here, not botocore's 60 s), then retried
                assert net.kinds.get("read timeout") == 1, net
                assert m.storage.fs.s3.meta.config.read_timeout == FAST["read_timeout"]
        totals = m.stats.network
        assert totals.faults >= 5 and totals.lost_s > 1.9
        storage = m.storage
    assert proxy.injected == {"503": 1, "500": 2, "reset_upload": 2, "hang": 1, "slow": 1}
    refs = layout.committed(storage, storage.root)
    assert [r.step for r in refs] == list(plan)
    for r in refs:
        verify(storage, r.path)
    assert not _uploads(storage, storage.root)

    # resume while downloads break part-way: exact
    proxy.inject("reset_download", method="GET", path=".distcp", count=2)
    fresh = tiny_state(seed=4)
    with CheckpointManager.from_config(config(url, storage_options=_options(s3, proxy),
                                              resume_from_checkpoint="latest"), quiet=True) as m2:
        assert m2.resume(fresh) == 5
        assert m2.stats.network.faults >= 1
    assert_same_state(state_snapshot(fresh), snaps[5])
    assert proxy.injected["reset_download"] == 2


def test_faults_past_the_attempts_fail_the_save_and_leave_nothing(
        s3: s3server.SeaweedServer, proxy: FaultProxy) -> None:
    """A part of a multipart upload that keeps failing: the save fails with an error, the
    upload is aborted (no parts left on the server), nothing is committed; the next save
    commits and earlier checkpoints are intact."""
    url = _url(s3)
    # 5 MiB parts (S3's smallest) so that a 12 MiB tensor is a multipart upload
    cfg = config(url, storage_options=_options(s3, proxy, max_attempts=3, default_block_size=5 << 20),
                 on_save_error="warn")
    import torch

    state = tiny_state(seed=5)
    state["big"] = {"w": torch.randn(3 << 20)}
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        first = m.save(1, state)
        proxy.inject("500", method="PUT", path="partNumber=2", count=3)
        assert m.save(2, state) is None and m.stats.failed == 1
        storage = m.storage
        assert not _uploads(storage, storage.root), "the failed multipart upload was aborted"
        assert [(r.step, r.committed) for r in layout.scan(storage, storage.root)] == [(1, True)]
        assert m.save(3, state) is not None
    verify(storage, first)
    assert [r.step for r in layout.committed(storage, storage.root)] == [1, 3]

    # a final save that fails raises an error naming the checkpoint
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        proxy.inject("503", method="PUT", path=".distcp", count=10)
        with pytest.raises(SaveError, match="checkpoint-4"):
            m.save(4, state, final=True)
        proxy.clear()
    assert 4 not in [r.step for r in layout.scan(storage, storage.root)]


def test_a_crashed_multipart_upload_is_removed_by_prune(s3: s3server.SeaweedServer, tmp_path: Any) -> None:
    """A writer killed mid-file leaves an unfinished multipart upload (invisible in listings,
    stored and billed): ``roll-ckpt prune`` (as the next start) aborts it with the folder."""
    url = _url(s3)
    storage = FsspecStorage(url, s3.storage_options)
    with CheckpointManager.from_config(config(url, storage_options=s3.storage_options, timestamp_subdir=False),
                                       quiet=True) as m:
        m.save(1, tiny_state(seed=1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=30, check=True)
    folder = storage.join(storage.root, "checkpoint-2")
    from roll_ckpt.format.commit import owner_record

    marker = dict(owner_record(), pid=int(dead.stdout), write_path=folder, final_path=folder)
    import json

    storage.fs.pipe_file(storage.join(storage.root, ".inflight-checkpoint-2-dead.json"), json.dumps(marker).encode())
    bucket, key, _ = storage.fs.split_path(folder + "/dcp/__0_0.distcp")
    upload = storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    storage.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                       Body=b"x" * (5 << 20))
    assert _uploads(storage, storage.root)
    from roll_ckpt.cli import main

    options = [f"key={s3server.ACCESS_KEY}", f"secret={s3server.SECRET_KEY}", f"endpoint_url={s3.endpoint}"]
    assert main(["prune", url, "--keep", "5", *(a for o in options for a in ("--storage-option", o))]) == 0
    assert not _uploads(storage, storage.root)
    assert [(r.step, r.committed) for r in layout.scan(storage, storage.root)] == [(1, True)]


def test_resume_over_a_link_that_keeps_failing_names_the_object(
        s3: s3server.SeaweedServer, proxy: FaultProxy) -> None:
    url = _url(s3)
    state = tiny_state(seed=7)
    with CheckpointManager.from_config(config(url, storage_options=_options(s3, proxy)), quiet=True) as m:
        m.save(1, state)
    proxy.inject("reset_download", method="GET", path="__0_0.distcp", count=50)
    fresh = tiny_state(seed=8)
    untouched = state_snapshot(fresh)
    cfg = config(url, storage_options=_options(s3, proxy, max_attempts=2), resume_from_checkpoint="latest")
    with CheckpointManager.from_config(cfg, quiet=True) as m2:
        with pytest.raises(RollCkptError, match=r"reading .*__0_0\.distcp failed after 2 attempt"):
            m2.resume(fresh)
    assert_same_state(state_snapshot(fresh), untouched)


SOAK_SAVES = int(os.environ.get("ROLL_CKPT_SOAK_SAVES", "12"))
"""Saves of the soak below: 12 in ``make test``, 40 in ``make test-reliability``."""


@pytest.mark.timeout(120 + 30 * SOAK_SAVES)
def test_soak_with_random_faults(s3: s3server.SeaweedServer, proxy: FaultProxy) -> None:
    """``bench.soak`` in the suite: a job saves every step through random faults (resets,
    503, 500, slow answers, requests never answered); every committed checkpoint verifies,
    the newest resumes exactly, no checkpoint is lost, and no request waits without bound:
    the request the proxy never answers (it would hold it for ``hang_s``, 600 s) is ended by
    the client's own read timeout and counted as one.
    (How long the soak takes against a fault-free pass is the benchmark's: ``bench.soak``.)"""
    from bench.soak import soak

    result = soak(s3, proxy, saves=SOAK_SAVES, seed=23, options=FAST)
    assert result["lost"] == 0 and result["committed"] + result["failed"] == SOAK_SAVES, result
    assert result["committed"] >= SOAK_SAVES // 2 and result["injected"], result
    assert not result["leftover_folders"] and not result["leftover_uploads"], result
    # Seed 23 leaves a request of the saves unanswered. The client's read timeout ended it (a
    # "read timeout" fault); a client without a bound of its own would have waited until the
    # proxy let go (hang_s: a "connection error", or the test's timeout first).
    assert result["fault_kinds"].get("read timeout", 0) >= result["injected"].get("hang", 0) >= 1, result


# The server goes silent with the connection held open (the proxy lets go only when it
# stops, 600 s): a client without a bound of its own would wait for ever.
SILENT = [("hang", "PUT", ".distcp", "save"),            # accepts the upload, never answers
          ("hang", "PUT", ".inflight-", "save"),         # the owner marker of PendingCheckpoint.begin
          ("stall_upload", "PUT", "partNumber", "save"),  # stops reading a part mid-upload
          ("stall_body", "GET", ".distcp", "resume")]     # headers and half the body, then silence


@pytest.mark.parametrize("kind,method,path,phase", SILENT, ids=[f"{k}-{p.strip('.-')}" for k, _, p, _ in SILENT])
def test_a_silent_server_costs_an_attempt_and_never_more_than_the_worst_case(
        s3: s3server.SeaweedServer, proxy: FaultProxy, kind: str, method: str, path: str, phase: str) -> None:
    """One silent attempt ends with the client's read timeout (counted as one fault) and is
    retried; a request that meets the silence on every attempt is given up after
    ``max_attempts`` of them: the save fails (nothing committed), the resume raises naming
    the object (the state untouched). Nothing waits for the server: the proxy would hold each
    silent request for 600 s, past this test's timeout. (``RetryPolicy.worst_case_s`` bounds
    the seconds; how long it takes is the benchmark's, not asserted here.)"""
    import torch
    from roll_ckpt_fs.network import RetryPolicy

    opts = _options(s3, proxy, max_attempts=2, default_block_size=5 << 20)  # 5 MiB parts: S3's smallest
    policy = RetryPolicy.pop_from(dict(opts), "test")
    url = _url(s3)
    state = tiny_state(seed=9)
    state["big"] = {"w": torch.randn(3 << 20)}  # 12 MiB: a multipart upload
    with CheckpointManager.from_config(config(url, storage_options=opts, on_save_error="warn"), quiet=True) as m:
        assert m.save(1, state) is not None
        saved = state_snapshot(state)
        if phase == "save":
            proxy.inject(kind, method=method, path=path, count=1)
            assert m.save(2, state) is not None
            net = m.stats.last.network  # one attempt lost to the silence, retried: nothing given up
            assert net.kinds.get("read timeout") == 1 and net.retries == net.faults, net
            _assert_cut_at(policy, m.storage)
            proxy.inject(kind, method=method, path=path, count=policy.max_attempts)
            before = m.stats.network
            assert m.save(3, state) is None and m.stats.failed == 1
            net = m.stats.network.since(before)  # every attempt of one request met the silence, then it gave up
            assert net.kinds.get("read timeout") == policy.max_attempts and net.faults - net.retries == 1, net
            assert proxy.injected[kind] == 1 + policy.max_attempts
            assert [r.step for r in layout.committed(m.storage, m.storage.root)] == [1, 2]
            return
    resume = config(url, storage_options=opts, resume_from_checkpoint="latest")
    proxy.inject(kind, method=method, path=path, count=1)
    fresh = tiny_state(seed=10)
    fresh["big"] = {"w": torch.zeros(3 << 20)}
    with CheckpointManager.from_config(resume, quiet=True) as m2:
        assert m2.resume(fresh) == 1
        net = m2.stats.network  # the body stalled once: read again from where it broke
        assert net.faults == net.retries == 1 and all(k.startswith("download broke") for k in net.kinds), net
        assert "download broke (FSTimeoutError)" in net.kinds, net  # the timeout, not s3fs's IndexError handling it
        _assert_cut_at(policy, m2.storage)
    assert_same_state(state_snapshot(fresh), saved)
    proxy.inject(kind, method=method, path=path, count=policy.max_attempts)
    other = tiny_state(seed=11)
    other["big"] = {"w": torch.zeros(3 << 20)}
    untouched = state_snapshot(other)
    with CheckpointManager.from_config(resume, quiet=True) as m3:
        with pytest.raises(RollCkptError, match=rf"\.distcp failed after {policy.max_attempts} attempt") as info:
            m3.resume(other)
    assert any("timeout" in type(e).__name__.lower() for e in _chain(info.value)), \
        f"the stalled body was ended by the client's read timeout: {[type(e).__name__ for e in _chain(info.value)]}"
    assert proxy.injected[kind] == 1 + policy.max_attempts
    assert_same_state(state_snapshot(other), untouched)


def _assert_cut_at(policy: Any, storage: FsspecStorage) -> None:
    """The client's own timeouts are the policy's (2 s here; not botocore's 60 s, s3fs's 15 s),
    so a silent attempt ends after ``read_timeout``: the seconds it takes are not asserted."""
    cfg = storage.fs.s3.meta.config
    assert (cfg.read_timeout, cfg.connect_timeout) == (policy.read_timeout, policy.connect_timeout), cfg


def _chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def test_retry_settings_are_checked(s3: s3server.SeaweedServer) -> None:
    with pytest.raises(RollCkptError, match="storage_options.read_timeout must be a number of seconds"):
        FsspecStorage(_url(s3), {**s3.storage_options, "read_timeout": "ten"})
    with pytest.raises(RollCkptError, match="storage_options.max_attempts must be an integer"):
        FsspecStorage(_url(s3), {**s3.storage_options, "max_attempts": 0})
    st = FsspecStorage(_url(s3), s3.storage_options)
    assert st.network is not None and st.network.policy.read_timeout == 10.0
    assert st.network_counts() == NetworkCounts()
    config_kwargs = st.fs.s3.meta.config
    assert config_kwargs.read_timeout == 10.0 and config_kwargs.connect_timeout == 5.0


def test_a_users_own_botocore_retries_bound_the_counted_attempts(s3: s3server.SeaweedServer) -> None:
    """botocore stops at ``config_kwargs.retries`` when the user sets it, so the policy that
    counts the faults (and says which were retried) takes the same bound; without it, ours."""
    from roll_ckpt_fs.network import botocore_attempts

    for retries, attempts in [({"max_attempts": 2}, 3), ({"total_max_attempts": 4}, 4), ({"mode": "standard"}, None)]:
        options = {**s3.storage_options, "max_attempts": 6, "config_kwargs": {"retries": retries}}
        network = FsspecStorage(_url(s3), options).network
        assert network.request_attempts == attempts, retries
        assert network.policy.max_attempts == 6  # still ours: roll-ckpt's re-reads of a broken download
    assert botocore_attempts({}) is None
