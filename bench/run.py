"""msb-kernels benchmark harness: every figure beside a plain local ipykernel, in one run.

    .venv/bin/python bench/run.py            # the full run (about 10 minutes on 2 cores)
    .venv/bin/python bench/run.py --quick    # a short smoke run with small counts

Writes bench/results/bench.json, bench/results/bench.md and bench/results/bench.png.
The baseline is the kernelspec "python3" (ipykernel's own, no sandbox); the sandboxed
kernel is "msb-python-small". Absolute times drift on shared machines, so compare the
ratios and deltas, which come from samples taken side by side (interleaved) in the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import queue
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
VENV_BIN = Path(sys.executable).parent
BARE = "python3"
MSB = "msb-python-small"
MiB = 1024 * 1024


# -- environment -----------------------------------------------------------------------------------


def isolate(base: Path, max_sessions: int) -> None:
    """Own runtime dirs (short paths: ipc sockets), no stray MSB_* settings, room for the capacity run."""
    for name in list(os.environ):
        if name.startswith("MSB_"):
            del os.environ[name]
    os.environ["MSB_RUNTIME_DIR"] = str(base / "rt")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(base / "jr")
    os.environ["MSB_MAX_SESSIONS"] = str(max_sessions)
    os.environ["MSB_POOL_SIZE"] = "0"
    os.environ["MSB_SESSION_TIMEOUT_SECONDS"] = "0"
    os.environ["PATH"] = f"{VENV_BIN}:{os.environ.get('PATH', '')}"


def machine() -> dict:
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), None)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    import ipykernel
    import jupyter_client
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_mib": mem, "python": platform.python_version(),
            "linux": platform.release(), "ipykernel": ipykernel.__version__, "jupyter_client": jupyter_client.__version__,
            "user": "root" if os.geteuid() == 0 else "unprivileged"}


# -- statistics ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(seconds: list[float]) -> dict:
    return {"n": len(seconds), "p50_ms": percentile(seconds, 50) * 1000, "p95_ms": percentile(seconds, 95) * 1000,
            "mean_ms": statistics.fmean(seconds) * 1000, "min_ms": min(seconds) * 1000, "max_ms": max(seconds) * 1000}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- direct kernel clients -------------------------------------------------------------------------


async def start_kernel(name: str, timeout: float = 120) -> tuple[float, Any, Any]:
    """create -> first kernel_info reply; returns (seconds, manager, client)."""
    from jupyter_client.manager import AsyncKernelManager

    started = time.perf_counter()
    km = AsyncKernelManager(kernel_name=name)
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=timeout)
    except BaseException:
        kc.stop_channels()
        with contextlib.suppress(Exception):
            await km.shutdown_kernel(now=True)
        raise
    return time.perf_counter() - started, km, kc


async def stop_kernel(km: Any, kc: Any) -> None:
    if kc is not None:
        kc.stop_channels()
    with contextlib.suppress(Exception):
        await km.shutdown_kernel(now=True)


async def drain_iopub(kc: Any) -> None:
    while True:
        try:
            await kc.get_iopub_msg(timeout=0)
        except queue.Empty:
            return


async def execute_rtt(kc: Any, code: str = "1+1") -> float:
    started = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        reply = await kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    elapsed = time.perf_counter() - started
    assert reply["content"]["status"] == "ok", reply["content"]
    return elapsed


async def first_stdout(kc: Any) -> float:
    """execute print('x') -> the first stdout stream message on iopub."""
    await drain_iopub(kc)
    started = time.perf_counter()
    msg_id = kc.execute("print('x')")
    while True:
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            elapsed = time.perf_counter() - started
            break
    while (await kc.get_shell_msg(timeout=60))["parent_header"].get("msg_id") != msg_id:
        pass
    return elapsed


# -- memory ----------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kernel_processes(km: Any) -> set[int]:
    """Every host process a kernel consists of: the sandbox's cgroup and init's tree, or the bare kernel's tree."""
    provisioner = km.provisioner
    sandbox = getattr(provisioner, "sandbox", None)
    if sandbox is not None:
        pids = set(descendants(sandbox.init_pid))
        if getattr(sandbox, "cgroup", None) is not None:
            pids |= sandbox.cgroup.pids()
        return pids
    return descendants(provisioner.process.pid)


def kernel_rss(km: Any) -> int:
    return sum(rss_bytes(pid) for pid in kernel_processes(km))


# -- gateway websocket and servers -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server subprocess (msb-kernels serve, or a plain jupyter server) reached with a token."""

    def __init__(self, argv: list[str], env: dict, port: int, token: str, health: str, log_path: Path):
        self.port, self.token, self.health = port, token, health
        self.log_file = open(log_path, "wb")
        self.process = subprocess.Popen(argv, env=env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.request(method, self.url + path, json=body,
                                          headers={"Authorization": f"token {self.token}"})
        response.raise_for_status()
        return response.json() if response.content else None

    async def wait_up(self, timeout: float = 90) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.process.args[:2]} exited with {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                async with httpx.AsyncClient(timeout=5) as http:
                    response = await http.get(self.url + self.health, headers={"Authorization": f"token {self.token}"})
                    if response.status_code == 200:
                        return
            await asyncio.sleep(0.3)
        raise RuntimeError(f"{self.url} did not come up in {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_file.close()


def start_gateway(base: Path) -> Server:
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "MSB_RUNTIME_DIR": str(base / "gw"), "MSB_TOKEN": token, "MSB_POOL_SIZE": "0"}
    return Server([str(VENV_BIN / "msb-kernels"), "serve", "--port", str(port)], env, port, token,
                  "/api/msb/health", base / "gateway.log")


def start_plain_jupyter_server(base: Path) -> Server:
    """The bare baseline for the WebSocket path: jupyter_server itself, relaying a plain ipykernel."""
    port, token = free_port(), secrets.token_hex(16)
    root = base / "js-root"
    root.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSB_")}
    argv = [str(VENV_BIN / "jupyter"), "server", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
            f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}"]
    return Server(argv, env, port, token, "/api/status", base / "jupyter-server.log")


class KernelSocket:
    """A raw /api/kernels/{id}/channels WebSocket (JSON messages), as JupyterLab talks to a gateway."""

    def __init__(self, connection: Any, quickack: bool = False):
        self.connection = connection
        self.session = uuid.uuid4().hex
        # Diagnostic only: TCP_QUICKACK on this end acknowledges at once, which hides the server's Nagle
        # delay (jupyter_server does not set TCP_NODELAY on kernel WebSockets); see the README.
        self.socket = connection.stream.socket if quickack else None

    @classmethod
    async def open(cls, server: Server, kernel_id: str, quickack: bool = False) -> KernelSocket:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
        request = HTTPRequest(url, headers={"Authorization": f"token {server.token}"}, connect_timeout=60, request_timeout=60)
        return cls(await asyncio.wait_for(websocket_connect(request), 60), quickack)

    async def execute(self, code: str = "1+1") -> float:
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": self.session, "username": "bench",
                  "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}
        payload = json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                              "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                                          "allow_stdin": False, "stop_on_error": True}})
        started = time.perf_counter()
        self.connection.write_message(payload)
        while True:
            if self.socket is not None:
                self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            raw = await asyncio.wait_for(self.connection.read_message(), 60)
            if raw is None:
                raise ConnectionError("the kernel WebSocket closed")
            message = json.loads(raw)
            if message["header"]["msg_type"] == "execute_reply" and message["parent_header"].get("msg_id") == msg_id:
                return time.perf_counter() - started

    def close(self) -> None:
        self.connection.close()


# -- the measurements ------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, base: Path):
        self.args = args
        self.base = base
        self.results: dict[str, Any] = {"machine": machine(), "mode": "quick" if args.quick else "full",
                                        "counts": {k: v for k, v in vars(args).items() if k != "quick"},
                                        "baseline": BARE, "sandboxed": MSB, "figures": {}}
        self.figures = self.results["figures"]

    # cold start ---------------------------------------------------------------------------------

    async def cold_start(self) -> None:
        from msb_kernels.backends import backend_classes

        backends: dict[str, Any] = {}
        for name, cls in backend_classes().items():
            availability = cls.availability()
            backends[name] = {"available": availability.ok, "reason": availability.reason}
        for name in ("namespace", "microsandbox"):
            backends.setdefault(name, {"available": False, "reason": "not installed"})
        starts: dict[str, list[float]] = {BARE: []}
        available = [name for name, info in backends.items() if info["available"]]
        for name in available:
            starts[name] = []
        log(f"cold start: {self.args.starts} starts each of {BARE} and {', '.join(available)}, interleaved")
        for _ in range(self.args.starts):
            for name in starts:
                if name != BARE:
                    os.environ["MSB_BACKEND"] = name
                elapsed, km, kc = await start_kernel(BARE if name == BARE else MSB)
                starts[name].append(elapsed)
                await stop_kernel(km, kc)
        os.environ.pop("MSB_BACKEND", None)
        bare = summary(starts[BARE])
        for name, info in backends.items():
            if info["available"]:
                info["start"] = summary(starts[name])
                info["ratio_p50"] = info["start"]["p50_ms"] / bare["p50_ms"]
                info["ratio_p95"] = info["start"]["p95_ms"] / bare["p95_ms"]
            else:
                info["result"] = f"unavailable: {info['reason']}"
        self.figures["cold_start"] = {"bare": bare, "backends": backends}

    # new session through MCP --------------------------------------------------------------------

    async def mcp_new_session(self) -> None:
        from mcp import Client

        from mcp_bridge.options import BridgeOptions
        from mcp_bridge.server import build_server
        from mcp_bridge.sessions import ManagedKernelSessions
        from msb_kernels.config import load_settings

        results = {}
        for label, pool_size in (("pool", "python-small=1"), ("no_pool", "0")):
            os.environ["MSB_POOL_SIZE"] = pool_size
            sessions = ManagedKernelSessions(start_timeout=120)
            settings = load_settings()
            server = build_server(sessions, settings, BridgeOptions.from_settings(settings))
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
                            await wait_for(lambda: pool.waiting() >= 1, 120, "the pool to fill")
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

    # execute round trips ------------------------------------------------------------------------

    async def round_trips(self) -> None:
        n = self.args.executes
        log(f"execute 1+1, direct client: {n} each, interleaved sandboxed/bare")
        _, msb_km, msb_kc = await start_kernel(MSB)
        _, bare_km, bare_kc = await start_kernel(BARE)
        try:
            for kc in (msb_kc, bare_kc):
                for _ in range(20):
                    await execute_rtt(kc)
            direct: dict[str, list[float]] = {"msb": [], "bare": []}
            for i in range(n):
                pair = [("msb", msb_kc), ("bare", bare_kc)]
                for key, kc in (pair if i % 2 == 0 else pair[::-1]):
                    direct[key].append(await execute_rtt(kc))
                if i % 100 == 99:
                    await drain_iopub(msb_kc)
                    await drain_iopub(bare_kc)
            self.figures["execute_direct"] = {"msb": summary(direct["msb"]), "bare": summary(direct["bare"])}

            log(f"time to first stdout byte of print('x'): {self.args.stdout_samples} each, interleaved")
            ttfb: dict[str, list[float]] = {"msb": [], "bare": []}
            for i in range(self.args.stdout_samples):
                pair = [("msb", msb_kc), ("bare", bare_kc)]
                for key, kc in (pair if i % 2 == 0 else pair[::-1]):
                    ttfb[key].append(await first_stdout(kc))
            self.figures["first_stdout"] = {"msb": summary(ttfb["msb"]), "bare": summary(ttfb["bare"])}
        finally:
            await stop_kernel(msb_km, msb_kc)
            await stop_kernel(bare_km, bare_kc)

    async def gateway_and_mcp(self) -> None:
        """Gateway WebSocket (sandboxed) beside jupyter_server's WebSocket to a bare kernel; MCP in memory and over HTTP."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from mcp_bridge.options import BridgeOptions
        from mcp_bridge.server import build_server
        from mcp_bridge.sessions import ManagedKernelSessions
        from msb_kernels.config import load_settings

        n = self.args.executes
        log("starting msb-kernels serve and a plain jupyter server")
        gateway, plain = start_gateway(self.base), start_plain_jupyter_server(self.base)
        sessions = None
        try:
            await asyncio.gather(gateway.wait_up(), plain.wait_up())
            gw_kernel = (await gateway.request("POST", "/api/kernels", {"name": MSB}))["id"]
            plain_kernel = (await plain.request("POST", "/api/kernels", {"name": BARE}))["id"]
            gw_ws, plain_ws = await KernelSocket.open(gateway, gw_kernel), await KernelSocket.open(plain, plain_kernel)
            gw_quick = await KernelSocket.open(gateway, gw_kernel, quickack=True)
            plain_quick = await KernelSocket.open(plain, plain_kernel, quickack=True)
            # A direct bare client as well, so every WebSocket sample has a direct bare sample beside it.
            _, bare_km, bare_kc = await start_kernel(BARE)
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
                    order = [("gateway", gw_ws.execute), ("plain", plain_ws.execute), ("gateway_quickack", gw_quick.execute),
                             ("plain_quickack", plain_quick.execute), ("bare_direct", lambda: execute_rtt(bare_kc))]
                    for key, run in (order if i % 2 == 0 else order[::-1]):
                        ws[key].append(await run())
                    if i % 100 == 99:
                        await drain_iopub(bare_kc)
                self.figures["execute_websocket"] = {"msb": summary(ws["gateway"]), "bare_ws": summary(ws["plain"]),
                                                     "msb_quickack": summary(ws["gateway_quickack"]),
                                                     "bare_ws_quickack": summary(ws["plain_quickack"]), "bare": summary(ws["bare_direct"])}
                for ws_ in (gw_ws, plain_ws, gw_quick, plain_quick):
                    ws_.close()  # closed before the MCP part: an open socket would buffer its iopub broadcasts

                settings = load_settings()
                sessions = ManagedKernelSessions(start_timeout=120)
                server = build_server(sessions, settings, BridgeOptions.from_settings(settings))
                mcp: dict[str, list[float]] = {"memory": [], "http": [], "bare_direct": []}
                async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=120) as http, \
                        Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as over_http, \
                        Client(server) as in_memory:
                    created = await in_memory.call_tool("execute_code", {"code": "1+1"})
                    memory_session = created.structured_content["session_id"]
                    http_args = {"code": "1+1", "session_id": gw_kernel}
                    memory_args = {"code": "1+1", "session_id": memory_session}

                    async def timed(client: Any, arguments: dict) -> float:
                        started = time.perf_counter()
                        result = await client.call_tool("execute_code", arguments)
                        elapsed = time.perf_counter() - started
                        assert not result.is_error and result.structured_content["results"][0]["data"]["text/plain"] == "2", \
                            result.content[0].text
                        return elapsed

                    for _ in range(20):
                        await timed(in_memory, memory_args)
                        await timed(over_http, http_args)
                    log(f"MCP execute_code('1+1') on an existing session: {n} each in memory and over HTTP (/mcp)")
                    for i in range(n):
                        order = [("memory", lambda: timed(in_memory, memory_args)), ("http", lambda: timed(over_http, http_args)),
                                 ("bare_direct", lambda: execute_rtt(bare_kc))]
                        for key, run in (order if i % 2 == 0 else order[::-1]):
                            mcp[key].append(await run())
                        if i % 100 == 99:
                            await drain_iopub(bare_kc)
                self.figures["execute_mcp"] = {"memory": summary(mcp["memory"]), "http": summary(mcp["http"]),
                                               "bare": summary(mcp["bare_direct"])}
            finally:
                for ws_ in (gw_ws, plain_ws, gw_quick, plain_quick):
                    ws_.close()
                await stop_kernel(bare_km, bare_kc)
        finally:
            if sessions is not None:
                await sessions.close()
            gateway.stop()
            plain.stop()

    # throughput and memory ----------------------------------------------------------------------

    async def throughput_and_memory(self) -> None:
        count, seconds = self.args.parallel, self.args.throughput_seconds
        result: dict[str, Any] = {"sessions": count, "seconds": seconds}
        memory: dict[str, Any] = {}
        for key, name in (("bare", BARE), ("msb", MSB)):
            log(f"throughput and idle memory: {count} {name} sessions")
            kernels = [await start_kernel(name) for _ in range(count)]
            try:
                await asyncio.sleep(2)  # let them settle to idle
                rss = [kernel_rss(km) for _, km, _ in kernels]
                processes = [len(kernel_processes(km)) for _, km, _ in kernels]
                memory[key] = {"sessions": count, "rss_mib_mean": statistics.fmean(rss) / MiB,
                               "rss_mib_median": statistics.median(rss) / MiB, "processes_per_session": statistics.median(processes)}
                deadline = time.perf_counter() + seconds

                async def worker(kc: Any) -> int:
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

    # capacity and cost growth -------------------------------------------------------------------

    async def capacity_and_growth(self) -> None:
        levels = sorted(set(self.args.levels))
        target = max(self.args.capacity, max(levels))
        growth: dict[str, Any] = {"levels": levels}
        capacity: dict[str, Any] = {"tried": target}
        for key, name in (("msb", MSB), ("bare", BARE)):
            log(f"capacity and cost growth: up to {target} live {name} sessions")
            live: list[tuple[Any, Any]] = []
            growth[key] = {}
            failure = None
            try:
                for level in [0, *levels]:
                    while len(live) < level and failure is None:
                        batch = min(self.args.batch, level - len(live))
                        outcome = await asyncio.gather(*(start_kernel(name) for _ in range(batch)), return_exceptions=True)
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
                    if level == 0:
                        continue
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
                    growth[key][str(level)] = {"start": summary(starts), "execute": summary(rtts),
                                               "host_available_mib": available_mib()}
                    log(f"  {len(live)} live: start p50 {growth[key][str(level)]['start']['p50_ms']:.0f} ms, "
                        f"execute p50 {growth[key][str(level)]['execute']['p50_ms']:.2f} ms")
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
                    capacity.update(reached=len(live), answering=alive, failure=failure, clients="session 1 keeps a client; "
                                    "the others are idle with none attached", host_available_mib_at_peak=available_mib())
            finally:
                await asyncio.gather(*(stop_kernel(km, kc) for km, kc in live))
        self.figures["capacity"] = capacity
        self.figures["cost_growth"] = growth

    # targets, table, chart ----------------------------------------------------------------------

    def targets(self) -> list[dict]:
        f = self.figures
        out = []

        def add(name: str, measured: str, met: bool | None, note: str = "") -> None:
            out.append({"target": name, "measured": measured, "met": met, "note": note})

        ns = f["cold_start"]["backends"].get("namespace", {})
        if "ratio_p50" in ns:
            add("namespace cold start <= 1.2x bare", f"{ns['ratio_p50']:.2f}x (p50 {ns['start']['p50_ms']:.0f} vs "
                f"{f['cold_start']['bare']['p50_ms']:.0f} ms)", ns["ratio_p50"] <= 1.2)
        d = f["execute_direct"]
        delta = d["msb"]["p50_ms"] - d["bare"]["p50_ms"]
        add("execute RTT p50 within +1 ms of bare, direct", f"{delta:+.2f} ms ({d['msb']['p50_ms']:.2f} vs {d['bare']['p50_ms']:.2f} ms)",
            delta <= 1.0)
        w = f["execute_websocket"]
        delta_ws = w["msb"]["p50_ms"] - w["bare_ws"]["p50_ms"]
        delta_direct = w["msb"]["p50_ms"] - w["bare"]["p50_ms"]
        add("execute RTT p50 within +1 ms of bare, through the gateway",
            f"{delta_ws:+.2f} ms vs a bare kernel behind plain jupyter_server ({w['msb']['p50_ms']:.2f} vs {w['bare_ws']['p50_ms']:.2f} ms); "
            f"{delta_direct:+.2f} ms vs bare direct", delta_ws <= 1.0)
        m = f["execute_mcp"]["memory"]
        add("MCP execute_code('1+1') on an existing session p50 <= 15 ms",
            f"{m['p50_ms']:.2f} ms in memory, {f['execute_mcp']['http']['p50_ms']:.2f} ms over HTTP", m["p50_ms"] <= 15)
        p = f["mcp_new_session"]["pool"]
        add("new session from the warm pool p50 <= 50 ms", f"{p['p50_ms']:.1f} ms", p["p50_ms"] <= 50)
        c = f["capacity"]
        add("50 concurrent idle small sessions", f"{c['answering']} of {c['tried']} tried" +
            (f" (stopped: {c['failure']})" if c["failure"] else ""), c["answering"] >= 50 if c["tried"] >= 50 else None,
            "" if c["tried"] >= 50 else "not tried in this run (fewer than 50 asked for)")
        mem = f["idle_memory"]
        add("memory per idle session <= bare ipykernel RSS + 15 MiB",
            f"{mem['msb']['rss_mib_median']:.1f} MiB vs {mem['bare']['rss_mib_median']:.1f} MiB ({mem['added_mib']:+.1f} MiB)",
            mem["added_mib"] <= 15)
        return out

    def table(self) -> str:
        f = self.figures
        rows = ["| figure | sandboxed (msb-python-small) | bare ipykernel (python3) | sandboxed vs bare |", "|---|---|---|---|"]

        def pp(s: dict, digits: int = 2) -> str:
            return f"p50 {s['p50_ms']:.{digits}f} / p95 {s['p95_ms']:.{digits}f} ms"

        bare_start = f["cold_start"]["bare"]
        for name, info in f["cold_start"]["backends"].items():
            if info["available"]:
                rows.append(f"| cold start, {name} (n={info['start']['n']}) | {pp(info['start'], 0)} | {pp(bare_start, 0)} | "
                            f"{info['ratio_p50']:.2f}x p50, {info['ratio_p95']:.2f}x p95 |")
            else:
                rows.append(f"| cold start, {name} | {info['result']} | {pp(bare_start, 0)} | - |")
        for label, title in (("pool", "MSB_POOL_SIZE=python-small=1"), ("no_pool", "MSB_POOL_SIZE=0")):
            s = f["mcp_new_session"][label]
            rows.append(f"| new session via MCP execute_code, {title} (n={s['n']}) | {pp(s, 1)} | bare cold start {pp(bare_start, 0)} | "
                        f"{s['p50_ms'] / bare_start['p50_ms']:.2f}x p50 |")

        def rtt(title: str, s: dict, b: dict, bare_title: str = "") -> None:
            rows.append(f"| {title} (n={s['n']}) | {pp(s)} | {bare_title}{pp(b)} | {s['p50_ms'] - b['p50_ms']:+.2f} ms p50, "
                        f"{s['p95_ms'] - b['p95_ms']:+.2f} ms p95 |")

        rtt("execute 1+1, direct client", f["execute_direct"]["msb"], f["execute_direct"]["bare"])
        rtt("execute 1+1, gateway WebSocket", f["execute_websocket"]["msb"], f["execute_websocket"]["bare_ws"], "plain jupyter_server WS: ")
        rtt("execute 1+1, WebSockets, client with TCP_QUICKACK (diagnostic)", f["execute_websocket"]["msb_quickack"],
            f["execute_websocket"]["bare_ws_quickack"], "plain jupyter_server WS: ")
        rtt("execute 1+1, gateway WebSocket vs bare direct", f["execute_websocket"]["msb"], f["execute_websocket"]["bare"], "direct: ")
        rtt("MCP execute_code 1+1, in memory", f["execute_mcp"]["memory"], f["execute_mcp"]["bare"], "direct: ")
        rtt("MCP execute_code 1+1, HTTP /mcp of the gateway", f["execute_mcp"]["http"], f["execute_mcp"]["bare"], "direct: ")
        rtt("first stdout byte of print('x'), direct", f["first_stdout"]["msb"], f["first_stdout"]["bare"])
        t = f["throughput"]
        rows.append(f"| throughput, {t['sessions']} sessions in parallel, {t['seconds']} s | {t['msb']['per_second']:.0f} exec/s | "
                    f"{t['bare']['per_second']:.0f} exec/s | {t['ratio']:.2f}x |")
        m = f["idle_memory"]
        rows.append(f"| RSS per idle session (median of {m['msb']['sessions']}; all sandbox processes) | {m['msb']['rss_mib_median']:.1f} MiB "
                    f"({m['msb']['processes_per_session']:.0f} processes) | {m['bare']['rss_mib_median']:.1f} MiB | {m['added_mib']:+.1f} MiB |")
        c = f["capacity"]
        rows.append(f"| capacity: idle small sessions at once (tried {c['tried']}) | {c['answering']} answering"
                    f"{' (stopped: ' + c['failure'] + ')' if c['failure'] else ''} | - | - |")
        g = f["cost_growth"]
        for level in g["levels"]:
            s, b = g["msb"].get(str(level)), g["bare"].get(str(level))
            if s and b:
                rows.append(f"| with {level} live: start (n={s['start']['n']}) | {pp(s['start'], 0)} | {pp(b['start'], 0)} | "
                            f"{s['start']['p50_ms'] / b['start']['p50_ms']:.2f}x p50 |")
                rows.append(f"| with {level} live: execute 1+1 (n={s['execute']['n']}) | {pp(s['execute'])} | {pp(b['execute'])} | "
                            f"{s['execute']['p50_ms'] - b['execute']['p50_ms']:+.2f} ms p50 |")
        lines = ["\n".join(rows), "", "| target | measured | met |", "|---|---|---|"]
        for t in self.results["targets"]:
            lines.append(f"| {t['target']} | {t['measured']} | {verdict(t['met'])} |")
        return "\n".join(lines) + "\n"

    def chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        f = self.figures
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
        pairs = [("direct\nclient", f["execute_direct"]["msb"], f["execute_direct"]["bare"]),
                 ("WebSocket", w["msb"], w["bare_ws"]),
                 ("WebSocket,\nQUICKACK client", w["msb_quickack"], w["bare_ws_quickack"]),
                 ("MCP\nin memory", f["execute_mcp"]["memory"], f["execute_mcp"]["bare"]),
                 ("MCP\nHTTP /mcp", f["execute_mcp"]["http"], f["execute_mcp"]["bare"]),
                 ("first stdout\nprint('x')", f["first_stdout"]["msb"], f["first_stdout"]["bare"])]
        grouped_bars(axes[0][1], [p[0] for p in pairs], [p[1]["p50_ms"] for p in pairs], [p[2]["p50_ms"] for p in pairs],
                     "p50 ms", "Execute 1+1 round trip (bare: direct client; WebSocket: plain jupyter_server)")

        t, m = f["throughput"], f["idle_memory"]
        grouped_bars(axes[0][2], [f"{t['sessions']} sessions in parallel"], [t["msb"]["per_second"]], [t["bare"]["per_second"]],
                     "executions / s", "Aggregate throughput")
        grouped_bars(axes[1][0], ["RSS per idle session"], [m["msb"]["rss_mib_median"]], [m["bare"]["rss_mib_median"]],
                     "MiB", f"Idle memory (sandboxed: every process of the sandbox, {m['added_mib']:+.1f} MiB)")

        g = f["cost_growth"]
        for ax, part, title in ((axes[1][1], "start", "Start latency with N live sessions"),
                                (axes[1][2], "execute", "Execute 1+1 latency with N live sessions")):
            for key, style, color, label in (("msb", "-o", "C0", "sandboxed"), ("bare", "--s", "C1", "bare ipykernel")):
                levels = [lv for lv in g["levels"] if str(lv) in g[key]]
                ax.plot(levels, [g[key][str(lv)][part]["p50_ms"] for lv in levels], style, color=color, label=f"{label} p50")
                ax.plot(levels, [g[key][str(lv)][part]["p95_ms"] for lv in levels], style, color=color, alpha=0.4,
                        label=f"{label} p95")
            ax.set_xlabel("live sessions")
            ax.set_ylabel("ms")
            ax.set_xticks(g["levels"])
            ax.set_ylim(bottom=0)
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=8)
        c = f["capacity"]
        axes[1][1].annotate(f"capacity: {c['answering']} of {c['tried']} idle small sessions" +
                            (f"; stopped: {c['failure']}" if c["failure"] else ""), (0.02, 0.02), xycoords="axes fraction", fontsize=8)
        mach = self.results["machine"]
        fig.suptitle(f"msb-kernels (namespace sandbox) vs bare ipykernel, one run - {mach['cpus']} CPUs, "
                     f"{mach['memory_mib'] / 1024:.0f} GiB, Python {mach['python']}, Linux {mach['linux']} ({self.results['mode']} run)")
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


def available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return -1


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run with small counts")
    parser.add_argument("--starts", type=int, help="cold starts per kernel (10)")
    parser.add_argument("--new-sessions", type=int, help="new MCP sessions with and without the pool (10)")
    parser.add_argument("--executes", type=int, help="1+1 round trips per path (500)")
    parser.add_argument("--stdout-samples", type=int, help="print('x') samples (100)")
    parser.add_argument("--parallel", type=int, help="sessions for throughput and idle memory (10)")
    parser.add_argument("--throughput-seconds", type=float, help="seconds of parallel executes (5)")
    parser.add_argument("--capacity", type=int, help="idle small sessions to try at once (50)")
    parser.add_argument("--levels", type=int, nargs="+", help="live-session levels for cost growth (1 10 50)")
    parser.add_argument("--growth-starts", type=int, help="starts measured at each level (5)")
    parser.add_argument("--growth-executes", type=int, help="1+1 round trips at each level (100)")
    parser.add_argument("--batch", type=int, help="kernels started at once while filling up (5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory (bench/results)")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only rewrite the table and chart from an earlier bench.json")
    args = parser.parse_args(argv)
    full = dict(starts=10, new_sessions=10, executes=500, stdout_samples=100, parallel=10, throughput_seconds=5.0,
                capacity=50, levels=[1, 10, 50], growth_starts=5, growth_executes=100, batch=5)
    quick = dict(starts=3, new_sessions=3, executes=50, stdout_samples=10, parallel=3, throughput_seconds=1.0,
                 capacity=4, levels=[1, 4], growth_starts=2, growth_executes=20, batch=2)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


async def run(args: argparse.Namespace) -> dict:
    base = Path(tempfile.mkdtemp(prefix="msbb-", dir="/tmp"))  # short: ipc socket paths must fit in 107 bytes
    isolate(base, max_sessions=max(args.capacity, max(args.levels)) + 10)
    bench = Bench(args, base)
    began = time.perf_counter()
    try:
        await bench.cold_start()
        await bench.mcp_new_session()
        await bench.round_trips()
        await bench.gateway_and_mcp()
        await bench.throughput_and_memory()
        await bench.capacity_and_growth()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bench.results["runtime_seconds"] = time.perf_counter() - began
    bench.results["targets"] = bench.targets()
    args.out.mkdir(parents=True, exist_ok=True)
    table = bench.table()
    (args.out / "bench.json").write_text(json.dumps(bench.results, indent=1, default=str))
    (args.out / "bench.md").write_text(table)
    bench.chart(args.out / "bench.png")
    mach = bench.results["machine"]
    print(f"\n{bench.results['mode']} run, {bench.results['runtime_seconds']:.0f} s; {mach['cpus']} CPUs ({mach['cpu_model']}), "
          f"{mach['memory_mib']} MiB, Python {mach['python']}, Linux {mach['linux']}\n")
    print(table)
    for t in bench.results["targets"]:
        print(f"{verdict(t['met']).upper():7} {t['target']}: {t['measured']}")
    print(f"\nwrote {args.out / 'bench.json'}, bench.md, bench.png")
    return bench.results


def replot(args: argparse.Namespace) -> None:
    bench = Bench.__new__(Bench)
    bench.results = json.loads(args.replot.read_text())
    bench.figures = bench.results["figures"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(bench.table())
    bench.chart(args.out / "bench.png")
    print(bench.table())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
