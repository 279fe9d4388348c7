"""Two gateways running two checkouts of this code, side by side: MCP execute_code('1+1') over /mcp and '1+1' over the
kernel WebSocket, one call to each in turn, and (with --starts) cold starts through each.

    .venv/bin/python bench/side_by_side.py OLD_CHECKOUT NEW_CHECKOUT [-n 500] [--starts 30]

Each gateway imports msb_kernels and mcp_bridge from its checkout (PYTHONPATH) and runs on this venv. Each
round calls A, B and a direct client of a bare kernel in a random order, so neither gateway always
follows the other; it prints p50 and p95 of each and the CPU each gateway spent per call. A cold start is
``POST /api/kernels`` (no pool) to the first '1+1' reply over the kernel's WebSocket, A's and B's in turn, in a
random order each round, the kernel deleted after. This VM drifts more between runs than most changes gain,
which is why a change is measured against the old code in the same minutes.
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
from bench.servers import KernelSocket, start_gateway  # noqa: E402
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


async def cold_start(server, name: str = MSB) -> float:
    """POST /api/kernels to the first '1+1' reply over the new kernel's WebSocket; the kernel is deleted after."""
    started = time.perf_counter()
    kernel = (await server.request("POST", "/api/kernels", {"name": name}))["id"]
    socket = await KernelSocket.open(server, kernel)
    try:
        await socket.execute("1+1")
        return time.perf_counter() - started
    finally:
        socket.close()
        await server.request("DELETE", f"/api/kernels/{kernel}")


async def measure(trees: dict[str, Path], calls: int, starts: int = 0) -> dict[str, dict]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    base = Path(tempfile.mkdtemp(prefix="msb-side-"))
    isolate(base, 10)
    servers = {key: start_gateway(base, log=f"gateway-{key}.log", runtime=f"gw{key}", code=tree) for key, tree in trees.items()}
    try:
        await asyncio.gather(*(server.wait_up() for server in servers.values()))
        for _ in range(2):  # warm-up, not kept: each gateway's fork server and first imports
            for server in servers.values():
                await cold_start(server)
        start_samples: dict[str, list[float]] = {f"{key}/start": [] for key in trees}
        for _ in range(starts):
            order = list(trees)
            random.shuffle(order)
            for key in order:
                start_samples[f"{key}/start"].append(await cold_start(servers[key]))
        kernels = {key: (await server.request("POST", "/api/kernels", {"name": MSB}))["id"] for key, server in servers.items()}
        sockets = {key: await KernelSocket.open(server, kernels[key]) for key, server in servers.items()}
        _, bare_km, bare_kc = await start_kernel(BARE)
        samples: dict[str, list[float]] = {key: [] for key in [*trees, *(f"{key}/ws" for key in trees), "direct"]}
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

                runs = {
                    "A": lambda: call("A"),
                    "B": lambda: call("B"),
                    "A/ws": sockets["A"].execute,
                    "B/ws": sockets["B"].execute,
                    "direct": direct,
                }
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
            for socket in sockets.values():
                socket.close()
            await stop_kernel(bare_km, bare_kc)
        return {
            key: {
                "p50_ms": percentile(values, 50) * 1000,
                "p95_ms": percentile(values, 95) * 1000,
                **({"cpu_ms_per_call": cpu[key] / calls * 1000} if key in cpu else {}),
            }
            for key, values in {**samples, **start_samples}.items()
            if values
        }
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="checkout A, the code before the change")
    parser.add_argument("new", help="checkout B, the code after it")
    parser.add_argument("-n", "--calls", type=int, default=500, help="calls to each gateway (500)")
    parser.add_argument("--starts", type=int, default=0, help="cold starts through each gateway, before the calls (0)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.starts < 0:
        parser.error(f"--calls {args.calls}, --starts {args.starts}: give at least 1 call and no negative starts")
    trees = {"A": checkout(args.old), "B": checkout(args.new)}
    figures = asyncio.run(measure(trees, args.calls, args.starts))
    labels = {"A": "MCP 1+1", "A/ws": "WebSocket 1+1", "A/start": "cold start to 1+1"}
    for what, label in labels.items():
        old, new = figures.get(what), figures.get("B" + what[1:])
        if old is None or new is None:
            continue
        cpu = f", gateway CPU {old['cpu_ms_per_call']:.2f} / {new['cpu_ms_per_call']:.2f} ms per call" if "cpu_ms_per_call" in old else ""
        print(
            f"{label}: A p50 {old['p50_ms']:.2f} / p95 {old['p95_ms']:.2f} ms, B p50 {new['p50_ms']:.2f} / p95 {new['p95_ms']:.2f} ms, "
            f"B/A p50 {new['p50_ms'] / old['p50_ms']:.3f}{cpu}"
        )
    direct = figures["direct"]
    print(f"direct client, bare kernel: p50 {direct['p50_ms']:.2f} / p95 {direct['p95_ms']:.2f} ms (n={args.calls}, starts={args.starts})")
    print(f"A {trees['A']}\nB {trees['B']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
