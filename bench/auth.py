"""What a person's token costs per request: `1+1` through the kernel WebSocket and MCP /mcp of three gateways at once.

    .venv/bin/python bench/auth.py [-n 300] [--no-hub]

The same code on three gateways, each asked with one token: the single token (MSB_TOKEN, today's path, the baseline),
a users file's person (MSB_USERS_FILE) and a JupyterHub user's API token (the gateway as the Hub's managed service,
deploy/jupyterhub/jupyterhub_config.py as tests/hub.py runs it; HubAuth's cache at its default, so the Hub is asked
again once per MSB_HUB_AUTH_CACHE_SECONDS and those calls are among the samples). Each gateway has two kernels of the
person's: one for a raw /api/kernels/<id>/channels WebSocket (execute_request -> execute_reply) and one for MCP
execute_code over streamable HTTP (to the result and idle), and a direct client of a bare local ipykernel is the
reference. Each round makes every call once, in a random order; it prints p50 and p95, each path's difference from the
single token at p50, and the CPU each gateway spent per call. The Hub's gateway is reached on its own port, as the
single-user servers reach it, not through the Hub's proxy: the proxy is a hop of its own, not auth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, sys.path starts at bench/
    sys.path.insert(0, str(REPO))

from bench.environment import VENV_BIN, isolate, machine  # noqa: E402
from bench.kernels import descendants, execute_rtt, start_kernel, stop_kernel  # noqa: E402
from bench.servers import KernelSocket, start_gateway  # noqa: E402
from bench.side_by_side import cpu_seconds  # noqa: E402
from bench.stats import percentile  # noqa: E402

MSB, BARE = "msb-python-small", "python3"
RESULTS = REPO / "bench" / "results"
PATHS = {"token": "single token (MSB_TOKEN)", "users": "users file (MSB_USERS_FILE)", "hub": "JupyterHub API token, cached"}
HUB_CHECK = "GET /hub/api/user "  # the Hub's access log line for each token HubAuth sends it (a cache miss)
TRANSPORTS = {"ws": "WebSocket", "mcp": "MCP /mcp"}  # each a kernel of its own
DIAGNOSTIC = {"rest": "REST GET /api/kernels/<id>"}  # every request authenticated; the WebSocket's only at its upgrade


@dataclass
class Endpoint:
    """One gateway as its person reaches it: base URL (a Hub service's prefix included), their token, its pid."""

    url: str
    token: str
    pid: int

    async def person(self) -> str:
        """Who the gateway takes this token for (jupyter_server's /api/me): the run checks it is the path it means."""
        import httpx

        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.get(self.url + "/api/me", headers={"Authorization": f"token {self.token}"})
        response.raise_for_status()
        return response.json()["identity"]["username"]

    async def start_kernel(self) -> str:
        import httpx

        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.post(self.url + "/api/kernels", json={"name": MSB}, headers={"Authorization": f"token {self.token}"})
        response.raise_for_status()
        return response.json()["id"]


def users_file_token(path: Path, person: str = "alice", admin: bool = False) -> str:
    """`msb-kernels users add` as an operator runs it; the token it prints once."""
    command = [str(VENV_BIN / "msb-kernels"), "users", "add", person, "--file", str(path), *(["--admin"] if admin else [])]
    added = subprocess.run(command, capture_output=True, text=True, check=True)
    first = added.stdout.splitlines()[0]  # "alice: <token>"
    return first.split(": ", 1)[1].strip()


def import_hub_harness():
    """tests/hub.py, without the test suite's environment: importing tests.conftest points MSB_* and JUPYTER_* at a
    fresh temp dir of its own, which this run does not use (only its empty directory, for the Hub's state)."""
    saved = dict(os.environ)
    try:
        from tests import conftest, hub
        from tests.skips import hub_unavailable
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return hub, conftest.TEST_BASE, hub_unavailable()


def gateway_pid(root: int) -> int:
    """The Hub's managed `msb-kernels serve`, among the Hub's processes."""
    for pid in sorted(descendants(root)):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(a.endswith(b"/msb-kernels") and b == b"serve" for a, b in zip(argv, argv[1:], strict=False)):  # python3 <script> serve
                return pid
    raise RuntimeError("no msb-kernels serve among the Hub's processes")


async def measure(calls: int, with_hub: bool) -> dict:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    base = Path(tempfile.mkdtemp(prefix="msb-auth-"))
    isolate(base, 20)
    hub = hub_base = None
    servers = []
    endpoints: dict[str, Endpoint] = {}
    try:
        single = start_gateway(base, log="gateway-token.log", runtime="gwt")
        users_path = base / "users.json"
        person_token = users_file_token(users_path)
        users = start_gateway(base, token=person_token, log="gateway-users.log", runtime="gwu", users_file=users_path)
        servers = [single, users]
        await asyncio.gather(single.wait_up(), users.wait_up())
        endpoints["token"] = Endpoint(single.url, single.token, single.process.pid)
        endpoints["users"] = Endpoint(users.url, users.token, users.process.pid)
        if with_hub:
            harness, hub_base, unavailable = import_hub_harness()
            if unavailable:
                raise SystemExit(f"auth.py: {unavailable}; --no-hub measures the other two paths")
            hub = await harness.launch_hub(users=("alice",))
            hub_token = await hub.token_for("alice")
            endpoints["hub"] = Endpoint(
                f"http://127.0.0.1:{hub.gateway_port}/services/{harness.SERVICE}", hub_token, gateway_pid(hub.process.pid)
            )
        people = {key: await endpoint.person() for key, endpoint in endpoints.items()}
        assert all(people[key] == "alice" for key in endpoints if key != "token"), people
        kernels = {key: {t: await endpoint.start_kernel() for t in TRANSPORTS} for key, endpoint in endpoints.items()}
        _, bare_km, bare_kc = await start_kernel(BARE)
        sockets = {key: await KernelSocket.open(endpoint, kernels[key]["ws"]) for key, endpoint in endpoints.items()}
        samples: dict[str, list[float]] = {f"{key}/{t}": [] for key in endpoints for t in (*TRANSPORTS, *DIAGNOSTIC)} | {"bare": []}
        cpu = dict.fromkeys(samples, 0.0)
        try:
            async with contextlib.AsyncExitStack() as stack:
                clients, rest = {}, {}
                for key, endpoint in endpoints.items():
                    http = await stack.enter_async_context(
                        httpx2.AsyncClient(headers={"Authorization": f"Bearer {endpoint.token}"}, timeout=120)
                    )
                    clients[key] = await stack.enter_async_context(Client(streamable_http_client(endpoint.url + "/mcp", http_client=http)))
                    rest[key] = await stack.enter_async_context(
                        httpx2.AsyncClient(base_url=endpoint.url, headers={"Authorization": f"token {endpoint.token}"}, timeout=120)
                    )

                def timed(key: str, transport: str) -> Callable[[], Awaitable[float]]:
                    pid = endpoints[key].pid

                    async def run() -> float:
                        before = cpu_seconds(pid)
                        if transport == "ws":
                            elapsed = await sockets[key].execute("1+1")
                        elif transport == "rest":
                            started = time.perf_counter()
                            response = await rest[key].get(f"/api/kernels/{kernels[key]['ws']}")
                            elapsed = time.perf_counter() - started
                            assert response.status_code == 200, (key, response.status_code, response.text)
                        else:
                            started = time.perf_counter()
                            result = await clients[key].call_tool("execute_code", {"code": "1+1", "session_id": kernels[key]["mcp"]})
                            elapsed = time.perf_counter() - started
                            assert not result.is_error and result.structured_content["results"][0]["data"]["text/plain"] == "2", (
                                key,
                                result.content[0].text,
                            )
                        cpu[f"{key}/{transport}"] += cpu_seconds(pid) - before
                        return elapsed

                    return run

                async def bare() -> float:
                    return await execute_rtt(bare_kc)

                runs = {f"{key}/{t}": timed(key, t) for key in endpoints for t in (*TRANSPORTS, *DIAGNOSTIC)} | {"bare": bare}
                for _ in range(30):  # warm-up, not kept: the Hub's token is checked and cached here
                    for run in runs.values():
                        await run()
                cpu = dict.fromkeys(samples, 0.0)
                hub_checks = hub.log().count(HUB_CHECK) if hub is not None else 0
                started = time.perf_counter()
                for _ in range(calls):
                    order = list(runs)
                    random.shuffle(order)
                    for key in order:
                        samples[key].append(await runs[key]())
                seconds = time.perf_counter() - started
                hub_checks = hub.log().count(HUB_CHECK) - hub_checks if hub is not None else None
                if hub is not None and not hub.log().count(HUB_CHECK):  # the warm-up's first request asked it
                    raise RuntimeError(f"no {HUB_CHECK!r} in the Hub's log: is the gateway checking Hub tokens?\n{hub.log()[-3000:]}")
        finally:
            for socket in sockets.values():
                socket.close()
            await stop_kernel(bare_km, bare_kc)
        figures = {
            key: {"n": len(values), "p50_ms": percentile(values, 50) * 1000, "p95_ms": percentile(values, 95) * 1000}
            | ({"gateway_cpu_ms_per_call": cpu[key] / calls * 1000} if key != "bare" else {})
            for key, values in samples.items()
        }
        return {
            "calls": calls,
            "timed_seconds": seconds,
            "people": people,
            "hub_token_checks_while_timed": hub_checks,
            "figures": figures,
            "machine": machine(),
        }
    finally:
        if hub is not None:
            hub.stop()
        for server in servers:
            server.stop()
        for directory in (base, hub_base):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)


def compared(figures: dict, key: str, transport: str) -> list[str]:
    """Two cells: a path's p50 / p95, and its p50 less the single token's on the same transport."""
    figure, baseline = figures[f"{key}/{transport}"], figures[f"token/{transport}"]
    return [
        f"{figure['p50_ms']:.2f} / {figure['p95_ms']:.2f} ms",
        "baseline" if key == "token" else f"{figure['p50_ms'] - baseline['p50_ms']:+.2f} ms",
    ]


def table(results: dict) -> str:
    figures = results["figures"]
    lines = [
        "| path | WebSocket p50 / p95 | Δ p50 vs single token | MCP /mcp p50 / p95 | Δ p50 vs single token "
        "| gateway CPU per call, WS / MCP | REST GET /api/kernels/<id> p50 / p95 (diagnostic) | Δ p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label in PATHS.items():
        if f"{key}/ws" not in figures:
            continue
        cells = [label]
        for transport in TRANSPORTS:
            cells += compared(figures, key, transport)
        cells.append(" / ".join(f"{figures[f'{key}/{t}']['gateway_cpu_ms_per_call']:.2f}" for t in TRANSPORTS) + " ms")
        for transport in DIAGNOSTIC:
            cells += compared(figures, key, transport)
        lines.append("| " + " | ".join(cells) + " |")
    bare = figures["bare"]
    lines.append(f"| bare ipykernel, direct client (reference) | {bare['p50_ms']:.2f} / {bare['p95_ms']:.2f} ms | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--calls", type=int, default=300, help="rounds; each makes every call once (300)")
    parser.add_argument("--no-hub", action="store_true", help="leave JupyterHub out: the single token and the users file only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where auth.json goes (bench/results)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls {args.calls}: give at least 1")
    results = asyncio.run(measure(args.calls, not args.no_hub))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auth.json").write_text(json.dumps(results, indent=1))
    hub = results["hub_token_checks_while_timed"]
    checks = f"; the Hub was asked about the token {hub} times while timed" if hub is not None else ""
    print(
        f"1+1, n={args.calls} rounds interleaved in {results['timed_seconds']:.0f} s, {results['machine']['cpus']} CPUs; "
        f"people: {', '.join(f'{k} {v}' for k, v in results['people'].items())}{checks}"
    )
    print(table(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
