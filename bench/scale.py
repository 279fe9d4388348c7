"""Idle sessions by the hundred through one `msb-kernels serve` (issue 39): do they all start, answer, list and cull?

    flock -x /tmp/heavy.lock timeout 3000 .venv/bin/python bench/scale.py --levels 100 500 1000 --write
    flock -s /tmp/heavy.lock timeout 600 .venv/bin/python bench/scale.py --quick

One gateway (namespace backend, small flavor, no pool) is filled level by level, the sessions of each level kept for
the next: half started with POST /api/kernels, half with MCP start_session over /mcp (the official client over
streamable HTTP), a few at a time. At each level: `1+1` on a random sample over the kernel WebSocket and over /mcp
execute_code, each checked to answer 2; GET /api/kernels and MCP get_sessions, each checked to list every session; the
host's memory, the sandboxes' PSS, and the gateway's RSS, threads and descriptors by kind, read from /proc; and the
gateway's event loop, timed by /api/msb/health polled throughout.

Then a cull of all of them by the culler: the gateway stops keeping its kernels (MSB_KEEP_KERNELS), and the next one,
on the same runtime dir, adopts them with MSB_SESSION_TIMEOUT_SECONDS short: every session is past it at once, so one
culler pass has all of them to cull. The gateway's own counter of culled kernels (msb_kernel_stops_total{how="culled"})
must reach the number started.

With --person (issue 47): a person's listings on a gateway of everyone's kernels. A gateway with a users file; pat
holds 5 kernels (notebook sessions, POST /api/sessions), and ops, an admin, fills the gateway to each level, half
with notebook sessions and half with bare kernels. At each level pat's GET /api/kernels, GET /api/sessions and MCP
get_sessions are timed, each checked to list pat's 5 and nothing else, and ops's beside them (an admin lists all):

    flock -x /tmp/heavy.lock timeout 3000 .venv/bin/python bench/scale.py --person --levels 100 1000 --write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.auth import users_file_token
from bench.environment import available_mib, isolate, machine, meminfo_mib, raise_host_limits
from bench.kernels import descendants, process_children, pss_bytes, rss_bytes
from bench.report import replace_section
from bench.servers import Server, start_gateway
from bench.stats import summary

REPO = Path(__file__).resolve().parent.parent
RESULTS_FILE = REPO / "bench" / "RESULTS.md"
JSON_FILE = REPO / "bench" / "results" / "scale.json"
SECTION = "## A thousand idle sessions through one gateway (issue 39)"
PERSON_JSON_FILE = REPO / "bench" / "results" / "scale-person.json"
PERSON_SECTION = "## A person's listings on a gateway of everyone's kernels (issue 47)"
PERSON_KERNELS = 5
PERSON_LISTS = 20  # timed lists of each kind, per person and level
PERSON_TARGET = 2.0  # issue 47: a person's listing at the last level costs at most this many times the first
KERNEL = "msb-python-small"
SMALL_MIB = 1024  # the small flavor's memory, as the capacity check counts it
MiB = 1024 * 1024


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class LoopWatch:
    """/api/msb/health polled every `every` seconds: its latency is the gateway's event loop, busy or free."""

    def __init__(self, gateway: Server, every: float = 0.1) -> None:
        self.gateway, self.every = gateway, every
        self.samples: list[float] = []
        self.task: asyncio.Task | None = None

    async def _poll(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=120) as http:
            while True:
                started = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    await http.get(self.gateway.url + "/api/msb/health")
                    self.samples.append(time.perf_counter() - started)
                await asyncio.sleep(self.every)

    def __enter__(self) -> LoopWatch:
        self.samples = []
        self.task = asyncio.ensure_future(self._poll())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.task is not None:
            self.task.cancel()

    def figures(self) -> dict:
        return summary(self.samples) if self.samples else {}


class Clients:
    """The bench's two ways in: REST (httpx) and one MCP client session over streamable HTTP."""

    def __init__(self, gateway: Server, token: str | None = None) -> None:
        self.gateway, self.token = gateway, token or gateway.token
        self.stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Clients:
        import httpx
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        self.http = await self.stack.enter_async_context(httpx.AsyncClient(timeout=600, headers={"Authorization": f"token {self.token}"}))
        mcp_http = await self.stack.enter_async_context(
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {self.token}"}, timeout=httpx2.Timeout(600))
        )
        self.mcp = await self.stack.enter_async_context(Client(streamable_http_client(self.gateway.url + "/mcp", http_client=mcp_http)))
        await self.mcp.call_tool("list_flavors", {})  # the client's first call imports jsonschema: not a session's cost
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stack.aclose()

    async def start_rest(self) -> str:
        response = await self.http.post(self.gateway.url + "/api/kernels", json={"name": KERNEL})
        if response.status_code != 201:
            raise RuntimeError(f"POST /api/kernels answered {response.status_code}: {response.text[:500]}")
        return response.json()["id"]

    async def start_notebook(self, path: str) -> str:
        """A notebook's session (POST /api/sessions, as JupyterLab opens one): a session row and its kernel."""
        body = {"path": path, "name": path, "type": "notebook", "kernel": {"name": KERNEL}}
        response = await self.http.post(self.gateway.url + "/api/sessions", json=body)
        if response.status_code != 201:
            raise RuntimeError(f"POST /api/sessions answered {response.status_code}: {response.text[:500]}")
        return response.json()["kernel"]["id"]

    async def list_sessions(self) -> tuple[float, set[str]]:
        started = time.perf_counter()
        response = await self.http.get(self.gateway.url + "/api/sessions")
        response.raise_for_status()
        return time.perf_counter() - started, {s["kernel"]["id"] for s in response.json()}

    async def start_mcp(self) -> str:
        result = await self.mcp.call_tool("start_session", {"flavor": "small"})
        if result.is_error:
            raise RuntimeError(f"MCP start_session: {result.content[0].text[:500]}")
        return result.structured_content["sessions"][0]["id"]

    async def execute_ws(self, kernel_id: str) -> float:
        """`1+1` over the kernel's WebSocket (opened, then closed as a notebook tab would); seconds to its reply."""
        from mcp_bridge import jupyter_ws

        connection = await jupyter_ws.connect(
            jupyter_ws.channels_url(self.gateway.url, kernel_id, uuid.uuid4().hex), self.gateway.token, 120
        )
        try:
            request = jupyter_ws.message(
                "shell", "execute_request", jupyter_ws.execute_content("1+1"), session=uuid.uuid4().hex, username="bench"
            )
            msg_id = request["header"]["msg_id"]
            started = time.perf_counter()
            connection.write_message(jupyter_ws.encode(request))
            result = replied = None
            while result is None or replied is None:
                raw = await asyncio.wait_for(connection.read_message(), 120)
                if raw is None:
                    raise ConnectionError(f"kernel {kernel_id}: the WebSocket closed")
                message = jupyter_ws.parse(raw)
                if message is None or jupyter_ws.parent_id(message) != msg_id:
                    continue
                if message["msg_type"] == "execute_result":
                    result = message["content"]["data"]["text/plain"]
                elif message["msg_type"] == "execute_reply":
                    replied = time.perf_counter() - started
            if result != "2":
                raise AssertionError(f"kernel {kernel_id}: 1+1 gave {result!r} over the WebSocket")
            return replied
        finally:
            connection.close()

    async def execute_mcp(self, kernel_id: str) -> float:
        started = time.perf_counter()
        result = await self.mcp.call_tool("execute_code", {"code": "1+1", "session_id": kernel_id})
        elapsed = time.perf_counter() - started
        data = result.structured_content or {}
        answer = (data.get("results") or [{}])[0].get("data", {}).get("text/plain")
        if result.is_error or answer != "2":
            raise AssertionError(f"kernel {kernel_id}: 1+1 over /mcp gave {answer!r}: {result.content[0].text[:300]}")
        return elapsed

    async def list_rest(self) -> tuple[float, set[str]]:
        started = time.perf_counter()
        response = await self.http.get(self.gateway.url + "/api/kernels")
        response.raise_for_status()
        return time.perf_counter() - started, {k["id"] for k in response.json()}

    async def list_mcp(self) -> tuple[float, set[str]]:
        started = time.perf_counter()
        result = await self.mcp.call_tool("get_sessions", {})
        elapsed = time.perf_counter() - started
        if result.is_error:
            raise RuntimeError(f"MCP get_sessions: {result.content[0].text[:300]}")
        return elapsed, {s["id"] for s in result.structured_content["sessions"]}


def fd_kinds(pid: int) -> dict[str, int]:
    """The process's descriptors by kind: socket, eventfd, eventpoll, pipe, pidfd, file, ..."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
            if kind == "anon_inode":
                kind = target.split(":", 1)[1].strip("[]")
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def thread_count(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def gateway_figures(pid: int) -> dict:
    """RSS, threads and descriptors of the gateway process.

    ZeroMQ sockets are counted by their mailboxes: libzmq gives every socket one eventfd (its command mailbox) and
    every context three more (its reaper's, its I/O thread's and its own), each with an epoll set for the first two.
    So sockets = eventfds - 3 x contexts, contexts = (eventpolls - 1) / 2, the 1 being the asyncio loop's own epoll."""
    kinds = fd_kinds(pid)
    contexts = max(0, (kinds.get("[eventpoll]", 0) + kinds.get("eventpoll", 0) - 1) // 2)
    eventfds = kinds.get("[eventfd]", 0) + kinds.get("eventfd", 0)
    return {
        "rss_mib": rss_bytes(pid) / MiB,
        "threads": thread_count(pid),
        "open_fds": sum(kinds.values()),
        "fd_kinds": kinds,
        "zmq_contexts": contexts,
        "zmq_sockets": max(0, eventfds - 3 * contexts),
    }


async def sandbox_memory(gateway: Server, runtime: Path, ids: list[str]) -> dict:
    """The sandboxes' PSS (every process of init's tree, from one /proc pass), and the shared helpers' beside it."""
    children = process_children()
    total = 0
    for kernel_id in ids:
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads((runtime / kernel_id / "state.json").read_text())
            total += sum(pss_bytes(pid) for pid in descendants(state["init_pid"], children))
    stats = await gateway.request("GET", "/api/msb/stats")
    fork_servers = sum(pss_bytes(s["pid"]) for s in stats.get("fork_servers", []) if s.get("pid"))
    keepers = [k["pid"] for k in stats.get("keepers", [])]
    return {
        "sandboxes_pss_mib": total / MiB,
        "pss_per_session_mib": total / MiB / max(1, len(ids)),
        "fork_servers_pss_mib": fork_servers / MiB,
        "keepers": len(keepers),
        "keepers_pss_mib": sum(pss_bytes(pid) for pid in keepers) / MiB,
        "keepers_open_fds": sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in keepers if Path(f"/proc/{pid}/fd").exists()),
        "gateway_active_sessions": stats.get("active_sessions"),
    }


async def gateway_metrics(gateway: Server) -> dict[str, float]:
    """The counters bench reads from the gateway's /metrics: kernels culled and adopted, and its culler's passes that
    culled nothing (their count and the seconds they took, summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        ("msb_kernel_stops_total", "how", "culled"): "culled",
        ("msb_kernel_adoptions_total", "outcome", "adopted"): "adopted",
        ("msb_cull_pass_seconds_count", None, None): "cull_passes",
        ("msb_cull_pass_seconds_sum", None, None): "cull_pass_seconds",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(await gateway.get_text("/metrics")):
        for sample in family.samples:
            for (name, label, value), key in wanted.items():
                if sample.name == name and (label is None or sample.labels.get(label) == value):
                    found[key] += sample.value
    return found


class ScaleRun:
    """One run: its gateway's runtime dir, the sessions started so far (and which way), and the results."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args, self.base = args, base
        self.runtime = base / "gw"
        self.ids: list[str] = []
        self.started_by: dict[str, str] = {}
        self.results: dict[str, Any] = {"machine": machine(), "levels": [], "limits": raise_host_limits(max(args.levels))}

    async def fill(self, clients: Clients, level: int) -> dict:
        """Start sessions up to level, `concurrency` at once, alternating REST and MCP; their start times by way."""
        times: dict[str, list[float]] = {"rest": [], "mcp": []}

        async def one(way: str) -> None:
            started = time.perf_counter()
            kernel_id = await (clients.start_rest() if way == "rest" else clients.start_mcp())
            times[way].append(time.perf_counter() - started)
            self.ids.append(kernel_id)
            self.started_by[kernel_id] = way

        began = time.perf_counter()
        while len(self.ids) < level:
            batch = min(self.args.concurrency, level - len(self.ids))
            ways = ["rest" if (len(self.ids) + i) % 2 == 0 else "mcp" for i in range(batch)]
            outcome = await asyncio.gather(*(one(way) for way in ways), return_exceptions=True)
            failures = [o for o in outcome if isinstance(o, BaseException)]
            if failures:
                raise RuntimeError(f"{len(failures)} start(s) failed at {len(self.ids)} sessions: {failures[0]}")
            if len(self.ids) % 100 < batch:
                log(f"  {len(self.ids)} sessions, {available_mib()} MiB available")
        return {
            "seconds": time.perf_counter() - began,
            "rest": summary(times["rest"]) if times["rest"] else {},
            "mcp": summary(times["mcp"]) if times["mcp"] else {},
            "all": summary(times["rest"] + times["mcp"]),
        }

    async def measure(self, clients: Clients, gateway: Server, level: int, used_before_mib: int, starts: dict) -> dict:
        await asyncio.sleep(2)  # idle
        memory_used = meminfo_mib("MemTotal") - available_mib()
        figures: dict[str, Any] = {"sessions": len(self.ids), "starts": starts}
        figures["gateway_before"] = gateway_figures(gateway.process.pid)
        passes_before = await gateway_metrics(gateway)
        with LoopWatch(gateway) as loop:
            sample = random.sample(self.ids, min(self.args.sample, len(self.ids)))
            ws, mcp = [], []
            for kernel_id in sample:  # WebSocket and /mcp in turn, kernel by kernel
                ws.append(await clients.execute_ws(kernel_id))
                mcp.append(await clients.execute_mcp(kernel_id))
            listed: dict[str, list[float]] = {"rest": [], "mcp": []}
            for _ in range(self.args.lists):
                for way, call in (("rest", clients.list_rest), ("mcp", clients.list_mcp)):
                    elapsed, found = await call()
                    missing = set(self.ids) - found
                    if missing:
                        raise AssertionError(f"{way} list at {len(self.ids)} sessions lacks {len(missing)}: {sorted(missing)[:3]}")
                    listed[way].append(elapsed)
        with LoopWatch(gateway) as idle:  # no request but the watch's own: at least one culler pass over them all
            await asyncio.sleep(self.args.cull_interval * 1.5)
        figures.update(
            loop_idle=idle.figures(),
            sampled=len(sample),
            execute_ws=summary(ws),
            execute_mcp=summary(mcp),
            list_rest=summary(listed["rest"]),
            list_mcp=summary(listed["mcp"]),
            loop=loop.figures(),
            host_used_mib=memory_used,
            host_used_by_sessions_mib=memory_used - used_before_mib,
            host_available_mib=available_mib(),
            memory=await sandbox_memory(gateway, self.runtime, self.ids),
            gateway=gateway_figures(gateway.process.pid),
        )
        figures["host_mib_per_session"] = figures["host_used_by_sessions_mib"] / max(1, len(self.ids))
        passes = await gateway_metrics(gateway)
        count = passes["cull_passes"] - passes_before["cull_passes"]
        figures["cull_pass_ms"] = 1000 * (passes["cull_pass_seconds"] - passes_before["cull_pass_seconds"]) / count if count else None
        g = figures["gateway"]
        log(
            f"  {level}: start p50 {starts['all']['p50_ms']:.0f} ms, ws 1+1 p50 {figures['execute_ws']['p50_ms']:.1f} ms, "
            f"mcp p50 {figures['execute_mcp']['p50_ms']:.1f} ms, list {figures['list_rest']['p50_ms']:.0f}/"
            f"{figures['list_mcp']['p50_ms']:.0f} ms, host {memory_used} MiB used, PSS/session "
            f"{figures['memory']['pss_per_session_mib']:.1f} MiB, gateway RSS {g['rss_mib']:.0f} MiB, {g['open_fds']} fds, "
            f"{g['threads']} threads, ~{g['zmq_sockets']} zmq sockets in {g['zmq_contexts']} contexts"
        )
        return figures

    async def levels(self) -> Server:
        env_first = {"MSB_KEEP_KERNELS": "true", "MSB_SESSION_TIMEOUT_SECONDS": "86400"}
        os.environ.update(env_first)
        gateway = start_gateway(self.base)
        await gateway.wait_up()
        self.results["gateway_log_limits"] = [line for line in self.log_lines() if "limits:" in line]
        used_before = meminfo_mib("MemTotal") - available_mib()
        self.results["host_used_before_mib"] = used_before
        try:
            async with Clients(gateway) as clients:
                for level in sorted(self.args.levels):
                    log(f"level {level}: starting {level - len(self.ids)} more sessions (REST and MCP in turn)")
                    try:
                        starts = await self.fill(clients, level)
                    except Exception as exc:
                        self.results["stopped"] = {
                            "at_sessions": len(self.ids),
                            "error": str(exc),
                            "host_available_mib": available_mib(),
                            "gateway": gateway_figures(gateway.process.pid) if gateway.process.poll() is None else None,
                        }
                        log(f"  stopped at {len(self.ids)} sessions: {exc}")
                        break
                    self.results["levels"].append({"level": level, **await self.measure(clients, gateway, level, used_before, starts)})
        except BaseException:
            await self.delete_all(gateway)  # this gateway keeps its kernels at a stop: none may outlive a failed run
            gateway.stop()
            raise
        return gateway

    async def delete_all(self, gateway: Server) -> None:
        for kernel_id in self.ids:
            with contextlib.suppress(Exception):
                await gateway.request("DELETE", f"/api/kernels/{kernel_id}")

    def log_lines(self) -> list[str]:
        path = self.base / "gateway.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    async def cull(self, gateway: Server) -> None:
        """The gateway goes, keeping its kernels; the next adopts them with a short idle timeout and culls them all."""
        n = len(self.ids)
        log(f"cull: stopping the gateway with MSB_KEEP_KERNELS, for the next to adopt {n} kernels and cull them")
        began = time.perf_counter()
        gateway.stop()
        stopped = time.perf_counter() - began
        os.environ.update(
            MSB_KEEP_KERNELS="false",
            MSB_SESSION_TIMEOUT_SECONDS=str(self.args.cull_timeout),
            MSB_CULL_INTERVAL_SECONDS=str(self.args.cull_interval),
        )
        began = time.perf_counter()
        successor = start_gateway(self.base, port=gateway.port, token=gateway.token, log="gateway-cull.log")
        try:
            await successor.wait_up(timeout=1800)  # adoption comes before the port opens
            up = time.perf_counter() - began
            # The culler starts with the gateway: some are gone before a first look. Its counters say what it did.
            adopted = int((await gateway_metrics(successor))["adopted"])
            log(f"  the next gateway is up in {up:.1f} s, having adopted {adopted} kernels; culling")
            gone_at: float | None = None
            first_at: float | None = None
            counts = []
            with LoopWatch(successor) as loop:
                culled_from = time.perf_counter()
                deadline = culled_from + self.args.cull_wait
                while time.perf_counter() < deadline:
                    culled = int((await gateway_metrics(successor))["culled"])
                    left = len((await successor.request("GET", "/api/kernels")) or [])
                    counts.append((round(time.perf_counter() - culled_from, 2), culled, left))
                    if first_at is None and culled:
                        first_at = time.perf_counter() - culled_from
                    if left == 0:
                        gone_at = time.perf_counter() - culled_from
                        break
                    await asyncio.sleep(0.5)
            culled = int((await gateway_metrics(successor))["culled"])
            self.results["cull"] = {
                "sessions": n,
                "stop_keeping_s": stopped,
                "adoption_s": up,
                "adopted": adopted,
                "timeout_s": self.args.cull_timeout,
                "interval_s": self.args.cull_interval,
                "culled_at_first_look": counts[0][1] if counts else None,
                "first_culled_after_s": first_at,
                "all_gone_after_s": gone_at,
                "left": counts[-1][2] if counts else None,
                "culled_counter": culled,
                "loop": loop.figures(),
                "progress": counts[:: max(1, len(counts) // 40)],
                "gateway": gateway_figures(successor.process.pid),
            }
            log(
                f"  culled {culled} of {n}: {counts[0][1] if counts else '?'} by the first look, all gone after {gone_at} s; "
                f"health p50 {self.results['cull']['loop'].get('p50_ms', 0):.1f} ms, max {self.results['cull']['loop'].get('max_ms', 0):.0f} ms"
            )
        finally:
            successor.stop()

    def leftovers(self) -> dict:
        """What the run left on the host: sandbox state dirs, the sandboxes' cgroups (msb-kernels/<id> under each
        controller) and processes still running as a sandbox's uid."""
        ids = set(self.ids)
        states = [p.name for p in self.runtime.iterdir() if (p / "state.json").exists()] if self.runtime.exists() else []
        cgroups = [str(group) for group in Path("/sys/fs/cgroup").glob("*/msb-kernels/*") if group.name in ids]
        cgroups += [str(group) for group in Path("/sys/fs/cgroup").glob("msb-kernels/*") if group.name in ids]
        return {"state_dirs": states, "cgroups": cgroups}


def fresh_base(args: argparse.Namespace, prefix: str) -> Path:
    """A run's own directory, this process's settings isolated to it, and room for the top level's sessions: on purpose
    past the host's memory (small kernels count 1 GiB each, and an idle one holds some 15 MiB)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    top = max(args.levels)
    isolate(base, max_sessions=top + 16)
    os.environ["MSB_CAPACITY_MEMORY_MIB"] = str((top + 16) * SMALL_MIB)
    return base


async def person_run(args: argparse.Namespace) -> dict:
    """--person: pat's listings, and ops's, at each level of everyone's kernels (see the module's docstring)."""
    begun = time.perf_counter()
    base = fresh_base(args, "msbsp-")
    results: dict[str, Any] = {"machine": machine(), "levels": [], "limits": raise_host_limits(max(args.levels))}
    results["args"] = dict(vars(args))
    users = base / "users.json"
    ops, pat = users_file_token(users, "ops", admin=True), users_file_token(users, "pat")
    gateway = start_gateway(base, token=ops, users_file=users)
    crowd: list[str] = []
    try:
        await gateway.wait_up()
        async with Clients(gateway) as everyone, Clients(gateway, token=pat) as person:
            mine = {await person.start_notebook(f"pat-{index}.ipynb") for index in range(PERSON_KERNELS)}
            notebooks = set(mine)  # the kernels that have a session row

            async def crowd_start(index: int) -> None:
                if index % 2:
                    notebooks.add(kernel_id := await everyone.start_notebook(f"crowd-{index}.ipynb"))
                else:
                    kernel_id = await everyone.start_rest()
                crowd.append(kernel_id)

            for level in sorted(args.levels):
                log(f"level {level}: ops starts {level - len(crowd) - len(mine)} more kernels")
                while len(crowd) + len(mine) < level:
                    batch = min(args.concurrency, level - len(crowd) - len(mine))
                    await asyncio.gather(*(crowd_start(len(crowd) + i) for i in range(batch)))
                await asyncio.sleep(2)  # idle
                figures: dict[str, Any] = {"sessions": len(crowd) + len(mine)}
                for who, clients, expected in (("person", person, mine), ("admin", everyone, mine | set(crowd))):
                    times: dict[str, list[float]] = {"kernels": [], "sessions": [], "get_sessions": []}
                    for _ in range(PERSON_LISTS):
                        for kind, call in (
                            ("kernels", clients.list_rest),
                            ("sessions", clients.list_sessions),
                            ("get_sessions", clients.list_mcp),
                        ):
                            elapsed, found = await call()
                            rows = expected if kind != "sessions" else expected & notebooks
                            if found != rows:
                                raise AssertionError(
                                    f"{who}'s {kind} at {figures['sessions']} kernels: {len(found)} listed, {len(rows)} expected"
                                )
                            times[kind].append(elapsed)
                    figures[who] = {kind: summary(values) for kind, values in times.items()}
                log(
                    f"  {figures['sessions']}: pat's kernels/sessions/get_sessions p50 "
                    + " / ".join(f"{figures['person'][k]['p50_ms']:.1f}" for k in ("kernels", "sessions", "get_sessions"))
                    + " ms; ops's "
                    + " / ".join(f"{figures['admin'][k]['p50_ms']:.1f}" for k in ("kernels", "sessions", "get_sessions"))
                    + " ms"
                )
                results["levels"].append(figures)
    finally:
        gateway.stop()  # no MSB_KEEP_KERNELS: a stop stops every kernel
        results["runtime_seconds"] = time.perf_counter() - begun
        shutil.rmtree(base, ignore_errors=True)
    return results


def person_section_lines(results: dict, command: str) -> list[str]:
    m, levels = results["machine"], results["levels"]
    if not levels:
        return ["", "No level was reached."]
    first = levels[0]
    rows = [
        "| p50 (ratio to the first level) | " + " | ".join(f"{level['sessions']} kernels" for level in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    names = {"kernels": "GET /api/kernels", "sessions": "GET /api/sessions", "get_sessions": "MCP `get_sessions`"}
    for who, title in (("person", "pat's (5 kernels)"), ("admin", "ops's (an admin: all)")):
        for kind, name in names.items():
            cells = [
                f"{level[who][kind]['p50_ms']:.1f} ms (×{level[who][kind]['p50_ms'] / first[who][kind]['p50_ms']:.2f})" for level in levels
            ]
            rows.append(f"| {title} {name} | " + " | ".join(cells) + " |")
    last = levels[-1]
    worst = max(last["person"][kind]["p50_ms"] / first["person"][kind]["p50_ms"] for kind in names)
    verdict = "met" if worst <= PERSON_TARGET else "not met"
    return [
        "",
        f"Written by `{command}` ({results['runtime_seconds'] / 60:.1f} minutes) on {m['cpus']} CPUs ({m['cpu_model']}), "
        f"{m['memory_mib']} MiB, namespace backend, small flavor, no pool. A gateway with a users file: pat holds "
        f"{PERSON_KERNELS} notebook sessions, ops (an admin) the rest, half notebook sessions and half bare kernels. "
        f"Each list ran {PERSON_LISTS} times per level, each checked to name exactly the caller's kernels (an admin's: all).",
        "",
        *rows,
        "",
        f"Target (issue 47): pat's three listings at {last['sessions']} kernels within {PERSON_TARGET:g}× of their cost at "
        f"{first['sessions']}: **{verdict}** (at most ×{worst:.2f}). An admin's lists name every kernel, so theirs grow with them.",
    ]


def ratio_rows(levels: list[dict]) -> list[str]:
    first = levels[0]

    def ratio(level: dict, key: str) -> str:
        return f"{level[key]['p50_ms']:.1f} ms (×{level[key]['p50_ms'] / first[key]['p50_ms']:.2f})"

    def start(level: dict) -> str:
        return f"{level['starts']['all']['p50_ms']:.0f} ms (×{level['starts']['all']['p50_ms'] / first['starts']['all']['p50_ms']:.2f})"

    rows = [
        "| sessions | " + " | ".join(str(level["sessions"]) for level in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    lines = {
        "start, p50 (REST and MCP, ratio to the first level)": start,
        "`1+1` over the WebSocket, p50": lambda level: ratio(level, "execute_ws"),
        "`1+1` over /mcp `execute_code`, p50": lambda level: ratio(level, "execute_mcp"),
        "GET /api/kernels, p50": lambda level: ratio(level, "list_rest"),
        "MCP `get_sessions`, p50": lambda level: ratio(level, "list_mcp"),
        "a culler pass over every kernel (none idle)": lambda level: (
            f"{level['cull_pass_ms']:.1f} ms" if level.get("cull_pass_ms") is not None else "-"
        ),
        "gateway event loop (/api/msb/health) p50 / max, while the sample ran and the lists": lambda level: (
            f"{level['loop'].get('p50_ms', 0):.1f} / {level['loop'].get('max_ms', 0):.0f} ms"
        ),
        "the same, idle but for the culler": lambda level: (
            f"{level['loop_idle'].get('p50_ms', 0):.1f} / {level['loop_idle'].get('max_ms', 0):.0f} ms" if "loop_idle" in level else "-"
        ),
        "host memory used by the sessions (per session)": lambda level: (
            f"{level['host_used_by_sessions_mib'] / 1024:.1f} GiB ({level['host_mib_per_session']:.1f} MiB)"
        ),
        "PSS per session (the sandbox's processes)": lambda level: f"{level['memory']['pss_per_session_mib']:.1f} MiB",
        "fork server + keeper PSS": lambda level: (
            f"{level['memory']['fork_servers_pss_mib']:.0f} + {level['memory']['keepers_pss_mib']:.0f} MiB"
        ),
        "gateway RSS": lambda level: f"{level['gateway']['rss_mib']:.0f} MiB",
        "gateway open fds (sockets)": lambda level: f"{level['gateway']['open_fds']} ({level['gateway']['fd_kinds'].get('socket', 0)})",
        "gateway threads": lambda level: str(level["gateway"]["threads"]),
        "keeper open fds": lambda level: str(level["memory"]["keepers_open_fds"]),
        "ZeroMQ sockets in the gateway (per session), contexts": lambda level: (
            f"{level['gateway']['zmq_sockets']} ({level['gateway']['zmq_sockets'] / level['sessions']:.1f}), "
            f"{level['gateway']['zmq_contexts']}"
        ),
    }
    for title, cell in lines.items():
        rows.append(f"| {title} | " + " | ".join(cell(level) for level in levels) + " |")
    return rows


def section_lines(results: dict, command: str) -> list[str]:
    m = results["machine"]
    lines = [
        "",
        f"Written by `{command}` ({results['runtime_seconds'] / 60:.1f} minutes) on {m['cpus']} CPUs ({m['cpu_model']}), "
        f"{m['memory_mib']} MiB, {m['user']}, namespace backend, small flavor, no pool. Each level keeps the sessions of "
        "the one before; half were started with POST /api/kernels, half with MCP `start_session`, "
        f"{results['args']['concurrency']} at a time. `1+1` ran on a random {results['args']['sample']} of them over "
        "the WebSocket and over /mcp, each answering 2, and both lists named every session. ZeroMQ sockets are "
        "counted by their mailboxes (an eventfd each) in /proc/<gateway>/fd, less three per context.",
        "",
        *(ratio_rows(results["levels"]) if results["levels"] else ["No level was reached."]),
    ]
    if "stopped" in results:
        s = results["stopped"]
        lines += ["", f"**Stopped** at {s['at_sessions']} sessions ({s['host_available_mib']} MiB available): {s['error']}"]
    c = results.get("cull")
    if c:
        gone = f"{c['all_gone_after_s']:.0f} s after that look" if c["all_gone_after_s"] is not None else "NOT gone within --cull-wait"
        lines += [
            "",
            f"**Cull**: {c['culled_counter']} of {c['sessions']} sessions culled by the culler "
            f"(MSB_SESSION_TIMEOUT_SECONDS={c['timeout_s']}, MSB_CULL_INTERVAL_SECONDS={c['interval_s']}). The next "
            f"gateway adopted {c['adopted']} in {c['adoption_s']:.0f} s; its culler starts with it, and had culled "
            f"{c.get('culled_at_first_look', '?')} by the bench's first look; all were gone "
            f"{gone}. /api/msb/health meanwhile: p50 {c['loop'].get('p50_ms', 0):.1f} ms, max "
            f"{c['loop'].get('max_ms', 0):.0f} ms.",
        ]
    if results.get("notes"):
        lines += ["", results["notes"]]
    said = [line.split("] ", 1)[-1] for line in results.get("gateway_log_limits", [])]
    if said:
        lines += ["", "The gateway at its start: " + "; ".join(f"`{line}`" for line in said) + "."]
    lines += ["", f"Left on the host after the run: {results.get('leftovers')}."]
    return lines


async def run(args: argparse.Namespace) -> dict:
    begun = time.perf_counter()
    base = fresh_base(args, "msbsc-")
    os.environ["MSB_CULL_INTERVAL_SECONDS"] = str(args.cull_interval)
    bench = ScaleRun(args, base)
    bench.results["args"] = {k: v for k, v in vars(args).items()}
    try:
        gateway = await bench.levels()
        await bench.cull(gateway)
    finally:
        bench.results["leftovers"] = bench.leftovers()
        bench.results["runtime_seconds"] = time.perf_counter() - begun
        shutil.rmtree(base, ignore_errors=True)
    return bench.results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[100, 500, 1000], help="session counts, each kept for the next")
    parser.add_argument("--quick", action="store_true", help="levels 5 and 10, a sample of 5: a smoke run")
    parser.add_argument("--sample", type=int, default=50, help="sessions that run 1+1 over each way at each level (50)")
    parser.add_argument("--lists", type=int, default=3, help="lists of each kind timed at each level (3)")
    parser.add_argument("--concurrency", type=int, default=4, help="starts in flight at once (4)")
    parser.add_argument("--cull-timeout", type=int, default=5, help="MSB_SESSION_TIMEOUT_SECONDS of the culling gateway (5)")
    parser.add_argument("--cull-interval", type=int, default=5, help="MSB_CULL_INTERVAL_SECONDS of both gateways (5)")
    parser.add_argument("--cull-wait", type=int, default=1800, help="seconds to wait for every session to be culled (1800)")
    parser.add_argument("--person", action="store_true", help="a person's listings among everyone's kernels (issue 47)")
    parser.add_argument("--replot", metavar="JSON", help="write RESULTS.md's section again from a run's JSON, running nothing")
    parser.add_argument("--write", action="store_true", help="write the run's JSON in bench/results and its section of RESULTS.md")
    args = parser.parse_args(argv)
    runner, lines_of, json_file, section = (
        (person_run, person_section_lines, PERSON_JSON_FILE, PERSON_SECTION) if args.person else (run, section_lines, JSON_FILE, SECTION)
    )
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        replace_section(RESULTS_FILE, section, lines_of(results, results.get("command", "bench/scale.py")))
        print(f"wrote {section!r} in {RESULTS_FILE} from {args.replot}")
        return
    if args.quick:
        args.levels, args.sample = ([10, 20] if args.person else [5, 10]), 5
    results = asyncio.run(runner(args))
    print(json.dumps({k: v for k, v in results.items() if k != "levels"}, indent=1, default=str)[:4000])
    command = results["command"] = " ".join(["bench/scale.py", *(argv if argv is not None else sys.argv[1:])])
    print("\n".join(lines_of(results, command)))
    if args.write:
        json_file.parent.mkdir(exist_ok=True)
        json_file.write_text(json.dumps(results, indent=1, default=str))
        replace_section(RESULTS_FILE, section, lines_of(results, command))
        print(f"wrote {json_file} and {section!r} in {RESULTS_FILE}")


if __name__ == "__main__":
    main()
