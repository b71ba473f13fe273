"""T6: the training loop's time lost per async save (run inside :mod:`bench.worker`).

The loop is CPU-bound on purpose and runs on the CPU even with ``--device cuda``.

A CPU-bound loop (FSDP2 Linear layers + AdamW, every core) runs one step, the save, and K
steps right after an async save returns, until both the K steps are done and the save is
durable; the same 1 + K steps run once more without a save, right next to them. The step
before the save is where roll-ckpt's ``maybe_save`` announces it (``prepare_save``: its
staging buffers, freed between saves, made ready in the writer thread), so that work is
counted too. Lost = (with) - (without): the call's
blocked time plus whatever the background write takes from the loop (CPU, memory
bandwidth, the GIL). The pair (with, without) runs in alternating order too. K is sized so that K steps outlast the slowest save (2.5x its time
alone); where a save still ends after the steps, the report shows that tail. Every method
runs on the same state, alternating order; the report shows medians.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from roll_ckpt.runtime.torch_compat import TorchCompatError, fsdp2_options, process_mode

from roll_ckpt import CheckpointManager, load_config

from . import peers
from .common import available, cpu_all, state_size

METHODS = ["dcp_thread", "dcp_process", "rc_regular", "rc_zc", "rc_zc_nice0", "tc_async"]


def _torch_checkpointing() -> None:
    why = peers.PEERS["tc"]().why_not()
    if why:
        raise TorchCompatError(why)


NEEDS = {"dcp_process": process_mode, "tc_async": _torch_checkpointing}
"""What a method needs of this torch (it raises TorchCompatError where a release lacks it)."""
TITLES = {
    "dcp_thread": "dcp.async_save, thread mode (with get_state_dict)",
    "dcp_process": "dcp.async_save, process mode (AsyncCheckpointerType.PROCESS)",
    "rc_regular": "roll-ckpt async, regular staging",
    "rc_zc": "roll-ckpt async, zero-copy (model + AdamW in the store; onload, then train)",
    "rc_zc_nice0": "roll-ckpt zero-copy, background_nice: 0 (writer at the loop's priority)",
    "tc_async": "torch-checkpointing async (with get_state_dict; each optimizer.step() under its manager.lock(), "
                "which waits until the state is staged; durable: the window, its write future then an fsync)",
}


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        import sys

        print(f"[worker {dist.get_world_size()}] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


class Loop:
    MANAGERS: tuple[tuple[str, bool, int], ...] = (("rc_regular", True, 10), ("rc_zc", True, 10),
                                                  ("rc_zc_nice0", True, 0))
    """roll-ckpt's managers: (method, async_save_ckpt, background_nice)."""

    def __init__(self, spec: dict[str, Any], scratch: str) -> None:
        self.spec = spec
        self.dir = os.path.join(scratch, spec["name"])
        self.guard: Callable[[], Any] = contextlib.nullcontext
        """What each ``optimizer.step()`` runs under (torch-checkpointing's lock in its windows)."""
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        self.build(spec, mesh)
        self.step()
        self.state = {"model": self.model, "optimizer": self.opt}
        self.tensors, self.state_bytes = state_size(self.model, self.opt)
        self.pg = dist.new_group(backend="gloo")
        self.n = 0
        self.m: dict[str, Any] = {}
        for key, is_async, nice in self.MANAGERS:
            cfg = {"checkpoint_config": {"output_dir": os.path.join(self.dir, key), "timestamp_subdir": False,
                                         "background_nice": nice},
                   "strategy_config": {"async_save_ckpt": is_async}}
            m = CheckpointManager.from_config(load_config(cfg), quiet=True)
            m.bind(self.state)
            self.m[key] = m

    def build(self, spec: dict[str, Any], mesh: Any) -> None:
        """``self.model`` (FSDP2 on ``mesh``), ``self.opt`` and the input ``self.x``."""
        width, depth = spec["width"], spec["depth"]
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        for layer in self.model:
            fully_shard(layer, mesh=mesh, **fsdp2_options(mesh.device_type))
        fully_shard(self.model, mesh=mesh, **fsdp2_options(mesh.device_type))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(spec.get("batch", 16), width)

    def step(self) -> None:
        self.model(self.x).pow(2).mean().backward()
        with self.guard():
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def steps(self, k: int) -> list[float]:
        """``k`` training steps; the seconds of each."""
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times

    def path(self, kind: str) -> str:
        self.n += 1
        return os.path.join(self.dir, f"{kind}-{self.n}")

    # ------------------------------------------------------------ one method, with or without a save

    def once(self, method: str, k: int, save: bool) -> dict[str, Any]:
        """Returns wall and CPU seconds of the window, blocked and durable seconds."""
        zc = method.startswith("rc_zc")
        m = self.m.get(method)
        dist.barrier()
        written: str | None = None
        done: Callable[[], None] = lambda: None  # noqa: E731
        c0, t0 = time.process_time(), time.perf_counter()
        ended: list[float] = []  # when the save became durable (from the save's call)
        stats_of: Any = None
        tc = peers.get("tc") if method == "tc_async" else None
        # the same lock in the window without a save: the loop a torch-checkpointing user runs
        self.guard = tc.manager(True).lock if tc is not None else contextlib.nullcontext
        # The step before the save is in every window: roll-ckpt's maybe_save announces the save
        # there (its staging buffers' memory, freed between saves, made ready in the writer thread)
        if save and m is not None:
            m.prepare_save()
        before = self.steps(1)
        if zc:  # (the RL cycle's offload, in both windows: it cancels out of the loss)
            m.strategy.offload_states(self.state, optimizer=True)
        t_call = time.perf_counter()
        if save:
            if method == "dcp_save":  # synchronous: the loop's loss is the save itself
                msd, osd = get_state_dict(self.model, self.opt)
                written = self.path(method)
                dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=written, process_group=self.pg)
                ended.append(time.perf_counter() - t_call)
            elif method == "dcp_thread" or method == "dcp_process":
                msd, osd = get_state_dict(self.model, self.opt)
                written = self.path(method)
                kw = process_mode() if method == "dcp_process" else {}
                resp = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=written, process_group=self.pg,
                                      **kw)
                fut = getattr(resp, "upload_completion", resp)
                fut.add_done_callback(lambda _f: ended.append(time.perf_counter() - t_call))
                done = fut.result
            elif tc is not None:  # returns at once; the loop waits at its lock until the state is staged
                msd, osd = get_state_dict(self.model, self.opt)
                written = self.path(method)
                pending = tc.async_save(written, {"model": msd, "optimizer": osd})
                where = written
                done = lambda: (pending.written(), tc.durable(where, dist.get_rank()))  # noqa: E731
            else:
                self.n += 1
                written = m.save(self.n, self.state)
                done = m.wait
                stats_of = m
        blocked = time.perf_counter() - t_call
        if zc:
            m.strategy.load_states(self.state)  # onload (the RL cycle's), in both windows
        step_times = before + self.steps(k)  # (the loss subtracts 1 + K median steps of the window without)
        t_steps = time.perf_counter() - t0
        done()
        self.guard = contextlib.nullcontext
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        durable = 0.0
        if save:
            if stats_of is not None and getattr(stats_of.stats.last, "total_s", None):
                durable = stats_of.stats.last.total_s  # measured by the manager from its save call
            else:
                durable = ended[0] if ended else wall - (t_call - t0)
        dist.barrier()
        if written and dist.get_rank() == 0:
            shutil.rmtree(written, ignore_errors=True)
        return {"wall_s": wall, "cpu_s": cpu, "blocked_s": blocked if save else 0.0, "durable_s": durable,
                "steps_s": t_steps, "step_times": step_times}

    def save_cpu(self, method: str) -> dict[str, Any]:
        """T6: one async save alone (no training beside it), from the call until durable: the
        CPU seconds of this process (the calling thread, the writer threads) and of its
        children (DCP's process-mode checkpointer), and the wall time."""
        zc = method.startswith("rc_zc")
        m = self.m.get(method)
        dist.barrier()
        written: str | None = None
        c0, t0 = cpu_all(), time.perf_counter()
        if method in ("dcp_thread", "dcp_process"):
            msd, osd = get_state_dict(self.model, self.opt)
            written = self.path(method)
            kw = process_mode() if method == "dcp_process" else {}
            resp = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=written, process_group=self.pg, **kw)
            getattr(resp, "upload_completion", resp).result()
        else:
            self.n += 1
            written = m.save(self.n, self.state)
            m.wait()
        wall = time.perf_counter() - t0
        cpu = cpu_all() - c0
        if zc:
            m.strategy.load_states(self.state)
        dist.barrier()
        if written and dist.get_rank() == 0:
            shutil.rmtree(written, ignore_errors=True)
        return {"cpu_s": cpu, "wall_s": wall, "bytes": self.state_bytes,
                "cpu_s_per_gb": cpu / (self.state_bytes / 1e9) if self.state_bytes else None}

    def close(self) -> None:
        for m in self.m.values():
            m.close()


def run_group(spec: dict[str, Any], scratch: str, out: dict[str, Any]) -> None:
    threads = spec.get("threads") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    t_build = time.perf_counter()
    lp = Loop(spec, scratch)
    log(f"{spec['name']}: {lp.tensors} tensors, {lp.state_bytes / 2**20:.0f} MiB/rank, {threads} torch threads, "
        f"built in {time.perf_counter() - t_build:.1f} s")
    methods, unavailable = available(spec.get("methods", METHODS), NEEDS, lambda msg: log(f"{spec['name']}: {msg}"))
    # warm-up: first calls (DCP's process mode spawns its process here, ~5 s), and the sizes of K
    lp.steps(2)
    tries = []
    for _ in range(3):  # the fastest of 3: a burst of load from elsewhere would shrink K
        t0 = time.perf_counter()
        lp.steps(3)
        tries.append((time.perf_counter() - t0) / 3)
    step_s = min(tries)
    for meth in methods:
        lp.once(meth, 1, True)
    if spec.get("steps"):  # the smoke run: a fixed K checks the harness end to end, it measures nothing
        k = int(spec["steps"])
        log(f"{spec['name']}: step {step_s * 1e3:.0f} ms, K = {k} steps (fixed)")
    else:
        slowest = 0.0
        for meth in methods:  # second saves: roll-ckpt's reused buffers/layouts, DCP's caches
            r = lp.once(meth, 1, True)
            slowest = max(slowest, r["durable_s"])
        # A save running beside the loop took about twice as long as alone here: K steps must
        # outlast it, or the window would end waiting for the save (counted as lost, wrongly).
        window = max(spec.get("window_s", 1.5), 2.5 * slowest)
        all_ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_ranks, math.ceil(window / step_s))
        k = max(all_ranks)
        log(f"{spec['name']}: step {step_s * 1e3:.0f} ms, slowest save {slowest:.2f} s -> K = {k} steps")
    reps: dict[str, list[Any]] = {m: [] for m in methods}
    for rep in range(spec["reps"]):
        order = methods if rep % 2 == 0 else methods[::-1]
        t_rep = time.perf_counter()
        for meth in order:
            # the pair's order alternates too, so a slow drift of the machine's load cancels
            if rep % 2 == 0:
                without = lp.once(meth, k, False)
                with_ = lp.once(meth, k, True)
            else:
                with_ = lp.once(meth, k, True)
                without = lp.once(meth, k, False)
            mine = {"without": without, "with": with_}
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            reps[meth].append(everyone)
        log(f"{spec['name']}: repetition {rep + 1} took {time.perf_counter() - t_rep:.1f} s")
    # T6: the CPU the whole save path spends, each save alone, alternating order
    # (not torch-checkpointing's: its writer process lives on, so its CPU is not this process's children's)
    alone = [m for m in methods if m != "tc_async"]
    cpu: dict[str, list[Any]] = {m: [] for m in alone}
    for rep in range(max(spec["reps"], spec.get("cpu_reps", 3))):
        for meth in (alone if rep % 2 == 0 else alone[::-1]):
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, lp.save_cpu(meth))
            cpu[meth].append(everyone)
    lp.close()
    peers.close_all()
    out["groups"].append({"name": spec["name"], "kind": "loop", "world_size": dist.get_world_size(),
                          "tensors": lp.tensors, "state_bytes": lp.state_bytes, "threads": threads,
                          "k": k, "step_s": step_s, "titles": TITLES, "methods": reps, "save_cpu": cpu,
                          "unavailable": unavailable})
    if dist.get_rank() == 0:
        shutil.rmtree(lp.dir, ignore_errors=True)
    dist.barrier()
