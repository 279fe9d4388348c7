"""Notebook tools, timed beside the peer: `insert_execute_code_cell("1+1")` through ours and through jupyter-mcp-server.

One JupyterLab (with jupyter-collaboration) runs its kernels on one `msb-kernels serve`, which is told where
that Lab is (MSB_LAB_URL). Then, round by round, interleaved so both see the same minutes of this VM:

* ours: insert_execute_code_cell on the gateway's /mcp (streamable HTTP), into notebook A;
* ours, no notebook: execute_code of 1+1 on notebook A's own kernel (the same sandbox, no cell);
* the peer: jupyter-mcp-server 2.2.4 (stdio, its defaults), insert_execute_code_cell into notebook B, whose
  kernel is also a sandbox of the same gateway;
* bare: a plain local ipykernel (`python3`, no sandbox, no server), 1+1 to its idle status.

    .venv/bin/python bench/notebook_tools.py            # 30 rounds, about a minute and a half
    .venv/bin/python bench/notebook_tools.py -n 100

It writes bench/results/notebook_tools.json and prints a table of p50 and p95 and the ratios.
`bash scripts/test` installs the peer into .venv/share/msb-kernels/peers/jupyter-mcp-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate, machine
from bench.kernels import execute_to_idle, start_kernel, stop_kernel
from bench.servers import Server, free_port, start_gateway, start_jupyter
from bench.stats import summary

PEER = Path(sys.prefix) / "share" / "msb-kernels" / "peers" / "jupyter-mcp-server" / "bin" / "jupyter-mcp-server"
RESULTS = Path(__file__).resolve().parent / "results"


def start_lab(base: Path, gateway: Server, port: int, token: str) -> Server:
    options = [
        f"--gateway-url={gateway.url}",
        f"--GatewayClient.auth_token={gateway.token}",
        f"--SQLiteYStore.db_path={base / 'ystore.db'}",
    ]
    return start_jupyter(base, "lab", *options, port=port, token=token)


async def timed(call) -> float:
    started = time.perf_counter()
    result = await call()
    elapsed = time.perf_counter() - started
    text = "\n".join(getattr(part, "text", "") for part in result.content)
    assert not result.is_error and "2" in text, text
    return elapsed


async def run(rounds: int) -> dict:
    import httpx2
    from mcp import Client, StdioServerParameters
    from mcp.client.streamable_http import streamable_http_client

    if not PEER.exists():
        raise SystemExit(f"jupyter-mcp-server 2.2.4 is not at {PEER}: run `bash scripts/test --co -q` once (it installs it)")
    base = Path(tempfile.mkdtemp(prefix="msbn-", dir="/tmp"))
    isolate(base, max_sessions=50)
    lab_port, lab_token = free_port(), secrets.token_hex(16)
    os.environ.update(MSB_LAB_URL=f"http://127.0.0.1:{lab_port}", MSB_LAB_TOKEN=lab_token, MSB_MCP_RUNNING_AFTER_SECONDS="60")
    gateway = start_gateway(base)
    await gateway.wait_up()
    lab = start_lab(base, gateway, lab_port, lab_token)
    await lab.wait_up()
    times: dict[str, list[float]] = {"ours": [], "ours_execute_code": [], "peer": [], "bare": []}
    _, km, kc = await start_kernel("python3")
    peer_env = {**os.environ, "JUPYTER_URL": lab.url, "JUPYTER_TOKEN": lab_token}
    try:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=180))
            ours = await stack.enter_async_context(Client(streamable_http_client(gateway.url + "/mcp", http_client=http)))
            peer = await stack.enter_async_context(Client(StdioServerParameters(command=str(PEER), args=[], env=peer_env)))
            opened = await ours.call_tool("use_notebook", {"notebook": "ours.ipynb", "create": True})
            session = opened.structured_content["session_id"]
            used = await peer.call_tool("use_notebook", {"notebook_name": "peer", "notebook_path": "peer.ipynb", "mode": "create"})
            assert not used.is_error, used.content[0].text
            calls = {
                "ours": lambda: ours.call_tool("insert_execute_code_cell", {"notebook": "ours.ipynb", "source": "1+1"}),
                "ours_execute_code": lambda: ours.call_tool("execute_code", {"code": "1+1", "session_id": session}),
                "peer": lambda: peer.call_tool("insert_execute_code_cell", {"cell_index": -1, "cell_source": "1+1"}),
            }
            for call in calls.values():  # one untimed call each: connections, imports, first cells
                await timed(call)
            for _ in range(rounds):
                for name, call in calls.items():
                    times[name].append(await timed(call))
                times["bare"].append(await execute_to_idle(kc))
    finally:
        await stop_kernel(km, kc)
        lab.stop()
        gateway.stop()
    figures = {name: summary(values) for name, values in times.items()}
    return {
        "machine": machine(),
        "rounds": rounds,
        "figures": figures,
        "ratios_p50": {
            "ours / peer": figures["ours"]["p50_ms"] / figures["peer"]["p50_ms"],
            "ours / ours execute_code": figures["ours"]["p50_ms"] / figures["ours_execute_code"]["p50_ms"],
            "ours / bare ipykernel": figures["ours"]["p50_ms"] / figures["bare"]["p50_ms"],
        },
    }


def table(results: dict) -> str:
    labels = {
        "ours": "msb notebook tools: insert_execute_code_cell (HTTP /mcp)",
        "ours_execute_code": "msb execute_code, same kernel (HTTP /mcp)",
        "peer": "jupyter-mcp-server 2.2.4: insert_execute_code_cell (stdio)",
        "bare": "plain local ipykernel, direct client",
    }
    lines = ["| 1+1 | p50 ms | p95 ms |", "|---|---|---|"]
    for name, label in labels.items():
        figure = results["figures"][name]
        lines.append(f"| {label} | {figure['p50_ms']:.1f} | {figure['p95_ms']:.1f} |")
    lines.append("")
    lines += [f"- {name}: {value:.2f} at p50" for name, value in results["ratios_p50"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=30, help="timed calls of each kind (default 30)")
    args = parser.parse_args()
    results = asyncio.run(run(args.rounds))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "notebook_tools.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
