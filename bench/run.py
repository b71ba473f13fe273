"""roll-ckpt benchmark: stall, memory and throughput against DCP, torch.save and the disk.

    python bench/run.py [--smoke|--quick|--full] [--check] [--device cpu|cuda] [--out DIR]

Everything is measured in one run, side by side: the machine's limits (durable write,
uncached read, memcpy) are cases of the same alternation as the checkpoint cases. Each
case runs ``reps`` times on the same FSDP2 + AdamW state, in alternating order; the
report shows medians. Writes DIR/latest.json, DIR/latest.md and DIR/latest.png (default
DIR: bench/results). ``--check`` exits 1 when a target fails.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import median  # noqa: E402

MB = 1 << 20

# The cases of each group; the limits run inside the alternation of the "target" group.
LIMITS = ["limit_write", "limit_write2", "limit_read", "limit_read2", "limit_memcpy", "limit_memcpy_fresh"]
# Loads sit between saves, never next to each other: a load right after another one ran
# measurably slower here (whichever came second), and the alternation would then favour
# one of them.
TARGET_CASES = ["dcp_async", "rc_load", "rc_async_zc_all", "dcp_save", "dcp_load", "rc_save", "rc_save_t1"]
ALL_CASES = ["torch_save", "rc_load", "dcp_save", "dcp_async", "dcp_async_stager", "rc_save", "dcp_load",
             "rc_async", "rc_async_zc_model", "rc_async_zc_all", "rc_dedup"]

# width x depth of Linear(width, width, bias=False) layers; with AdamW the state is 3 x params.
MODES: dict[str, dict[str, Any]] = {
    # T1/T2 need >= 512 MiB in the store: 11 x 2048^2 x 4 B x 3 = 528 MiB over 2 ranks.
    # 4 repetitions: with the order reversed every other one, each case runs as often
    # before as after its neighbours.
    "quick": {"reps": 4, "target": (2048, 11), "small": (2048, 2), "warmup": False},
    "full": {"reps": 6, "target": (4096, 11), "small": (2048, 11), "warmup": True},
    # Every case once, in one 2-rank group: checks the harness end to end, not the speed.
    "smoke": {"reps": 1, "target": (256, 2), "small": (256, 2), "warmup": False, "one_group": True,
              "ranks": "2"},
}


def machine(scratch: str, device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "device": device,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / (1 << 30), 1)
    except ImportError:
        pass
    try:
        out = subprocess.run(["df", "-T", "-h", scratch], capture_output=True, text=True).stdout.splitlines()[-1].split()
        info["disk"] = f"{out[0]} ({out[1]}, {out[2]})"
    except (OSError, IndexError):
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    return info


def run_worker(nproc: int, spec: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    spec_path = os.path.join(workdir, f"spec-{nproc}.json")
    out_path = os.path.join(workdir, f"result-{nproc}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "worker.py"), spec_path, out_path]
    env = dict(os.environ, ROLL_CKPT_QUIET="1", PYTHONWARNINGS="ignore")
    log_path = os.path.join(workdir, f"worker-{nproc}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env=env)
        tail: list[str] = []
        assert proc.stderr is not None
        deadline = time.monotonic() + timeout
        for line in proc.stderr:  # progress lines are shown as they come
            if line.startswith("[worker"):
                print(line.rstrip(), flush=True)
            else:
                tail = (tail + [line])[-200:]
            if time.monotonic() > deadline:
                proc.kill()
        rc = proc.wait()
    if rc != 0 or not os.path.exists(out_path):
        with open(log_path) as f:
            sys.stderr.write(f.read()[-4000:])
        sys.stderr.write("".join(tail)[-8000:])
        raise SystemExit(f"benchmark worker on {nproc} rank(s) failed (exit {rc})")
    with open(out_path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- summarising


def summarise(group: dict[str, Any], name: str, case: dict[str, Any]) -> dict[str, Any]:
    reps = case["reps"]
    row: dict[str, Any] = {"group": group["name"], "ranks": group["world_size"], "case": name,
                           "title": case["title"], "kind": case["kind"], "reps": len(reps)}
    if case["kind"] == "limit":
        rates = [r["ranks"][0]["rate"] for r in reps]
        row.update(gbps=median(rates) / 1e9, method=reps[0]["ranks"][0].get("method", ""),
                   bytes=reps[0]["ranks"][0].get("nbytes", 0), raw_gbps=[x / 1e9 for x in rates])
        return row
    per_rep = []
    for r in reps:
        ranks = r["ranks"]
        blocked = max(x["blocked_s"] for x in ranks)
        durable = max(x["durable_s"] for x in ranks)
        frac = max(x["extra_rss"] / x["state_bytes"] if x["state_bytes"] else 0.0 for x in ranks)
        hash_frac = max((x.get("hash_s") or 0.0) / x["durable_s"] if x["durable_s"] else 0.0 for x in ranks)
        staged = [x["staged_s"] for x in ranks if x.get("staged_s") is not None]
        per_rep.append({
            "blocked_s": blocked, "durable_s": durable, "bytes": r["bytes"],
            "gbps": r["bytes"] / durable / 1e9 if durable else None,
            "extra_rss": max(x["extra_rss"] for x in ranks), "extra_rss_frac": frac,
            "copied": sum(x.get("copied") or 0 for x in ranks), "hash_frac": hash_frac,
            "staged_s": max(staged) if staged else None,
            "policies": ranks[0].get("policies"),
        })
    for key in ("blocked_s", "durable_s", "bytes", "gbps", "extra_rss", "extra_rss_frac", "copied", "hash_frac",
                "staged_s"):
        row[key] = median([p[key] for p in per_rep])
    row["state_bytes"] = sum(x["state_bytes"] for x in reps[0]["ranks"])
    row["policies"] = per_rep[0]["policies"]
    row["raw"] = per_rep
    return row


def find(rows: list[dict[str, Any]], group: str, case: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["group"] == group and r["case"] == case), None)


def targets(rows: list[dict[str, Any]], limits: dict[str, Any]) -> dict[str, Any]:
    g = "target"
    zc, da = find(rows, g, "rc_async_zc_all"), find(rows, g, "dcp_async")
    rs, ds = find(rows, g, "rc_save"), find(rows, g, "dcp_save")
    rl, dl = find(rows, g, "rc_load"), find(rows, g, "dcp_load")
    out: dict[str, Any] = {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def entry(value: float | None, limit: float, le: bool, what: str, **more: Any) -> dict[str, Any]:
        ok = value is not None and (value <= limit if le else value >= limit)
        return {"value": value, "limit": limit, "pass": bool(ok), "op": "<=" if le else ">=", "what": what, **more}

    out["T1"] = entry(ratio(zc and zc["blocked_s"], da and da["blocked_s"]), 0.10, True,
                      "blocking time: zero-copy async save (model + AdamW in the store) / dcp.async_save default staging",
                      ours_s=zc and zc["blocked_s"], dcp_s=da and da["blocked_s"],
                      state_mib=zc and zc["state_bytes"] / MB)
    out["T2"] = entry(zc and zc["extra_rss_frac"], 0.05, True,
                      "extra peak RSS during that save / the rank's checkpointed bytes (max over ranks)",
                      dcp_async_default=da and da["extra_rss_frac"])
    disk = max(filter(None, [limits.get("disk_write_gbps"), limits.get("disk_write2_gbps")]), default=None)
    v_disk = ratio(rs and rs["gbps"], disk)
    v_dcp = ratio(rs and rs["gbps"], ds and ds["gbps"])
    t3 = entry(v_disk, 0.8, False, "durable write GB/s of roll-ckpt sync save / best fdatasync write GB/s "
               "(1 or 2 files at once); and / dcp.save default",
               ours_gbps=rs and rs["gbps"], disk_gbps=disk, dcp_gbps=ds and ds["gbps"],
               vs_dcp={"value": v_dcp, "limit": 1.0, "pass": v_dcp is not None and v_dcp >= 1.0})
    t3["pass"] = t3["pass"] and t3["vs_dcp"]["pass"]
    out["T3"] = t3
    read = max(filter(None, [limits.get("disk_read_gbps"), limits.get("disk_read2_gbps")]), default=None)
    out["T4"] = entry(ratio(rl and rl["gbps"], dl and dl["gbps"]), 1.0, False,
                      "load GB/s of roll-ckpt resume (checksums verified) / dcp.load of the same checkpoint, cold cache",
                      ours_gbps=rl and rl["gbps"], dcp_gbps=dl and dl["gbps"], disk_read_gbps=read,
                      vs_disk_read=ratio(rl and rl["gbps"], read))
    out["T5"] = entry(rs and rs["hash_frac"], 0.25, True,
                      "seconds spent hashing (xxh3-128, while writing) / seconds of the sync save (max over ranks)")
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick", help="(default) <= 3 min on 2 cores, 4 repetitions")
    size.add_argument("--full", action="store_const", dest="mode", const="full", help="larger states (2.2 GB), 6 repetitions")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="a few MB, 1 repetition")
    p.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--scratch", default=None, help="where checkpoints are written (default: next to --out)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--ranks", default=None, help="world sizes to run (default 2,1)")
    p.add_argument("--groups", default="small,target", help="state groups to run (small, target)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    reps = args.reps or cfg["reps"]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    os.makedirs(args.out, exist_ok=True)
    scratch_parent = args.scratch or args.out
    os.makedirs(scratch_parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".scratch-", dir=scratch_parent)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    limits: dict[str, Any] = {}
    invariants: list[str] = []
    try:
        ranks = [int(x) for x in (args.ranks or cfg.get("ranks", "2,1")).split(",") if x]
        if args.device == "cuda":
            import torch

            ranks = [min(r, torch.cuda.device_count()) for r in ranks]
            ranks = sorted(set(ranks), reverse=True)
        # Without a warm-up round the first repetition pays for first calls (thread pools,
        # DCP's caches, staging buffers); the median of 4 repetitions discards it.
        warm = cfg.get("warmup", True)
        for nproc in ranks:
            # The small group runs first and warms every code path (thread pools, DCP's caches,
            # process groups); the target group then needs no warm-up round of its own.
            wanted = set(args.groups.split(","))
            w, d = cfg["small"]
            groups = []
            if cfg.get("one_group"):
                wanted = set()
                w, d = cfg["target"]
                cases = list(dict.fromkeys(TARGET_CASES + ALL_CASES + LIMITS))
                groups.append({"name": "target", "width": w, "depth": d, "reps": reps, "warmup": False,
                               "cases": cases})
            if "small" in wanted:
                groups.append({"name": "small", "width": w, "depth": d, "reps": reps, "warmup": warm,
                               "cases": ALL_CASES})
            if nproc == max(ranks) and "target" in wanted:
                w, d = cfg["target"]
                groups.append({"name": "target", "width": w, "depth": d, "reps": reps,
                               "warmup": warm and "small" not in wanted,
                               "cases": TARGET_CASES + LIMITS})
            if not groups:
                continue
            spec = {"device": args.device, "scratch": os.path.join(scratch, f"r{nproc}"), "groups": groups}
            print(f"[bench] {mode}: {nproc} rank(s), groups {[g['name'] for g in groups]}, {reps} rep(s)", flush=True)
            res = run_worker(nproc, spec, scratch, timeout=1800)
            for group in res["groups"]:
                invariants += group.get("invariants", [])
                for name, case in group["cases"].items():
                    row = summarise(group, name, case)
                    if group["world_size"] == 1:
                        row["group"] = "small-1"
                    rows.append(row)
        for key, case in (("disk_write_gbps", "limit_write"), ("disk_write2_gbps", "limit_write2"),
                          ("disk_read_gbps", "limit_read"), ("disk_read2_gbps", "limit_read2"),
                          ("memcpy_gbps", "limit_memcpy"),
                          ("memcpy_fresh_gbps", "limit_memcpy_fresh")):
            r = find(rows, "target", case)
            if r is not None:
                limits[key] = r["gbps"]
                limits[key.replace("_gbps", "_method")] = r.get("method")
                limits["bytes"] = r.get("bytes")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tg = targets(rows, limits)
    result = {
        "schema": 1, "mode": mode, "reps": reps, "device": args.device,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "machine": machine(scratch_parent, args.device), "limits": limits,
        "cases": [r for r in rows if r["kind"] != "limit"], "targets": tg,
        "invariants": sorted(set(invariants)),
        "all_pass": all(t["pass"] for t in tg.values()) and not invariants,
    }
    from report import markdown, plot

    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(md)
    if not args.no_plot:
        plot(result, os.path.join(args.out, "latest.png"))
    print(md)
    for k, t in tg.items():
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{k}: {'PASS' if t['pass'] else 'FAIL'}  {v} {t['op']} {t['limit']}  ({t['what']})")
    for problem in result["invariants"]:
        print(f"INVARIANT BROKEN: {problem}")
    print(f"[bench] {result['duration_s']} s; wrote {args.out}/latest.{{json,md,png}}")
    return 1 if args.check and not result["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
