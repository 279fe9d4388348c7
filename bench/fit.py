"""How many idle small gVisor sessions fit on this host through the gateway, awake and with hibernation, and where
the count stops and why (issue 39, point 4). As root with runsc; it needs the whole machine:

    flock -x /tmp/heavy.lock timeout 1800 .venv/bin/python bench/fit.py --cap 40                  # the capacity check
    flock -x /tmp/heavy.lock timeout 1800 .venv/bin/python bench/fit.py --cap 150 --overcommit     # past it: the host
    flock -x /tmp/heavy.lock timeout 1800 .venv/bin/python bench/fit.py --cap 80 --hibernate 10    # idle ones sleep

One `msb-kernels serve` with MSB_BACKEND=gvisor, no pool, no culling, MSB_MAX_SESSIONS above the cap. Sessions are
started one after another with `POST /api/kernels` (msb-python-small: 1 CPU, 1 GiB) and left idle; the run stops at
the first refusal or failure, when the host's MemAvailable falls under --floor-mib or its tasks come within
--task-margin of kernel.pid_max (so a run never takes the memory or the PIDs other work on the host needs; under
ptrace an idle gVisor kernel holds some 170 host tasks), or at --cap. With --hibernate S the gateway checkpoints kernels idle for S seconds
(MSB_HIBERNATE_AFTER_SECONDS, transport tcp), and each session runs 1+1 once over the WebSocket after its start (the
gateway hibernates only kernels whose state is "idle", which a kernel no client has asked anything never is); a start refused by the capacity check then waits up to S + 60 s for
idle kernels to sleep and is tried again, and the run stops where it is still refused. --overcommit sets
MSB_CAPACITY_MEMORY_MIB far above the host's memory, so only the host stops the count. At the end, 1+1 runs over
the WebSocket in up to --sample of the sessions (a hibernated one wakes for it), then every session is deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.environment import isolate, meminfo_mib, raise_host_limits  # noqa: E402
from bench.servers import KernelSocket, Server, start_gateway  # noqa: E402


def used_mib() -> int:
    return (meminfo_mib("MemTotal") or 0) - (meminfo_mib("MemAvailable") or 0)


def host_tasks() -> int:
    """Every task (thread) on the host, from /proc/loadavg: under ptrace each guest thread is host tasks."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def pid_max() -> int:
    """kernel.pid_max: the most tasks the host runs at once, whoever owns them."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


async def stats(server: Server) -> dict:
    return await server.request("GET", "/api/msb/stats")


async def start_one(server: Server) -> tuple[int, dict]:
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        response = await http.post(server.url + "/api/kernels", json={"name": "msb-python-small"}, headers=server.headers)
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:500]}
    return response.status_code, body


async def fill(server: Server, cap: int, floor_mib: int, task_margin: int, hibernate: int) -> dict:
    """Start sessions until a refusal, a failure, the memory floor or the cap; what each step looked like."""
    before, tasks_before = used_mib(), host_tasks()
    ids: list[str] = []
    steps: list[dict] = []
    stop = f"the cap of {cap} sessions"
    begun = time.perf_counter()
    while len(ids) < cap:
        if (meminfo_mib("MemAvailable") or 0) < floor_mib:
            stop = f"the host's MemAvailable fell under --floor-mib {floor_mib} MiB (the run's guard for the host)"
            break
        if host_tasks() + task_margin > pid_max():
            stop = f"the host's tasks came within --task-margin {task_margin} of kernel.pid_max={pid_max()} (the run's guard)"
            break
        started = time.perf_counter()
        status, body = await start_one(server)
        if status == 429 and hibernate and "capacity" in str(body.get("message", "")):
            deadline = time.monotonic() + hibernate + 60
            while status == 429 and time.monotonic() < deadline:  # idle kernels sleep, and make room
                await asyncio.sleep(2)
                status, body = await start_one(server)
        if status != 201:
            stop = f"HTTP {status}: {body.get('message') or body}"
            break
        ids.append(body["id"])
        if hibernate:  # a kernel no client ever asked anything stays "starting", and only "idle" ones hibernate
            socket = await KernelSocket.open(server, body["id"])
            try:
                await socket.execute("1+1")
            finally:
                socket.close()
        now = await stats(server)
        steps.append(
            {
                "sessions": len(ids),
                "seconds": round(time.perf_counter() - started, 2),
                "host_used_mib": used_mib(),
                "host_tasks": host_tasks(),
                "hibernated": now["hibernation"]["hibernated_now"],
                "awake_memory_mb": now["total_memory_mb"],
            }
        )
        print(json.dumps(steps[-1]), flush=True)
    last = steps[-1] if steps else {"host_used_mib": before, "host_tasks": tasks_before, "hibernated": 0}
    n = max(1, len(ids))
    return {
        "sessions": len(ids),
        "stopped_by": stop,
        "minutes": round((time.perf_counter() - begun) / 60, 1),
        "host_used_mib_before": before,
        "host_used_mib_at_stop": last["host_used_mib"],
        "per_session_mib": round((last["host_used_mib"] - before) / n, 1),
        "host_tasks_before": tasks_before,
        "host_tasks_at_stop": last["host_tasks"],
        "tasks_per_session": round((last["host_tasks"] - tasks_before) / n, 1),
        "hibernated_at_stop": last["hibernated"],
        "mem_available_mib_at_stop": meminfo_mib("MemAvailable"),
        "ids": ids,
    }


async def answer(server: Server, ids: list[str], sample: int) -> dict:
    """1+1 over the WebSocket in a spread of the sessions: how many answered, and the slowest."""
    chosen = ids[:: max(1, len(ids) // max(1, sample))][:sample]
    answered, slowest, errors = 0, 0.0, []
    for kernel_id in chosen:
        try:
            socket = await KernelSocket.open(server, kernel_id)
            try:
                slowest = max(slowest, await socket.execute("1+1"))
                answered += 1
            finally:
                socket.close()
        except Exception as exc:  # a figure, not a crash: the report says which failed and why
            errors.append(f"{kernel_id}: {type(exc).__name__}: {exc}")
    return {"asked": len(chosen), "answered": answered, "slowest_s": round(slowest, 2), "errors": errors[:3]}


async def delete_all(server: Server, ids: list[str]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        for start in range(0, len(ids), 8):
            await asyncio.gather(
                *(http.delete(f"{server.url}/api/kernels/{kernel_id}", headers=server.headers) for kernel_id in ids[start : start + 8]),
                return_exceptions=True,
            )


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", type=int, default=40, help="most sessions to start (40)")
    parser.add_argument("--floor-mib", type=int, default=3072, help="stop when the host's MemAvailable falls under this (3072)")
    parser.add_argument("--task-margin", type=int, default=3000, help="stop when host tasks come this close to pid_max (3000)")
    parser.add_argument("--hibernate", type=int, default=0, metavar="S", help="MSB_HIBERNATE_AFTER_SECONDS (0: off)")
    parser.add_argument("--overcommit", action="store_true", help="MSB_CAPACITY_MEMORY_MIB far above the host's memory")
    parser.add_argument("--sample", type=int, default=5, help="sessions that run 1+1 at the end (5)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.cap < 1 or args.floor_mib < 0 or args.hibernate < 0:
        parser.error("--cap must be >= 1, --floor-mib and --hibernate >= 0")
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        raise SystemExit("bench/fit.py: run it as root on a host with runsc (apt-get install runsc)")

    base = Path(tempfile.mkdtemp(prefix="msbf-", dir="/tmp"))
    isolate(base, max_sessions=args.cap + 10, backend="gvisor")
    os.environ.update(MSB_PORT_RANGE=f"30000-{30000 + 5 * (args.cap + 20)}")  # 5 host ports per kernel over tcp
    if args.overcommit:
        os.environ["MSB_CAPACITY_MEMORY_MIB"] = str(2**20)
    if args.hibernate:
        key = base / "key"
        key.write_bytes(secrets.token_bytes(32))
        key.chmod(0o600)
        os.environ.update(
            MSB_TRANSPORT="tcp",
            MSB_HIBERNATE_AFTER_SECONDS=str(args.hibernate),
            MSB_HIBERNATE_DIR=str(base / "images"),
            MSB_HIBERNATE_KEY_FILE=str(key),
        )
    for said in raise_host_limits(args.cap):
        print(said)
    server = start_gateway(base)
    figures: dict = {}
    try:
        await server.wait_up()
        capacity = (await stats(server))["capacity"]
        figures = await fill(server, args.cap, args.floor_mib, args.task_margin, args.hibernate)
        figures["capacity_memory_mb"] = capacity["memory_mb"]
        figures["pid_max"] = pid_max()
        final = await stats(server)
        figures["images_mib"] = round((final["hibernation"].get("images_bytes") or 0) / 2**20, 1)
        figures["answers"] = await answer(server, figures["ids"], args.sample)
        await delete_all(server, figures["ids"])
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    figures.pop("ids", None)
    figures["settings"] = {
        name: os.environ[name] for name in ("MSB_TRANSPORT", "MSB_HIBERNATE_AFTER_SECONDS", "MSB_CAPACITY_MEMORY_MIB") if name in os.environ
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
