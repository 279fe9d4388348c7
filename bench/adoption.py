"""What keeping kernels through a gateway restart costs: the keepers' memory, and how soon the next gateway serves.

    .venv/bin/python bench/adoption.py                 # 10 kernels, each with a variable set
    .venv/bin/python bench/adoption.py --kernels 20
    .venv/bin/python bench/adoption.py --execute-cost 400  # what recording each cell for adoption costs an execute

kill -9 of `msb-kernels serve`, then a new one on the same runtime dir and port. Prints the time
from the new start to its port answering with every kernel adopted (beside the first start, with
nothing to adopt), the time to the first
execute on an old kernel, and each keeper's RSS and PSS (its unique share of memory), beside
one idle session's PSS for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate
from bench.servers import KernelSocket, start_gateway


def memory_kib(pid: int) -> tuple[int, int]:
    """RSS and PSS of one process, in KiB (smaps_rollup)."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            values[key] = int(rest.split()[0])
    return values["Rss"], values["Pss"]


def tree_pss_kib(root: int) -> int:
    """PSS of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += memory_kib(pid)[1]
        except (OSError, KeyError):
            pass
        todo.extend(children.get(pid, []))
    return total


async def measure(kernels: int) -> None:
    import json

    base = Path(tempfile.mkdtemp(prefix="msba-", dir="/tmp"))
    isolate(base, max_sessions=kernels + 1)
    started = time.perf_counter()
    first = start_gateway(base)
    await first.wait_up()
    empty_start = time.perf_counter() - started
    ids = [(await first.request("POST", "/api/kernels", {"name": "msb-python-small"}))["id"] for _ in range(kernels)]
    for number, kernel_id in enumerate(ids):
        ws = await KernelSocket.open(first, kernel_id)
        await ws.execute(f"kept = {number}")
        ws.connection.close()
    states = [json.loads(path.read_text()) for path in (base / "gw").glob("*/state.json")]
    keepers = [memory_kib(state["keeper_pid"]) for state in states]
    sessions = [tree_pss_kib(state["init_pid"]) for state in states]
    first.process.kill()
    first.process.wait()
    started = time.perf_counter()
    second = start_gateway(base, port=first.port, token=first.token, log="gateway-2.log")
    await second.wait_up()
    up = time.perf_counter() - started
    adopted = len((await second.request("GET", "/api/msb/stats"))["kernels"])
    ws = await KernelSocket.open(second, ids[-1])
    await ws.execute(f"assert kept == {kernels - 1}")
    first_execute = time.perf_counter() - started
    ws.connection.close()
    second.stop()
    print(
        f"{kernels} kernels: the new gateway answered in {up:.2f} s with {adopted} adopted (a start with nothing to "
        f"adopt: {empty_start:.2f} s); first execute on an old kernel {first_execute:.2f} s after its start"
    )
    print(
        f"keeper per kernel: RSS {statistics.median(r for r, _ in keepers) / 1024:.1f} MiB, "
        f"PSS {statistics.median(p for _, p in keepers) / 1024:.1f} MiB (median of {len(keepers)}); "
        f"an idle session's sandbox: PSS {statistics.median(sessions) / 1024:.1f} MiB"
    )


async def execute_cost(executes: int) -> None:
    """`1+1` over the WebSocket of two gateways, interleaved: kernels kept for adoption (MSB_ADOPT_GRACE_SECONDS=300,
    each cell's start and end recorded) and not (0)."""
    import os

    sockets, servers = {}, []
    for grace in ("0", "300"):
        base = Path(tempfile.mkdtemp(prefix=f"msbo{grace}-", dir="/tmp"))
        isolate(base, max_sessions=2)
        os.environ["MSB_ADOPT_GRACE_SECONDS"] = grace
        gateway = start_gateway(base)
        servers.append(gateway)
        await gateway.wait_up()
        kernel_id = (await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}))["id"]
        sockets[grace] = await KernelSocket.open(gateway, kernel_id)
    try:
        times: dict[str, list[float]] = {grace: [] for grace in sockets}
        for round_ in range(executes + 20):
            for grace, ws in sockets.items():
                took = await ws.execute()
                if round_ >= 20:  # warm-up first
                    times[grace].append(took)
        for grace, taken in times.items():
            taken.sort()
            print(
                f"MSB_ADOPT_GRACE_SECONDS={grace}: execute 1+1 p50 {statistics.median(taken) * 1000:.2f} ms, "
                f"p95 {taken[int(len(taken) * 0.95)] * 1000:.2f} ms (n={len(taken)})"
            )
    finally:
        for gateway in servers:
            gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=10)
    parser.add_argument("--execute-cost", type=int, metavar="N", help="instead: N executes with and without keeping")
    args = parser.parse_args()
    asyncio.run(execute_cost(args.execute_cost) if args.execute_cost else measure(args.kernels))


if __name__ == "__main__":
    main()
