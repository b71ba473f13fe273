"""The conformance suite's manager round trip: save, verify, resume, retention and the cleanup
of a crashed save, over the backend under test, selected through ``checkpoint_config.type``."""

from __future__ import annotations

from typing import Any, Mapping

import pytest

from ..format import layout
from ..format.commit import pending_checkpoint
from ..contracts import Storage
from ..errors import CheckpointCorruptError
from .helpers import read_file, write_file, write_stale_marker
from .state import assert_same_state, state_snapshot, tiny_state

__all__ = ["ManagerChecks"]


class ManagerChecks:
    """A full :class:`~roll_ckpt.CheckpointManager` cycle on a tiny torch model (mixed into
    :class:`~roll_ckpt.testing.BackendConformance`, which provides the fixtures)."""


    def _config(self, checkpoint_config: Mapping[str, Any], **top: Any) -> Any:
        from ..config.schema import load_config

        return load_config({"checkpoint_config": dict(checkpoint_config), **top})

    def test_manager_save_verify_resume(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from .. import CheckpointManager
        from ..format.manifest import verify

        state = tiny_state(seed=1)
        before = state_snapshot(state)
        with CheckpointManager.from_config(self._config(checkpoint_config, save_steps=2), quiet=True) as m:
            assert m.resume(state) == 0
            assert m.maybe_save(1, state) is None
            path = m.maybe_save(2, state)
            assert path is not None
            m.save(3, state, final=True, metadata={"note": "conformance"})
        refs = layout.committed(storage, storage.root)
        assert [r.step for r in refs] == [2, 3]
        for r in refs:
            report = verify(storage, r.path)
            assert set(report.manifest.files) >= {"trainer_state.json", "dcp/.metadata"}

        fresh = tiny_state(seed=99)
        cfg = self._config(checkpoint_config, resume_from_checkpoint="latest")
        with CheckpointManager.from_config(cfg, quiet=True) as m2:
            assert m2.resume(fresh) == 3
            assert m2.resumed.trainer_state["user"] == {"note": "conformance"}
        assert_same_state(state_snapshot(fresh), before)

        # an explicit checkpoint path/URL of this backend resumes too
        fresh2 = tiny_state(seed=98)
        explicit = refs[0].path if "://" not in storage.url else _url_of(storage, refs[0].path)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=explicit),
                                           quiet=True) as m3:
            assert m3.resume(fresh2) == 2

    def test_manager_async_save_round_trip(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        import torch

        from .. import CheckpointManager

        state = tiny_state(seed=2)
        before = state_snapshot(state)
        cfg = self._config(checkpoint_config, strategy_config={"async_save_ckpt": True})
        with CheckpointManager.from_config(cfg, quiet=True) as m:
            m.save(7, state)
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(1.0)  # the checkpoint must hold the values at save time
            m.wait()
            assert m.stats.last is not None and m.stats.last.is_async
        fresh = tiny_state(seed=3)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=True),
                                           quiet=True) as m2:
            assert m2.resume(fresh) == 7
        assert_same_state(state_snapshot(fresh), before)

    def test_manager_refuses_corrupt_checkpoint(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from .. import CheckpointManager

        state = tiny_state(seed=4)
        with CheckpointManager.from_config(self._config(checkpoint_config), quiet=True) as m:
            path = m.save(1, state)
        target = storage.join(path, "trainer_state.json")
        data = bytearray(read_file(storage, target))
        data[len(data) // 2] ^= 0xFF
        write_file(storage, target, bytes(data))
        fresh = tiny_state(seed=5)
        untouched = state_snapshot(fresh)
        with CheckpointManager.from_config(self._config(checkpoint_config, resume_from_checkpoint=True),
                                           quiet=True) as m2:
            with pytest.raises(CheckpointCorruptError, match="trainer_state.json"):
                m2.resume(fresh)
        assert_same_state(state_snapshot(fresh), untouched)

    def test_manager_retention_sorts_by_step(self, storage: Storage, checkpoint_config: dict[str, Any]) -> None:
        from .. import CheckpointManager

        state = tiny_state(seed=6)
        cc = {**checkpoint_config, "max_ckpt_to_keep": 2}
        with CheckpointManager.from_config(self._config(cc), quiet=True) as m:
            for step in (9, 10, 100):
                m.save(step, state)
        assert [r.step for r in layout.committed(storage, storage.root)] == [10, 100]
        assert [r.step for r in layout.scan(storage, storage.root)] == [10, 100], "removed folders are gone"

    def test_manager_cleans_stale_temp_at_next_save(self, storage: Storage,
                                                    checkpoint_config: dict[str, Any]) -> None:
        from .. import CheckpointManager

        state = tiny_state(seed=7)
        with CheckpointManager.from_config(self._config(checkpoint_config), quiet=True) as m:
            m.save(1, state)
            run_dir = m.run_dir
        crashed = pending_checkpoint(storage, storage.join(run_dir, layout.checkpoint_name(2)), "crashed0")
        crashed.begin()
        self._write_payload(storage, crashed)
        write_stale_marker(storage, crashed)
        fresh = tiny_state(seed=8)
        cfg = self._config(checkpoint_config, resume_from_checkpoint="latest")
        with CheckpointManager.from_config(cfg, quiet=True) as m2:
            assert m2.resume(fresh) == 1, "the crashed save of step 2 is not a checkpoint"
            assert storage.exists(crashed.write_path)
            m2.save(3, fresh)
        assert not storage.exists(crashed.write_path)
        assert not storage.exists(crashed.marker_path)
        assert [r.step for r in layout.committed(storage, storage.root)] == [1, 3]


def _url_of(storage: Storage, path: str) -> str:
    """``path`` of ``storage`` written as a URL of the same scheme (``memory://...``)."""
    scheme = storage.url.split("://", 1)[0]
    return f"{scheme}://{path.lstrip('/')}" if scheme != "file" else f"file://{path}"
