"""The gateway's RSS, threads and open descriptors after repeated load runs, every kernel deleted after each.

    .venv/bin/python bench/gateway_soak.py --kernels 20 --executions 300 --runs 5

A run starts the kernels, sends each one's executions at once over its WebSocket, waits for every
reply, and deletes the kernels; then the gateway's own figures come from /api/msb/stats.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate
from bench.servers import KernelSocket, Server, start_gateway


async def one_run(gateway: Server, kernels: int, executions: int) -> None:
    from mcp_bridge import jupyter_ws

    ids = [(await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}))["id"] for _ in range(kernels)]

    async def pipelined(kernel_id: str) -> None:
        ws = await KernelSocket.open(gateway, kernel_id)
        waiting = set()
        for i in range(executions):
            request = jupyter_ws.message(
                "shell", "execute_request", jupyter_ws.execute_content(f"{i} + 1"), session=ws.session, username="bench"
            )
            waiting.add(request["header"]["msg_id"])
            ws.connection.write_message(jupyter_ws.encode(request))
        while waiting:
            message = jupyter_ws.parse(await ws.connection.read_message())
            if message is not None and message["msg_type"] == "execute_reply":
                waiting.discard(jupyter_ws.parent_id(message))
        ws.close()

    await asyncio.gather(*(pipelined(kernel_id) for kernel_id in ids))
    for kernel_id in ids:
        await gateway.request("DELETE", f"/api/kernels/{kernel_id}")


async def soak(kernels: int, executions: int, runs: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="msbs-", dir="/tmp"))
    isolate(base, max_sessions=kernels + 1)
    gateway = start_gateway(base)
    try:
        await gateway.wait_up()
        print(f"before: {(await gateway.request('GET', '/api/msb/stats'))['gateway']}")
        for number in range(runs):
            started = time.perf_counter()
            await one_run(gateway, kernels, executions)
            await asyncio.sleep(1)
            figures = (await gateway.request("GET", "/api/msb/stats"))["gateway"]
            print(
                f"after run {number + 1} ({kernels} kernels x {executions} executions, {time.perf_counter() - started:.0f} s): "
                f"RSS {figures['rss_mib']} MiB, {figures['threads']} threads, {figures['open_fds']} open descriptors"
            )
    finally:
        gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--executions", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(soak(args.kernels, args.executions, args.runs))


if __name__ == "__main__":
    main()
