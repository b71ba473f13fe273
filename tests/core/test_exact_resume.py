"""The key guarantee: a job killed right after a save and resumed in a new process continues
bit for bit like a job that was never interrupted (losses and final parameters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

CHILD = Path(__file__).with_name("_train_child.py")
STEPS, EVERY, DIE = 24, 4, 12


def _run(py, out: Path, *extra: str) -> tuple[int, dict[int, str], str]:
    res = py([str(CHILD), "--out", str(out), "--steps", str(STEPS), "--save-every", str(EVERY), *extra],
             timeout=100, warm=True)
    losses = {int(m.group(1)): m.group(2) for m in re.finditer(r"^loss (\d+) (\S+)$", res.stdout, re.M)}
    start = re.search(r"^start (\d+)$", res.stdout, re.M)
    assert start is not None, f"child failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.returncode, losses, res.stdout + res.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory, py) -> tuple[dict[int, str], dict]:
    """The uninterrupted run (it saves too, with the same schedule)."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, losses, log = _run(py, tmp / "ckpt", "--result", str(tmp / "final.pt"))
    assert rc == 0, log
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, torch.load(tmp / "final.pt", weights_only=False)


def _assert_bitwise(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_killed_and_resumed_run_is_bitwise_identical(reference, tmp_path: Path, py, async_save: bool) -> None:
    ref_losses, ref_final = reference
    flags = ["--async-save"] if async_save else []
    out = tmp_path / "ckpt"

    rc, first, log = _run(py, out, "--die-after", str(DIE), *flags)
    assert rc == 17 and f"died {DIE}" in log, log
    assert sorted(first) == list(range(1, DIE + 1))
    assert all(first[s] == ref_losses[s] for s in first), "the killed run diverged before dying"

    rc, second, log = _run(py, out, "--resume", "--result", str(tmp_path / "final.pt"), *flags)
    assert rc == 0, log
    start = int(re.search(r"^start (\d+)$", log, re.M).group(1))
    if async_save:
        # the write of step DIE may or may not have committed before the process died;
        # the save of step DIE-EVERY was committed before that save began
        assert start in (DIE - EVERY, DIE), log
    else:
        assert start == DIE, log
    assert sorted(second) == list(range(start + 1, STEPS + 1))
    mismatched = {s: (second[s], ref_losses[s]) for s in second if second[s] != ref_losses[s]}
    print(f"\n[{'async' if async_save else 'sync'}] resumed at step {start}; "
          f"losses after resume: {len(second)}, e.g. step {STEPS}: {second[STEPS]}")
    assert not mismatched, f"losses differ after resuming at step {start}: {mismatched}"

    final = torch.load(tmp_path / "final.pt", weights_only=False)
    for name, ref_value in ref_final["model"].items():
        assert torch.equal(final["model"][name], ref_value), f"parameter {name} differs"
    _assert_bitwise(final, ref_final, "final")
