"""Progress bars: a save or resume passes a byte counter only where a bar can be shown."""

from __future__ import annotations

import pytest

from roll_ckpt.runtime.progress import Progress, progress


def test_no_counter_where_no_bar_is_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CKPT_QUIET", "1")
    with progress("save step 1", 10) as on_bytes:
        assert on_bytes is None  # quiet: the writers get no callback to call per chunk
    monkeypatch.delenv("ROLL_CKPT_QUIET")
    with progress("save step 1", 10, enabled=False) as on_bytes:  # not the coordinator, or quiet=True
        assert on_bytes is None
    with progress("save step 1", 10) as on_bytes:
        assert isinstance(on_bytes, Progress)
        on_bytes(3)
        on_bytes(4)
        assert on_bytes.bytes == 7
