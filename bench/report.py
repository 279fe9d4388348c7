"""The run's report: the targets met or missed, the markdown table and the chart, all from results alone (so --replot can redo them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def targets(figures: dict) -> list[dict]:
    f = figures
    out = []

    def add(name: str, measured: str, met: bool | None, note: str = "") -> None:
        out.append({"target": name, "measured": measured, "met": met, "note": note})

    cold = f["cold_start"]
    if cold.get("flavors"):
        worst = max(s["p50_ms"] for s in cold["flavors"].values())
        add(
            "cold start of a sandboxed python kernel without the pool (create -> kernel_info reply), p50 <= 100 ms, every flavor",
            ", ".join(f"{flavor} {s['p50_ms']:.0f} ms" for flavor, s in cold["flavors"].items())
            + f" (bare ipykernel {cold['bare']['p50_ms']:.0f} ms)",
            worst <= 100,
        )
    no_pool = f["mcp_new_session"]["no_pool"]
    add("new MCP session without the pool p50 <= 120 ms", f"{no_pool['p50_ms']:.1f} ms", no_pool["p50_ms"] <= 120)
    mem = f["idle_memory"]
    peak = f["capacity"].get("memory_at_peak")
    if peak and "pss_mib_median" in mem["msb"]:
        gateway = f.get("gateway_session_pss") or {}
        # One keeper holds all of a gateway's sessions: each pays what it adds, and an equal part of the keeper itself.
        keeper = (
            gateway.get("keeper_per_session_mib", 0.0) + gateway.get("keeper_uss_mib", 0.0) / peak["sessions"]
            if "keeper_per_session_mib" in gateway
            else gateway.get("keeper_uss_mib", 0.0)
        )
        add(
            "idle memory per session unique to it (PSS, all its processes) <= 20 MiB",
            f"{peak['pss_mib_median']:.1f} MiB PSS with {peak['sessions']} sessions live (USS {peak['uss_mib_median']:.1f} MiB; "
            f"host memory taken {peak['host_mib_per_session']:.1f} MiB per session), + {keeper * 1024:.0f} KiB for a gateway session's share of its keeper (USS, one keeper for {peak['sessions']}); "
            f"{mem['msb']['pss_mib_median']:.1f} MiB PSS with {mem['msb']['sessions']} live; bare ipykernel {mem['bare']['pss_mib_median']:.1f} MiB",
            peak["pss_mib_median"] + keeper <= 20,
            "PSS shares a fork server's pages among the sessions that map them: judged with the capacity run's sessions all live",
        )
    d = f["execute_direct"]
    if "msb_exec" in d:
        delta_exec = d["msb"]["p50_ms"] - d["msb_exec"]["p50_ms"]
        add(
            "execute round trip after a fork no slower than an exec'd sandboxed kernel",
            f"{delta_exec:+.2f} ms p50 ({d['msb']['p50_ms']:.2f} vs {d['msb_exec']['p50_ms']:.2f} ms)",
            delta_exec <= 0.25,
            "0.25 ms: the run's noise between two equal kernels",
        )
    delta = d["msb"]["p50_ms"] - d["bare"]["p50_ms"]
    add(
        "execute RTT p50 within +1 ms of bare, direct",
        f"{delta:+.2f} ms ({d['msb']['p50_ms']:.2f} vs {d['bare']['p50_ms']:.2f} ms)",
        delta <= 1.0,
    )
    w = f["execute_websocket"]
    delta_ws = w["msb"]["p50_ms"] - w["bare_ws"]["p50_ms"]
    delta_direct = w["msb"]["p50_ms"] - w["bare"]["p50_ms"]
    add(
        "execute RTT p50 within +1 ms of bare, through the gateway",
        f"{delta_ws:+.2f} ms vs a bare kernel behind plain jupyter_server ({w['msb']['p50_ms']:.2f} vs {w['bare_ws']['p50_ms']:.2f} ms); "
        f"{delta_direct:+.2f} ms vs bare direct",
        delta_ws <= 1.0,
    )
    m, h = f["execute_mcp"]["memory"], f["execute_mcp"]["http"]
    over_direct = h["p50_ms"] - f["execute_mcp"]["bare"]["p50_ms"]
    to_idle = f["execute_mcp"].get("bare_to_idle")  # absent from results written before this figure existed
    msb_idle = f["execute_mcp"].get("msb_to_idle")  # likewise
    add(
        "MCP execute_code('1+1') over HTTP within +4 ms of a direct client at p50",
        f"{over_direct:+.2f} ms ({h['p50_ms']:.2f} vs "
        f"{f['execute_mcp']['bare']['p50_ms']:.2f} ms direct, to the reply)"
        + (
            f"; {h['p50_ms'] - to_idle['p50_ms']:+.2f} ms vs a direct client that also waits, as execute_code does, for the "
            f"result and the idle status ({to_idle['p50_ms']:.2f} ms; not the verdict)"
            if to_idle
            else ""
        )
        + (
            f"; the HTTP path alone: {h['p50_ms'] - msb_idle['p50_ms']:+.2f} ms vs a direct client of a sandboxed kernel, to idle "
            f"({msb_idle['p50_ms']:.2f} ms)"
            if msb_idle
            else ""
        ),
        over_direct <= 4,
    )
    add(
        "MCP execute_code('1+1') on an existing session p50 <= 15 ms, in memory and over HTTP",
        f"{m['p50_ms']:.2f} ms in memory, {h['p50_ms']:.2f} ms over HTTP",
        m["p50_ms"] <= 15 and h["p50_ms"] <= 15,
    )  # met only on both paths
    p = f["mcp_new_session"]["pool"]
    add("new session from the warm pool p50 <= 50 ms", f"{p['p50_ms']:.1f} ms", p["p50_ms"] <= 50)
    c = f["capacity"]
    add(
        "500 concurrent idle small sessions",
        f"{c['answering']} of {c['tried']} tried" + (f" (stopped: {c['failure']})" if c["failure"] else ""),
        c["answering"] >= 500 if c["tried"] >= 500 else None,
        "" if c["tried"] >= 500 else "not tried in this run (bench/run.py --capacity 500)",
    )
    if "pss_mib_median" in mem["msb"]:  # RSS counts a fork server's shared pages whole in every kernel forked from it
        added = mem["msb"]["pss_mib_median"] - mem["bare"]["pss_mib_median"]
        add(
            "memory per idle session <= bare ipykernel + 15 MiB (PSS)",
            f"{mem['msb']['pss_mib_median']:.1f} MiB vs {mem['bare']['pss_mib_median']:.1f} MiB ({added:+.1f} MiB)",
            added <= 15,
        )
    else:
        add(
            "memory per idle session <= bare ipykernel RSS + 15 MiB",
            f"{mem['msb']['rss_mib_median']:.1f} MiB vs {mem['bare']['rss_mib_median']:.1f} MiB ({mem['added_mib']:+.1f} MiB)",
            mem["added_mib"] <= 15,
        )
    return out


def table(results: dict) -> str:
    f = results["figures"]
    backend = results.get("backend", "namespace")  # results written before --backend existed measured namespaces
    rows = [f"| figure | sandboxed (msb-python-small, {backend}) | bare ipykernel (python3) | sandboxed vs bare |", "|---|---|---|---|"]

    def pp(s: dict, digits: int = 2) -> str:
        return f"p50 {s['p50_ms']:.{digits}f} / p95 {s['p95_ms']:.{digits}f} ms"

    bare_start = f["cold_start"]["bare"]
    for name, info in f["cold_start"]["backends"].items():
        if info["available"]:
            rows.append(
                f"| cold start, {name} (n={info['start']['n']}) | {pp(info['start'], 0)} | {pp(bare_start, 0)} | "
                f"{info['ratio_p50']:.2f}x p50, {info['ratio_p95']:.2f}x p95 |"
            )
        else:
            rows.append(f"| cold start, {name} | {info['result']} | {pp(bare_start, 0)} | - |")
    for flavor, s in f["cold_start"].get("flavors", {}).items():
        if flavor != "small":
            rows.append(
                f"| cold start, {f['cold_start']['backend']}, msb-python-{flavor} (n={s['n']}) | {pp(s, 0)} | {pp(bare_start, 0)} | "
                f"{s['p50_ms'] / bare_start['p50_ms']:.2f}x p50 |"
            )
    for label, title in (("pool", "MSB_POOL_SIZE=python-small=1"), ("no_pool", "MSB_POOL_SIZE=0")):
        s = f["mcp_new_session"][label]
        rows.append(
            f"| new session via MCP execute_code, {title} (n={s['n']}) | {pp(s, 1)} | bare cold start {pp(bare_start, 0)} | "
            f"{s['p50_ms'] / bare_start['p50_ms']:.2f}x p50 |"
        )

    def rtt(title: str, s: dict, b: dict, bare_title: str = "") -> None:
        rows.append(
            f"| {title} (n={s['n']}) | {pp(s)} | {bare_title}{pp(b)} | {s['p50_ms'] - b['p50_ms']:+.2f} ms p50, "
            f"{s['p95_ms'] - b['p95_ms']:+.2f} ms p95 |"
        )

    rtt("execute 1+1, direct client", f["execute_direct"]["msb"], f["execute_direct"]["bare"])
    if "msb_exec" in f["execute_direct"]:
        rtt(
            "execute 1+1, direct, forked vs exec'd sandboxed kernel (MSB_FORK_KERNELS=false)",
            f["execute_direct"]["msb"],
            f["execute_direct"]["msb_exec"],
            "exec'd: ",
        )
    for key, figure in f.get("side_by_side", {}).items():  # absent from results written before this figure existed
        if key != "bare":
            bare = f["side_by_side"]["bare"]
            rtt(f"execute 1+1, direct, {key} (side by side)", figure["execute"], bare["execute"])
            rows.append(
                f"| RSS of one idle session, {key} (side by side; all its host processes) | {figure['rss_mib']:.1f} MiB | "
                f"{bare['rss_mib']:.1f} MiB | {figure['rss_mib'] - bare['rss_mib']:+.1f} MiB |"
            )
    rtt("execute 1+1, gateway WebSocket", f["execute_websocket"]["msb"], f["execute_websocket"]["bare_ws"], "plain jupyter_server WS: ")
    rtt(
        "execute 1+1, WebSockets, client with TCP_QUICKACK (diagnostic)",
        f["execute_websocket"]["msb_quickack"],
        f["execute_websocket"]["bare_ws_quickack"],
        "plain jupyter_server WS: ",
    )
    rtt("execute 1+1, gateway WebSocket vs bare direct", f["execute_websocket"]["msb"], f["execute_websocket"]["bare"], "direct: ")
    rtt("MCP execute_code 1+1, in memory", f["execute_mcp"]["memory"], f["execute_mcp"]["bare"], "direct: ")
    rtt("MCP execute_code 1+1, HTTP /mcp of the gateway", f["execute_mcp"]["http"], f["execute_mcp"]["bare"], "direct: ")
    if "bare_to_idle" in f["execute_mcp"]:
        rtt(
            "MCP execute_code 1+1, HTTP /mcp, vs a direct client that waits for the result and idle (diagnostic)",
            f["execute_mcp"]["http"],
            f["execute_mcp"]["bare_to_idle"],
            "direct, to idle: ",
        )
    if "msb_to_idle" in f["execute_mcp"]:
        rtt(
            "MCP execute_code 1+1, HTTP /mcp, vs a direct client of a sandboxed kernel, to idle: the HTTP path alone (diagnostic)",
            f["execute_mcp"]["http"],
            f["execute_mcp"]["msb_to_idle"],
            "sandboxed direct, to idle: ",
        )
    rtt("first stdout byte of print('x'), direct", f["first_stdout"]["msb"], f["first_stdout"]["bare"])
    t = f["throughput"]
    rows.append(
        f"| throughput, {t['sessions']} sessions in parallel, {t['seconds']} s | {t['msb']['per_second']:.0f} exec/s | "
        f"{t['bare']['per_second']:.0f} exec/s | {t['ratio']:.2f}x |"
    )
    m = f["idle_memory"]
    rows.append(
        f"| RSS per idle session (median of {m['msb']['sessions']}; all sandbox processes) | {m['msb']['rss_mib_median']:.1f} MiB "
        f"({m['msb']['processes_per_session']:.0f} processes) | {m['bare']['rss_mib_median']:.1f} MiB | {m['added_mib']:+.1f} MiB |"
    )
    if "pss_mib_median" in m:
        rows.append(
            f"| PSS per idle session (median of {m['msb']['sessions']} live; all sandbox processes) | "
            f"{m['msb']['pss_mib_median']:.1f} MiB (USS {m['msb']['uss_mib_median']:.1f}) | {m['bare']['pss_mib_median']:.1f} MiB "
            f"(USS {m['bare']['uss_mib_median']:.1f}) | {m['msb']['pss_mib_median'] - m['bare']['pss_mib_median']:+.1f} MiB |"
        )
        rows.append(f"| the fork servers, once per Python environment (PSS) | {m.get('fork_server_pss_mib', 0):.1f} MiB | - | - |")
    if peak := f["capacity"].get("memory_at_peak"):
        rows.append(
            f"| per idle session with {peak['sessions']} live: PSS / USS (median of {peak['sampled']}); host memory taken "
            f"| {peak['pss_mib_median']:.1f} / {peak['uss_mib_median']:.1f} MiB; {peak['host_mib_per_session']:.1f} MiB | - | - |"
        )
    if g := f.get("gateway_session_pss"):
        rows.append(
            f"| an idle gateway session, the only one: its sandbox, PSS (USS) | {g['sandbox_mib']:.1f} "
            f"({g.get('sandbox_uss_mib', 0):.1f}) MiB | - | - |"
        )
        if "keeper_per_session_mib" in g:
            rows.append(
                f"| the gateway's keeper, one process for all its sessions: USS with 1 session; what each more session adds "
                f"| {g['keeper_uss_mib']:.1f} MiB; {g['keeper_per_session_mib'] * 1024:.0f} KiB | - | - |"
            )
    if b := f.get("burst"):  # absent from results written before this figure existed

        def ready(run: dict) -> str:
            again = run.get("started_again", 0)  # a kernel that died before it answered (a TCP port taken), started again
            return f"first {run['first_s']:.1f} / median {run['median_s']:.1f} / last {run['last_s']:.1f} s" + (
                f" ({again} started again after dying at start)" if again else ""
            )

        rows.append(
            f"| {b['kernels']} kernels asked for at once, ready at ({b['turns']} start at a time) | {ready(b['msb'])} | "
            f"{ready(b['bare'])} | {b['msb']['median_s'] / b['bare']['median_s']:.2f}x median |"
        )
        rows.append(
            f"| the same burst, all {b['kernels']} starting at once (MSB_CONCURRENT_STARTS={b['kernels']}) | "
            f"{ready(b['msb_all_at_once'])} | {ready(b['bare'])} | {b['msb_all_at_once']['median_s'] / b['bare']['median_s']:.2f}x median |"
        )
    c = f["capacity"]
    rows.append(
        f"| capacity: idle small sessions at once (tried {c['tried']}) | {c['answering']} answering"
        f"{' (stopped: ' + c['failure'] + ')' if c['failure'] else ''} | - | - |"
    )
    g = f["cost_growth"]
    for level in g["levels"]:
        s, b = g["msb"].get(str(level)), g["bare"].get(str(level))
        if s and b:
            rows.append(
                f"| with {level} live: start (n={s['start']['n']}) | {pp(s['start'], 0)} | {pp(b['start'], 0)} | "
                f"{s['start']['p50_ms'] / b['start']['p50_ms']:.2f}x p50 |"
            )
            rows.append(
                f"| with {level} live: execute 1+1 (n={s['execute']['n']}) | {pp(s['execute'])} | {pp(b['execute'])} | "
                f"{s['execute']['p50_ms'] - b['execute']['p50_ms']:+.2f} ms p50 |"
            )
    lines = ["\n".join(rows), "", "| target | measured | met |", "|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {verdict(t['met'])} |")
    return "\n".join(lines) + "\n"


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = results["figures"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    labels, msb, bare = [], [], []
    for name, info in f["cold_start"]["backends"].items():
        if info["available"]:
            labels.append(f"cold start\n({name})")
            msb.append(info["start"]["p50_ms"])
            bare.append(f["cold_start"]["bare"]["p50_ms"])
    for label, title in (("pool", "new MCP session\n(warm pool)"), ("no_pool", "new MCP session\n(no pool)")):
        labels.append(title)
        msb.append(f["mcp_new_session"][label]["p50_ms"])
        bare.append(f["cold_start"]["bare"]["p50_ms"])
    grouped_bars(axes[0][0], labels, msb, bare, "p50 ms", "Start: create -> first reply (bare: bare cold start)")

    w = f["execute_websocket"]
    pairs = [
        ("direct\nclient", f["execute_direct"]["msb"], f["execute_direct"]["bare"]),
        ("WebSocket", w["msb"], w["bare_ws"]),
        ("WebSocket,\nQUICKACK client", w["msb_quickack"], w["bare_ws_quickack"]),
        ("MCP\nin memory", f["execute_mcp"]["memory"], f["execute_mcp"]["bare"]),
        ("MCP\nHTTP /mcp", f["execute_mcp"]["http"], f["execute_mcp"]["bare"]),
        ("first stdout\nprint('x')", f["first_stdout"]["msb"], f["first_stdout"]["bare"]),
    ]
    grouped_bars(
        axes[0][1],
        [p[0] for p in pairs],
        [p[1]["p50_ms"] for p in pairs],
        [p[2]["p50_ms"] for p in pairs],
        "p50 ms",
        "Execute 1+1 round trip (bare: direct client; WebSocket: plain jupyter_server)",
    )

    t, m = f["throughput"], f["idle_memory"]
    grouped_bars(
        axes[0][2],
        [f"{t['sessions']} sessions in parallel"],
        [t["msb"]["per_second"]],
        [t["bare"]["per_second"]],
        "executions / s",
        "Aggregate throughput",
    )
    grouped_bars(
        axes[1][0],
        ["RSS per idle session"],
        [m["msb"]["rss_mib_median"]],
        [m["bare"]["rss_mib_median"]],
        "MiB",
        f"Idle memory (sandboxed: every process of the sandbox, {m['added_mib']:+.1f} MiB)",
    )

    g = f["cost_growth"]
    for ax, part, title in (
        (axes[1][1], "start", "Start latency with N live sessions"),
        (axes[1][2], "execute", "Execute 1+1 latency with N live sessions"),
    ):
        for key, style, color, label in (("msb", "-o", "C0", "sandboxed"), ("bare", "--s", "C1", "bare ipykernel")):
            levels = [lv for lv in g["levels"] if str(lv) in g[key]]
            ax.plot(levels, [g[key][str(lv)][part]["p50_ms"] for lv in levels], style, color=color, label=f"{label} p50")
            ax.plot(levels, [g[key][str(lv)][part]["p95_ms"] for lv in levels], style, color=color, alpha=0.4, label=f"{label} p95")
        ax.set_xlabel("live sessions")
        ax.set_ylabel("ms")
        ax.set_xticks(g["levels"])
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    c = f["capacity"]
    axes[1][1].annotate(
        f"capacity: {c['answering']} of {c['tried']} idle small sessions" + (f"; stopped: {c['failure']}" if c["failure"] else ""),
        (0.02, 0.02),
        xycoords="axes fraction",
        fontsize=8,
    )
    mach = results["machine"]
    fig.suptitle(
        f"msb-kernels (namespace sandbox) vs bare ipykernel, one run - {mach['cpus']} CPUs, "
        f"{mach['memory_mib'] / 1024:.0f} GiB, Python {mach['python']}, Linux {mach['linux']} ({results['mode']} run)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def grouped_bars(ax: Any, labels: list[str], msb: list[float], bare: list[float], ylabel: str, title: str) -> None:
    xs = range(len(labels))
    width = 0.38
    bars_msb = ax.bar([x - width / 2 for x in xs], msb, width, label="sandboxed (msb-python-small)", color="C0")
    bars_bare = ax.bar([x + width / 2 for x in xs], bare, width, label="bare ipykernel (python3)", color="C1")
    for bars in (bars_msb, bars_bare):
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "missed"


def write(results: dict, out: Path) -> str:
    """bench.md and bench.png into out; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    (out / "bench.md").write_text(text)
    chart(results, out / "bench.png")
    return text


def write_results_file(results: dict, path: Path, command: str) -> None:
    """bench/RESULTS.md: the table and the targets of a full run, with the command and the machine that gave them."""
    machine = results.get("machine", {})
    lines = [
        "# Latest benchmark results",
        "",
        f"Written by `{command}` ({results.get('runtime_seconds', 0) / 60:.1f} minutes) on {machine.get('cpus', '?')} CPUs "
        f"({machine.get('cpu_model', '?')}); the method and how to read the figures are in [README.md](README.md).",
        "",
        table(results).strip(),
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    lines += [f"| {t['target']} | {t['measured']} | {'met' if t['met'] else 'missed'} |" for t in results.get("targets", [])]
    kept = sections_of_other_benches(path)
    path.write_text("\n".join(lines) + "\n" + (f"\n{kept}" if kept else ""))


def replace_section(path: Path, heading: str, lines: list[str]) -> None:
    """Replace (or add) one bench's section of RESULTS.md, from its "## " heading to the next; bench/run.py keeps
    it when it rewrites its own table (sections_of_other_benches)."""
    text = path.read_text() if path.exists() else ""
    head, found, rest = text.partition(heading)
    after = rest.split("\n## ", 1)[1] if found and "\n## " in rest else ""
    path.write_text(head.rstrip("\n") + "\n\n" + "\n".join([heading, *lines]) + "\n" + (f"\n## {after}" if after else ""))


def sections_of_other_benches(path: Path) -> str:
    """What follows this file's own table and targets: sections other benches recorded (## headings after
    "## Targets", such as bench/auth.py's), kept as they are when a full run rewrites the rest."""
    if not path.exists():
        return ""
    text = path.read_text()
    targets = text.find("\n## Targets\n")
    following = text.find("\n## ", targets + 1) if targets >= 0 else -1
    return text[following + 1 :].rstrip() + "\n" if following >= 0 else ""
