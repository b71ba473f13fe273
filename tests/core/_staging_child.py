"""The host memory a manager's regular staging holds around each event of a periodic job, in
a process of its own (a pytest worker's heap moves under readings of its own RSS).

``python _staging_child.py OUT`` prints one JSON line: MiB of anonymous resident memory over
the reading before step 3's save: once it is staged, once written, a step before the next
save, once that save's buffers are ready, once it is written; and the state's MiB.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch

from roll_ckpt import CheckpointManager, load_config


def anon_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    size = sum(p.numel() * 3 * 4 for p in model.parameters()) / 2**20  # weights + 2 Adam moments
    cfg = load_config({"save_steps": 3, "checkpoint_config": {"output_dir": out, "timestamp_subdir": False},
                       "strategy_config": {"async_save_ckpt": True}})
    got = {"state": size}
    with CheckpointManager.from_config(cfg, quiet=True) as m:
        for step in (1, 2):
            m.maybe_save(step, state)
        base = anon_mib()
        m.maybe_save(3, state)  # laid out in the call
        got["staged"] = anon_mib() - base
        m.wait()
        got["written"] = anon_mib() - base
        m.maybe_save(4, state)
        got["step_4"] = anon_mib() - base
        m.maybe_save(5, state)  # announces step 6
        m.prepare_save().result(timeout=60)
        got["ready"] = anon_mib() - base
        m.maybe_save(6, state)
        m.wait()
        got["written_6"] = anon_mib() - base
        got["allocated_6"] = m.stats.last.bytes_allocated
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
