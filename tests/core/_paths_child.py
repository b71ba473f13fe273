"""Trace one steady-state asynchronous save and one resume through the public API; write what
of roll-ckpt each ran (``tests/core/test_paths.py``, issue 37).

``_paths_child.py ROOT OUT``: one gloo rank (``MASTER_ADDR``... in the environment), a small
FSDP2 model with AdamW, checkpoints under ``ROOT``, the trace as JSON in ``OUT``.

A profile function is set on every thread (``sys.setprofile`` and ``threading.setprofile``)
before the manager exists, so the threads the save starts are traced too; it records only
between the traced call and its end: for the save, from ``maybe_save`` until ``wait()``
returns (the manifest committed), the third save of the run (the first builds what later saves
reuse); for the resume, ``resume(state, "latest")`` on a new manager.

What counts: a *function* is a code object of the product (a file under
``packages/*/src`` of this checkout) that is a function's body (``CO_OPTIMIZED |
CO_NEWLOCALS``: not a module's or a class's body), lambdas and nested functions included;
list, set and dict comprehensions and generator expressions are not counted (Python 3.12
inlines comprehensions, PEP 709: counting them would make the figures depend on the
interpreter). A *module* is a file one of those functions lies in. Functions are told apart
by file and first line (``co_qualname`` names them; Python 3.10, without it, ``co_name``).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import roll_ckpt
from roll_ckpt import CheckpointManager, load_config
from roll_ckpt.runtime.torch_compat import fsdp2_options

REPO = Path(__file__).resolve().parents[2]
PACKAGES = str(REPO / "packages") + os.sep
SRC = os.sep + "src" + os.sep
FUNCTION = inspect.CO_OPTIMIZED | inspect.CO_NEWLOCALS
NOT_COUNTED = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
seen: set[tuple[str, int, str]] = set()
recording = False


def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
    if recording and event == "call":
        code = frame.f_code
        name = code.co_filename
        if (name.startswith(PACKAGES) and SRC in name and code.co_flags & FUNCTION == FUNCTION
                and code.co_name not in NOT_COUNTED):
            seen.add((name, code.co_firstlineno, getattr(code, "co_qualname", code.co_name)))


def state() -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh, **fsdp2_options("cpu"))
    fully_shard(model, mesh=mesh, **fsdp2_options("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def traced(fn):  # noqa: ANN001, ANN201
    """Run ``fn`` recording; its result and ``{"modules": n, "functions": n, "by_module":
    {file relative to the checkout: [qualified names, sorted]}}``."""
    global recording
    seen.clear()
    recording = True
    try:
        out = fn()
    finally:
        recording = False
    by_module: dict[str, list[str]] = {}
    for file, _line, qualname in seen:
        by_module.setdefault(os.path.relpath(file, REPO), []).append(qualname)
    by_module = {m: sorted(names) for m, names in sorted(by_module.items())}
    return out, {"modules": len(by_module), "functions": len(seen), "by_module": by_module}


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    if not os.path.realpath(roll_ckpt.__file__).startswith(os.path.realpath(PACKAGES)):
        sys.exit(f"roll_ckpt imported from {roll_ckpt.__file__}, not from this checkout ({REPO}): "
                 "put its packages/*/src first on PYTHONPATH")
    sys.setprofile(profile)
    threading.setprofile(profile)
    dist.init_process_group("gloo")
    config = load_config({"save_steps": 1, "checkpoint_config": {"output_dir": root},
                          "strategy_config": {"async_save_ckpt": True}})
    manager = CheckpointManager.from_config(config, quiet=True)
    st = state()
    manager.maybe_save(1, st)  # the first save builds what later saves reuse: not the steady state
    manager.wait()
    manager.maybe_save(2, st)
    manager.wait()

    def save() -> None:
        manager.maybe_save(3, st)
        manager.wait()

    _, saved = traced(save)
    manager.close()
    resumer = CheckpointManager.from_config(config, quiet=True)
    fresh = state()
    step, resumed = traced(lambda: resumer.resume(fresh, "latest"))
    assert step == 3, step
    resumer.close()
    sys.setprofile(None)
    threading.setprofile(None)
    with open(out, "w") as f:
        json.dump({"python": sys.version.split()[0], "torch": torch.__version__, "save": saved, "resume": resumed},
                  f, indent=1)
    dist.destroy_process_group()
    os._exit(0)  # see tests/helpers/launch.py exit_worker


if __name__ == "__main__":
    main()
