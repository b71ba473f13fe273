"""Real jobs for :mod:`bench.scale`: storage operations and collective bytes per rank, per save and per resume.

    python -m bench.scale_jobs [--worlds 1,2,4,8,16] [--out DIR]           (the driver)
    python -m torch.distributed.run --standalone --nproc_per_node N -m bench.scale_jobs worker SPEC OUT

Each job is ``torchrun --standalone`` on N CPU processes (gloo), a tiny FSDP2 model
(``init_device_mesh("cpu", (N,))``, a few Linear + LayerNorm layers, AdamW, a LambdaLR
scheduler), and real :class:`~roll_ckpt.CheckpointManager` saves. Every rank's storage is a
:class:`bench.opcount.CountingStorage` and every collective goes through
:class:`bench.opcount.CollectiveBytes`. Per configuration (``max_ckpt_to_keep`` K, with E earlier
checkpoints already in the folder) the job saves S times (the first save of a manager takes
the full path, the later ones are saves of an unchanged structure), then a fresh manager
resumes the newest checkpoint into a fresh model and checks every parameter, optimizer
state, scheduler and RNG state bit-exact against what was saved. One job more loads the
checkpoint of the largest job at another world size (N -> M resharding) and checks it too.

Every job runs under a time limit; its whole process group is killed at the end.
With ``--s3`` one more 1-process job saves and resumes over S3 (SeaweedFS, as the tests
start it) counting HTTP requests by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .launch import RESULTS, ROOT, child_env, torchrun, use_test_helpers
from .scale_limits import OPS_LIMIT

WIDTH, DEPTH = 48, 3


# ----------------------------------------------------------------------------- worker


def _build(seed: int) -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from roll_ckpt.runtime.torch_compat import fsdp2_options

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    layers: list[Any] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)]
    model = torch.nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh, **fsdp2_options(mesh.device_type))
    fully_shard(model, mesh=mesh, **fsdp2_options(mesh.device_type))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(state: dict[str, Any], step: int) -> None:
    import random

    import numpy as np
    import torch

    torch.manual_seed(1000 + step)
    x = torch.randn(4, WIDTH) * (1 + random.random() + float(np.random.rand()))
    state["model"](x).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["scheduler"].step()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a resume must bring back, as full tensors / plain values (collectives
    run here: call it outside the counted windows)."""
    import random

    import numpy as np
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = state["model"], state["optimizer"]
    params = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt)
    optim = {f"{p}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
             for p, st in osd["state"].items() for k, v in st.items()}
    return {"params": params, "optim": optim, "sched": dict(state["scheduler"].state_dict()),
            "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().clone())}


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    bad = []
    for part in ("params", "optim"):
        if set(a[part]) != set(b[part]):
            bad.append(f"{part}: keys differ")
            continue
        for k in a[part]:
            x, y = a[part][k], b[part][k]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8)
                                                                            if x.numel() else x,
                                                                            y.view(-1).view(torch.uint8)
                                                                            if y.numel() else y):
                bad.append(f"{part}.{k}")
    sa = {k: v for k, v in a["sched"].items() if k != "lr_lambdas"}
    sb = {k: v for k, v in b["sched"].items() if k != "lr_lambdas"}
    if sa != sb:
        bad.append("scheduler")
    if a["rng"][0] != b["rng"][0] or a["rng"][1] != b["rng"][1] or not torch.equal(a["rng"][2], b["rng"][2]):
        bad.append("rng")
    return bad


def _manager(out: str, keep: int, resume: str | None = None) -> Any:
    from roll_ckpt import CheckpointManager, load_config

    cfg: dict[str, Any] = {"checkpoint_config": {"output_dir": out, "timestamp_subdir": False,
                                                 "max_ckpt_to_keep": keep},
                           "strategy_config": {"async_save_ckpt": False}}
    if resume:
        cfg["resume_from_checkpoint"] = resume
    return CheckpointManager.from_config(load_config(cfg), quiet=True)


def worker(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from .opcount import CollectiveBytes, CountingStorage, categorise

    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    coll = CollectiveBytes().install()
    results: dict[str, Any] = {"world_size": ws, "configs": [], "errors": []}

    def gather(obj: Any) -> list[Any]:
        coll.uninstall()
        try:
            everyone: list[Any] = [None] * ws
            dist.all_gather_object(everyone, obj)
            return everyone
        finally:
            coll.install()

    try:
        if spec.get("load_only"):
            # N -> M: load a checkpoint saved at another world size
            model, opt, sched = _build(seed=77)
            state = {"model": model, "optimizer": opt, "scheduler": sched}
            m = _manager(spec["folder"], 0, resume="latest")  # the folder's newest: the one saved at N
            store = CountingStorage(m.storage)
            m.storage = store
            with store.phase("resume"), coll.phase("resume"):
                step = m.resume(state)
            m.close()
            got = _snapshot(state)
            import torch

            want = torch.load(spec["expected"], weights_only=False)
            bad = [b for b in _diff(got, want) if b not in ("rng",)]  # RNG is per process: not resharded
            mine = {"ops": categorise(store.of("resume")), "methods": store.of("resume"),
                    "collectives": coll.of("resume"), "step": step, "bad": bad}
            results["reshard"] = {"from": spec["from_world"], "to": ws, "ranks": gather(mine)}
        for ci, conf in enumerate(spec["configs"]):
            keep, present, saves = conf["keep"], conf["present"], spec["saves"]
            folder = os.path.join(spec["scratch"], f"k{keep}-e{present}")
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            model, opt, sched = _build(seed=0)
            state = {"model": model, "optimizer": opt, "scheduler": sched}
            step = 0
            if present:
                pre = _manager(folder, 0)
                for _ in range(present):
                    step += 1
                    _train(state, step)
                    pre.save(step, state)
                pre.close()
            m = _manager(folder, keep)
            store = CountingStorage(m.storage)
            m.storage = store
            per_save = []
            snap = None
            path = None
            for i in range(saves):
                step += 1
                _train(state, step)
                dist.barrier()
                name = f"c{ci}-save-{i}"  # the collective counter lives across configurations
                t0 = time.perf_counter()
                with store.phase(name), coll.phase(name):
                    path = m.save(step, state)
                    m.wait()
                dt = time.perf_counter() - t0
                per_save.append({"ops": categorise(store.of(name)), "methods": store.of(name),
                                 "collectives": coll.of(name), "wall_s": dt})
            snap = _snapshot(state)
            m.close()
            last = path
            # resume into a fresh model: every value must come back bit-exact
            model2, opt2, sched2 = _build(seed=123)
            state2 = {"model": model2, "optimizer": opt2, "scheduler": sched2}
            for _ in range(2):  # a different RNG state than the saved one
                _train(state2, 999)
            r = _manager(folder, keep, resume="latest")  # the newest committed checkpoint: the last save
            rstore = CountingStorage(r.storage)
            r.storage = rstore
            dist.barrier()
            t0 = time.perf_counter()
            rname = f"c{ci}-resume"
            with rstore.phase(rname), coll.phase(rname):
                got_step = r.resume(state2)
            resume_s = time.perf_counter() - t0
            r.close()
            got = _snapshot(state2)
            bad = _diff(got, snap)
            if got_step != step:
                bad.append(f"resumed step {got_step} != {step}")
            mine = {"saves": per_save, "resume": {"ops": categorise(rstore.of(rname)),
                                                  "methods": rstore.of(rname),
                                                  "collectives": coll.of(rname), "wall_s": resume_s},
                    "bad": bad}
            everyone = gather(mine)
            results["configs"].append({"keep": keep, "present": present, "saves": saves, "checkpoint": last,
                                       "ranks": everyone})
            if spec.get("keep_for_reshard") and conf is spec["configs"][-1] and rank == 0:
                import torch

                torch.save(snap, os.path.join(spec["scratch"], "expected.pt"))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        coll.uninstall()
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def _launch(nproc: int, spec: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    tag = spec.get("tag", str(nproc))
    spec_path = os.path.join(workdir, f"spec-{tag}.json")
    out_path = os.path.join(workdir, f"result-{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = torchrun(nproc, "scale_jobs", "worker", spec_path, out_path)
    env = child_env(ROLL_CKPT_QUIET="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    log_path = os.path.join(workdir, f"job-{tag}.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the agent and every worker it started: the group is this job's own
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}"
        return {"world_size": nproc, "error": f"{why}: {tail}", "wall_s": wall}
    with open(out_path) as f:
        res = json.load(f)
    res["wall_s"] = wall
    return res


def _per_role(ranks: list[dict[str, Any]], pick: Any) -> dict[str, Any]:
    """``pick(rank_result)`` for the coordinator and the max over the other ranks."""
    co = pick(ranks[0])
    others = [pick(r) for r in ranks[1:]]
    return {"coordinator": co, "others_max": max(others) if others else None}


def summarise(jobs: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """Per job and configuration: ops and collective bytes per rank per save (first save;
    later saves) and per resume; T14's figures."""
    rows = []
    bad: list[str] = []
    steady: dict[tuple, set] = {}
    listed_growth = []
    for job in jobs:
        if job.get("error"):
            bad.append(f"{job['world_size']} process(es): {job['error'][:300]}")
            continue
        ws = job["world_size"]
        for conf in job["configs"]:
            ranks = conf["ranks"]
            for r, rk in enumerate(ranks):
                if rk["bad"]:
                    bad.append(f"{ws} processes, keep {conf['keep']}, {conf['present']} present, rank {r}: "
                               f"resume not exact: {rk['bad'][:5]}")
            n_saves = len(ranks[0]["saves"])
            row = {"world_size": ws, "keep": conf["keep"], "present": conf["present"], "saves": n_saves}
            for label, idx in (("first", [0]), ("later", list(range(1, n_saves)))):
                if not idx:
                    continue
                row[f"{label}_ops"] = _per_role(ranks, lambda rk: max(rk["saves"][i]["ops"]["total"] for i in idx))
                row[f"{label}_ops_by_kind"] = {
                    "coordinator": ranks[0]["saves"][idx[-1]]["ops"],
                    "other": ranks[-1]["saves"][idx[-1]]["ops"] if ws > 1 else None}
                row[f"{label}_entries_listed"] = _per_role(
                    ranks, lambda rk: max(rk["saves"][i]["methods"].get("entries_listed", 0) for i in idx))
                row[f"{label}_sent"] = _per_role(
                    ranks, lambda rk: max(rk["saves"][i]["collectives"].get("sent", 0) for i in idx))
                row[f"{label}_received"] = _per_role(
                    ranks, lambda rk: max(rk["saves"][i]["collectives"].get("received", 0) for i in idx))
                row[f"{label}_calls"] = _per_role(
                    ranks, lambda rk: max(rk["saves"][i]["collectives"].get("calls", 0) for i in idx))
            row["resume_ops"] = _per_role(ranks, lambda rk: rk["resume"]["ops"]["total"])
            row["resume_reads"] = _per_role(ranks, lambda rk: rk["resume"]["ops"].get("reads", 0))
            row["resume_sent"] = _per_role(ranks, lambda rk: rk["resume"]["collectives"].get("sent", 0))
            row["resume_received"] = _per_role(ranks, lambda rk: rk["resume"]["collectives"].get("received", 0))
            row["exact"] = not any(rk["bad"] for rk in ranks)
            rows.append(row)
            key = row.get("later_ops") or row.get("first_ops")
            steady.setdefault((conf["keep"], "coordinator"), set()).add(key["coordinator"])
            if key["others_max"] is not None:
                steady.setdefault((conf["keep"], "other"), set()).add(key["others_max"])
            le = row.get("later_entries_listed") or row.get("first_entries_listed")
            listed_growth.append((conf["keep"], conf["present"], ws, le["coordinator"]))
    reshards = [j["reshard"] for j in jobs if j.get("reshard")]
    for reshard in reshards:
        for r, rk in enumerate(reshard["ranks"]):
            if rk["bad"]:
                bad.append(f"reshard {reshard['from']} -> {reshard['to']}, rank {r}: not exact: {rk['bad'][:5]}")
    all_ops = [v for s in steady.values() for v in s]
    # listings must not grow with the checkpoints present (same keep, same N)
    grow = {}
    for keep, present, ws, n in listed_growth:
        grow.setdefault((keep, ws), {})[present] = n
    listing_grows = any(len(set(v.values())) > 1 for v in grow.values())
    independent = bool(steady) and all(len(s) == 1 for s in steady.values()) and not listing_grows
    return {"rows": rows, "max_ops_per_rank_save": max(all_ops) if all_ops else None, "limit": limit,
            "independent": independent, "listing_grows_with_present": listing_grows,
            "steady_ops": {f"keep {k} {role}": sorted(s) for (k, role), s in steady.items()},
            "worlds": sorted({j["world_size"] for j in jobs if not j.get("error")}),
            "reshard": [{"from": rs["from"], "to": rs["to"], "exact": not any(rk["bad"] for rk in rs["ranks"]),
                         "resume_ops": _per_role(rs["ranks"], lambda rk: rk["ops"]["total"]),
                         "resume_reads": _per_role(rs["ranks"], lambda rk: rk["ops"].get("reads", 0)),
                         "resume_received": _per_role(rs["ranks"], lambda rk: rk["collectives"].get("received", 0))}
                        for rs in reshards],
            "problems": bad,
            "by_job": {f"{r['world_size']}p keep{r['keep']} present{r['present']}": (r.get("later_ops") or r["first_ops"])
                       for r in rows}}


def run_all(cfg: dict[str, Any], outdir: str, timeout: float | None = None) -> dict[str, Any]:
    """Every job of ``cfg`` (``worlds``, ``keeps`` [(K, E)...], ``saves``, ``reshard`` (N, M));
    scratch under ``outdir``, removed at the end."""
    outdir = os.path.abspath(outdir)  # the jobs run from the repository root
    os.makedirs(outdir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".scale-jobs-", dir=outdir)
    jobs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        src, dst = cfg.get("reshard") or (None, None)
        for ws in cfg["worlds"]:
            spec = {"scratch": os.path.join(scratch, f"w{ws}"), "saves": cfg["saves"],
                    "configs": [{"keep": k, "present": e} for k, e in cfg["keeps"]],
                    "keep_for_reshard": ws == src}
            os.makedirs(spec["scratch"], exist_ok=True)
            # generous: these machines are shared; a stuck job is killed, not waited for
            limit = timeout or (120 + 40 * ws + 15 * sum(cfg["saves"] + e + 2 for _, e in cfg["keeps"]))
            print(f"[scale-jobs] {ws} process(es), {len(spec['configs'])} configuration(s) x {cfg['saves']} saves",
                  flush=True)
            res = _launch(ws, spec, scratch, limit)
            print(f"[scale-jobs]   {res['wall_s']:.1f} s" + (f", FAILED: {res['error'][-400:]}" if res.get("error")
                                                            else ""), flush=True)
            jobs.append(res)
        if src and dst:
            job = next((j for j in jobs if j["world_size"] == src and not j.get("error")), None)
            if job is not None:
                last = job["configs"][-1]
                spec = {"tag": f"reshard-{src}-{dst}", "scratch": os.path.join(scratch, f"w{src}"), "saves": 0,
                        "configs": [], "load_only": last["checkpoint"],
                        "folder": os.path.dirname(last["checkpoint"]), "from_world": src,
                        "expected": os.path.join(scratch, f"w{src}", "expected.pt")}
                print(f"[scale-jobs] resharding {src} -> {dst}", flush=True)
                res = _launch(dst, spec, scratch, timeout or (120 + 40 * dst))
                print(f"[scale-jobs]   {res['wall_s']:.1f} s" + (f", FAILED: {res['error'][-400:]}"
                                                                if res.get("error") else ""), flush=True)
                res["configs"] = []
                jobs.append(res)
        if cfg.get("s3"):
            jobs_s3 = run_s3(scratch)
        else:
            jobs_s3 = None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarise(jobs, OPS_LIMIT)
    return {"jobs": jobs, "summary": summary, "s3": jobs_s3, "wall_s": time.perf_counter() - t0,
            "config": {k: v for k, v in cfg.items()}}


# ----------------------------------------------------------------------------- S3


def run_s3(scratch: str, saves: int = 3) -> dict[str, Any]:
    """One process, saves and a resume over S3 (SeaweedFS from the tests' helper), counting
    HTTP requests by kind. Returns ``{"error": ...}`` when no server can be started."""
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    use_test_helpers()
    try:
        from backend_fs import s3server  # the tests' throwaway SeaweedFS server
    except ImportError as exc:
        return {"error": f"no S3 server helper: {exc}"}
    from pathlib import Path

    try:
        with s3server.seaweed(Path(scratch) / "s3") as server:
            return _s3_job(server, saves)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal for the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _s3_job(server: Any, saves: int) -> dict[str, Any]:
    import torch

    from .opcount import CountingStorage, S3Requests, categorise
    from roll_ckpt import CheckpointManager, load_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    url = f"s3://{server.bucket}/scale-{os.getpid()}-{int(time.time())}"
    out: dict[str, Any] = {"saves": []}

    def manager(resume: str | None = None) -> Any:
        cfg: dict[str, Any] = {"checkpoint_config": {"output_dir": url, "timestamp_subdir": False,
                                                     "max_ckpt_to_keep": 2,
                                                     "storage_options": server.storage_options}}
        if resume:
            cfg["resume_from_checkpoint"] = resume
        return CheckpointManager.from_config(load_config(cfg), quiet=True)

    m = manager()
    store = CountingStorage(m.storage)
    m.storage = store
    http = S3Requests(store.inner.fs).hook()
    for i in range(saves):
        with store.phase(f"save-{i}"), http.phase(f"save-{i}"):
            m.save(i + 1, state)
        out["saves"].append({"ops": categorise(store.of(f"save-{i}")), "http": http.of(f"save-{i}")})
    m.close()
    r = manager(resume="latest")  # the newest committed checkpoint under the URL: the last save
    rstore = CountingStorage(r.storage)
    r.storage = rstore
    rhttp = S3Requests(rstore.inner.fs).hook()
    with rstore.phase("resume"), rhttp.phase("resume"):
        r.resume(state)
    r.close()
    out["resume"] = {"ops": categorise(rstore.of("resume")), "http": rhttp.of("resume")}
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "worker":
        worker(argv[1], argv[2])
        sys.stdout.flush()
        os._exit(0)  # see tests/helpers/launch.exit_worker: skip interpreter exit after gloo
    p = argparse.ArgumentParser(prog="python -m bench.scale_jobs", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--reshard", default="4,2")
    p.add_argument("--keeps", default="0:0,2:0,1:10", help="K:E pairs (max_ckpt_to_keep : earlier checkpoints)")
    p.add_argument("--s3", action="store_true")
    p.add_argument("--out", default=RESULTS, help="where the jobs' scratch folder goes")
    p.add_argument("--json", default=None, help="write every job's result and the summary here")
    args = p.parse_args(argv)
    cfg = {"worlds": [int(x) for x in args.worlds.split(",")], "saves": args.saves,
           "reshard": tuple(int(x) for x in args.reshard.split(",")) if args.reshard else None,
           "keeps": [tuple(int(y) for y in x.split(":")) for x in args.keeps.split(",")], "s3": args.s3}
    res = run_all(cfg, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))
    if res.get("s3"):
        print(json.dumps(res["s3"], indent=1))
    return 0 if not res["summary"]["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
