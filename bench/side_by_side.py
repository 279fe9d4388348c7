"""MCP execute_code('1+1') over /mcp of two gateways running two checkouts of this code, one call to each in turn.

    .venv/bin/python bench/side_by_side.py OLD_CHECKOUT NEW_CHECKOUT [-n 500]

Each gateway imports msb_kernels and mcp_bridge from its checkout (PYTHONPATH) and runs on this venv. Each
round calls A, B and a direct client of a bare kernel in a random order, so neither gateway always
follows the other; it prints p50 and p95 of each and the CPU each gateway spent per call. This VM drifts
more between runs than most changes gain, which is why a change is measured against the old code in the
same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, sys.path starts at bench/
    sys.path.insert(0, str(REPO))

from bench.environment import isolate  # noqa: E402
from bench.kernels import execute_rtt, start_kernel, stop_kernel  # noqa: E402
from bench.servers import start_gateway  # noqa: E402
from bench.stats import percentile  # noqa: E402

MSB, BARE = "msb-python-small", "python3"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def checkout(path: str) -> Path:
    tree = Path(path).resolve()
    if not (tree / "msb_kernels").is_dir() or not (tree / "mcp_bridge").is_dir():
        raise SystemExit(
            f"side_by_side.py: {path} is not a checkout of msb-kernels (no msb_kernels/ and mcp_bridge/ in it); "
            "make one with `git worktree add /tmp/old <commit>`"
        )
    return tree


async def measure(trees: dict[str, Path], calls: int) -> dict[str, dict]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    base = Path(tempfile.mkdtemp(prefix="msb-side-"))
    isolate(base, 10)
    servers = {key: start_gateway(base, log=f"gateway-{key}.log", runtime=f"gw{key}", code=tree) for key, tree in trees.items()}
    try:
        await asyncio.gather(*(server.wait_up() for server in servers.values()))
        kernels = {key: (await server.request("POST", "/api/kernels", {"name": MSB}))["id"] for key, server in servers.items()}
        _, bare_km, bare_kc = await start_kernel(BARE)
        samples: dict[str, list[float]] = {key: [] for key in [*trees, "direct"]}
        cpu = dict.fromkeys(trees, 0.0)
        try:
            async with (
                httpx2.AsyncClient(headers={"Authorization": f"Bearer {servers['A'].token}"}, timeout=120) as http_a,
                httpx2.AsyncClient(headers={"Authorization": f"Bearer {servers['B'].token}"}, timeout=120) as http_b,
                Client(streamable_http_client(servers["A"].url + "/mcp", http_client=http_a)) as client_a,
                Client(streamable_http_client(servers["B"].url + "/mcp", http_client=http_b)) as client_b,
            ):
                clients = {"A": client_a, "B": client_b}

                async def call(key: str) -> float:
                    pid = servers[key].process.pid
                    before = cpu_seconds(pid)
                    started = time.perf_counter()
                    result = await clients[key].call_tool("execute_code", {"code": "1+1", "session_id": kernels[key]})
                    elapsed = time.perf_counter() - started
                    cpu[key] += cpu_seconds(pid) - before
                    assert not result.is_error and result.structured_content["results"][0]["data"]["text/plain"] == "2", result.content[
                        0
                    ].text
                    return elapsed

                async def direct() -> float:
                    return await execute_rtt(bare_kc)

                runs = {"A": lambda: call("A"), "B": lambda: call("B"), "direct": direct}
                for _ in range(30):  # warm-up, not kept
                    for run in runs.values():
                        await run()
                cpu = dict.fromkeys(trees, 0.0)
                for _ in range(calls):
                    order = list(runs)
                    random.shuffle(order)
                    for key in order:
                        samples[key].append(await runs[key]())
        finally:
            await stop_kernel(bare_km, bare_kc)
        return {
            key: {
                "p50_ms": percentile(values, 50) * 1000,
                "p95_ms": percentile(values, 95) * 1000,
                **({"cpu_ms_per_call": cpu[key] / calls * 1000} if key in cpu else {}),
            }
            for key, values in samples.items()
        }
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="checkout A, the code before the change")
    parser.add_argument("new", help="checkout B, the code after it")
    parser.add_argument("-n", "--calls", type=int, default=500, help="calls to each gateway (500)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls {args.calls}: give at least 1")
    trees = {"A": checkout(args.old), "B": checkout(args.new)}
    figures = asyncio.run(measure(trees, args.calls))
    for key, label in (("A", f"A {trees['A']}"), ("B", f"B {trees['B']}"), ("direct", "direct client, bare kernel")):
        figure = figures[key]
        cpu = f", gateway CPU {figure['cpu_ms_per_call']:.2f} ms per call" if "cpu_ms_per_call" in figure else ""
        print(f"{label}: p50 {figure['p50_ms']:.2f} / p95 {figure['p95_ms']:.2f} ms{cpu}")
    print(
        f"B - A: p50 {figures['B']['p50_ms'] - figures['A']['p50_ms']:+.2f} ms, gateway CPU "
        f"{figures['B']['cpu_ms_per_call'] - figures['A']['cpu_ms_per_call']:+.2f} ms per call (n={args.calls})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
