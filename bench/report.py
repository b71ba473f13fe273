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
        f"(2 files at once {_f(lim.get('disk_write2_gbps'), '{:.2f}')} GB/s), "
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
        if r.get("staged_s") is not None:
            blocked += f" (copy done {_ms(r['staged_s'])})"
        lines.append(f"| {state} | {r['ranks']} | `{r['case']}` {r['title']} | {blocked} | {_ms(r['durable_s'])} | "
                     f"{_f(r.get('gbps'), '{:.2f}')} | {rss} | {copied} |")
    lines += ["", "| target | value | limit | result | what |", "|---|---:|---:|---|---|"]
    for k, t in res["targets"].items():
        extra = ""
        if k == "T3":
            extra = f"; vs dcp.save {_f(t['vs_dcp']['value'])} (>= 1.0)"
        if k == "T4" and t.get("vs_disk_read") is not None:
            extra = f"; {t['vs_disk_read']:.2f}× the uncached read bandwidth"
        lines.append(f"| {k} | {_f(t['value'])} | {t['op']} {t['limit']} | {'PASS' if t['pass'] else '**FAIL**'} | "
                     f"{t['what']}{extra} |")
    for problem in res.get("invariants", []):
        lines += ["", f"**Invariant broken:** {problem}"]
    lines += ["", "blocked: what the training loop waits for; durable after: from the call until the checkpoint is "
              "committed (fsynced); GB/s: checkpoint bytes / durable time (loads: bytes / load time, cold page cache); "
              "extra peak RSS: max over ranks of the peak above the RSS just before the call (× the rank's state bytes).",
              ""]
    return "\n".join(lines)


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
