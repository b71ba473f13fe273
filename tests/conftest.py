"""Fixtures shared by the whole test suite (the helpers they use: tests/helpers/)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from helpers import plugins as plugin_helpers
from helpers.launch import run_python
from helpers.training import config


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker computes on one torch thread: the workers run side by side, one a
    core (two threads each on two cores only made them wait for each other)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plugin selection or signing key inherited from the shell that runs the tests."""
    for var in plugin_helpers.PLUGIN_SWITCHES:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def ckpt_config(tmp_path: Path) -> Callable[..., Any]:
    """``ckpt_config(cc=None, **top)`` → a loaded Config writing under tmp_path/ckpt
    (``cc``: more checkpoint_config keys; ``top``: top-level keys; see helpers.training.config)."""

    def make(cc: dict[str, Any] | None = None, **top: Any) -> Any:
        return config(tmp_path / "ckpt", **(cc or {}), **top)

    return make


@pytest.fixture(scope="session")
def _example_backend_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test-fixture backend distribution, pip-installed once per session into a folder
    of its own (never into the environment: ``make venv`` does not install it)."""
    return plugin_helpers.install_example_backend(tmp_path_factory.mktemp("example-backend-site"))


@pytest.fixture
def example_backend(_example_backend_site: Path) -> Iterator[Path]:
    """The third-party backend ``example_dir`` (distribution ``roll-ckpt-example-backend``,
    tests/plugins/example_backend) is installed while the test runs: entry points of this
    process (``roll_ckpt.plugins.get_plugins()`` is found again) and of the processes it
    starts (``PYTHONPATH``). Yields the folder it is installed in."""
    with plugin_helpers.installed(_example_backend_site) as site:
        yield site


# The modules with the longest tests first (measured with --durations, make test on 2 cores):
# a two-minute test picked up last keeps one worker busy while the other has nothing left to
# do. (xdist gives each worker a contiguous share first: make test uses --dist worksteal, so
# the worker without these takes from the other's.)
LONGEST_FIRST = (
    "tests/integration_torchtitan/test_trainer.py",  # (the torchtitan leg)
    "tests/integration_verl/test_ppo_trainer.py", "tests/integration_verl/test_sft.py",  # (the verl leg)
    "tests/integration_roll/test_roll_integration.py", "tests/integration_roll/test_roll_double.py",
    "tests/integration_torchtitan/test_manager.py",
    "tests/examples/test_ray_job.py", "tests/bench/test_bench_smoke.py", "tests/strategy_fsdp2/test_local_tier.py",
    "tests/backend_fs/test_network_faults.py", "tests/strategy_fsdp2/test_preemption_fsdp2.py",
    "tests/strategy_fsdp2/test_hf_fsdp2.py", "tests/strategy_fsdp2/test_fixed_layout_ranks.py",
    "tests/reliability/test_crash.py", "tests/strategy_fsdp2/test_fsdp2.py", "tests/plugins/test_third_party_backend.py",
    "tests/bench/test_recovery_bench.py", "tests/core/test_demo.py", "tests/reliability/test_components.py",
    "tests/core/test_preemption.py", "tests/bench/test_scale_smoke.py", "tests/core/test_exact_resume.py",
    "tests/examples/test_rl_components_example.py", "tests/reliability/test_two_launches.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules of :data:`LONGEST_FIRST` first, in that order; the rest keep theirs."""
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a test that had the fixture backend installed, and once every fixture of it is
    torn down (monkeypatched plugin discovery too), the process-wide plugin manager is found
    again: later tests never see the backend, nor anything that test patched."""
    try:
        return (yield)
    finally:
        if "example_backend" in getattr(item, "fixturenames", ()):
            plugin_helpers.reload_plugins()


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh ``memory://`` prefix, removed afterwards."""
    import fsspec

    prefix = f"roll-ckpt-test-{uuid.uuid4().hex[:10]}"
    yield f"memory://{prefix}"
    fs = fsspec.filesystem("memory")
    try:
        fs.rm(f"/{prefix}", recursive=True)
    except FileNotFoundError:
        pass


def _mount_tmpfs(path: Path, size: str, readonly: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size="4m", readonly=False)`` mounts a small tmpfs under tmp_path; unmounted after."""
    mounted: list[Path] = []

    def mount(size: str = "4m", readonly: bool = False) -> Path:
        path = tmp_path / f"tmpfs{len(mounted)}"
        _mount_tmpfs(path, size, readonly)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def py() -> Callable[..., subprocess.CompletedProcess]:
    """helpers.launch.run_python: a fresh interpreter with a time limit."""
    return run_python


# --------------------------------------------------------------------------- S3 (SeaweedFS)


def _s3server() -> Any:
    """``tests/backend_fs/s3server.py``: starts and stops ``weed mini`` (tests/ is on sys.path)."""
    from backend_fs import s3server

    return s3server


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One S3 server (SeaweedFS ``weed mini`` on loopback) for the whole session, shared by
    every test that asks for it; each test works under its own ``s3://<bucket>/<prefix>``.
    Skipped only when s3fs is missing or the ``weed`` binary cannot run here; always stopped."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'roll-ckpt[s3]')")
    s3server = _s3server()
    try:
        s3server.check_runs(s3server.weed_binary())
    except s3server.SeaweedUnavailable as exc:
        pytest.skip(f"no S3 server for these tests: {exc}")
    data = tmp_path_factory.mktemp("seaweedfs") / "data"
    with s3server.seaweed(data, bucket="roll-ckpt-test") as server:
        yield server


@pytest.fixture(scope="module")
def offline_aws() -> Iterator[dict[str, str]]:
    """No real AWS for a module (and the processes it starts): dummy credentials, no
    metadata service, a dead default endpoint. Yields the variables it set."""
    with _s3server().offline_aws() as env:
        yield env
