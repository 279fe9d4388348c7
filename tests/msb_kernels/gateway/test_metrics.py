"""/metrics (issue 28): read by prometheus_client's own text parser, behind the gateway's token and on
MSB_METRICS_PORT's listener, and following a scripted workload: starts (one from the warm pool, one refused), an OOM
kill and its restart, shutdowns, a cull and MCP calls; jupyter_server's own metrics stay."""

from __future__ import annotations

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families

from msb_kernels.backends.core import scratch
from tests.msb_kernels.gateway.conftest import KernelSocket, free_port, wait_until
from tests.skips import needs_cgroups

pytestmark = pytest.mark.slow

HOG = "import mmap\nm = mmap.mmap(-1, 1536 * 2**20)\nfor i in range(0, len(m), 4096):\n    m[i] = 1"


def samples(text: str) -> dict[tuple, float]:
    """Every sample as {(name, (label, value), ...): value}."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, *sorted(labels.items())), 0.0)


def total(found: dict, name: str, **labels: str) -> float:
    """The sum over every sample of name whose labels include labels."""
    wanted = set(labels.items())
    return sum(v for key, v in found.items() if key[0] == name and wanted <= set(key[1:]))


@needs_cgroups
async def test_metrics_follow_a_scripted_workload(gateway_factory):
    port = free_port()
    gateway = await gateway_factory(
        extra_env={
            "MSB_METRICS_PORT": str(port),
            "MSB_POOL_SIZE": "python-small=1",
            "MSB_SESSION_TIMEOUT_SECONDS": "3",
            "MSB_CULL_INTERVAL_SECONDS": "1",
        }
    )

    async def scrape() -> dict:
        response = await gateway.request("GET", "/metrics")
        assert response.code == 200 and response.headers["Content-Type"].startswith("text/plain"), response.code
        return samples(response.body.decode())

    assert (await gateway.request("GET", "/metrics", token=None)).code == 403, "/metrics takes the gateway's token"
    assert (await gateway.request("GET", "/metrics", headers={"Authorization": f"Bearer {gateway.token}"})).code == 200
    await wait_until(lambda: _waiting(scrape), 90, "the warm pool's kernel")
    first = await scrape()
    assert value(first, "jupyter_server_started_timestamp_seconds") > 0, "jupyter_server's own metrics stay"

    # Three starts: the pool serves the first. A, B and C; A and B keep a client connected, so only C is culled.
    ids = [await gateway.start_kernel() for _ in range(3)]
    sockets = [await KernelSocket.open(gateway, kernel_id) for kernel_id in ids[:2]]
    assert (await sockets[0].execute("sum(range(10**6))")).result == "499999500000"
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_FLAVOR": "huge"}})
    assert refused.code == 400
    during = await scrape()
    assert total(during, "msb_kernel_start_seconds_count") == 3
    assert total(during, "msb_kernel_start_seconds_count", from_pool="true") == value(during, "msb_pool_hits_total") >= 1
    assert value(during, "msb_kernel_start_failures_total", reason="invalid_request") == 1
    assert total(during, "msb_sessions") == 3 and total(during, "msb_sessions", flavor="small", backend="namespace") == 3
    for kernel_id in ids:
        assert value(during, "msb_kernel_memory_bytes", kernel_id=kernel_id, flavor="small") > 10 * 2**20
        assert value(during, "msb_kernel_memory_limit_bytes", kernel_id=kernel_id, flavor="small") == 2**30
    assert value(during, "msb_kernel_cpu_seconds_total", kernel_id=ids[0], flavor="small") > 0.01
    assert value(during, "msb_gateway_resident_bytes") > 30 * 2**20
    if scratch.unavailable_reason() is None:  # three namespace kernels' disks, each its flavor's size, none left over
        assert value(during, "msb_scratch_reserved_bytes") >= 3 * 2**20 and value(during, "msb_scratch_left_bytes") == 0
        assert value(during, "msb_scratch_used_bytes") > 0  # each ext4 holds its own metadata, read through init's root
    assert value(during, "msb_gateway_retained", structure="records") == 3

    # One OOM kill: B's sandbox passes its flavor's memory; jupyter_client restarts it under the same id.
    sockets[1].send("execute_request", {"code": HOG, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False})
    await wait_until(lambda: _counted(scrape, "msb_kernel_oom_kills_total", flavor="small"), 90, "the OOM kill's count")
    # Two shutdowns and one cull. A and B are deleted while their clients are still connected: closed first, B (idle
    # since its OOM restart, past the 3 s timeout) could be culled by the next 1 s pass before its DELETE arrived.
    for kernel_id in ids[:2]:
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    for socket in sockets:
        socket.close()
    await wait_until(lambda: _counted(scrape, "msb_kernel_stops_total", how="culled"), 30, "C's cull")
    headers = {"Authorization": f"Bearer {gateway.token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60)) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client:
            assert not (await client.call_tool("get_sessions", {})).is_error
            assert (await client.call_tool("execute_code", {"code": "1", "session_id": "no-such-session"})).is_error

    after = await scrape()
    assert value(after, "msb_kernel_oom_kills_total", flavor="small") == 1
    assert value(after, "msb_kernel_restarts_total", cause="died") == 1
    assert value(after, "msb_kernel_stops_total", how="shutdown") == 2
    assert value(after, "msb_kernel_stops_total", how="culled") == 1
    assert value(after, "msb_mcp_calls_total", tool="get_sessions", outcome="ok") == 1
    assert value(after, "msb_mcp_calls_total", tool="execute_code", outcome="SessionNotFound") == 1
    assert total(after, "msb_sessions") == 0
    assert value(after, "msb_gateway_retained", structure="records") == 0

    async with httpx2.AsyncClient(timeout=10) as http:
        unauthenticated = await http.get(f"http://127.0.0.1:{port}/metrics")
    assert unauthenticated.status_code == 200
    assert value(samples(unauthenticated.text), "msb_kernel_stops_total", how="culled") == 1


async def _waiting(scrape) -> bool:
    return value(await scrape(), "msb_pool_waiting", kernel_name="msb-python-small") >= 1


async def _counted(scrape, name: str, **labels: str) -> bool:
    return value(await scrape(), name, **labels) >= 1
