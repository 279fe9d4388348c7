"""The gateway holds steady under load: once the kernels of a load run are gone, so is what it held for them, its own
structures (/metrics' msb_gateway_retained) and the MCP bridge's included. The ten-run soak with figures is
bench/gateway_soak.py."""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families

from mcp_bridge import jupyter_ws
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

KERNELS, EXECUTIONS, RUNS = 8, 150, 4
# Python's and glibc's heaps keep some of what a first run touched (caches, arenas); a leak of a
# kernel's manager, sockets or message buffers is per kernel and per run, and grows past this.
RSS_BOUND_MIB = 16


async def pipelined_executions(gateway: Gateway, kernel_id: str) -> None:
    """EXECUTIONS execute requests sent at once over one kernel WebSocket, then every reply awaited."""
    ws = await KernelSocket.open(gateway, kernel_id)
    try:
        waiting = {ws.send("execute_request", jupyter_ws.execute_content(f"print({i}); {i} + 1")) for i in range(EXECUTIONS)}
        while waiting:
            message = await ws.receive(120)
            if message["msg_type"] == "execute_reply":
                waiting.discard(jupyter_ws.parent_id(message))
    finally:
        ws.connection.close()


async def test_rss_fds_and_threads_return_after_load_runs_with_every_kernel_deleted(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_MAX_SESSIONS": str(KERNELS + 1)})
    after_runs = []
    for _ in range(RUNS):
        kernel_ids = [await gateway.start_kernel() for _ in range(KERNELS)]
        await asyncio.gather(*(pipelined_executions(gateway, kernel_id) for kernel_id in kernel_ids))
        for kernel_id in kernel_ids:
            assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
        await asyncio.sleep(1)  # closed WebSockets finish on the server's side
        stats = await gateway.stats()
        assert stats["active_sessions"] == 0 and stats["kernels"] == []
        after_runs.append(stats["gateway"])
    first, last = after_runs[0], after_runs[-1]
    rss = [run["rss_mib"] for run in after_runs]
    print(f"gateway RSS after each run of {KERNELS} kernels x {EXECUTIONS} executions: {rss} MiB")
    assert all(run["open_fds"] == first["open_fds"] for run in after_runs), after_runs  # no kernel's sockets or pipes kept
    assert all(run["threads"] == first["threads"] for run in after_runs), after_runs
    assert last["rss_mib"] <= first["rss_mib"] + RSS_BOUND_MIB, rss

    # MCP sessions that end every way but stop_session leave nothing in the bridge either: deleted over REST (as a
    # notebook user's shutdown), stopped, and one whose kernel died and was restarted (it stays, as a session).
    headers = {"Authorization": f"Bearer {gateway.token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(120)) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client:
            ids = []
            for _ in range(3):
                first_call = await client.call_tool("execute_code", {"code": "x = 1"})
                ids.append(first_call.structured_content["session_id"])
                await client.call_tool("execute_code", {"code": "print(x)", "session_id": ids[-1]})
            assert (await gateway.request("DELETE", f"/api/kernels/{ids[0]}")).code == 204
            assert (await gateway.request("DELETE", f"/api/kernels/{ids[1]}")).code == 204
            assert not (await client.call_tool("stop_session", {"session_id": ids[2]})).is_error
    retained = await retained_sizes(gateway)
    assert {name: size for name, size in retained.items() if size and name != "recently_stopped"} == {}, retained


async def retained_sizes(gateway: Gateway) -> dict[str, float]:
    """msb_gateway_retained from /metrics, by structure."""
    text = (await gateway.request("GET", "/metrics")).body.decode()
    return {
        sample.labels["structure"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "msb_gateway_retained"
    }
