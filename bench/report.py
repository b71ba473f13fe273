"""latest.json -> a markdown table and a PNG plot."""

from __future__ import annotations

from typing import Any

MB = 1 << 20
GROUP_TITLES = {"target": "target state", "small": "small state", "small-1": "small state"}


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
        "| state | ranks | case | blocked | durable after | GB/s | extra peak RSS | copied at staging |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["cases"]:
        state = f"{GROUP_TITLES.get(r['group'], r['group'])} {r['state_bytes'] / MB:.0f} MiB"
        rss = f"{r['extra_rss'] / MB:.0f} MiB ({r['extra_rss_frac']:.2f}×)" if r.get("extra_rss") is not None else "—"
        copied = f"{r['copied'] / MB:.0f} MiB" if r.get("copied") else "0"
        blocked = _ms(r["blocked_s"]) if r["kind"] != "load" else "(load)"
        if r["kind"] == "load" and r.get("read_per_byte") is not None:
            blocked = f"(load; {r['read_per_byte']:.2f} B read from storage / B)"
        if r.get("staged_s") is not None:
            blocked += f" (copy done {_ms(r['staged_s'])})"
        lines.append(f"| {state} | {r['ranks']} | `{r['case']}` {r['title']} | {blocked} | {_ms(r['durable_s'])} | "
                     f"{_f(r.get('gbps'), '{:.2f}')} | {rss} | {copied} |")
    lines += ["", "| target | value | limit | result | what |", "|---|---:|---:|---|---|"]
    for k, t in res["targets"].items():
        extra = ""
        if k == "T3":
            extra = (f"; vs dcp.save {_f(t['vs_dcp']['value'])} (>= 1.0); vs an O_DIRECT write "
                     f"{_f(t.get('vs_direct'))} (reported, not the target)")
        if k == "T4":
            if t.get("vs_disk_read") is not None:
                extra = f"; {t['vs_disk_read']:.2f}× the uncached read bandwidth"
            st = t.get("stream") or {}
            extra += f"; one-pass `rc_load_stream` / dcp.load {_f(st.get('value'))} (reported, not the target)"
        if k == "T6":
            extra = (f"; regular staging {_f(t.get('regular'))}, DCP process mode {_f(t.get('process_mode'))}, "
                     f"zero-copy with background_nice 0 {_f(t.get('zc_nice0'))}")
        if k == "T7":
            extra = (f"; at {t.get('tensors')} tensors: zero-copy {_f(t.get('zc_ms'), '{:.1f}')} ms, "
                     f"dcp {_f(t.get('dcp_ms'), '{:.1f}')} ms, regular / dcp {_f(t.get('regular'))} (<= 0.5); "
                     f"vs DCP plan caching: zero-copy {_f((t.get('vs_plan_caching') or {}).get('zc'))}, "
                     f"regular {_f((t.get('vs_plan_caching') or {}).get('regular'))}")
        if k == "T10":
            extra = "; µs per tensor: " + ", ".join(
                f"{m} {_f(v, '{:.0f}')}" for m, v in (t.get("us_per_tensor") or {}).items())
        if k == "T11":
            extra = f"; regular staging / DCP {_f(t.get('regular'))} (<= 1.0)"
        if k == "T8":
            extra = "; blocked by budget: " + ", ".join(
                f"{c.replace('rc_budget_', '')} {_ms(v)}" for c, v in (t.get("blocked_s") or {}).items())
        if k == "T9":
            extra = (f"; {_ms(t.get('ours_s'))} vs {_ms(t.get('dcp_s'))}, extra RSS "
                     f"{_f(t.get('extra_rss_frac'), '{:.2f}')}× (<= 1.1; dcp {_f(t.get('dcp_extra_rss_frac'), '{:.2f}')}×); "
                     f"cold (staging buffers dropped first): {_ms((t.get('cold') or {}).get('blocked_s'))}, extra RSS "
                     f"{_f((t.get('cold') or {}).get('extra_rss_frac'), '{:.2f}')}×")
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


LIMITS_TEXT = [
    "**Machine**: 2 shared cores, a virtual disk; another job may run at the same time. Ratios are taken "
    "within one run, side by side; absolute times move 2× between runs.",
    "**T4 (load)**: the disk's uncached read bandwidth for all loaders; B read from storage / B comes from "
    "/proc/self/io read_bytes (page-cache hits do not count), summed over ranks. With a page cache larger than "
    "the checkpoint the default verify-first resume reads each byte from storage once too (its second pass hits "
    "the cache); only a checkpoint larger than the page cache shows the second pass (the --full cgroup case).",
    "**T6, T11 (loop time lost)**: a window of K steps with the save against K times the median step of a window "
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
           "| K steps without | save ended after the steps by |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for meth, r in lp["methods"].items():
        out.append(f"| `{meth}` {r['title']} | {_ms(r['blocked_s'])} | {_ms(r['durable_s'])} | "
                   f"{_ms(r['lost_s'])} | {_f(r['cpu_s'], '{:.2f}')} | {_ms(r['without_s'])} | "
                   f"{_ms(r.get('tail_s')) if r.get('tail_s') else '—'} |")
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
    return ["", f"**Hash cost**: `roll_ckpt.digest.FileHasher` (whole file + 8 MiB pieces, xxh3-128) on "
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

    groups = [g for g in ("target", "small", "small-1") if any(r["group"] == g for r in res["cases"])]
    fig, axes = plt.subplots(len(groups), 3, figsize=(17, 4.2 * len(groups)), squeeze=False)
    lim = res["limits"]
    for gi, g in enumerate(groups):
        rows = [r for r in res["cases"] if r["group"] == g]
        saves = [r for r in rows if r["kind"] == "save"]
        colour = ["tab:blue" if r["case"].startswith("rc_") else "tab:gray" for r in saves]
        names = [r["case"] for r in saves]
        title = f"{GROUP_TITLES.get(g, g)} {rows[0]['state_bytes'] / MB:.0f} MiB, {rows[0]['ranks']} rank(s)"
        ax = axes[gi][0]
        ax.barh(names, [max(r["blocked_s"], 1e-4) * 1e3 for r in saves], color=colour)
        ax.set_xscale("log")
        ax.set_xlabel("blocked (ms, log)")
        ax.set_title(f"training loop blocked — {title}", fontsize=9)
        ax.invert_yaxis()
        ax = axes[gi][1]
        allr = saves + [r for r in rows if r["kind"] == "load"]
        ax.barh([r["case"] for r in allr], [r.get("gbps") or 0 for r in allr],
                color=["tab:blue" if r["case"].startswith("rc_") else "tab:gray" for r in allr])
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
        ax.set_title("memory", fontsize=9)
        ax.invert_yaxis()
    passed = ", ".join(f"{k} {'PASS' if t['pass'] else 'FAIL'}" for k, t in res["targets"].items())
    m = res["machine"]
    fig.suptitle(f"roll-ckpt ({'blue'}) vs torch/DCP (grey) — {res['mode']}, {m.get('cpus')} cores, "
                 f"{m.get('device')}; {passed}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
