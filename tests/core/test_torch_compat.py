"""The private torch APIs roll-ckpt wraps (roll_ckpt.runtime.torch_compat): what each wrapper adds."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from roll_ckpt.runtime.torch_compat import collective, save_tensor_without_crc


def test_writing_tensors_leaves_no_garbage_in_cycles() -> None:
    """torch.serialization._save makes a pickler class per call (objects only the cyclic
    collector frees); ours hands it a plain pickler, so a save of thousands of tensors does
    not set off collections over the whole heap."""
    tensors = [torch.randn(3, 4) for _ in range(300)]
    for t in tensors[:5]:
        buf = io.BytesIO()
        save_tensor_without_crc(t, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=True), t)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to be looked at
    try:
        for t in tensors:
            save_tensor_without_crc(t, io.BytesIO())
        gc.collect()
        picklers = [o for o in gc.garbage if isinstance(o, type) and o.__name__ == "PyTorchPickler"]
        assert not picklers, f"{len(picklers)} pickler classes left in cycles by {len(tensors)} tensors"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


_FULL_DISK_CHILD = """
import errno, gc, torch
from roll_ckpt.runtime.torch_compat import save_tensor_without_crc

class Full:
    def __init__(self, room): self.room, self.pos = room, 0
    def write(self, b):
        n = memoryview(b).nbytes
        if self.pos + n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.pos += n
        return n

for room in (100, 1000, 300000):
    try:
        save_tensor_without_crc(torch.arange(100000, dtype=torch.float32), Full(room))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        kept = exc  # the failed frame (and the writer in it) stays alive until here
    else:
        raise AssertionError("the write did not fail")
    del kept
    gc.collect()
print("survived")
"""


def test_a_write_that_fails_on_a_full_disk_leaves_no_writer_to_abort_the_process() -> None:
    """A ``torch.save`` that fails mid-write leaves its ``PyTorchFileWriter`` unfinished in the
    failed frame; once that frame is freed, the writer's destructor wrote the zip's end into
    the failed stream and aborted the process ("terminate called ... unexpected pos").
    ``save_tensor_without_crc`` finishes the writer on failure: the error is raised, and the
    process lives on (checked in a child: the abort would end the test process)."""
    from helpers.launch import run_python

    done = run_python(_FULL_DISK_CHILD, timeout=120)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_collective_returns_only_once_the_other_holder_let_go_of_its_tensors() -> None:
    """collective() waits while something outside Python (gloo's worker thread, here a view
    a timer thread drops 0.2 s later) still holds a tensor it was given."""
    import threading
    import time

    t = torch.ones(4)
    held: list[torch.Tensor] = []

    def call() -> str:
        held.append(t.view(-1))  # another C++ reference to t's tensor, as a finished gloo work keeps
        threading.Timer(0.2, held.clear).start()
        return "done"

    t0 = time.monotonic()
    assert collective(call, (t,)) == "done"
    assert time.monotonic() - t0 >= 0.15
    assert t._use_count() == 1


def test_a_real_collective_leaves_its_tensors_to_python(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = None
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        group = dist.group.WORLD
    try:
        for _ in range(20):
            t = torch.ones(4)
            parts = [torch.empty(4)]
            collective(dist.all_gather, (t, *parts), parts, t)
            assert t._use_count() == 1 and parts[0]._use_count() == 1
            assert torch.equal(parts[0], t)
    finally:
        if group is not None:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- loaded_in_place


def test_a_state_dict_over_the_live_tensors_is_loaded_in_place() -> None:
    from roll_ckpt.runtime.torch_compat import loaded_in_place

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # BatchNorm: torch.nn's own override
    assert loaded_in_place(model, model.state_dict())
    copied = {k: v.clone() for k, v in model.state_dict().items()}
    assert not loaded_in_place(model, copied)  # other memory: the hand-over must copy
    assert not loaded_in_place(model, {**model.state_dict(), "extra": 3})  # a value only a load hands over


def test_a_user_load_hook_or_override_keeps_the_hand_over() -> None:
    from roll_ckpt.runtime.torch_compat import loaded_in_place

    model = torch.nn.Linear(3, 4)
    model.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not loaded_in_place(model, model.state_dict())

    class Custom(torch.nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):  # e.g. recomputes a cache from the weights
            super()._load_from_state_dict(*args, **kwargs)

    custom = Custom(3, 4)
    assert not loaded_in_place(custom, custom.state_dict())


def test_a_resume_still_runs_a_modules_load_hook(tmp_path) -> None:
    """The hand-over is skipped only where it would copy each tensor onto itself: a module
    with a load hook of its own has it run, with the checkpoint's values in place."""
    from roll_ckpt import CheckpointManager, load_config

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    seen: list[torch.Tensor] = []
    model.register_load_state_dict_post_hook(lambda module, keys: seen.append(module.weight.detach().clone()))
    opt = torch.optim.AdamW(model.parameters())
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "timestamp_subdir": False}})
    m = CheckpointManager.from_config(cfg, quiet=True)
    m.save(1, {"model": model, "optimizer": opt})
    m.wait()
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert m.resume({"model": model, "optimizer": opt}, target="latest") == 1
    m.close()
    assert torch.equal(model.weight, saved)
    assert len(seen) == 1 and torch.equal(seen[0], saved)


# ----------------------------------------------------------------------------- optimizer_loaded_in_place


def _trained(tmp_path, hook: bool = False):
    from roll_ckpt import CheckpointManager, load_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}])
    seen: list[float] = []
    if hook:
        opt.register_load_state_dict_post_hook(lambda o: seen.append(o.param_groups[1]["lr"]))
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    cfg = load_config({"checkpoint_config": {"output_dir": str(tmp_path), "timestamp_subdir": False}})
    return CheckpointManager.from_config(cfg, quiet=True), model, opt, seen


def _moved_on(model, opt) -> None:
    """The loop after the save: another step, and the hyperparameters changed (a scheduler)."""
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    for g in opt.param_groups:
        g["lr"] *= 10
        g["betas"] = (0.5, 0.5)


def test_an_optimizer_loaded_in_place_takes_only_the_checkpoints_hyperparameters(tmp_path, monkeypatch) -> None:
    """Its state filled in its own per-parameter dicts, the resume skips torch's re-mapping
    (set_optimizer_state_dict, made to fail here) and takes the groups' hyperparameters: the
    optimizer ends as the checkpoint's, state and groups, to the bit."""
    import torch.distributed.checkpoint.state_dict as sd

    m, model, opt, _ = _trained(tmp_path)
    m.save(1, {"model": model, "optimizer": opt})
    m.wait()
    saved = copy.deepcopy(opt.state_dict())
    _moved_on(model, opt)
    monkeypatch.setattr(sd, "set_optimizer_state_dict", lambda *a, **k: pytest.fail("torch's hand-over ran"))
    assert m.resume({"model": model, "optimizer": opt}, target="latest") == 1
    m.close()
    now = opt.state_dict()
    assert now["param_groups"] == saved["param_groups"]
    assert now["state"].keys() == saved["state"].keys()
    for k, st in saved["state"].items():
        for name, v in st.items():
            assert torch.equal(now["state"][k][name], v), (k, name)


def test_an_optimizer_with_a_load_hook_keeps_torchs_hand_over(tmp_path) -> None:
    """Its hook runs, with the checkpoint's hyperparameters in place."""
    m, model, opt, seen = _trained(tmp_path, hook=True)
    m.save(1, {"model": model, "optimizer": opt})
    m.wait()
    _moved_on(model, opt)
    assert m.resume({"model": model, "optimizer": opt}, target="latest") == 1
    m.close()
    assert seen == [0.5]
