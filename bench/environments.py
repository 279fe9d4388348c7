"""Starts of a kernel in a second environment beside the default environment's, with a plain ipykernel as reference.

    .venv/bin/python bench/environments.py -n 10
    .venv/bin/python bench/environments.py -n 10 --write   # and the "Environments (issue 38)" section of RESULTS.md

The run makes its own environment `second` offline (`msb-kernels env create` from wheels it packs, as the tests do:
the probe package and ipykernel with its requirements), its kernelspecs in a prefix of its own. Then, in one run:

- cold start: `AsyncKernelManager.start_kernel` -> the first `1+1` execute reply, of msb-second-python-small,
  msb-python-small and the bare `python3`, interleaved start by start (the order alternates every round), after an
  untimed round that starts the fork servers;
- pooled start: `POST /api/kernels` to a gateway whose pool holds one of each (`MSB_POOL_SIZE=second-python-small=1,
  python-small=1`) -> its WebSocket -> the first `1+1` execute reply, the two interleaved, each timed only once the
  pool holds a ready kernel of its kind.

An environment's kernels are exec'd afresh, never forked from a host fork server (which imported the gateway's
venv): that is the gap the cold figures show, and what the pool hides.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.environment import VENV_BIN, isolate, machine, settle  # noqa: E402
from bench.kernels import execute_rtt, start_kernel, stop_kernel  # noqa: E402
from bench.report import replace_section  # noqa: E402
from bench.servers import KernelSocket, Server, free_port  # noqa: E402
from bench.starts import forked  # noqa: E402
from bench.stats import summary  # noqa: E402

ENV = "second"
SECOND, DEFAULT, BARE = f"msb-{ENV}-python-small", "msb-python-small", "python3"
RESULTS_FILE = REPO / "bench" / "RESULTS.md"
SECTION = "## Environments (issue 38)"


def make_environment(base: Path) -> str:
    """`msb-kernels env create second` offline into base/environments, its kernelspecs under base/prefix; what it said."""
    from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, offline_wheels

    wheels = offline_wheels(base / "wheels")
    requirements = base / "requirements.txt"
    requirements.write_text(PROBE_PACKAGE + "\n")
    os.environ["MSB_ENVIRONMENTS_DIR"] = str(base / "environments")
    prefix = base / "prefix"
    argv = [str(VENV_BIN / "msb-kernels"), "env", "create", ENV, "-r", str(requirements), "--wheels", str(wheels), "--prefix", str(prefix)]
    made = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if made.returncode != 0:
        raise SystemExit(f"bench/environments.py: env create failed:\n{made.stdout}{made.stderr}")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(prefix / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")]))
    return made.stdout


async def cold(rounds: int) -> dict[str, dict]:
    """Each kernel's starts to the first 1+1 reply; beside them, to the first kernel_info reply (as bench/run.py times
    a cold start), and whether its kernels were forked from a fork server."""
    kernels = [SECOND, DEFAULT, BARE]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    to_info: dict[str, list[float]] = {name: [] for name in kernels}
    how: dict[str, set] = {name: set() for name in kernels}
    for round_ in range(rounds + 1):
        for name in kernels if round_ % 2 else kernels[::-1]:
            started = time.perf_counter()
            info, km, kc = await start_kernel(name)
            await execute_rtt(kc)
            if round_:  # the first round starts the fork servers, untimed
                times[name].append(time.perf_counter() - started)
                to_info[name].append(info)
                how[name].add(forked(km))
            await stop_kernel(km, kc)
            await settle()
    return {
        name: {**summary(samples), "kernel_info_p50_ms": summary(to_info[name])["p50_ms"], "forked": sorted(how[name], key=str)}
        for name, samples in times.items()
    }


async def pooled(base: Path, rounds: int) -> dict[str, dict]:
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "MSB_RUNTIME_DIR": str(base / "gw"), "MSB_TOKEN": token, "MSB_POOL_SIZE": f"{ENV}-python-small=1,python-small=1"}
    server = Server(
        [str(VENV_BIN / "msb-kernels"), "serve", "--port", str(port)], env, port, token, "/api/msb/health", base / "gateway.log"
    )
    kernels = [SECOND, DEFAULT]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    try:
        await server.wait_up()
        for round_ in range(rounds):
            for name in kernels if round_ % 2 else kernels[::-1]:
                deadline = time.monotonic() + 180
                while (await server.request("GET", "/api/msb/stats"))["pool"]["waiting"].get(name, 0) < 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the pool held no {name} kernel after 180 s; see {base / 'gateway.log'}")
                    await asyncio.sleep(0.1)
                await settle()
                handed_before = (await server.request("GET", "/api/msb/stats"))["pool"]["handed_out"]
                started = time.perf_counter()
                kernel_id = (await server.request("POST", "/api/kernels", {"name": name}))["id"]
                ws = await KernelSocket.open(server, kernel_id)
                await ws.execute("1+1")
                times[name].append(time.perf_counter() - started)
                ws.close()
                handed_after = (await server.request("GET", "/api/msb/stats"))["pool"]["handed_out"]
                if handed_after != handed_before + 1:
                    raise RuntimeError(f"{name}: the start did not come from the pool ({handed_before} -> {handed_after} handed out)")
                await server.request("DELETE", f"/api/kernels/{kernel_id}")
    finally:
        server.stop()
    return {name: summary(samples) for name, samples in times.items()}


def table(results: dict) -> list[str]:
    c, p = results["cold"], results["pooled"]
    bare = c[BARE]["p50_ms"]

    def row(what: str, figure: dict, default: dict | None) -> str:
        versus = f"{figure['p50_ms'] / default['p50_ms']:.2f}x" if default is not None else "-"
        info = f"{figure['kernel_info_p50_ms']:.0f} ms" if "kernel_info_p50_ms" in figure else "-"
        return f"| {what} | {figure['p50_ms']:.0f} ms | {figure['p95_ms']:.0f} ms | {versus} | {figure['p50_ms'] / bare:.2f}x | {info} |"

    return [
        "| start, to the first `1+1` reply | p50 | p95 | vs default, p50 | vs bare ipykernel, p50 | to `kernel_info`, p50 |",
        "|---|---|---|---|---|---|",
        row(f"cold, environment `{ENV}` ({SECOND})", c[SECOND], c[DEFAULT]),
        row(f"cold, default ({DEFAULT})", c[DEFAULT], None),
        row(f"pooled, environment `{ENV}`, through the gateway", p[SECOND], p[DEFAULT]),
        row("pooled, default, through the gateway", p[DEFAULT], None),
        row(f"cold, bare ipykernel ({BARE}), reference", c[BARE], None),
    ]


def yes_no(figure: dict) -> str:
    """Whether every start of a kernel was forked: "yes", "no", or "mixed"."""
    seen = set(figure.get("forked", []))
    return {frozenset({True}): "yes", frozenset({False}): "no"}.get(frozenset(seen), "mixed")


def write_section(results: dict, command: str, path: Path = RESULTS_FILE) -> None:
    """Replace (or add) this bench's section of RESULTS.md; bench/run.py keeps it when it rewrites the rest."""
    m = results["machine"]
    section = [
        "",
        f"Written by `{command}` ({results['runtime_seconds'] / 60:.1f} minutes, n={results['n']} each) on {m['cpus']} CPUs "
        f"({m['cpu_model']}), {m['user']}, namespace backend, ipykernel {m['ipykernel']}. Forked from a fork server: "
        f"{SECOND} {yes_no(results['cold'][SECOND])}, {DEFAULT} {yes_no(results['cold'][DEFAULT])}. An "
        "environment's kernel is exec'd afresh (its packages never run on the host, so no fork server serves it); the "
        "pool hides that. The first `1+1` of any ipykernel costs some 200 ms more than its `kernel_info` reply (the "
        "last column, as bench/run.py times a cold start).",
        "",
        *table(results),
    ]
    replace_section(path, SECTION, section)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--rounds", type=int, default=10, help="timed starts of each kind, cold and pooled (10)")
    parser.add_argument("--write", action="store_true", help=f"write the section {SECTION!r} of bench/RESULTS.md")
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="msb-envs-", dir="/tmp"))
    os.chmod(base, 0o755)
    isolate(base, max_sessions=8)
    print(make_environment(base).rstrip())
    results = {"n": args.rounds, "machine": machine()}
    results["cold"] = asyncio.run(cold(args.rounds))
    results["pooled"] = asyncio.run(pooled(base, args.rounds))
    results["runtime_seconds"] = time.perf_counter() - begun
    subprocess.run([str(VENV_BIN / "msb-kernels"), "env", "remove", ENV], capture_output=True, text=True, timeout=120)
    shutil.rmtree(base, ignore_errors=True)  # its wheels, kernelspecs and runtime dirs
    print("\n".join(table(results)))
    if args.write:
        write_section(results, " ".join(["bench/environments.py", *(argv if argv is not None else sys.argv[1:])]))
        print(f"wrote {SECTION!r} in {RESULTS_FILE}")


if __name__ == "__main__":
    main()
