"""latest.json -> a markdown table and a PNG plot."""

from __future__ import annotations

from typing import Any

MB = 1 << 20
GROUP_TITLES = {"target": "target state", "small": "small state", "small-1": "small state", "target-1": "target state",
                "tensors": "many-tensors state", "tensors-1": "many-tensors state", "moe": "MoE-shaped state",
                "moe-1": "MoE-shaped state"}
COLOURS = {"rc_": "tab:blue", "tc_": "tab:orange", "bcp_": "tab:green"}
"""roll-ckpt, torch-checkpointing, ByteCheckpoint; torch/DCP grey."""


def _colour(case: str) -> str:
    return next((c for p, c in COLOURS.items() if case.startswith(p)), "tab:gray")


def _f(x: Any, fmt: str = "{:.3f}", none: str = "—") -> str:
    return none if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lim = res["limits"]
    lines = [
        f"# roll-ckpt benchmark ({res['mode']}, {res['reps']} repetitions, medians)",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cpus')} cores, {m.get('ram_gib', '?')} GiB RAM, "
        f"disk {m.get('disk', '?')}, kernel {m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch')}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "") + f"; {res['created']}, commit {m.get('commit', '?')}, "
        f"run took {res['duration_s']} s.",
        "",
        "**Machine limits** (same run, alternating with the cases, "
        f"{round((lim.get('bytes') or 0) / MB)} MiB each): "
        f"write + fdatasync {_f(lim.get('disk_write_gbps'), '{:.2f}')} GB/s "
        f"(2 files at once {_f(lim.get('disk_write2_gbps'), '{:.2f}')} GB/s; with O_DIRECT "
        f"{_f(lim.get('disk_write_direct_gbps'), '{:.2f}')} GB/s), "
        f"uncached read ({lim.get('disk_read_method', '?')}) {_f(lim.get('disk_read_gbps'), '{:.2f}')} GB/s "
        f"(2 files at once {_f(lim.get('disk_read2_gbps'), '{:.2f}')} GB/s), "
        f"memcpy {_f(lim.get('memcpy_gbps'), '{:.1f}')} GB/s (into fresh memory {_f(lim.get('memcpy_fresh_gbps'), '{:.1f}')} GB/s).",
        "",
        "| state | ranks | case | blocked | durable after | GB/s | extra peak RSS | kept between saves | "
        "copied at staging |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["cases"]:
        state = f"{GROUP_TITLES.get(r['group'], r['group'])} {r['state_bytes'] / MB:.0f} MiB"
        if r["group"].startswith(("tensors", "moe")) and r.get("tensors"):
            state += f", {r['tensors']:,} tensors"
        rss = f"{r['extra_rss'] / MB:.0f} MiB ({r['extra_rss_frac']:.2f}×)" if r.get("extra_rss") is not None else "—"
        copied = f"{r['copied'] / MB:.0f} MiB" if r.get("copied") else "0"
        blocked = _ms(r["blocked_s"]) if r["kind"] != "load" else "(load)"
        if r["kind"] == "load" and r.get("read_per_byte") is not None:
            blocked = f"(load; {r['read_per_byte']:.2f} B read from storage / B)"
        if r.get("staged_s") is not None:
            blocked += f" (copy done {_ms(r['staged_s'])})"
        if r.get("call_s") is not None:
            blocked += f" (the call: {_ms(r['call_s'])})"
        durable = _ms(r["durable_s"])
        if r.get("written_s") is not None:
            durable += f" (written, before the fsync: {_ms(r['written_s'])})"
        kept = "—"
        if r.get("kept") is not None:
            kept = f"{max(0, r['kept']) / MB:.0f} MiB ({max(0.0, r['kept_frac']):.2f}×)"
            if r.get("kept_children", 0) > MB:
                kept += f", {r['kept_children'] / MB:.0f} MiB of it in its processes"
        lines.append(f"| {state} | {r['ranks']} | `{r['case']}` {r['title']} | {blocked} | {durable} | "
                     f"{_f(r.get('gbps'), '{:.2f}')} | {rss} | {kept} | {copied} |")
    lines += _peers_md(res)
    if res.get("unavailable"):
        lines += ["", f"Not run on torch {m.get('torch')} (each a DCP option a newer release has; "
                  "the targets that compare with it are not reached here):", ""]
        lines += [f"- `{case}`: {why}" for case, why in sorted(res["unavailable"].items())]
    lines += ["", "| target | value | limit | result | what |", "|---|---:|---:|---|---|"]
    for k, t in res["targets"].items():
        extra = ""
        if k == "T3":
            extra = (f"; vs dcp.save {_f(t['vs_dcp']['value'])} (>= 1.0); vs an O_DIRECT write "
                     f"{_f(t.get('vs_direct'))} (reported, not the target)")
        if k == "T4":
            st = t.get("stream") or {}
            extra = (f"; {_f(t.get('ours_gbps'), '{:.2f}')} GB/s vs {_f(t.get('disk_read_gbps'), '{:.2f}')} GB/s; "
                     f"dcp.load {_f(t.get('dcp_gbps'), '{:.2f}')} GB/s ({_f(t.get('dcp_vs_disk_read'))}× the disk; "
                     f"roll-ckpt / dcp.load {_f(t.get('vs_dcp'))}); one-pass `rc_load_stream` "
                     f"{_f(st.get('value'))}× the disk (reported, not the target)")
        if k == "T6":
            cps = t.get("cpu_s_per_gb") or {}
            extra = ("; CPU s per GB: " + ", ".join(f"{m} {_f(v, '{:.2f}')}" for m, v in cps.items())
                     + f" (medians of {t.get('runs')}); regular staging {_f(t.get('regular'))}, DCP process mode "
                     f"{_f(t.get('process_mode'))}; former T6 (loop time lost) {_f((t.get('loop_lost') or {}).get('value'))}")
        if k == "T26":
            ls = t.get("lost_s") or {}
            extra = (f"; roll-ckpt regular {_ms(ls.get('rc_regular'))}, zero-copy {_ms(ls.get('rc_zc'))}, "
                     f"torch-checkpointing {_ms(ls.get('tc_async'))} (zero-copy / it: {_f(t.get('zero_copy'))}; "
                     f"in T6's loop, regular / it: {_f(t.get('loop'))})"
                     + (f"; not run: {t['not_run']}" if t.get("not_run") else ""))
        if k == "T7":
            extra = (f"; median of {t.get('runs')} runs (>= 3); at {t.get('tensors')} tensors: zero-copy "
                     f"{_f(t.get('zc_ms'), '{:.1f}')} ms, "
                     f"dcp {_f(t.get('dcp_ms'), '{:.1f}')} ms, regular / dcp {_f(t.get('regular'))} (<= 0.5); "
                     f"vs DCP plan caching: zero-copy {_f((t.get('vs_plan_caching') or {}).get('zc'))}, "
                     f"regular {_f((t.get('vs_plan_caching') or {}).get('regular'))}")
        if k == "T10":
            extra = "; µs per tensor: " + ", ".join(
                f"{m} {_f(v, '{:.0f}')}" for m, v in (t.get("us_per_tensor") or {}).items())
        if k == "T11":
            extra = f"; regular staging / DCP {_f(t.get('regular'))} (<= 1.0)"
        if k == "T18":
            extra = (f"; {_ms(t.get('ours_s'))} vs {_ms(t.get('torchtitan_s'))}; time to durable "
                     f"{_f(t.get('durable_ratio'))}× torchtitan's (torchtitan.md)")
        if k == "T8":
            extra = "; blocked by budget: " + ", ".join(
                f"{c.replace('rc_budget_', '')} {_ms(v)}" for c, v in (t.get("blocked_s") or {}).items())
        if k == "import":
            extra = (f"; {t['error']}" if t.get("error") else
                     f"; import roll_ckpt: {_f(t.get('ms'), '{:.0f}')} ms, no numpy, no torch.distributed "
                     f"(torch itself {'imported' if t.get('torch') else 'not imported'})")
        if k == "T9":
            extra = (f"; {_ms(t.get('ours_s'))} vs {_ms(t.get('dcp_s'))}, extra RSS "
                     f"{_f(t.get('extra_rss_frac'), '{:.2f}')}× (<= 1.1; dcp {_f(t.get('dcp_extra_rss_frac'), '{:.2f}')}×); "
                     f"cold (staging buffers dropped first): {_ms((t.get('cold') or {}).get('blocked_s'))}, extra RSS "
                     f"{_f((t.get('cold') or {}).get('extra_rss_frac'), '{:.2f}')}×")
        if k == "T27":
            extra = "; " + ", ".join(
                f"{_state(x)}: kept {_f(x['kept_frac'])}× blocked {_ms(x['blocked_s'])}; kept buffers "
                f"{_f(x['keep_kept_frac'])}× blocked {_ms(x['keep_blocked_s'])}; a save not announced blocked "
                f"{_ms(x['cold_blocked_s'])}" for x in t.get("per_state") or [])
        elif t.get("per_state") is not None:  # T20-T25: each state and rank count, the worst first
            per = sorted(t["per_state"], key=lambda x: -x["ratio"])
            extra = "; " + ", ".join(
                f"{_state(x)}: {x['ratio']:.2f} ({_ms(x['ours_s'])} vs {_ms(x['peer_s'])}"
                + (f", its call {_ms(x['peer_call_s'])}" if x.get("peer_call_s") else "") + ")" for x in per)
            if t.get("not_run"):
                extra += f"; not run: {t['not_run']}"
            if t.get("open"):
                extra += f"; **{t['open']}**"
        lines.append(f"| {k} | {_f(t['value'])} | {t['op']} {t['limit']} | {'PASS' if t['pass'] else '**FAIL**'} | "
                     f"{t['what']}{extra} |")
    for problem in res.get("invariants", []):
        lines += ["", f"**Invariant broken:** {problem}"]
    lines += _loop_md(res) + _transformer_md(res) + _many_md(res) + _hash_md(res)
    for sk in res.get("skipped", []):
        lines += ["", f"**Skipped** `{sk['case']}`: {sk['reason']}"]
    lines += ["", "## What limits each figure", ""] + [f"- {x}" for x in LIMITS_TEXT]
    lines += ["", "blocked: what the training loop waits for; durable after: from the call until the checkpoint is "
              "committed (fsynced); GB/s: checkpoint bytes / durable time (loads: bytes / load time, cold page cache); "
              "extra peak RSS: max over ranks of the peak above the RSS just before the call (× the rank's state bytes).",
              ""]
    return "\n".join(lines)


def _state(x: dict[str, Any]) -> str:
    """A state and rank count of T20-T25, in words."""
    what = f"{x['tensors']:,} tensors" if str(x["group"]).startswith(("tensors", "moe")) else f"{x['state_mib']:.0f} MiB"
    return f"{what}, {x['ranks']} rank{'s' if x['ranks'] != 1 else ''}"


def _peers_md(res: dict[str, Any]) -> list[str]:
    """The peer libraries: the release and settings each ran with, those not run and why."""
    pr = res.get("peers")
    if not pr:
        return []
    out = ["", "**Peer libraries** (`tc_*`, `bcp_*`; bench/peers.py), each on its own public API in the same "
               "alternation and on the same state:", ""]
    for key, p in pr.get("peers", {}).items():
        out.append(f"- {p['title']} {p['version']} (`{key}_*`): {p['settings']}.")
    for name, why in (pr.get("cannot_run") or {}).items():
        out.append(f"- {name}: {why}.")
    if pr.get("unavailable"):
        out += ["", "Peer cases not run in this run:", ""]
        out += [f"- `{case}`: {why}" for case, why in sorted(pr["unavailable"].items())]
    out += ["", "kept between saves: what the rank holds after two saves of the case, each alone and waited "
                "for until durable, against before its first (RSS, plus the unique memory of the child processes "
                "it started: a writer process, a gRPC server); freed heap is given back first."]
    return out


LIMITS_TEXT = [
    "**Machine**: 2 shared cores, a virtual disk; another job may run at the same time. Ratios are taken "
    "within one run, side by side; absolute times move 2× between runs.",
    "**T4 (load)**: against the disk's uncached read bandwidth measured with as many readers at once as ranks "
    "(limit_read2 for 2 ranks); the disk's read bandwidth for all loaders; B read from storage / B comes from "
    "/proc/self/io read_bytes (page-cache hits do not count), summed over ranks. With a page cache larger than "
    "the checkpoint the default verify-first resume reads each byte from storage once too (its second pass hits "
    "the cache); only a checkpoint larger than the page cache shows the second pass (the --full cgroup case).",
    "**T6 (save CPU)**: each async save alone (no training beside it) from the call until durable: "
    "getrusage of this process (every thread) and of its ended children, plus psutil's CPU times of its live "
    "children (DCP's process-mode checkpointer), per GB of the rank's state; medians of at least 3 saves.",
    "**T11, and the former T6 (loop time lost)**: a window of K steps with the save against K times the median step of a window "
    "without it (each ~1.5 s or more; a slow step there from another job does not count against the save): "
    "step-time noise "
    "from other jobs on the 2 cores is of the same order as the loss itself, so single repetitions can be "
    "negative; the median of a few is shown. The loop uses every core (torch threads = cores), so any CPU "
    "the background write uses (copy, hash, write syscalls, GIL) comes out of the loop. DCP's process mode "
    "spends its CPU in another process (not in this process's CPU column).",
    "**T7 (many tensors)**: Python work per tensor (state-dict traversal, DTensor wrapping, planning); DCP is "
    "timed with get_state_dict included. Second and later saves of an unchanged structure.",
    "**T8 (budget)**: measured cold (staging buffers dropped before each save), so the extra RSS counts the "
    "staging buffers plus the writer's pooled 4 MiB O_DIRECT buffers; the blocked time includes their first-touch page "
    "faults and, with a budget, waiting for earlier waves to be written.",
    "**T9 (local_dedup)**: HSDP on 2 ranks on 1 host (all-gathers over gloo on loopback). `rc_dedup` is warm "
    "(like every other save row, T2 included): staging buffers kept from the previous save are already resident "
    "and do not show as extra RSS; `rc_dedup_cold` drops them first and shows what they hold.",
    "**Hashing**: one core's xxh3-128 speed; the writer hashes while writing.",
]


def _loop_md(res: dict[str, Any]) -> list[str]:
    lp = res.get("loop")
    if not lp:
        return []
    out = ["", f"## T6: training-loop time lost per async save ({lp['ranks']} rank(s), {lp['tensors']} tensors, "
               f"{lp['state_bytes'] / MB:.0f} MiB, {lp['threads']} torch threads; K = {lp['k']} steps of "
               f"{lp['step_s'] * 1e3:.0f} ms; medians)", "",
           "| method | blocked | durable after (beside the loop) | loop time lost | CPU s of this process, extra "
           "| K steps without | save ended after the steps by | save alone: CPU s per GB (children too) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for meth, r in lp["methods"].items():
        out.append(f"| `{meth}` {r['title']} | {_ms(r['blocked_s'])} | {_ms(r['durable_s'])} | "
                   f"{_ms(r['lost_s'])} | {_f(r['cpu_s'], '{:.2f}')} | {_ms(r['without_s'])} | "
                   f"{_ms(r.get('tail_s')) if r.get('tail_s') else '—'} | {_f(r.get('cpu_s_per_gb'), '{:.2f}')} |")
    out += ["", "loop time lost: (K steps with the save in flight, until both the steps are done and the save is "
                "durable) − K × the median step of the same K steps without a save, run next to them; blocked "
                "time included. "
                "A non-zero last column means the save outlasted the steps (the loss then includes waiting)."]
    return out


def _transformer_md(res: dict[str, Any]) -> list[str]:
    tr = res.get("transformer")
    if not tr:
        return []
    md = tr["model"]
    out = ["", f"## T10/T11: a Hugging Face Llama on FSDP2 ({tr['ranks']} ranks; {md['layers']} layers, hidden "
               f"{md['hidden']}, vocab {md['vocab']}; {tr['tensors']} tensors and {tr['state_bytes'] / MB:.0f} MiB "
               f"per rank with AdamW; steps of {tr['step_s'] * 1e3:.0f} ms, K = {tr['k']}; medians)", "",
           "| method | blocked | durable after | per tensor | loop time lost | CPU s of this process, extra |",
           "|---|---:|---:|---:|---:|---:|"]
    for meth, r in tr["methods"].items():
        out.append(f"| `{meth}` {r['title']} | {_ms(r['blocked_s'])} | {_ms(r['durable_s'])} | "
                   f"{_f(r['us_per_tensor'], '{:.0f}')} µs | {_ms(r['lost_s'])} | {_f(r['cpu_s'], '{:.2f}')} |")
    out += ["", "A synchronous save's loss is the save itself (K = 0); an asynchronous one is measured as in T6, "
                "with K steps of the model's own training (forward, loss, backward, AdamW) per method."]
    return out


def _many_md(res: dict[str, Any]) -> list[str]:
    mn = res.get("many")
    if not mn:
        return []
    meths = list(mn["points"][0]["methods"]) if mn["points"] else []
    out = ["", f"## T7: blocked time vs tensor count ({mn['ranks']} FSDP2 rank(s), AdamW, LayerNorm(64) + "
               "Linear(64, 64) blocks between two Linear(64, 8192); medians of the second and later saves)", "",
           "| tensors (state) | " + " | ".join(f"`{m}`" for m in meths) + " | get_state_dict |",
           "|---|" + "---:|" * (len(meths) + 1)]
    for pt in mn["points"]:
        cells = [_ms(pt["methods"][m]["blocked_s"]) for m in meths]
        gsd = pt["methods"].get("dcp_async", {}).get("get_state_dict_s")
        out.append(f"| {pt['tensors']:,} ({pt['state_bytes'] / MB:.1f} MiB) | " + " | ".join(cells)
                   + f" | {_ms(gsd)} |")
    out += [""] + [f"`{m}`: {mn['titles'].get(m, m)}." for m in meths]
    return out


def _hash_md(res: dict[str, Any]) -> list[str]:
    h = res.get("hash")
    if not h:
        return []
    return ["", f"**Hash cost**: the hashing of roll-ckpt's writer, `roll_ckpt.dcp.files` (whole file + 8 MiB pieces, xxh3-128) on "
                f"{h['bytes'] / MB:.0f} MiB: {_ms(h['file_hasher_s'])} ({h['file_hasher_gbps']:.1f} GB/s; "
                f"one xxh3-128 pass {h['xxh3_gbps']:.1f} GB/s), best of 3, one core."]


def plot_tensors(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mn = res["many"]
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p["tensors"] for p in mn["points"]]
    styles = {"dcp_async": ("tab:gray", "o-"), "dcp_async_plancache": ("tab:gray", "s--"),
              "rc_async": ("tab:blue", "o-"), "rc_async_zc_all": ("tab:cyan", "^-")}
    for meth in (mn["points"][0]["methods"] if mn["points"] else []):
        ys = [p["methods"][meth]["blocked_s"] * 1e3 for p in mn["points"]]
        colour, st = styles.get(meth, ("tab:red", "x-"))
        ax.plot(xs, ys, st, color=colour, label=f"{meth}")
    ax.axhline(25, color="tab:red", ls=":", label="T7: zero-copy <= 25 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors in the rank's state (model + AdamW)")
    ax.set_ylabel("blocked per async save (ms, log)")
    ax.set_title(f"blocked time vs tensor count — {mn['ranks']} FSDP2 rank, {res['mode']}, "
                 f"{res['machine'].get('cpus')} cores", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("target", "target-1", "tensors", "tensors-1", "moe", "moe-1", "small", "small-1")
    groups = [g for g in order if any(r["group"] == g for r in res["cases"])]
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 4, figsize=(22, 4.2 * len(groups)), squeeze=False)
    lim = res["limits"]
    for gi, g in enumerate(groups):
        rows = [r for r in res["cases"] if r["group"] == g]
        saves = [r for r in rows if r["kind"] == "save"]
        colour = [_colour(r["case"]) for r in saves]
        names = [r["case"] for r in saves]
        title = f"{GROUP_TITLES.get(g, g)} {rows[0]['state_bytes'] / MB:.0f} MiB, {rows[0]['ranks']} rank(s)"
        if g.startswith(("tensors", "moe")) and rows[0].get("tensors"):
            title += f", {rows[0]['tensors']:,} tensors"
        ax = axes[gi][0]
        ax.barh(names, [max(r["blocked_s"], 1e-4) * 1e3 for r in saves], color=colour)
        ax.set_xscale("log")
        ax.set_xlabel("blocked (ms, log)")
        ax.set_title(f"training loop blocked — {title}", fontsize=9)
        ax.invert_yaxis()
        ax = axes[gi][1]
        allr = saves + [r for r in rows if r["kind"] == "load"]
        ax.barh([r["case"] for r in allr], [r.get("gbps") or 0 for r in allr], color=[_colour(r["case"]) for r in allr])
        if g == "target" and lim.get("disk_write_gbps"):
            ax.axvline(max(lim.get("disk_write_gbps") or 0, lim.get("disk_write2_gbps") or 0), color="tab:red",
                       ls="--", label="fdatasync write")
            if lim.get("disk_read_gbps"):
                ax.axvline(max(lim["disk_read_gbps"], lim.get("disk_read2_gbps") or 0), color="tab:green", ls=":",
                           label="uncached read")
            ax.legend(fontsize=7)
        ax.set_xlabel("GB/s until durable (loads: GB/s)")
        ax.set_title("throughput", fontsize=9)
        ax.invert_yaxis()
        ax = axes[gi][2]
        ax.barh(names, [r["extra_rss_frac"] for r in saves], color=colour)
        ax.axvline(0.05, color="tab:red", ls="--", label="T2 limit 0.05")
        ax.legend(fontsize=7)
        ax.set_xlabel("extra peak RSS / state bytes of the rank")
        ax.set_title("memory during the save", fontsize=9)
        ax.invert_yaxis()
        ax = axes[gi][3]
        held = [r for r in saves if r.get("kept") is not None]
        own = [max(0.0, r["kept_frac"]) * (1 - r.get("kept_children", 0) / r["kept"] if r["kept"] > 0 else 1)
               for r in held]
        ax.barh([r["case"] for r in held], own, color=[_colour(r["case"]) for r in held])
        ax.barh([r["case"] for r in held], [max(0.0, r["kept_frac"]) - o for r, o in zip(held, own)], left=own,
                color=[_colour(r["case"]) for r in held], alpha=0.4, hatch="//", label="in its processes")
        if any(r.get("kept_children", 0) > 0 for r in held):
            ax.legend(fontsize=7)
        ax.set_xlabel("kept / state bytes of the rank")
        ax.set_title("memory kept between saves", fontsize=9)
        ax.invert_yaxis()
    passed = ", ".join(f"{k} {'PASS' if t['pass'] else 'FAIL'}" for k, t in res["targets"].items())
    m = res["machine"]
    fig.suptitle(f"roll-ckpt (blue) vs torch/DCP (grey), torch-checkpointing (orange), ByteCheckpoint (green) — "
                 f"{res['mode']}, {m.get('cpus')} cores, {m.get('device')}\n{passed}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- scale (scale.py)


def _b(x: float | None) -> str:
    """Bytes, human-sized (decimal units, as the issue's table)."""
    if x is None:
        return "—"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.{1 if x / k < 100 else 0}f} {unit}"
    return f"{x:.0f} B"


def _s(x: float | None) -> str:
    if x is None:
        return "—"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def scale_markdown(res: dict[str, Any]) -> str:
    """scale.json -> markdown: the save table, the resume table, the real jobs, T12-T14."""
    m = res.get("machine", {})
    sh = res.get("shapes", {})
    lines = [f"# roll-ckpt at scale ({res['mode']}): coordination cost against N simulated ranks", "",
             f"torch {m.get('torch')}, Python {m.get('python')}, {m.get('cpus')} cores; {res['created']}, commit "
             f"{m.get('commit', '?')}, run took {res['duration_s']} s. State: a Llama (hidden {sh.get('hidden')}, "
             f"intermediate {sh.get('intermediate')}, vocab {sh.get('vocab')}) of P parameters, fp32, each "
             "`Shard(0)` over N; AdamW (exp_avg, exp_avg_sq, a replicated 0-d step per parameter, the param "
             "group); per rank `per_rank.<r>.__rng__.*` (5 tensors), a scheduler and counters. One process runs "
             "DCP's own planner, global plan (dedup, validation, plan caching), finish and pickling for all N "
             "ranks; every object collective is a pickle on the sender and an unpickle on the receiver, and the "
             "coordinator's share of both is in its CPU.",
             "", f"roll-ckpt's unchanged-structure column: **{res.get('rc_source', 'modelled')}** "
             "(`roll_ckpt.dcp.writer`: the library's own `FixedLayouts.save` on the coordinator, over a simulated "
             "group that hands it the N ranks' pickled messages; `modelled`: the same message shapes, merged by "
             "bench/scale.py's `RollCkptFastPath`). Its full save (the first of a structure) is DCP's protocol with "
             "roll-ckpt's own global plan (`ReusingSavePlanner.create_global_plan`, timed on the same gathered plans). "
             "\"Before issue 20\": each rank read and unpickled `.metadata` twice per resume (collector on, "
             "restricted unpickler).", ""]
    cells = [c for c in res.get("cells", []) if not c.get("error")]
    for p in sorted({c["params"] for c in cells}):
        rows = sorted((c for c in cells if c["params"] == p), key=lambda c: c["ranks"])
        lines += [f"## Save, P = {p} ({rows[0].get('items_per_rank', '?')} state entries per rank)", "",
                  "| N ranks | local plans gathered | coordinator CPU per save: plan caching on / off | write results "
                  "gathered | `.metadata` (broadcast to every rank) | use_collectives=False: rank 0 CPU, all "
                  "`__r.metadata` | roll-ckpt full save (first of a structure): coordinator CPU | **roll-ckpt**, "
                  "unchanged structure: coordinator CPU | roll-ckpt: bytes per rank sent (less checksums) "
                  "| roll-ckpt: all bytes moved |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in rows:
            ms = c["methods"]
            d, dc, nc, rc, rf = (ms.get(k) or {} for k in ("dcp", "dcp_cached", "dcp_nocoord", "rc", "rc_full"))
            skip = " (DCP skipped: memory)" if c.get("skipped") else ""
            lines.append(
                f"| {c['ranks']:,}{skip} | {_b((d.get('collective_bytes') or {}).get('local_plans'))} | "
                f"{_s(dc.get('coordinator_cpu_s'))} / {_s(d.get('coordinator_cpu_s'))} | "
                f"{_b((d.get('collective_bytes') or {}).get('write_results'))} | {_b(d.get('metadata_bytes'))} "
                f"({_b((d.get('collective_bytes') or {}).get('metadata_bcast'))}) | "
                f"{_s(nc.get('coordinator_cpu_s'))}, {_b(nc.get('metadata_bytes'))} | "
                f"{_s(rf.get('coordinator_cpu_s'))} | {_s(rc.get('coordinator_cpu_s'))} | {_b(rc.get('per_rank_sent'))} "
                f"({_b(rc.get('per_rank_overhead_max'))}) | {_b(rc.get('collective_total'))} |")
        lines += ["", f"## Resume, P = {p}", "",
                  "| N ranks | `.metadata` | one rank unpickles it: plain, collector off / on | restricted "
                  "(`safe_load_metadata`), off / on | read for it, all ranks: dcp.load / roll-ckpt before issue 20 (twice "
                  "per rank) / roll-ckpt (coordinator, then broadcast) | use_collectives=False: all ranks read |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for c in rows:
            r = c.get("resume") or {}
            u = r.get("unpickle") or {}
            rd = r.get("read_all_ranks") or {}
            est = " (estimated: linear in N from the largest cell that ran DCP)" if r.get("metadata_estimated") else ""
            lines.append(f"| {c['ranks']:,} | {_b(r.get('metadata_bytes'))}{est} | {_s(u.get('plain_gc_off_s'))} / "
                         f"{_s(u.get('plain_gc_on_s'))} | {_s(u.get('safe_gc_off_s'))} / {_s(u.get('safe_gc_on_s'))} | "
                         f"{_b(rd.get('dcp'))} / {_b(rd.get('rc_today'))} / {_b(rd.get('rc'))} | "
                         f"{_b(rd.get('dcp_nocoord'))} |")
        lines.append("")
    for c in res.get("cells", []):
        if c.get("error"):
            lines.append(f"**Cell N={c['ranks']}, P={c['params']} failed:** {str(c['error'])[-300:]}")
    lines += ["Coordinator CPU: `time.process_time` of the coordinator's own steps (its pickles and unpickles "
              "of the collectives' objects, the global plan, `finish`, the metadata broadcast's pickle), with the "
              "collector held off as roll-ckpt's `CollectorPause` does (DCP alone runs them with it on: slower); "
              "unpickle times are CPU seconds too (the wall time, on a shared machine, is in scale.json); "
              "plan caching on = a second save of the same structure; off = DCP's default (the first save). "
              "use_collectives=False: each rank plans alone and writes `__<r>.metadata` (sizes of 3 ranks, "
              "summed as N x their mean); torch 2.13's `dcp.load` then still gathers and scatters load plans (its "
              "`use_collectives` check runs before `local_step` finds the per-rank file), and a rank's metadata "
              "holds only its own chunks: no N -> M resharding. `no_dist=True` on N processes makes every one "
              "rank 0 (`__0_0.distcp`, `.metadata` for all): not a multi-rank format.", ""]
    lines += _scale_jobs_md(res.get("jobs"))
    tg = res.get("targets") or {}
    if tg:
        lines += ["", "| target | value | limit | result | what |", "|---|---:|---:|---|---|"]
        for k, t in tg.items():
            extra = ""
            if k == "T12":
                extra = (f"; N={t.get('ranks')}, P={t.get('params')}: {_s(t.get('rc_cpu_s'))} vs "
                         f"{_s(t.get('dcp_cached_cpu_s'))}; per rank {_b(t.get('per_rank_sent'))} sent, "
                         f"{_b(t.get('per_rank_overhead'))} without its checksums (<= 1 KiB); {t.get('source')}")
            if k == "T13":
                extra = (f"; dcp.load {_f(t.get('dcp'), '{:.0f}')}×, roll-ckpt before issue 20 "
                         f"{_f(t.get('rc_today'), '{:.0f}')}×"
                         f" of {_b(t.get('metadata_bytes'))}; {t.get('source')}")
            if k == "T14":
                extra = f"; the same for every N and number kept: {t.get('independent')}"
            lines.append(f"| {k} | {_f(t['value'])} | {t['op']} {t['limit']} | {'PASS' if t['pass'] else '**FAIL**'} "
                         f"| {t['what']}{extra} |")
    return "\n".join(lines) + "\n"


def _scale_jobs_md(jobs: dict[str, Any] | None) -> list[str]:
    if not jobs:
        return []
    sm = jobs.get("summary") or {}
    out = ["## Real jobs: storage operations and collective bytes per rank (gloo, FSDP2, CPU)", "",
           "| processes | max_ckpt_to_keep | earlier checkpoints | storage ops per save, first / later: "
           "coordinator, others (max) | entries listed per save (coordinator) | bytes sent per rank per save, first / "
           "later: coordinator, others | ops per resume: coordinator, others (of them files opened) | bytes "
           "received per rank on resume: "
           "coordinator, others | resume bit-exact |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def pr(d: dict[str, Any] | None, fmt: Any = str) -> str:
        if not d:
            return "—"
        o = d.get("others_max")
        return f"{fmt(d.get('coordinator'))}, {fmt(o) if o is not None else '—'}"

    for r in sm.get("rows", []):
        out.append(f"| {r['world_size']} | {r['keep']} | {r['present']} | {pr(r.get('first_ops'))} / "
                   f"{pr(r.get('later_ops'))} | {(r.get('later_entries_listed') or r.get('first_entries_listed') or {}).get('coordinator')} | "
                   f"{pr(r.get('first_sent'), _b)} / {pr(r.get('later_sent'), _b)} | {pr(r.get('resume_ops'))} "
                   f"({pr(r.get('resume_reads'))}) | "
                   f"{pr(r.get('resume_received'), _b)} | {'yes' if r.get('exact') else '**NO**'} |")
    rss = sm.get("reshard") or []
    for rs in ([rss] if isinstance(rss, dict) else rss):
        out += ["", f"Resharding {rs['from']} -> {rs['to']} processes: bit-exact {'yes' if rs['exact'] else '**NO**'}; "
                    f"ops per resume {pr(rs.get('resume_ops'))} (files opened {pr(rs.get('resume_reads'))}); "
                    f"bytes received {pr(rs.get('resume_received'), _b)}."]
    kinds = next((r.get("later_ops_by_kind") or r.get("first_ops_by_kind") for r in sm.get("rows", [])
                  if r["world_size"] > 1), None)
    if kinds:
        out += ["", "Operations of a later save by kind: coordinator "
                + ", ".join(f"{k} {v}" for k, v in sorted((kinds.get("coordinator") or {}).items()))
                + "; another rank " + ", ".join(f"{k} {v}" for k, v in sorted((kinds.get("other") or {}).items()))
                + "."]
    s3 = jobs.get("s3")
    if s3:
        if s3.get("error"):
            out += ["", f"S3 (SeaweedFS): not run ({s3['error'][:200]})."]
        else:
            out += ["", "S3 (SeaweedFS, 1 process, max_ckpt_to_keep 2): HTTP requests per save "
                    + "; ".join(", ".join(f"{k} {v}" for k, v in sorted(sv["http"].items())) for sv in s3["saves"])
                    + "; per resume " + ", ".join(f"{k} {v}" for k, v in sorted(s3["resume"]["http"].items())) + "."]
    for p in sm.get("problems", []):
        out += ["", f"**Problem:** {p}"]
    out += ["", "Storage ops: every call of the rank's `Storage` (bench/opcount.py: files created, renames, mkdirs, "
                "listings, stats/exists, syncs (a durable file counts as one), removes, reads). Bytes: what the rank "
                "puts into each collective (the pickled object, a tensor's bytes), summed over the save."]
    return out


def scale_plot(res: dict[str, Any], path: str) -> None:
    """Log-log: coordinator CPU per save, bytes moved per save, bytes read for .metadata per resume, against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in res.get("cells", []) if not c.get("error")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    styles = {"dcp": ("tab:gray", "o"), "dcp_cached": ("tab:brown", "s"), "dcp_nocoord": ("tab:green", "^"),
              "rc_full": ("tab:purple", "v"), "rc": ("tab:blue", "D")}
    titles = {"dcp": "DCP default", "dcp_cached": "DCP plan caching", "dcp_nocoord": "DCP use_collectives=False",
              "rc_full": "roll-ckpt full save", "rc": f"roll-ckpt unchanged ({res.get('rc_source', 'modelled')})"}
    for p, ls in zip(sorted({c["params"] for c in cells}), ("-", "--", ":")):
        rows = sorted((c for c in cells if c["params"] == p), key=lambda c: c["ranks"])
        for meth, (colour, mk) in styles.items():
            pts = [(c["ranks"], c["methods"][meth]) for c in rows if meth in c["methods"]]
            if not pts:
                continue
            xs = [n for n, _ in pts]
            axes[0].plot(xs, [max(r["coordinator_cpu_s"], 1e-6) for _, r in pts], ls, marker=mk, color=colour,
                         label=f"{titles[meth]}, P={p}")
            if any(r["collective_total"] > 0 for _, r in pts):  # use_collectives=False: a barrier, 0 B
                axes[1].plot(xs, [max(r["collective_total"], 1) for _, r in pts], ls, marker=mk, color=colour,
                             label=f"{titles[meth]}, P={p}")
        for key, colour, mk, name in (("dcp", "tab:gray", "o", "dcp.load"), ("rc_today", "tab:red", "x",
                                                                               "roll-ckpt before issue 20"),
                                      ("rc", "tab:blue", "D", "roll-ckpt"),
                                      ("dcp_nocoord", "tab:green", "^", "use_collectives=False")):
            pts = [(c["ranks"], (c.get("resume") or {}).get("read_all_ranks", {}).get(key)) for c in rows]
            pts = [(n, v) for n, v in pts if v]
            if pts:
                axes[2].plot([n for n, _ in pts], [v for _, v in pts], ls, marker=mk, color=colour,
                             label=f"{name}, P={p}")
    axes[1].text(0.02, 0.02, "DCP use_collectives=False: 0 B (a barrier; no resharding)", transform=axes[1].transAxes,
                 fontsize=7, color="tab:green")
    for ax, yl, t in ((axes[0], "coordinator CPU s per save", "coordinator CPU per save"),
                      (axes[1], "bytes through collectives per save (all ranks)", "bytes moved per save"),
                      (axes[2], "bytes read for .metadata per resume (all ranks)", "resume: .metadata reads")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N ranks (simulated)")
        ax.set_ylabel(yl)
        ax.set_title(t, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", framealpha=0.6)
    fig.suptitle(f"roll-ckpt vs DCP at scale ({res['mode']}); torch {res.get('machine', {}).get('torch')}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
