"""The gateway's memory over repeated load runs, every kernel gone after each: does it stay flat?

    .venv/bin/python bench/gateway_soak.py --runs 10

A run (issue 28's shape): 20 kernels each take 150 executions at once over their WebSockets (3,000), then 10 MCP
sessions each take 50 execute_code calls over /mcp with the official client (500), and every kernel is deleted.
After each run the gateway's RSS and the sizes of what it retains come from its /metrics (msb_gateway_resident_bytes,
msb_gateway_retained), read by prometheus_client's own parser. The verdict: every run's RSS within 10% of the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate
from bench.servers import KernelSocket, Server, start_gateway

FLAT_WITHIN = 0.10  # each run's RSS against the first run's


async def websocket_load(gateway: Server, kernels: int, executions: int) -> int:
    from mcp_bridge import jupyter_ws

    ids = [(await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}))["id"] for _ in range(kernels)]
    lost = 0

    async def pipelined(kernel_id: str) -> None:
        nonlocal lost
        ws = await KernelSocket.open(gateway, kernel_id)
        waiting, printed = set(), set()
        for i in range(executions):
            request = jupyter_ws.message(
                "shell", "execute_request", jupyter_ws.execute_content(f"print({i})"), session=ws.session, username="bench"
            )
            waiting.add(request["header"]["msg_id"])
            ws.connection.write_message(jupyter_ws.encode(request))
        expected = set(waiting)
        while waiting:  # each execution ends at its idle status, after all it printed
            message = jupyter_ws.parse(await ws.connection.read_message())
            if message is None:
                continue
            parent = jupyter_ws.parent_id(message)
            if message["msg_type"] == "stream" and parent in expected:
                printed.add(parent)
            elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                waiting.discard(parent)
        lost += len(expected - printed)
        ws.close()

    await asyncio.gather(*(pipelined(kernel_id) for kernel_id in ids))
    for kernel_id in ids:
        await gateway.request("DELETE", f"/api/kernels/{kernel_id}")
    return lost


async def mcp_load(gateway: Server, sessions: int, calls: int) -> int:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    lost = 0

    async def one_session() -> None:
        nonlocal lost
        headers = {"Authorization": f"Bearer {gateway.token}"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(300)) as http:
            async with Client(streamable_http_client(f"{gateway.url}/mcp", http_client=http)) as client:
                session_id = None
                for i in range(calls):
                    arguments = {"code": f"print({i})", **({"session_id": session_id} if session_id else {})}
                    result = await client.call_tool("execute_code", arguments)
                    session_id = result.structured_content["session_id"]
                    lost += result.structured_content.get("stdout") != f"{i}\n"
                await client.call_tool("stop_session", {"session_id": session_id})

    await asyncio.gather(*(one_session() for _ in range(sessions)))
    return lost


async def figures(gateway: Server) -> tuple[float, dict[str, float]]:
    """The gateway's RSS in MiB and its retained structures, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = await gateway.get_text("/metrics")
    rss, retained = 0.0, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "msb_gateway_resident_bytes":
                rss = sample.value / 2**20
            elif sample.name == "msb_gateway_retained":
                retained[sample.labels["structure"]] = sample.value
    return rss, retained


async def soak(kernels: int, executions: int, sessions: int, calls: int, runs: int, trace: str | None = None) -> list[float]:
    base = Path(tempfile.mkdtemp(prefix="msbs-", dir="/tmp"))
    isolate(base, max_sessions=kernels + sessions + 1)
    if trace:  # bench/tracing/sitecustomize.py, in the gateway
        os.environ.update(GATEWAY_SOAK_TRACE=trace, PYTHONPATH=str(Path(__file__).resolve().parent / "tracing"))
    gateway = start_gateway(base)
    results = []
    try:
        await gateway.wait_up()
        rss, _ = await figures(gateway)
        print(f"before: RSS {rss:.1f} MiB")
        for number in range(runs):
            started = time.perf_counter()
            lost = await websocket_load(gateway, kernels, executions) + await mcp_load(gateway, sessions, calls)
            await asyncio.sleep(1)
            if trace:
                gateway.process.send_signal(signal.SIGUSR2)  # the investigation's tracemalloc snapshot (see --trace)
                await asyncio.sleep(5)
            rss, retained = await figures(gateway)
            results.append(rss)
            held = ", ".join(f"{name} {int(size)}" for name, size in sorted(retained.items()) if size)
            print(
                f"after run {number + 1} ({kernels * executions} WebSocket executions, {sessions * calls} MCP calls, "
                f"{time.perf_counter() - started:.0f} s, {lost} outputs lost): RSS {rss:.1f} MiB; retained: {held or 'nothing'}"
            )
    finally:
        gateway.stop()
    worst = max(results) / results[0] - 1
    verdict = "flat" if worst <= FLAT_WITHIN else "NOT flat"
    print(f"{verdict}: the largest RSS after a run is {100 * worst:+.1f}% of the first run's ({results[0]:.1f} MiB)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--executions", type=int, default=150)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--trace", metavar="FILE", help="tracemalloc in the gateway: what grew between runs, appended to FILE")
    args = parser.parse_args()
    asyncio.run(soak(args.kernels, args.executions, args.sessions, args.calls, args.runs, args.trace))


if __name__ == "__main__":
    main()
