"""A reusable pytest conformance suite for roll-ckpt storage backends.

Every backend — roll-ckpt's own and third parties' — proves the same contract by
subclassing :class:`BackendConformance` in its test suite and providing one fixture,
``storage``: a fresh :class:`~roll_ckpt.storage.Storage` rooted in an empty location::

    import pytest
    from roll_ckpt.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_type = "my_backend"          # the name its BackendRecord registers

        @pytest.fixture
        def storage(self, tmp_path):
            return MyStore(str(tmp_path / "root"))

The suite checks the :class:`~roll_ckpt.storage.Storage` protocol call by call, then
runs the real commit protocol (:mod:`roll_ckpt.format.commit`) and a full
:class:`~roll_ckpt.CheckpointManager` save → verify → resume round trip on a tiny torch
model over the backend, selected through ``checkpoint_config.type`` like a user would.
Override the ``checkpoint_config`` fixture when the backend needs ``storage_options``.

This package imports pytest (it is a testing package); ``import roll_ckpt`` never imports
it. The manager tests import torch when they run. :func:`tiny_state`,
:func:`state_snapshot` and :func:`assert_same_state` are the suite's own state helpers,
public so a backend's further tests can use them too.
"""

from __future__ import annotations

try:
    import pytest  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the dev extra
    raise ImportError("roll_ckpt.testing is a pytest suite: pip install pytest") from exc

from .conformance import BackendConformance
from .helpers import dead_pid, write_stale_marker
from .state import assert_same_state, state_snapshot, tiny_state

__all__ = ["BackendConformance", "tiny_state", "state_snapshot", "assert_same_state",
           "dead_pid", "write_stale_marker"]
