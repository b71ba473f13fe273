#!/usr/bin/env python3
"""roll-ckpt-roll against the real ROLL (not the CI test double), on CPU. See README.md.

    ROLL_SOURCE=/path/to/ROLL ROLL_PYTHON=/path/to/venv/bin/python \\
        python3 scripts/roll_source_check/check.py [--only a,b,c,d] [--workdir DIR] [--json FILE]

Scenarios (one PASS/FAIL line each, then the facts):
  a  ROLL writes, roll-ckpt resumes: ROLL's own checkpoints (integration off) resumed by plain
     roll-ckpt into ROLL's real FSDP2TrainStrategy, bit-for-bit (Adam state included), resharded to
     1 process; ``latest``; the pipeline part; ``roll-ckpt ls/verify/inspect``.
  b  roll-ckpt inside ROLL: roll_ckpt_roll.enable(); the tree; ``roll-ckpt verify``; a fresh Ray
     session with resume_from_checkpoint: true continues bit-for-bit.
  c  no lock-in: ``roll-ckpt export --format roll``; ROLL's own load_checkpoint (integration off).
  d  preemption: SIGTERM to the driver, then to one worker actor; the resume continues.

Only the standard library here: it runs every piece under ROLL_PYTHON in a process of its own,
in a session of its own, bounded by a timeout, and afterwards kills by pid every process that
still carries that run's token in its environment (Ray's raylet, GCS and workers included).
Exit status 0 when every scenario run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")
FIELDS = ("params", "opt", "sched", "lr", "rng")


# ----------------------------------------------------------------------------------------- processes


class Runner:
    def __init__(self, workdir: str, roll_source: str, roll_python: str, verbose: bool) -> None:
        self.workdir = workdir
        self.roll_source = roll_source
        self.python = roll_python
        self.verbose = verbose
        self.tokens: list[str] = []
        self.killed: list[tuple[str, int]] = []

    def env(self, token: str) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([self.roll_source, HERE] + [p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p])
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RSC_TOKEN=token, RAY_DEDUP_LOGS="1",
                   TOKENIZERS_PARALLELISM="false")
        return env

    def start(self, name: str, argv: list[str]) -> tuple[subprocess.Popen, str, str]:
        token = f"{name}-{uuid.uuid4().hex[:12]}"
        self.tokens.append(token)
        log = os.path.join(self.workdir, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(token), cwd=self.workdir,
                                    start_new_session=True)
        return proc, token, log

    def finish(self, proc: subprocess.Popen, token: str, timeout: float) -> tuple[int | None, bool]:
        """Wait for ``proc`` (``timeout`` seconds from now), then sweep its token. (rc, timed_out)."""
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.sweep(token)
        return proc.returncode, timed_out

    def run(self, name: str, args: list[str], timeout: float) -> dict:
        t0 = time.monotonic()
        proc, token, log = self.start(name, [self.python, *args])
        rc, timed_out = self.finish(proc, token, timeout)
        out = {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1), "log": log}
        if self.verbose or rc != 0:
            out["tail"] = tail(log)
        return out

    def sweep(self, token: str, grace: float = 5.0) -> list[int]:
        """Kill, by pid, every process whose environment carries ``token`` (the run's leftovers)."""
        found = pids_with(token)
        for pid in found:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p) for p in found):
            time.sleep(0.2)
        for pid in found:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.killed.extend((token, p) for p in found)
        return found

    def sweep_all(self) -> None:
        for token in self.tokens:
            self.sweep(token, grace=2.0)


def pids_with(token: str) -> list[int]:
    me = os.getpid()
    needle = f"RSC_TOKEN={token}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return "\n".join(ln[:400] for ln in lines[-n:])


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tree(root: str) -> list[str]:
    rows = []
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            rows.append(f"{os.path.getsize(p):>9}  {os.path.relpath(p, root)}")
    return rows


# ----------------------------------------------------------------------------------------- checking


class Scenario:
    current: "Scenario | None" = None

    def __init__(self, key: str, title: str) -> None:
        self.key, self.title = key, title
        self.checks: list[tuple[str, bool, str]] = []
        self.facts: dict = {}
        self.notes: list[str] = []
        self.t0 = time.monotonic()
        self.seconds = 0.0
        Scenario.current = self
        print(f"\n=== {key}: {title}", flush=True)

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((what, bool(ok), detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {what}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def fact(self, name: str, value) -> None:
        self.facts[name] = value
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if "\n" in text:
            print(f"  - {name}:\n" + "\n".join(f"      {ln}" for ln in text.splitlines()), flush=True)
        else:
            print(f"  - {name}: {text}", flush=True)

    def step(self, what: str, res: dict) -> bool:
        ok = res["rc"] == 0 and not res["timed_out"]
        self.check(f"{what} (rc {res['rc']}{', TIMED OUT' if res['timed_out'] else ''}, {res['seconds']} s)", ok,
                   "" if ok else f"log {res['log']}\n{res.get('tail', '')}")
        return ok

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def summary(self) -> dict:
        return {"scenario": self.key, "title": self.title, "pass": self.ok, "seconds": self.seconds,
                "checks": [{"what": w, "ok": o, "detail": d} for w, o, d in self.checks], "facts": self.facts,
                "notes": self.notes}


def compare(saved: list[dict], got: list[dict], fields=FIELDS, *, ranks_of_saved=None) -> tuple[bool, str]:
    """Per rank, each field of the digests equal? ``ranks_of_saved``: which saved rank each got rank
    is compared with (resharded loads: the full-tensor digests of rank 0)."""
    parts, ok = [], True
    for i, g in enumerate(got):
        s = saved[ranks_of_saved[i] if ranks_of_saved else i]
        eq = {f: g.get(f) == s.get(f) for f in fields}
        ok &= all(eq.values())
        bad = [f for f, v in eq.items() if not v]
        extra = ""
        for f in bad:
            if isinstance(s.get(f), dict) and isinstance(g.get(f), dict):
                diff = [k for k in s[f] if s[f].get(k) != g[f].get(k)]
                extra += f" {f}: {len(diff)}/{len(s[f])} differ (e.g. {diff[:2]}), {len(g[f])} in the loaded state;"
            else:
                extra += f" {f}: saved {s.get(f)!r} loaded {g.get(f)!r};"
        parts.append(f"rank {i}: " + ("all equal" if not bad else f"DIFFER{extra}") +
                     f" ({len(s['params'])} params, {len(s['opt'])} Adam state tensors)")
    return ok, "; ".join(parts)


def ranks_digests(res_path: str) -> list[dict]:
    r = load(res_path)
    return [r["ranks"][k]["digests"] for k in sorted(r["ranks"], key=int)]


def job_args(workdir: str, ckpt_root: str, result: str, integration: int, max_steps: int, save_steps: int,
             **kw) -> list[str]:
    args = [os.path.join(HERE, "_job.py"), "--workdir", workdir, "--ckpt-root", ckpt_root, "--result", result,
            "--integration", str(integration), "--max-steps", str(max_steps), "--save-steps", str(save_steps)]
    for k, v in kw.items():
        if v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def ranks_args(workdir: str, model: str, cluster: str, world: int, load_kind: str, target: str, result: str,
               root: str | None = None, max_steps: int = 5, prime: int = 0) -> list[str]:
    args = [os.path.join(HERE, "_ranks.py"), "--workdir", workdir, "--model", model, "--cluster", cluster,
            "--world-size", str(world), "--load", load_kind, "--target", target, "--result", result,
            "--max-steps", str(max_steps), "--prime-optimizer", str(prime)]
    return args + (["--root", root] if root else [])


def cli(r: Runner, sc: Scenario, name: str, args: list[str], *, expect_ok: bool = True, gate: bool = True) -> dict:
    res = r.run(f"cli-{name}", ["-m", "roll_ckpt.cli", *args], timeout=180)
    with open(res["log"], errors="replace") as f:
        text = "\n".join(ln for ln in f.read().splitlines() if "UserWarning" not in ln and "return func(" not in ln)
    sc.fact(f"roll-ckpt {' '.join(args)}  (rc {res['rc']})", text.strip())
    if gate:
        sc.check(f"roll-ckpt {args[0]} exits {'0' if expect_ok else 'non-zero'}", (res["rc"] == 0) == expect_ok)
    return res


def driver_state_resume(r: Runner, name: str, root: str, target: str, out: str) -> dict:
    code = ("import json,sys\nfrom roll_ckpt import CheckpointManager, DriverState, load_config\n"
            "m = CheckpointManager(load_config({'checkpoint_config': {'type': 'file_system', 'output_dir': sys.argv[1]}}))\n"
            "d = DriverState(); step = m.resume({'driver': d}, sys.argv[2]); m.close()\n"
            "json.dump({'step': step, 'resumed_from': m.resumed.path, 'state': dict(d)}, open(sys.argv[3], 'w'))\n")
    return r.run(name, ["-c", code, root, target, out], timeout=180)


def losses(state: dict) -> dict:
    return {k: v for k, v in (state["log_history"][-1] if state["log_history"] else {}).items()
            if "loss" in k or k.endswith("/lr")}


# ----------------------------------------------------------------------------------------- scenarios


def scenario_a(r: Runner, ctx: dict) -> Scenario:
    sc = Scenario("a", "ROLL writes (integration off), roll-ckpt resumes")
    w = os.path.join(r.workdir, "a")
    root, result = os.path.join(w, "ckpt"), os.path.join(w, "job.json")
    res = r.run("a-job", job_args(w, root, result, 0, max_steps=5, save_steps=1, stop_after=2), timeout=480)
    if not sc.step("ROLL pipeline on Ray (actor_train 2 + critic 2 + driver), ROLL's own do_checkpoint, steps 0..2",
                   res):
        return sc
    job = load(result)
    run_dir = job["checkpoint_output_dir"]
    ck = os.path.join(run_dir, "checkpoint-2")
    sc.fact("job timings (s)", {"init": job["init_s"], "total": job["seconds"],
                                "do_checkpoint": {k: v.get("do_checkpoint_s") for k, v in job["steps"].items()}})
    sc.check("ROLL's uploads finished (no staging folder left)", job.get("roll_staging_left") == [],
             str(job.get("roll_staging_left")))
    sc.check("ROLL's layout: checkpoint-1 and checkpoint-2 under output_dir/<launch timestamp>/",
             all(os.path.isdir(os.path.join(run_dir, f"checkpoint-{n}")) for n in (1, 2)), run_dir)
    sc.fact(f"tree of {ck}", "\n".join(tree(ck)))
    saved = job["steps"]["2"]["digests"]
    model = os.path.join(w, "tiny_llama")

    res = r.run("a-actor-2", ranks_args(os.path.join(w, "r_actor2"), model, "actor_train", 2, "roll-ckpt", "latest",
                                        os.path.join(w, "actor2.json"), root=root), timeout=300)
    if sc.step("actor_train: plain roll-ckpt resume('latest') into ROLL's FSDP2TrainStrategy, 2 gloo processes", res):
        rr = load(os.path.join(w, "actor2.json"))["ranks"]
        sc.check("'latest' over output_dir resolves to checkpoint-2, resume returns 2",
                 all(v.get("latest_resolves_to") == ck and v.get("resumed_step") == 2 for v in rr.values()),
                 str({k: (v.get("latest_resolves_to"), v.get("resumed_step")) for k, v in rr.items()}))
        ok, detail = compare(saved["actor_train"], ranks_digests(os.path.join(w, "actor2.json")))
        sc.check("actor_train bit-equal to the state ROLL saved (params, Adam state, scheduler, lr, RNG)", ok, detail)
        sc.fact("actor_train resume seconds", {k: v["load_s"] for k, v in rr.items()})

    res = r.run("a-critic-2", ranks_args(os.path.join(w, "r_critic2"), model, "critic", 2, "roll-ckpt",
                                         os.path.join(ck, "critic"), os.path.join(w, "critic2.json"), root=root),
                timeout=300)
    if sc.step("critic: plain roll-ckpt resume(<checkpoint-2>/critic), 2 gloo processes", res):
        ok, detail = compare(saved["critic"], ranks_digests(os.path.join(w, "critic2.json")))
        sc.check("critic bit-equal to the state ROLL saved (params, Adam state, scheduler, lr, RNG)", ok, detail)

    res = r.run("a-actor-1", ranks_args(os.path.join(w, "r_actor1"), model, "actor_train", 1, "roll-ckpt", ck,
                                        os.path.join(w, "actor1.json"), root=root), timeout=300)
    if sc.step("actor_train resharded: the 2-rank checkpoint resumed into 1 process", res):
        ok, detail = compare(saved["actor_train"], ranks_digests(os.path.join(w, "actor1.json")),
                             ranks_of_saved=[0])
        sc.check("1-process actor_train bit-equal to the 2-rank saved state (full tensors)", ok, detail)

    res = driver_state_resume(r, "a-pipeline", root, os.path.join(ck, "pipeline"), os.path.join(w, "pipeline.json"))
    if sc.step("pipeline part: plain roll-ckpt resume({'driver': DriverState()}, <checkpoint-2>/pipeline)", res):
        got = load(os.path.join(w, "pipeline.json"))
        sc.check("driver state equals ROLL's WorkerState after do_checkpoint(2) (step, log_history, kv)",
                 got["state"] == job["steps"]["2"]["state_after_checkpoint"] and got["step"] == 2,
                 f"step {got['state'].get('step')}, {len(got['state'].get('log_history', []))} logged steps, "
                 f"kv {sorted(got['state'].get('kv', {}))}")

    # the contrast: what ROLL's own load_checkpoint restores of the same checkpoint
    res = r.run("a-roll-own-load", ranks_args(os.path.join(w, "r_rollown"), model, "actor_train", 2, "roll", ck,
                                              os.path.join(w, "rollown.json")), timeout=300)
    if res["rc"] == 0:
        got = ranks_digests(os.path.join(w, "rollown.json"))
        eq = [{f: g[f] == s[f] for f in FIELDS} | {"n_opt_state": g["n_opt_state"]}
              for g, s in zip(got, saved["actor_train"])]
        sc.fact("for contrast, ROLL's own FSDP2TrainStrategy.load_checkpoint(<checkpoint-2>) restores", eq)
    else:
        sc.fact("for contrast, ROLL's own load_checkpoint failed", res.get("tail", ""))

    cli(r, sc, "a-ls", ["ls", root])
    cli(r, sc, "a-verify", ["verify", ck])
    cli(r, sc, "a-inspect", ["inspect", ck])
    cli(r, sc, "a-verify-part", ["verify", os.path.join(ck, "critic")], gate=False)
    return sc


def scenario_b(r: Runner, ctx: dict) -> Scenario:
    sc = Scenario("b", "roll-ckpt inside ROLL (roll_ckpt_roll.enable()), then resume_from_checkpoint: true")
    w = os.path.join(r.workdir, "b")
    root = os.path.join(w, "ckpt")
    result1, result2 = os.path.join(w, "job1.json"), os.path.join(w, "job2.json")
    res = r.run("b-job1", job_args(os.path.join(w, "launch1"), root, result1, 1, max_steps=5, save_steps=2,
                                   stop_after=3, wait_commit=2), timeout=480)
    if not sc.step("launch 1: ROLL pipeline with roll-ckpt, steps 0..3 (save_steps 2: step 2 saved), then ends", res):
        return sc
    job = load(result1)
    run_dir = job["checkpoint_output_dir"]
    ck = os.path.join(run_dir, "checkpoint-2")
    facts = job["integration_facts"]
    sc.check("the worker actors run roll-ckpt's save_checkpoint (worker_process_setup_hook)",
             all(f["save_checkpoint"] == "roll_ckpt_roll.patches.save_checkpoint" and f["manager"]
                 for fs in facts.values() for f in fs), json.dumps(facts))
    sc.fact("ray runtime_env of the job", job.get("ray_runtime_env"))
    sc.fact(f"Ray {job.get('ray_version')}: ActorHandle.__ray_call__", {"exists": job.get("actor_handle_has___ray_call__"),
                                                                        "call returned": job.get("__ray_call___works")})
    sc.fact("launch 1 timings (s)", {"init": job["init_s"], "total": job["seconds"],
                                     "do_checkpoint": {k: v.get("do_checkpoint_s") for k, v in job["steps"].items()}})
    sc.fact("step 2 committed when run() returned (async save; else waited for)", job.get("committed_when_run_returned"))
    listing = tree(ck)
    sc.fact(f"tree of {ck}", "\n".join(listing))
    names = {ln.split(None, 1)[1] for ln in listing}
    sc.check("checkpoint-2/{actor_train,critic,pipeline}/manifest.json and checkpoint-2/manifest.json",
             all(f"{p}/manifest.json" in names for p in ("actor_train", "critic", "pipeline")) and "manifest.json" in names)
    sc.check("HF files published at checkpoint-2/ (" + ", ".join(HF_FILES) + ")", all(f in names for f in HF_FILES))
    sc.check("the critic's HF files stay in critic/ (none of its own at the step)", "critic/model.safetensors" in names)
    staged = [d for d in os.listdir(os.path.join(w, "launch1", "output")) if d != "logs"] \
        if os.path.isdir(os.path.join(w, "launch1", "output")) else []
    sc.check("nothing in ROLL's local staging folder (output_dir/<worker>/checkpoint-N)", not staged, str(staged))
    log_keys = sorted(k for k in job["steps"]["2"]["state_after_checkpoint"]["log_history"][-1] if k.startswith("time/"))
    sc.check("patched do_checkpoint: DataProto.materialize_concat + reduce_metrics merged the workers' metrics",
             any("do_checkpoint/dcp_save" in k for k in log_keys), str(log_keys))
    cli(r, sc, "b-verify", ["verify", ck])

    res = r.run("b-job2", job_args(os.path.join(w, "launch2"), root, result2, 1, max_steps=5, save_steps=2,
                                   resume="true"), timeout=480)
    if not sc.step("launch 2: fresh Ray session, resume_from_checkpoint: true, runs to max_steps", res):
        return sc
    job2 = load(result2)
    sc.check("resume_from_checkpoint: true resolved to launch 1's checkpoint-2",
             job2["resume_from_checkpoint"]["pipeline.resume_from_checkpoint"] == ck,
             str(job2["resume_from_checkpoint"]))
    sc.check("pipeline WorkerState (step, log_history, kv) equals the one saved",
             job2["state_after_init"] == job["steps"]["2"]["state_after_checkpoint"],
             f"step {job2['state_after_init']['step']}, {len(job2['state_after_init']['log_history'])} logged steps")
    for cl in ("actor_train", "critic"):
        ok, detail = compare(job["steps"]["2"]["digests"][cl], job2["digests_after_init"][cl])
        sc.check(f"{cl} after initialize() bit-equal to its state at save (params, Adam state, scheduler, lr, RNG)",
                 ok, detail)
        ok, detail = compare(job["steps"]["3"]["digests"][cl], job2["steps"]["3"]["digests"][cl])
        sc.check(f"{cl} after the resumed step 3 bit-equal to launch 1's step 3", ok, detail)
    sc.check("step 3 losses and lr equal to launch 1's",
             losses(job["steps"]["3"]["state_after_checkpoint"]) == losses(job2["steps"]["3"]["state_after_checkpoint"]),
             json.dumps(losses(job2["steps"]["3"]["state_after_checkpoint"]))[:300])
    ran = sorted(int(k) for k in job2["steps"])
    sc.check("launch 2 trained exactly steps 3..4", ran == [3, 4], str(ran))
    final = os.path.join(job2["checkpoint_output_dir"], "checkpoint-4")
    sc.check("the final step (4, synchronous) committed in launch 2's folder",
             os.path.isfile(os.path.join(final, "manifest.json")), final)
    sc.fact("launch 2 timings (s)", {"init (includes the resume)": job2["init_s"], "total": job2["seconds"]})
    cli(r, sc, "b-ls", ["ls", root])
    ctx["b"] = {"final": final, "job2": result2, "model": os.path.join(w, "tiny_llama")}
    return sc


def scenario_c(r: Runner, ctx: dict) -> Scenario:
    sc = Scenario("c", "no lock-in: roll-ckpt export --format roll, loaded by ROLL's own load_checkpoint")
    if "b" not in ctx:
        sc.check("scenario b's checkpoint (needed)", False, "scenario b did not produce one")
        return sc
    w = os.path.join(r.workdir, "c")
    os.makedirs(w, exist_ok=True)
    src, job2 = ctx["b"]["final"], load(ctx["b"]["job2"])
    out = os.path.join(w, "exported", "checkpoint-4")
    res = cli(r, sc, "c-export", ["export", src, "--format", "roll", "--out", out])
    if res["rc"] != 0:
        return sc
    sc.fact(f"tree of {out}", "\n".join(tree(out)))
    cli(r, sc, "c-verify", ["verify", out])
    saved = job2["steps"]["4"]["digests"]
    for cl, target in (("actor_train", out), ("critic", os.path.join(out, "critic"))):
        res = r.run(f"c-{cl}", ranks_args(os.path.join(w, f"r_{cl}"), ctx["b"]["model"], cl, 2, "roll", target,
                                          os.path.join(w, f"{cl}.json")), timeout=300)
        if not sc.step(f"{cl}: ROLL's own FSDP2TrainStrategy.load_checkpoint({os.path.relpath(target, w)}), "
                       "integration off, 2 fresh gloo processes", res):
            continue
        got = ranks_digests(os.path.join(w, f"{cl}.json"))
        ok, detail = compare(saved[cl], got, ("params",))
        sc.check(f"{cl} parameters bit-equal to the saved ones", ok, detail)
        _, detail = compare(saved[cl], got, ("sched", "lr", "opt", "rng"))
        sc.fact(f"{cl}: what else ROLL's own load restored (n_opt_state {[g['n_opt_state'] for g in got]})", detail)
        res = r.run(f"c-{cl}-primed", ranks_args(os.path.join(w, f"r_{cl}_p"), ctx["b"]["model"], cl, 2, "roll",
                                                 target, os.path.join(w, f"{cl}_p.json"), prime=1), timeout=300)
        if sc.step(f"{cl}: the same, with a zero Adam state put in first (ROLL's load restores only existing state)",
                   res):
            ok, detail = compare(saved[cl], ranks_digests(os.path.join(w, f"{cl}_p.json")), ("params", "opt", "sched"))
            sc.check(f"{cl}: the exported Adam state is ROLL's schema (loads bit-equal into a primed optimizer)",
                     ok, detail)
        dcp = os.path.join(target, "dcp")
        res = r.run(f"c-{cl}-facts", [os.path.join(HERE, "_dcp_facts.py"), dcp, os.path.join(w, f"{cl}_dcp.json")],
                    timeout=120)
        if res["rc"] == 0:
            f = load(os.path.join(w, f"{cl}_dcp.json"))
            sc.check(f"{cl}: the exported rng_state.cpu is rank 0's saved torch RNG",
                     f["rng_torch"] == saved[cl][0]["rng"]["torch"], f"{f['rng_torch']} vs {saved[cl][0]['rng']['torch']}")
            sc.fact(f"{cl}: exported scheduler / param groups", {"scheduler": f["scheduler"],
                                                                  "param_groups": f["param_groups"]})
    return sc


def _preempt_run(r: Runner, name: str, w: str, root: str, result: str, target: str) -> dict:
    """Start a launch (max_steps 6, save_steps 4: steps 1..3 are not scheduled), SIGTERM ``target``
    ('driver' or 'worker': actor_train rank 1) once step 1 is done; wait for the driver."""
    args = job_args(w, root, result, 1, max_steps=6, save_steps=4, step_delay=2)
    t0 = time.monotonic()
    proc, token, log = r.start(name, [r.python, *args])
    sent = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            job = load(result)
        except (OSError, ValueError):
            job = None
        if job and any(e[1] == "step 1 done" for e in job["events"]):
            pid = job["worker_pids"]["actor_train"][1] if target == "worker" else proc.pid
            if target == "group":  # the driver's process group: Ray's own processes (raylet, GCS...) too
                os.killpg(pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
            sent = {"to": target, "pid": pid, "after_s": round(time.monotonic() - t0, 1)}
            break
        time.sleep(0.3)
    alive_after: dict = {}
    try:
        proc.wait(timeout=max(30.0, 420 - (time.monotonic() - t0)))
        try:  # before any leftover is killed: did the worker actors end by themselves?
            pids = [p for ps in load(result)["worker_pids"].values() for p in ps]
        except (OSError, ValueError, KeyError):
            pids = []
        end = time.monotonic() + 15
        while time.monotonic() < end and any(alive(p) for p in pids):
            time.sleep(0.5)
        alive_after = {str(p): alive(p) for p in pids}
    except subprocess.TimeoutExpired:
        pass
    rc, timed_out = r.finish(proc, token, 0.1)
    leftovers = [p for t, p in r.killed if t == token]
    return {"rc": rc, "timed_out": timed_out, "sent": sent, "log": log, "seconds": round(time.monotonic() - t0, 1),
            "workers_alive_after_driver_exit": alive_after, "leftovers_killed": leftovers}


def _check_preempted(sc: Scenario, res: dict, result: str, label: str) -> dict | None:
    sc.fact(f"{label}: SIGTERM", res["sent"])
    if not sc.check(f"{label}: the SIGTERM was sent after step 1 and the driver exited by itself",
                    res["sent"] is not None and not res["timed_out"], tail(res["log"]) if res["timed_out"] else ""):
        return None
    job = load(result)
    exc = job.get("exception") or {}
    sc.fact(f"{label}: driver exit status {res['rc']}; raised",
            {k: exc.get(k) for k in ("type", "repr", "exit_code", "step", "path")})
    sc.fact(f"{label}: driver traceback", (exc.get("traceback") or "").strip())
    sc.fact(f"{label}: events", job["events"])
    ck = os.path.join(job["checkpoint_output_dir"], "checkpoint-2")
    names = {ln.split(None, 1)[1] for ln in tree(ck)} if os.path.isdir(ck) else set()
    sc.check(f"{label}: step 2 (not scheduled) committed for every component",
             all(f"{p}/manifest.json" in names for p in ("actor_train", "critic", "pipeline")) and "manifest.json" in names,
             ck)
    if exc.get("type") == "Preempted":
        # the driver's manager raises it: its part of that step (checkpoint-N/pipeline)
        sc.check(f"{label}: Preempted names the driver's part of the step it committed",
                 exc.get("path") in (ck, f"{ck}/pipeline"), f"Preempted.path {exc.get('path')!r}")
    ran = sorted(int(k) for k in job["steps"])
    sc.check(f"{label}: the launch stopped after step 2", ran == [0, 1, 2], str(ran))
    sc.fact(f"{label}: worker actors alive after the preemption, before the driver's ray.shutdown()",
            job.get("workers_alive_before_shutdown"))
    after = res["workers_alive_after_driver_exit"]
    sc.check(f"{label}: every worker actor process ended once the driver exited (15 s grace, before any kill)",
             bool(after) and not any(after.values()), str(after))
    sc.fact(f"{label}: leftover processes of the launch killed by pid afterwards", res["leftovers_killed"])
    return job


def scenario_d(r: Runner, ctx: dict) -> Scenario:
    sc = Scenario("d", "preemption in ROLL: SIGTERM to the driver, then to one worker actor")
    w = os.path.join(r.workdir, "d")
    root, result = os.path.join(w, "ckpt"), os.path.join(w, "job_driver.json")
    res = _preempt_run(r, "d-driver", os.path.join(w, "launch_driver"), root, result, "driver")
    job = _check_preempted(sc, res, result, "SIGTERM to the driver")
    if job is not None:
        result2 = os.path.join(w, "job_resume.json")
        res2 = r.run("d-resume", job_args(os.path.join(w, "launch_resume"), root, result2, 1, max_steps=6,
                                          save_steps=4, resume="true"), timeout=480)
        if sc.step("resume (fresh Ray session, resume_from_checkpoint: true)", res2):
            job2 = load(result2)
            sc.check("resumed from the preemption checkpoint (step 2)",
                     job2["state_after_init"]["step"] == 2 and
                     job2["resume_from_checkpoint"]["pipeline.resume_from_checkpoint"] ==
                     os.path.join(job["checkpoint_output_dir"], "checkpoint-2"),
                     str(job2["resume_from_checkpoint"]))
            for cl in ("actor_train", "critic"):
                ok, detail = compare(job["steps"]["2"]["digests"][cl], job2["digests_after_init"][cl])
                sc.check(f"{cl} bit-equal to its state at the preemption save", ok, detail)
            sc.check("pipeline WorkerState equals the one the preemption save wrote (step, log_history, kv)",
                     job2["state_after_init"] == job.get("state_at_exit"),
                     f"step {job2['state_after_init']['step']}, {len(job2['state_after_init']['log_history'])} "
                     "logged steps")
            ran = sorted(int(k) for k in job2["steps"])
            sc.check("the resumed launch continued with steps 3..5 and committed its final step",
                     ran == [3, 4, 5] and os.path.isfile(os.path.join(job2["checkpoint_output_dir"], "checkpoint-5",
                                                                      "manifest.json")), str(ran))
    w2 = os.path.join(w, "worker")
    result3 = os.path.join(w2, "job_worker.json")
    res = _preempt_run(r, "d-worker", os.path.join(w2, "launch"), os.path.join(w2, "ckpt"), result3, "worker")
    job3 = _check_preempted(sc, res, result3, "SIGTERM to actor_train rank 1")
    if job3 is not None:
        victim = str(res["sent"]["pid"])
        sc.check("SIGTERM to actor_train rank 1: that actor ended after the preemption save (its Ray handler ran)",
                 (job3.get("workers_alive_before_shutdown") or {}).get(victim) is False,
                 str(job3.get("workers_alive_before_shutdown")))
    if ctx.get("group"):  # informational: not part of PASS/FAIL
        w3 = os.path.join(w, "group")
        result4 = os.path.join(w3, "job_group.json")
        res = _preempt_run(r, "d-group", os.path.join(w3, "launch"), os.path.join(w3, "ckpt"), result4, "group")
        info: dict = {"SIGTERM": res["sent"], "driver exit status": res["rc"], "timed out": res["timed_out"],
                      "leftovers killed": res["leftovers_killed"]}
        try:
            job4 = load(result4)
            exc = job4.get("exception") or {}
            info["raised"] = {k: exc.get(k) for k in ("type", "repr")}
            info["last frame"] = (exc.get("traceback") or "").strip().splitlines()[-1:]
            info["events"] = job4["events"]
            run_dir = job4["checkpoint_output_dir"]
            info["committed steps"] = sorted(d for d in (os.listdir(run_dir) if os.path.isdir(run_dir) else [])
                                             if os.path.isfile(os.path.join(run_dir, d, "manifest.json")))
            info["step folders"] = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
        except (OSError, ValueError, KeyError) as exc:
            info["result"] = repr(exc)
        sc.fact("INFO (not gated) SIGTERM to the driver's whole process group (Ray's raylet/GCS included)", info)
    return sc


# ----------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="a,b,c,d", help="scenarios to run, e.g. a,b (c needs b)")
    p.add_argument("--workdir", default=None, help="default: a new folder under $TMPDIR (kept)")
    p.add_argument("--json", default=None, help="write every scenario's checks and facts here")
    p.add_argument("--verbose", action="store_true", help="keep each step's log tail in the facts")
    p.add_argument("--group-sigterm", action="store_true",
                   help="d: also SIGTERM the driver's whole process group (informational, +1 launch)")
    a = p.parse_args()
    roll_source = os.environ.get("ROLL_SOURCE")
    roll_python = os.environ.get("ROLL_PYTHON", sys.executable)
    if not roll_source or not os.path.isfile(os.path.join(roll_source, "roll", "pipeline", "base_pipeline.py")):
        print("ROLL_SOURCE must name a checkout of alibaba/ROLL (roll/pipeline/base_pipeline.py)", file=sys.stderr)
        return 2
    workdir = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="roll_source_check_"))
    os.makedirs(workdir, exist_ok=True)
    r = Runner(workdir, roll_source, roll_python, a.verbose)
    head = subprocess.run(["git", "-C", roll_source, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    probe = subprocess.run([roll_python, "-c", "import torch, ray, transformers, roll_ckpt_roll, importlib.metadata as m;"
                            "print(torch.__version__, ray.__version__, transformers.__version__, "
                            "m.version('roll-ckpt-roll'), roll_ckpt_roll.ROLL_COMMIT)"],
                           capture_output=True, text=True, timeout=120, env=r.env("probe"))
    print(f"workdir {workdir}\nROLL {roll_source} @ {head.stdout.strip() or '?'}\nROLL_PYTHON {roll_python}: "
          f"torch, ray, transformers, roll-ckpt-roll, ROLL_COMMIT = {probe.stdout.strip() or probe.stderr.strip()}")
    scenarios = {"a": scenario_a, "b": scenario_b, "c": scenario_c, "d": scenario_d}
    ctx: dict = {"group": a.group_sigterm}
    done: list[Scenario] = []
    t0 = time.monotonic()
    try:
        for key in [k.strip() for k in a.only.split(",") if k.strip()]:
            Scenario.current = None
            try:
                sc = scenarios[key](r, ctx)
            except Exception:  # a bug in the check itself: that scenario fails, the others run
                import traceback

                sc = Scenario.current if Scenario.current is not None and Scenario.current.key == key else \
                    Scenario(key, f"scenario {key}")
                sc.check("the check itself ran to its end", False, traceback.format_exc())
            sc.seconds = round(time.monotonic() - sc.t0, 1)
            done.append(sc)
    finally:
        r.sweep_all()
    print("\n=== results")
    for sc in done:
        failed = [w for w, ok, _ in sc.checks if not ok]
        print(f"{'PASS' if sc.ok else 'FAIL'} {sc.key}: {sc.title} ({sc.seconds} s"
              f"{'; failed: ' + ' | '.join(failed) if failed else ''})")
    print(f"total {round(time.monotonic() - t0, 1)} s; leftover processes killed by pid: "
          f"{[p for _, p in r.killed] or 'none'}; workdir {workdir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workdir": workdir, "roll_head": head.stdout.strip(), "versions": probe.stdout.strip(),
                       "scenarios": [sc.summary() for sc in done], "killed": r.killed}, f, indent=1, default=str)
    return 0 if done and all(sc.ok for sc in done) else 1


if __name__ == "__main__":
    sys.exit(main())
