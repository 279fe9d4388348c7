"""Where a new MCP connection's first call goes: through a JupyterHub token, beside the single token.

    .venv/bin/python bench/mcp_connect.py [-n 30]

Issue 46 saw the first tool call of each MCP connection through the Hub take about 1 s, and the next 9 ms. Each round
here opens one connection to each gateway (the single token's, and the Hub's managed one with a new Hub API token,
which the gateway has not seen), in a random order, and times its steps with the official MCP client: initialize,
`tools/list`, the first `get_sessions`, and the second. The client's own import is timed once, in a fresh process:
a client that starts a process per connection pays it every time. The first `get_sessions` is timed twice: as a
client calls it cold (the SDK lists the tools first, to validate the result, and compiles the tool's output schema),
and after a `tools/list` of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, sys.path starts at bench/
    sys.path.insert(0, str(REPO))

from bench.auth import gateway_pid, import_hub_harness  # noqa: E402
from bench.environment import VENV_BIN, isolate  # noqa: E402
from bench.servers import start_gateway  # noqa: E402
from bench.stats import percentile  # noqa: E402

STEPS = ("initialize", "first call, cold", "tools/list", "first call, listed", "second call")
CLIENT_IMPORT = "import httpx2; from mcp import Client; from mcp.client.streamable_http import streamable_http_client"


def client_import_ms(runs: int = 5) -> list[float]:
    """The MCP client's import, each in a fresh interpreter of this venv, as a process per connection pays it."""
    timed = f"import time; t = time.perf_counter(); {CLIENT_IMPORT}; print((time.perf_counter() - t) * 1000)"
    return [
        float(subprocess.run([str(VENV_BIN / "python"), "-c", timed], capture_output=True, text=True, check=True).stdout)
        for _ in range(runs)
    ]


async def one_connection(url: str, token: str, listed_first: bool) -> dict[str, float]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    steps: dict[str, float] = {}
    began = time.perf_counter()
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120) as http:
        async with Client(streamable_http_client(f"{url}/mcp", http_client=http)) as client:
            mark = time.perf_counter()
            steps["initialize"] = mark - began
            if listed_first:
                await client.list_tools()
                steps["tools/list"], mark = time.perf_counter() - mark, time.perf_counter()
            await client.call_tool("get_sessions", {})
            steps["first call, listed" if listed_first else "first call, cold"], mark = time.perf_counter() - mark, time.perf_counter()
            await client.call_tool("get_sessions", {})
            steps["second call"] = time.perf_counter() - mark
    return {step: seconds * 1000 for step, seconds in steps.items()}


async def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    base = Path(tempfile.mkdtemp(prefix="msb-connect-"))
    isolate(base, 20)
    harness, _, unavailable = import_hub_harness()
    if unavailable:
        raise SystemExit(f"mcp_connect.py: {unavailable}")
    single = start_gateway(base, log="gateway-token.log", runtime="gwt")
    hub = None
    try:
        await single.wait_up()
        hub = await harness.launch_hub(users=("alice",))
        gateway_pid(hub.process.pid)  # the Hub's own gateway is up
        hub_url = f"http://127.0.0.1:{hub.gateway_port}/services/{harness.SERVICE}"
        samples: dict[str, dict[str, list[float]]] = {"token": {s: [] for s in STEPS}, "hub": {s: [] for s in STEPS}}
        await one_connection(single.url, single.token, False)  # warm both once: imports, the first Hub check
        await one_connection(hub_url, await hub.token_for("alice"), False)
        for _ in range(rounds):
            for key, listed in random.sample([(k, flag) for k in samples for flag in (False, True)], 4):
                token = single.token if key == "token" else await hub.token_for("alice")  # a new Hub token each time
                for step, ms in (await one_connection(single.url if key == "token" else hub_url, token, listed)).items():
                    samples[key][step].append(ms)
        return samples
    finally:
        if hub is not None:
            hub.stop()
        single.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=30, help="rounds; each opens four connections (30)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    imports = client_import_ms()
    samples = asyncio.run(measure(args.rounds))
    print(f"the MCP client's import, in a fresh process: p50 {percentile(imports, 50):.0f} ms (n={len(imports)})")
    print(f"| step (ms), n={args.rounds} | single token p50 | p95 | Hub token (new each time) p50 | p95 | Hub / single at p50 |")
    print("|---|---|---|---|---|---|")
    for step in STEPS:
        token, hub = samples["token"][step], samples["hub"][step]
        ratio = percentile(hub, 50) / percentile(token, 50)
        print(
            f"| {step} | {percentile(token, 50):.1f} | {percentile(token, 95):.1f} | "
            f"{percentile(hub, 50):.1f} | {percentile(hub, 95):.1f} | {ratio:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
