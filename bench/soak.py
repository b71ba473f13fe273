"""Soak: a job saving every step to a real S3 server (SeaweedFS) through random network faults.

``python -m bench.soak [--saves 200] [--seed 1] [--out bench/results/soak.json]`` starts
``weed mini`` and the tests' fault-injecting proxy (``tests/backend_fs/faultproxy.py``),
then saves ``--saves`` steps synchronously with ``on_save_error: warn`` while the proxy
resets uploads and downloads part-way, answers 503 SlowDown and 500, slows answers and
leaves requests unanswered, at random (seeded). At the end, with the link still faulty,
a second job resumes ``latest``; then, over a clean link, every checkpoint is checked.

Reported (one JSON object): saves committed, saves failed cleanly (nothing of them left:
no folder, no unfinished multipart upload), network faults met, retries, seconds lost to
faults (as the retry policy counts them: failed attempts and the waits after them), the
wall time against a fault-free pass of the same saves, and checkpoints lost: a save that
returned its path but whose checkpoint does not verify, or a resume that is not exact.
It must be 0. ``tests/backend_fs/test_network_faults.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .launch import RESULTS, use_test_helpers

RATES = {"reset_upload": 0.05, "reset_download": 0.05, "503": 0.05, "500": 0.03, "slow": 0.04, "hang": 0.01}
"""Share of requests that get each fault."""

OPTIONS = {"connect_timeout": 2, "read_timeout": 2, "max_attempts": 5, "retry_backoff": 0.1, "retry_backoff_max": 1}
"""The retry policy of the soak: shorter read timeout than the default 10 s, so the hung
requests cost seconds, not tens of seconds, over 200 saves."""


def _run(s3: Any, proxy: Any, url: str, saves: int, options: dict[str, Any]) -> tuple[dict[int, str], dict[int, Any], Any, float]:
    use_test_helpers()
    from helpers.training import config, drift
    from roll_ckpt import CheckpointManager
    from roll_ckpt.testing import state_snapshot, tiny_state

    opts = s3.storage_options
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint}
    cfg = config(url, storage_options={**opts, **options}, on_save_error="warn", timestamp_subdir=False)
    state = tiny_state(seed=1)
    paths: dict[int, str] = {}
    snaps: dict[int, Any] = {}
    t0 = time.monotonic()
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        for step in range(1, saves + 1):
            drift(state, step)
            path = m.save(step, state)
            if path is not None:
                paths[step] = path
                snaps[step] = state_snapshot(state)
        network = m.stats.network
    return paths, snaps, network, time.monotonic() - t0


def soak(s3: Any, proxy: Any, *, saves: int, seed: int, options: dict[str, Any] | None = None,
         rates: dict[str, float] | None = None) -> dict[str, Any]:
    use_test_helpers()
    from helpers.training import config
    from roll_ckpt import CheckpointManager
    from roll_ckpt.format import layout
    from roll_ckpt.errors import RollCkptError
    from roll_ckpt.testing import assert_same_state, state_snapshot, tiny_state
    from roll_ckpt.format.manifest import verify
    from roll_ckpt_fs import FsspecStorage

    options = dict(OPTIONS if options is None else options)
    base = f"s3://{s3.bucket}/soak-{uuid.uuid4().hex[:10]}"
    proxy.clear()
    _, _, _, clean_s = _run(s3, proxy, base + "-clean", saves, options)
    clean_requests = proxy.requests
    proxy.randomly(rates or RATES, seed)
    paths, snaps, network, faulty_s = _run(s3, proxy, base, saves, options)

    # a resume over the same faulty link
    opts = s3.storage_options
    opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint}
    lost = 0
    resumed = None
    fresh = tiny_state(seed=2)
    try:
        with CheckpointManager.from_config(config(base, storage_options={**opts, **options}, timestamp_subdir=False,
                                                  resume_from_checkpoint="latest"), quiet=True) as m:
            resumed = m.resume(fresh)
        if resumed != max(paths, default=0):
            lost += 1
        elif resumed:
            assert_same_state(state_snapshot(fresh), snaps[resumed])
    except RollCkptError as exc:  # allowed only with an error naming what failed
        resumed = f"failed: {exc}"
    except AssertionError:
        lost += 1
    injected = dict(proxy.injected)
    proxy.clear()

    storage = FsspecStorage(base, s3.storage_options)  # straight to the server
    committed = {r.step for r in layout.committed(storage, storage.root)}
    for step, path in paths.items():
        try:
            verify(storage, path)
        except Exception:
            lost += 1
    leftovers = [r.path for r in layout.scan(storage, storage.root) if not r.committed]
    bucket, key, _ = storage.fs.split_path(storage.root)
    uploads = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/").get("Uploads") or []
    for suffix in ("", "-clean"):
        FsspecStorage(base + suffix, s3.storage_options).remove_tree(storage.root + suffix)
    return {
        "saves": saves, "seed": seed, "rates": rates or RATES, "policy": options,
        "requests": proxy.requests - clean_requests, "requests_without_faults": clean_requests,
        "injected": injected,
        "committed": len(paths), "failed": saves - len(paths),
        "committed_not_reported": sorted(committed - set(paths)),
        "faults": network.faults, "retries": network.retries, "lost_to_faults_s": round(network.lost_s, 2),
        "fault_kinds": dict(network.kinds),
        "wall_s": round(faulty_s, 1), "wall_without_faults_s": round(clean_s, 1),
        "resumed_step": resumed, "leftover_folders": leftovers, "leftover_uploads": len(uploads),
        "lost": lost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "soak.json")
    args = parser.parse_args()
    use_test_helpers()
    from backend_fs import s3server
    from backend_fs.faultproxy import fault_proxy

    os.environ.update(s3server.OFFLINE_ENV)
    for k in s3server.OFFLINE_UNSET:
        os.environ.pop(k, None)
    with tempfile.TemporaryDirectory(prefix="roll-ckpt-soak-") as tmp:
        with s3server.seaweed(Path(tmp) / "data") as s3, fault_proxy(s3.endpoint) as proxy:
            result = soak(s3, proxy, saves=args.saves, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    sys.exit(1 if result["lost"] else 0)


if __name__ == "__main__":
    main()
