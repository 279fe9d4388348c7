"""The benchmark harness runs end to end in --quick mode with tiny counts (structure only, no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # each runs a benchmark end to end: 18 to 70 s here

TINY = [
    "--quick",
    "--starts",
    "1",
    "--new-sessions",
    "1",
    "--executes",
    "3",
    "--stdout-samples",
    "2",
    "--parallel",
    "2",
    "--throughput-seconds",
    "0.3",
    "--capacity",
    "2",
    "--levels",
    "1",
    "2",
    "--growth-starts",
    "1",
    "--growth-executes",
    "2",
    "--batch",
    "2",
    "--burst",
    "2",
]


def test_quick_run_writes_json_table_and_chart(tmp_path):
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), *TINY, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    assert results["mode"] == "quick" and results["baseline"] == "python3"
    figures = results["figures"]
    assert set(figures) == {
        "cold_start",
        "mcp_new_session",
        "execute_direct",
        "first_stdout",
        "execute_websocket",
        "execute_mcp",
        "throughput",
        "idle_memory",
        "burst",
        "capacity",
        "cost_growth",
        "side_by_side",
        "gateway_session_pss",
    }
    backends = figures["cold_start"]["backends"]
    assert backends["namespace"]["available"] and backends["namespace"]["start"]["n"] == 1
    assert backends["microsandbox"]["available"] or backends["microsandbox"]["result"].startswith("unavailable: ")
    # Every flavor, forked from the one fork server the first, untimed round started.
    assert {flavor: s["n"] for flavor, s in figures["cold_start"]["flavors"].items()} == {"small": 1, "medium": 1, "large": 1}
    assert [server["kernels_forked"] >= 6 for server in figures["cold_start"]["fork_servers"]] == [True]
    assert figures["execute_direct"]["msb_forked"] is True
    for key in ("pool", "no_pool"):
        assert figures["mcp_new_session"][key]["n"] == 1
    assert figures["mcp_new_session"]["pool"]["handed_out_by_pool"] == 1
    for section, keys in (
        ("execute_direct", ("msb", "bare", "msb_exec")),
        ("first_stdout", ("msb", "bare")),
        ("execute_websocket", ("msb", "bare_ws", "bare")),
        ("execute_mcp", ("memory", "http", "bare", "bare_to_idle", "msb_to_idle")),
    ):
        for key in keys:
            assert {"n", "p50_ms", "p95_ms"} <= set(figures[section][key]), (section, key)
    side = figures["side_by_side"]  # every backend that runs here, and the namespace sandbox over tcp
    expected = {"bare", "namespace/ipc", "namespace/tcp"} | ({"gvisor/ipc"} if backends["gvisor"]["available"] else set())
    assert set(side) == expected | ({"microsandbox/tcp"} if backends["microsandbox"]["available"] else set()), side
    assert all(figure["execute"]["n"] == 3 and figure["rss_mib"] > 0 for figure in side.values()), side
    table = (out / "bench.md").read_text()
    assert all(f"execute 1+1, direct, {key} (side by side)" in table for key in expected - {"bare"}), table
    assert "vs a direct client that waits for the result and idle (diagnostic)" in table, table
    assert "vs a direct client of a sandboxed kernel, to idle: the HTTP path alone (diagnostic)" in table, table
    assert figures["throughput"]["msb"]["executions"] > 0 and figures["throughput"]["bare"]["executions"] > 0
    assert figures["idle_memory"]["msb"]["rss_mib_median"] > 0 and figures["idle_memory"]["bare"]["rss_mib_median"] > 0
    assert 0 < figures["idle_memory"]["msb"]["pss_mib_median"] < figures["idle_memory"]["msb"]["rss_mib_median"]
    assert figures["idle_memory"]["fork_server_pss_mib"] > 0
    gateway = figures["gateway_session_pss"]
    assert gateway["forked"] and gateway["sandbox_uss_mib"] > 0 and gateway["keeper_uss_mib"] > 0
    assert gateway["keeper_shared"] and gateway["keeper_sessions"] == 3 and gateway["keeper_per_session_mib"] >= 0, gateway
    for key in ("bare", "msb", "msb_all_at_once"):
        run = figures["burst"][key]
        assert 0 < run["first_s"] <= run["median_s"] <= run["last_s"], (key, run)
    assert figures["capacity"]["answering"] == 2 and figures["capacity"]["failure"] is None
    peak = figures["capacity"]["memory_at_peak"]
    assert peak["sessions"] == 2 and 0 < peak["uss_mib_median"] < peak["pss_mib_median"], peak
    assert set(figures["cost_growth"]["msb"]) == {"1", "2"} == set(figures["cost_growth"]["bare"])
    assert len(results["targets"]) == 11 and all({"target", "measured", "met"} <= set(t) for t in results["targets"])
    # A target with two paths is met only when both are: the in-memory figure alone once printed "MET".
    sys.path.insert(0, str(REPO))
    from bench import report

    figures["execute_mcp"]["memory"]["p50_ms"], figures["execute_mcp"]["http"]["p50_ms"] = 3.0, 18.54
    (mcp_target,) = [t for t in report.targets(figures) if "on an existing session" in t["target"]]
    assert mcp_target["met"] is False and "18.54 ms over HTTP" in mcp_target["measured"], mcp_target
    figures["execute_mcp"]["http"]["p50_ms"] = 12.0
    assert [t["met"] for t in report.targets(figures) if "on an existing session" in t["target"]] == [True]
    # Over HTTP against a direct client: +4 ms at most.
    figures["execute_mcp"]["bare"]["p50_ms"] = 7.5
    assert [t["met"] for t in report.targets(figures) if "within +4 ms" in t["target"]] == [False]
    figures["execute_mcp"]["http"]["p50_ms"] = 11.4
    assert [t["met"] for t in report.targets(figures) if "within +4 ms" in t["target"]] == [True]
    assert (out / "bench.md").read_text().startswith("| figure |")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_starts_interleaves_kernelspecs_and_variants_of_one_by_their_settings():
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "starts.py"), "-n", "1", "msb-python-small", "MSB_FORK_KERNELS=false:msb-python-small"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("msb-python-small: p50 ") and "(n=1, forked)" in lines[0], lines
    assert lines[1].startswith("MSB_FORK_KERNELS=false:msb-python-small: p50 ") and "(n=1, exec'd)" in lines[1], lines
    refused = subprocess.run(
        [sys.executable, str(REPO / "bench" / "starts.py"), "FORK=false:msb-python-small", "nothing"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "is not MSB_NAME=VALUE" in refused.stderr and "Traceback" not in refused.stderr


def test_quick_flush_times_a_plain_kernel_beside_one_running_the_quick_flush():
    # The script refuses to report unless the quick flush is installed in the one kernel and not in the other.
    run = subprocess.run([sys.executable, str(REPO / "bench" / "quick_flush.py"), "-n", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ipykernel: 1+1 to its reply" in run.stdout and "quick flush - ipykernel: reply" in run.stdout, run.stdout


def test_side_by_side_calls_two_checkouts_in_turn_and_refuses_what_is_not_one(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "side_by_side.py"), str(REPO), str(REPO), "-n", "2", "--starts", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()[-6:]
    assert lines[0].startswith("MCP 1+1: A p50 ") and "B/A p50 " in lines[0] and "gateway CPU" in lines[0], lines
    assert lines[1].startswith("WebSocket 1+1: A p50 ") and lines[2].startswith("cold start to 1+1: A p50 "), lines
    assert lines[3].startswith("direct client, bare kernel: p50 ") and lines[3].endswith("(n=2, starts=1)"), lines
    assert lines[4:] == [f"A {REPO}", f"B {REPO}"], lines
    refused = subprocess.run(
        [sys.executable, str(REPO / "bench" / "side_by_side.py"), str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "is not a checkout of msb-kernels" in refused.stderr and "Traceback" not in refused.stderr


DIES_AT_FIRST_START = """
import os, sys
marker, connection_file = sys.argv[1], sys.argv[2]
if marker == "always" or not os.path.exists(marker):
    if marker != "always":
        open(marker, "w").close()
    sys.exit(1)  # as a kernel whose TCP port another process took exits
os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file])
"""


async def test_a_kernel_that_dies_at_its_start_is_started_again_and_counted(tmp_path, monkeypatch):
    from bench.kernels import KernelDied, start_kernel_again_if_it_dies, stop_kernel

    script = tmp_path / "dies_at_first_start.py"
    script.write_text(DIES_AT_FIRST_START)
    for name, marker in (("dies-once", str(tmp_path / "died-once")), ("dies-always", "always")):
        spec = tmp_path / "kernels" / name
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(
            json.dumps({"argv": [sys.executable, str(script), marker, "{connection_file}"], "display_name": name, "language": "python"})
        )
    monkeypatch.setenv("JUPYTER_PATH", f"{tmp_path}:{os.environ.get('JUPYTER_PATH', '')}".rstrip(":"))

    starts, km, kc = await start_kernel_again_if_it_dies("dies-once", timeout=60)
    try:
        assert starts == 2
        assert (await kc.kernel_info(reply=True, timeout=30))["content"]["status"] == "ok"
    finally:
        await stop_kernel(km, kc)
    with pytest.raises(KernelDied):
        await start_kernel_again_if_it_dies("dies-always", timeout=60, attempts=2)


def test_a_full_runs_results_file_keeps_the_sections_other_benches_recorded(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench import report

    monkeypatch.setattr(report, "table", lambda results: "| figure | new |\n")

    path = tmp_path / "RESULTS.md"
    other = "## Auth per request (issue 37)\n\nWritten by `bench/auth.py -n 1000`.\n\n| path | p50 |\n|---|---|\n"
    path.write_text("# Latest benchmark results\n\nold table\n\n## Targets\n\n| old | target |\n\n" + other)
    report.write_results_file({"figures": {}, "targets": [], "machine": {"cpus": 2}}, path, "bench/run.py")
    text = path.read_text()
    assert "old table" not in text and "| old | target |" not in text, text
    assert text.index("## Targets") < text.index("## Auth per request (issue 37)") and text.endswith(other), text
    report.write_results_file({"figures": {}, "targets": [], "machine": {"cpus": 2}}, path, "bench/run.py")
    assert path.read_text() == text  # kept once, not once more per run


def test_environments_times_a_second_environment_beside_the_default_and_a_bare_kernel():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "environments.py"), "-n", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "created environment second in " in run.stdout and "(offline, from " in run.stdout, run.stdout
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and " ms |" in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| cold, environment `second` (msb-second-python-small)",
        "| cold, default (msb-python-small)",
        "| pooled, environment `second`, through the gateway",
        "| pooled, default, through the gateway",
        "| cold, bare ipykernel (python3), reference",
    ], rows


def test_the_environments_section_is_written_after_targets_and_kept_when_run_rewrites_the_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench import environments, report

    path = tmp_path / "RESULTS.md"
    path.write_text("# Latest benchmark results\n\nold table\n\n## Targets\n\n| target | measured | met |\n")
    figure = {"p50_ms": 300.0, "p95_ms": 400.0}
    results = {
        "n": 1,
        "runtime_seconds": 60,
        "machine": {"cpus": 2, "cpu_model": "cpu", "user": "root", "ipykernel": "7"},
        "cold": {
            environments.SECOND: figure,
            environments.DEFAULT: {**figure, "p50_ms": 60.0},
            environments.BARE: {**figure, "p50_ms": 200.0},
        },
        "pooled": {environments.SECOND: {**figure, "p50_ms": 20.0}, environments.DEFAULT: {**figure, "p50_ms": 10.0}},
    }
    environments.write_section(results, "bench/environments.py -n 1", path)
    environments.write_section(results, "bench/environments.py -n 1", path)  # replaced, not added twice
    text = path.read_text()
    assert text.count(environments.SECTION) == 1 and text.index("## Targets") < text.index(environments.SECTION), text
    assert "| cold, environment `second` (msb-second-python-small) | 300 ms | 400 ms | 5.00x | 1.50x | - |" in text, text
    assert "| pooled, environment `second`, through the gateway | 20 ms | 400 ms | 2.00x | 0.10x | - |" in text, text
    monkeypatch.setattr(report, "table", lambda results: "new table")  # the run's own table, not under test here
    report.write_results_file({"machine": {}, "targets": []}, path, "bench/run.py")
    rewritten = path.read_text()
    assert "new table" in rewritten and "old table" not in rewritten and rewritten.endswith(text[text.index(environments.SECTION) :]), (
        rewritten
    )


def test_scale_fills_one_gateway_level_by_level_and_has_the_culler_cull_every_session():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| sessions | 5 | 10 |" in run.stdout and "| `1+1` over /mcp `execute_code`, p50 |" in run.stdout, run.stdout[-3000:]
    assert "**Cull**: 10 of 10 sessions culled by the culler" in run.stdout, run.stdout[-3000:]
    assert "Left on the host after the run: {'state_dirs': [], 'cgroups': []}." in run.stdout, run.stdout[-3000:]


def test_scale_times_a_persons_listings_among_everyones_kernels_and_each_names_only_theirs():
    """bench/scale.py --person: each of pat's lists (REST kernels and sessions, MCP get_sessions) named exactly pat's 5
    kernels at each level, and an admin's named all (the bench raises otherwise)."""
    command = [sys.executable, str(REPO / "bench" / "scale.py"), "--person", "--quick"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| p50 (ratio to the first level) | 10 kernels | 20 kernels |" in run.stdout, run.stdout[-3000:]
    assert "| pat's (5 kernels) MCP `get_sessions` |" in run.stdout, run.stdout[-3000:]


def test_lab_first_cell_times_a_sandboxed_lab_beside_a_plain_one_in_chromium(tmp_path):
    """bench/lab_first_cell.py clicks each Lab's launcher card in Chromium and times the first cell to its output
    (issue 55, point 11); one round each here."""
    from bench.browser import missing

    if (reason := missing()) is not None:
        pytest.skip(reason)
    output = tmp_path / "first_cell.json"
    argv = [sys.executable, str(REPO / "bench" / "lab_first_cell.py"), "-n", "1", "--output", str(output)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["figures"]) == {"sandboxed", "plain"} and results["backend"] == "namespace", results
    assert all(figure["n"] == 1 and figure["p50_ms"] > 0 for figure in results["figures"].values()), results
    assert "sandboxed / plain: " in run.stdout, run.stdout
