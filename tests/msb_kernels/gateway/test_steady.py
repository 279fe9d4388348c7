"""The gateway holds steady under load: once the kernels of a load run are gone, so is what it held for them."""

from __future__ import annotations

import asyncio

import pytest

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
