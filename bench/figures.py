"""Every figure of the run, each measured beside a bare ipykernel in the same run (interleaved where it can be)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.environment import available_mib, machine, settle
from bench.kernels import (
    drain_iopub,
    execute_rtt,
    execute_to_idle,
    first_stdout,
    kernel_memory,
    kernel_rss,
    pss_bytes,
    start_kernel,
    start_kernel_again_if_it_dies,
    stop_kernel,
)
from bench.memory import fork_servers, gateway_session_pss, memory_at_scale
from bench.servers import KernelSocket, start_gateway, start_plain_jupyter_server
from bench.stats import summary

BARE = "python3"
MSB = "msb-python-small"
MiB = 1024 * 1024
# (MSB_BACKEND, MSB_TRANSPORT) of the side-by-side figure: each backend, and the namespace sandbox over tcp
SIDE_BY_SIDE = (("namespace", "ipc"), ("namespace", "tcp"), ("gvisor", "ipc"), ("microsandbox", "tcp"))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


class Bench:
    """One run's results; each method measures one group of figures into results["figures"]."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.results: dict[str, Any] = {
            "machine": machine(),
            "mode": "quick" if args.quick else "full",
            "counts": {k: v for k, v in vars(args).items() if k != "quick"},
            "baseline": BARE,
            "sandboxed": MSB,
            "backend": args.backend,
            "figures": {},
        }
        self.figures = self.results["figures"]

    async def cold_start(self) -> None:
        from msb_kernels.backends import backend_classes

        backends: dict[str, Any] = {}
        for name, cls in backend_classes().items():
            availability = cls.availability()
            backends[name] = {"available": availability.ok, "reason": availability.reason}
        for name in ("namespace", "gvisor", "microsandbox"):
            backends.setdefault(name, {"available": False, "reason": "not installed"})
        starts: dict[str, list[float]] = {BARE: []}
        available = [name for name, info in backends.items() if info["available"]]
        for name in available:
            starts[name] = []
        # The other flavors on the run's backend: a fork server serves every flavor, the warm pool only python-small.
        flavors = {f"{self.args.backend}:{flavor}": f"msb-python-{flavor}" for flavor in ("medium", "large")}
        starts.update({key: [] for key in flavors})
        log(
            f"cold start: {self.args.starts} starts each of {BARE}, {', '.join(available)} and {', '.join(flavors)}, interleaved, "
            "after a first untimed round (which starts the fork servers)"
        )
        for round_ in range(self.args.starts + 1):
            for name in starts:
                os.environ["MSB_BACKEND"] = name.split(":")[0] if name != BARE else self.args.backend
                elapsed, km, kc = await start_kernel(BARE if name == BARE else flavors.get(name, MSB))
                if round_:
                    starts[name].append(elapsed)
                await stop_kernel(km, kc)
                await settle()  # a stopped sandbox's teardown (gVisor's runsc above all) ends before the next start
        os.environ["MSB_BACKEND"] = self.args.backend
        bare = summary(starts[BARE])
        for name, info in backends.items():
            if info["available"]:
                info["start"] = summary(starts[name])
                info["ratio_p50"] = info["start"]["p50_ms"] / bare["p50_ms"]
                info["ratio_p95"] = info["start"]["p95_ms"] / bare["p95_ms"]
            else:
                info["result"] = f"unavailable: {info['reason']}"
        by_flavor = {"small": backends[self.args.backend]["start"]} if "start" in backends.get(self.args.backend, {}) else {}
        by_flavor.update({key.split(":")[1]: summary(times) for key, times in starts.items() if key in flavors})
        self.figures["cold_start"] = {
            "bare": bare,
            "backends": backends,
            "flavors": by_flavor,
            "backend": self.args.backend,
            "fork_kernels": os.environ.get("MSB_FORK_KERNELS", "true"),
            "fork_servers": fork_servers(),
        }

    async def mcp_new_session(self) -> None:
        from mcp import Client

        from mcp_bridge.local_sessions import ManagedKernelSessions
        from mcp_bridge.options import BridgeOptions
        from mcp_bridge.server import build_server
        from msb_kernels.identity.people import local_person
        from msb_kernels.settings.config import load_settings

        results = {}
        for label, pool_size in (("pool", "python-small=1"), ("no_pool", "0")):
            os.environ["MSB_POOL_SIZE"] = pool_size
            sessions = ManagedKernelSessions(start_timeout=120)
            settings = load_settings()
            server = build_server(sessions, settings, BridgeOptions.from_settings(settings), local_caller=local_person())
            pool = sessions.kernel_manager.pool
            pool.fill()
            times = []
            log(f"new MCP session ({label}, MSB_POOL_SIZE={pool_size}): {self.args.new_sessions} sessions")
            try:
                async with Client(server) as client:
                    # The first tool call of a Python MCP client imports jsonschema (about 2 s here); not a session cost.
                    await client.call_tool("list_flavors", {})
                    for _ in range(self.args.new_sessions):
                        if pool_size != "0":
                            await wait_for(lambda pool=pool: pool.waiting() >= 1, 120, "the pool to fill")
                        started = time.perf_counter()
                        result = await client.call_tool("execute_code", {"code": "1+1"})
                        times.append(time.perf_counter() - started)
                        assert not result.is_error, result.content[0].text
                        data = result.structured_content
                        assert data["session_created"] is True, data
                        await client.call_tool("stop_session", {"session_id": data["session_id"]})
                    handed_out = pool.handed_out
            finally:
                await sessions.close()
            results[label] = {"pool_size": pool_size, "handed_out_by_pool": handed_out, **summary(times)}
        os.environ["MSB_POOL_SIZE"] = "0"
        self.figures["mcp_new_session"] = results

    async def round_trips(self) -> None:
        n = self.args.executes
        log(f"execute 1+1, direct client: {n} each, interleaved sandboxed/bare")
        _, msb_km, msb_kc = await start_kernel(MSB)
        _, bare_km, bare_kc = await start_kernel(BARE)
        os.environ["MSB_FORK_KERNELS"] = "false"  # beside it, a kernel that started its own interpreter: the round trip before forks
        try:
            _, exec_km, exec_kc = await start_kernel(MSB)
        finally:
            os.environ.pop("MSB_FORK_KERNELS")
        try:
            for kc in (msb_kc, bare_kc, exec_kc):
                for _ in range(20):
                    await execute_rtt(kc)
            direct: dict[str, list[float]] = {"msb": [], "bare": [], "msb_exec": []}
            for i in range(n):
                trio = [("msb", msb_kc), ("bare", bare_kc), ("msb_exec", exec_kc)]
                for key, kc in trio if i % 2 == 0 else trio[::-1]:
                    direct[key].append(await execute_rtt(kc))
                if i % 100 == 99:
                    for kc in (msb_kc, bare_kc, exec_kc):
                        await drain_iopub(kc)
            self.figures["execute_direct"] = {key: summary(times) for key, times in direct.items()}
            self.figures["execute_direct"]["msb_forked"] = msb_km.provisioner.sandbox.info().get("forked")
            await stop_kernel(exec_km, exec_kc)

            log(f"time to first stdout byte of print('x'): {self.args.stdout_samples} each, interleaved")
            ttfb: dict[str, list[float]] = {"msb": [], "bare": []}
            for i in range(self.args.stdout_samples):
                pair = [("msb", msb_kc), ("bare", bare_kc)]
                for key, kc in pair if i % 2 == 0 else pair[::-1]:
                    ttfb[key].append(await first_stdout(kc))
            self.figures["first_stdout"] = {"msb": summary(ttfb["msb"]), "bare": summary(ttfb["bare"])}
        finally:
            await stop_kernel(msb_km, msb_kc)
            await stop_kernel(bare_km, bare_kc)

    async def backends_side_by_side(self) -> None:
        """Round trip and idle memory of one kernel of every backend that runs here, and bare, in turn."""
        from msb_kernels.backends import backend_classes

        classes = backend_classes()
        variants = [(name, transport) for name, transport in SIDE_BY_SIDE if name in classes and classes[name].availability().ok]
        n = self.args.executes
        log(f"execute 1+1 and idle memory, side by side: {BARE} and {', '.join(f'{b}/{t}' for b, t in variants)}, {n} each, interleaved")
        kernels: dict[str, tuple[Any, Any]] = {}
        try:
            _, km, kc = await start_kernel(BARE)
            kernels["bare"] = (km, kc)
            for name, transport in variants:
                os.environ["MSB_BACKEND"], os.environ["MSB_TRANSPORT"] = name, transport
                _, km, kc = await start_kernel(MSB)
                kernels[f"{name}/{transport}"] = (km, kc)
            await asyncio.sleep(2)  # let them settle to idle
            rss = {key: kernel_rss(km) / MiB for key, (km, _) in kernels.items()}
            for _, kc in kernels.values():
                for _ in range(20):
                    await execute_rtt(kc)
            samples: dict[str, list[float]] = {key: [] for key in kernels}
            order = list(kernels)
            for i in range(n):
                for key in order[i % len(order) :] + order[: i % len(order)]:
                    samples[key].append(await execute_rtt(kernels[key][1]))
                if i % 100 == 99:
                    for _, kc in kernels.values():
                        await drain_iopub(kc)
        finally:
            os.environ["MSB_BACKEND"] = self.args.backend
            os.environ.pop("MSB_TRANSPORT", None)
            await asyncio.gather(*(stop_kernel(km, kc) for km, kc in kernels.values()))
        self.figures["side_by_side"] = {key: {"execute": summary(samples[key]), "rss_mib": rss[key]} for key in kernels}

    async def gateway_and_mcp(self) -> None:
        """Gateway WebSocket (sandboxed) beside jupyter_server's WebSocket to a bare kernel; MCP in memory and over HTTP."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from mcp_bridge.local_sessions import ManagedKernelSessions
        from mcp_bridge.options import BridgeOptions
        from mcp_bridge.server import build_server
        from msb_kernels.identity.people import local_person
        from msb_kernels.settings.config import load_settings

        n = self.args.executes
        log("starting msb-kernels serve and a plain jupyter server")
        gateway, plain = start_gateway(self.base), start_plain_jupyter_server(self.base)
        sessions = None
        try:
            await asyncio.gather(gateway.wait_up(), plain.wait_up())
            gw_kernel = (await gateway.request("POST", "/api/kernels", {"name": MSB}))["id"]
            plain_kernel = (await plain.request("POST", "/api/kernels", {"name": BARE}))["id"]
            gw_ws, plain_ws = await KernelSocket.open(gateway, gw_kernel), await KernelSocket.open(plain, plain_kernel)
            self.figures["gateway_session_pss"] = await gateway_session_pss(
                gateway, self.base / "gw", gw_kernel, more=2 if self.args.quick else 9
            )
            gw_quick = await KernelSocket.open(gateway, gw_kernel, quickack=True)
            plain_quick = await KernelSocket.open(plain, plain_kernel, quickack=True)
            # A direct bare client as well, so every WebSocket sample has a direct bare sample beside it.
            _, bare_km, bare_kc = await start_kernel(BARE)
            # And a direct client of a sandboxed kernel: MCP over HTTP against it is what the path alone adds.
            _, msb_km, msb_kc = await start_kernel(MSB)
            try:
                for _ in range(20):
                    await gw_ws.execute()
                    await plain_ws.execute()
                    await gw_quick.execute()
                    await plain_quick.execute()
                    await execute_rtt(bare_kc)
                log(f"execute 1+1 over the WebSocket: {n} each through msb-kernels serve and plain jupyter server")
                ws: dict[str, list[float]] = {"gateway": [], "plain": [], "gateway_quickack": [], "plain_quickack": [], "bare_direct": []}
                for i in range(n):
                    order = [
                        ("gateway", gw_ws.execute),
                        ("plain", plain_ws.execute),
                        ("gateway_quickack", gw_quick.execute),
                        ("plain_quickack", plain_quick.execute),
                        ("bare_direct", lambda: execute_rtt(bare_kc)),
                    ]
                    for key, run in order if i % 2 == 0 else order[::-1]:
                        ws[key].append(await run())
                    if i % 100 == 99:
                        await drain_iopub(bare_kc)
                self.figures["execute_websocket"] = {
                    "msb": summary(ws["gateway"]),
                    "bare_ws": summary(ws["plain"]),
                    "msb_quickack": summary(ws["gateway_quickack"]),
                    "bare_ws_quickack": summary(ws["plain_quickack"]),
                    "bare": summary(ws["bare_direct"]),
                }
                for ws_ in (gw_ws, plain_ws, gw_quick, plain_quick):
                    ws_.close()  # closed before the MCP part: an open socket would buffer its iopub broadcasts
                # A kernel of its own for MCP: jupyter_server keeps buffering a closed WebSocket's messages for its
                # reconnection, and that extra stream on gw_kernel costs every call (0.75 ms p50, side by side).
                mcp_kernel = (await gateway.request("POST", "/api/kernels", {"name": MSB}))["id"]

                settings = load_settings()
                sessions = ManagedKernelSessions(start_timeout=120)
                server = build_server(sessions, settings, BridgeOptions.from_settings(settings), local_caller=local_person())
                mcp: dict[str, list[float]] = {"memory": [], "http": [], "bare_direct": [], "bare_to_idle": [], "msb_to_idle": []}
                async with (
                    httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=120) as http,
                    Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as over_http,
                    Client(server) as in_memory,
                ):
                    created = await in_memory.call_tool("execute_code", {"code": "1+1"})
                    memory_session = created.structured_content["session_id"]
                    http_args = {"code": "1+1", "session_id": mcp_kernel}
                    memory_args = {"code": "1+1", "session_id": memory_session}

                    async def timed(client: Any, arguments: dict) -> float:
                        started = time.perf_counter()
                        result = await client.call_tool("execute_code", arguments)
                        elapsed = time.perf_counter() - started
                        assert not result.is_error and result.structured_content["results"][0]["data"]["text/plain"] == "2", result.content[
                            0
                        ].text
                        return elapsed

                    for _ in range(20):
                        await timed(in_memory, memory_args)
                        await timed(over_http, http_args)
                    log(f"MCP execute_code('1+1') on an existing session: {n} each in memory and over HTTP (/mcp)")
                    for i in range(n):
                        order = [
                            ("memory", lambda: timed(in_memory, memory_args)),
                            ("http", lambda: timed(over_http, http_args)),
                            ("bare_direct", lambda: execute_rtt(bare_kc)),
                            ("bare_to_idle", lambda: execute_to_idle(bare_kc)),
                            ("msb_to_idle", lambda: execute_to_idle(msb_kc)),
                        ]
                        for key, run in order if i % 2 == 0 else order[::-1]:
                            mcp[key].append(await run())
                        if i % 100 == 99:
                            await drain_iopub(bare_kc)
                self.figures["execute_mcp"] = {
                    "memory": summary(mcp["memory"]),
                    "http": summary(mcp["http"]),
                    "bare": summary(mcp["bare_direct"]),
                    "bare_to_idle": summary(mcp["bare_to_idle"]),
                    "msb_to_idle": summary(mcp["msb_to_idle"]),
                }
            finally:
                for ws_ in (gw_ws, plain_ws, gw_quick, plain_quick):
                    ws_.close()
                await stop_kernel(bare_km, bare_kc)
                await stop_kernel(msb_km, msb_kc)
        finally:
            if sessions is not None:
                await sessions.close()
            gateway.stop()
            plain.stop()

    async def throughput_and_memory(self) -> None:
        count, seconds = self.args.parallel, self.args.throughput_seconds
        result: dict[str, Any] = {"sessions": count, "seconds": seconds}
        memory: dict[str, Any] = {}
        for key, name in (("bare", BARE), ("msb", MSB)):
            log(f"throughput and idle memory: {count} {name} sessions")
            kernels = [await start_kernel(name) for _ in range(count)]
            try:
                await asyncio.sleep(2)  # let them settle to idle
                measured = [kernel_memory(km) for _, km, _ in kernels]
                rss, pss, uss, processes = ([m[field] for m in measured] for field in ("rss", "pss", "uss", "processes"))
                memory[key] = {
                    "sessions": count,
                    "rss_mib_mean": statistics.fmean(rss) / MiB,
                    "rss_mib_median": statistics.median(rss) / MiB,
                    "processes_per_session": statistics.median(processes),
                    "pss_mib_median": statistics.median(pss) / MiB,
                    "uss_mib_median": statistics.median(uss) / MiB,
                }
                if key == "msb":
                    memory["fork_server_pss_mib"] = sum(pss_bytes(server["pid"]) for server in fork_servers()) / MiB
                deadline = time.perf_counter() + seconds

                async def worker(kc: Any, deadline: float = deadline) -> int:
                    done = 0
                    while time.perf_counter() < deadline:
                        await execute_rtt(kc)
                        done += 1
                    return done

                started = time.perf_counter()
                done = await asyncio.gather(*(worker(kc) for _, _, kc in kernels))
                elapsed = time.perf_counter() - started
                result[key] = {"executions": sum(done), "per_second": sum(done) / elapsed}
            finally:
                await asyncio.gather(*(stop_kernel(km, kc) for _, km, kc in kernels))
        result["ratio"] = result["msb"]["per_second"] / result["bare"]["per_second"]
        memory["added_mib"] = memory["msb"]["rss_mib_median"] - memory["bare"]["rss_mib_median"]
        self.figures["throughput"] = result
        self.figures["idle_memory"] = memory

    async def burst(self) -> None:
        """N kernels asked for at once: when the first, the median and the last answer (MSB_CONCURRENT_STARTS)."""
        n = self.args.burst
        runs: dict[str, Any] = {}
        for key, name, turns in (("bare", BARE, None), ("msb", MSB, None), ("msb_all_at_once", MSB, n)):
            log(f"burst: {n} {name} kernels at once" + (f" (MSB_CONCURRENT_STARTS={turns})" if turns else ""))
            if turns:
                os.environ["MSB_CONCURRENT_STARTS"] = str(turns)
            began = time.perf_counter()

            async def ready(name: str = name, began: float = began) -> tuple[float, int, Any, Any]:
                starts, km, kc = await start_kernel_again_if_it_dies(name, timeout=600)
                return time.perf_counter() - began, starts, km, kc

            try:
                started = await asyncio.gather(*(ready() for _ in range(n)))
            finally:
                os.environ.pop("MSB_CONCURRENT_STARTS", None)
            await asyncio.gather(*(stop_kernel(km, kc) for _, _, km, kc in started))
            times = sorted(elapsed for elapsed, _, _, _ in started)
            runs[key] = {
                "first_s": times[0],
                "median_s": statistics.median(times),
                "last_s": times[-1],
                "started_again": sum(starts - 1 for _, starts, _, _ in started),
            }
        runs["kernels"] = n
        runs["turns"] = int(os.environ.get("MSB_CONCURRENT_STARTS") or len(os.sched_getaffinity(0)))
        self.figures["burst"] = runs

    async def capacity_and_growth(self) -> None:
        levels = sorted(set(self.args.levels))
        target = max(self.args.capacity, max(levels))
        growth: dict[str, Any] = {"levels": levels}
        capacity: dict[str, Any] = {"tried": target}
        # The live managers share one context, sized as the gateway sizes its own: one each would be an I/O thread
        # each, and one of ZeroMQ's default size stops near 500 kernels (issue 39).
        import zmq.asyncio

        from msb_kernels.provisioning.limits import size_zmq_context

        context = zmq.asyncio.Context()
        size_zmq_context(context, target)
        for key, name in (("msb", MSB), ("bare", BARE)):
            # Bare kernels go up to the cost-growth levels only: 500 of them would take some 25 GiB.
            steps = [0, *levels, *([target] if key == "msb" and target not in levels else [])]
            log(f"capacity and cost growth: up to {steps[-1]} live {name} sessions")
            live: list[tuple[Any, Any]] = []
            growth[key] = {}
            failure = None
            available_before = available_mib()
            try:
                for level in steps:
                    while len(live) < level and failure is None:
                        batch = min(self.args.batch, level - len(live))
                        outcome = await asyncio.gather(*(start_kernel(name, context=context) for _ in range(batch)), return_exceptions=True)
                        for item in outcome:
                            if isinstance(item, BaseException):
                                failure = failure or f"{type(item).__name__}: {item}"
                            elif live:
                                # Idle sessions keep no client: a client's channels cost ~20 fds in this
                                # process, and NamespaceSandbox._exited's select() fails once a pidfd is
                                # numbered past 1024 (see the README). Session 1 keeps its client.
                                item[2].stop_channels()
                                live.append((item[1], None))
                            else:
                                live.append((item[1], item[2]))
                    if failure is not None:
                        break
                    if level not in levels:
                        continue  # none yet, or the capacity beyond the growth levels: reached, then probed below
                    await asyncio.sleep(1)
                    starts = []
                    for _ in range(self.args.growth_starts):
                        elapsed, km, kc = await start_kernel(name)
                        starts.append(elapsed)
                        await stop_kernel(km, kc)
                    kc0 = live[0][1]
                    await drain_iopub(kc0)
                    rtts = [await execute_rtt(kc0) for _ in range(self.args.growth_executes)]
                    await drain_iopub(kc0)
                    growth[key][str(level)] = {"start": summary(starts), "execute": summary(rtts), "host_available_mib": available_mib()}
                    log(
                        f"  {len(live)} live: start p50 {growth[key][str(level)]['start']['p50_ms']:.0f} ms, "
                        f"execute p50 {growth[key][str(level)]['execute']['p50_ms']:.2f} ms"
                    )
                if key == "msb":
                    # every one of them still alive and answering a kernel_info request
                    alive = 0
                    for km, _ in live:
                        with contextlib.suppress(Exception):
                            if await km.is_alive():
                                probe = km.client()
                                probe.start_channels()
                                try:
                                    msg_id = probe.kernel_info()
                                    while (await probe.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
                                        pass
                                    alive += 1
                                finally:
                                    probe.stop_channels()
                    capacity.update(
                        reached=len(live),
                        answering=alive,
                        failure=failure,
                        clients="session 1 keeps a client; the others are idle with none attached",
                        host_available_mib_at_peak=available_mib(),
                    )
                    capacity["memory_at_peak"] = memory_at_scale([km for km, _ in live], available_before)
            finally:
                for first in range(0, len(live), 50):  # a shutdown opens sockets: 500 at once pass ZMQ's 1023 per context
                    await asyncio.gather(*(stop_kernel(km, kc) for km, kc in live[first : first + 50]))
        context.destroy(linger=0)
        self.figures["capacity"] = capacity
        self.figures["cost_growth"] = growth
