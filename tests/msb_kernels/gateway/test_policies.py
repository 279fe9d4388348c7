"""Gateway policies an operator sets: the CPU capacity, the pool and the limits, culling, /mcp's
DNS-rebinding checks, and TCP_NODELAY on kernel WebSockets. Each runs against a real
``msb-kernels serve`` with real sandboxed kernels."""

from __future__ import annotations

import ctypes
import os
import socket

import pytest

from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def test_a_start_past_the_cpu_capacity_is_refused(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_CAPACITY_CPUS": "3", "MSB_MAX_SESSIONS": "5"})
    await gateway.start_kernel("msb-python-medium")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-medium"})
    assert refused.code == 429, refused.body
    assert refused.json["limit"] == "capacity_cpus" and "MSB_CAPACITY_CPUS=3" in refused.json["message"]
    assert any("smaller flavor" in s and "small" in s for s in refused.json["suggestions"])
    await gateway.start_kernel("msb-python-small")  # the one CPU left still fits
    assert (await gateway.stats())["total_cpus"] == 3


async def _pool_waiting(gateway: Gateway) -> str:
    async def waiting() -> bool:
        stats = await gateway.stats()
        return bool(gateway.sandboxes()) and stats["pool"]["waiting"]["msb-python-small"] == 1

    await wait_until(waiting, 90, "the pool to hold a started kernel")
    (pooled,) = gateway.sandboxes()
    return pooled.sandbox_id


@pytest.mark.parametrize("counts", [True, False], ids=["counts", "does-not-count"])
async def test_pooled_kernels_count_toward_the_limit_only_when_asked(gateway_factory, counts: bool) -> None:
    gateway = await gateway_factory(
        extra_env={"MSB_POOL_SIZE": "python-small=1", "MSB_MAX_SESSIONS": "2", "MSB_POOL_COUNTS_AS_SESSIONS": "true" if counts else "false"}
    )
    await _pool_waiting(gateway)
    await gateway.start_kernel("msb-python-medium")  # not from the pool: one session, one waiting kernel
    second = await gateway.request("POST", "/api/kernels", {"name": "msb-python-medium"})
    if counts:
        assert second.code == 429 and second.json["limit"] == "max_sessions", second.body
    else:
        assert second.code == 201, second.body


async def test_pooled_kernels_are_never_culled(gateway_factory) -> None:
    gateway = await gateway_factory(
        extra_env={
            "MSB_POOL_SIZE": "python-small=1",
            "MSB_SESSION_TIMEOUT_SECONDS": "2",
            "MSB_CULL_INTERVAL_SECONDS": "1",
            "MSB_MAX_SESSIONS": "3",
        }
    )
    pooled = await _pool_waiting(gateway)
    # A session kernel started after the pooled one is culled; by then the pooled one was idle longer.
    session = await gateway.start_kernel("msb-python-medium")
    await wait_until(lambda: session not in {s.sandbox_id for s in gateway.sandboxes()}, 60, "the idle session to be culled")
    stats = await gateway.stats()
    assert stats["pool"]["waiting"]["msb-python-small"] == 1
    assert pooled in {s.sandbox_id for s in gateway.sandboxes()}, "the waiting pooled kernel was culled"


@pytest.mark.parametrize("cull_busy_and_connected", [False, True], ids=["defaults", "cull-busy-and-connected"])
async def test_culling_of_busy_and_connected_kernels_follows_the_settings(gateway_factory, cull_busy_and_connected: bool) -> None:
    flag = "true" if cull_busy_and_connected else "false"
    gateway = await gateway_factory(
        extra_env={"MSB_SESSION_TIMEOUT_SECONDS": "3", "MSB_CULL_INTERVAL_SECONDS": "1", "MSB_CULL_BUSY": flag, "MSB_CULL_CONNECTED": flag}
    )
    busy = await gateway.start_kernel()
    connected = await gateway.start_kernel()
    busy_socket = await KernelSocket.open(gateway, busy)
    busy_socket.send(
        "execute_request",
        {
            "code": "import time\ntime.sleep(600)",
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    )
    idle_socket = await KernelSocket.open(gateway, connected)
    # Started last, so once the culler has taken it, it has also weighed the other two past their timeout.
    sentinel = await gateway.start_kernel()

    def running() -> set[str]:
        return {s.sandbox_id for s in gateway.sandboxes()}

    try:
        await wait_until(lambda: sentinel not in running(), 60, "the idle, unconnected kernel to be culled")
        if cull_busy_and_connected:
            await wait_until(lambda: not ({busy, connected} & running()), 60, "the busy and the connected kernel to be culled")
        else:
            assert {busy, connected} <= running(), "a busy or connected kernel was culled under the defaults"
    finally:
        busy_socket.close()
        idle_socket.close()


async def test_mcp_refuses_foreign_hosts_and_origins(gateway: Gateway) -> None:
    """DNS rebinding: a page on another site must not drive /mcp through the user's browser."""
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
    }
    base = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json", "Authorization": f"Bearer {gateway.token}"}
    accepted = await gateway.request("POST", "/mcp", body, token=None, headers=base)
    assert accepted.code == 200, accepted.body
    for extra in (
        {"Host": "evil.example"},
        {"Host": f"evil.example:{gateway.port}"},
        {"Origin": "http://evil.example"},
        {"Origin": f"http://127.0.0.1.evil.example:{gateway.port}"},
    ):
        refused = await gateway.request("POST", "/mcp", body, token=None, headers={**base, **extra})
        assert refused.code in (403, 421), (extra, refused.code, refused.body)
    same_origin = await gateway.request("POST", "/mcp", body, token=None, headers={**base, "Origin": f"http://127.0.0.1:{gateway.port}"})
    assert same_origin.code == 200, same_origin.body


def _peer_socket_option(pid: int, local: tuple[str, int], level: int, option: int) -> int:
    """getsockopt on the process's socket whose peer is ``local``, through a copy of its descriptor."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                continue
            fd = libc.syscall(438, pidfd, int(name), 0)  # pidfd_getfd
            if fd < 0:
                continue
            copy = socket.socket(fileno=fd)
            try:
                if copy.type == socket.SOCK_STREAM and copy.family == socket.AF_INET and copy.getpeername() == local:
                    return copy.getsockopt(level, option)
            except OSError:
                pass
            finally:
                copy.close()
    finally:
        os.close(pidfd)
    raise AssertionError(f"no socket of pid {pid} is connected to {local}")


async def test_kernel_websockets_have_nagle_off(gateway: Gateway) -> None:
    """A reply is several small frames; with Nagle's algorithm each waits for the last one's ACK."""
    kernel_id = await gateway.start_kernel()
    ws = await KernelSocket.open(gateway, kernel_id)
    try:
        assert (await ws.execute("1 + 1")).result == "2"  # a reply has come: the server's open() has run
        local = ws.connection.stream.socket.getsockname()
        assert _peer_socket_option(gateway.process.pid, local, socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        ws.close()
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204


@pytest.mark.skipif(os.geteuid() != 0, reason="a host uid per sandbox is how msb-kernels runs as root")
async def test_two_gateways_never_share_a_host_uid(gateway_factory) -> None:
    """Two gateways with their own runtime dirs (two teams on one host): their sandboxes run as different
    host uids, so neither team's kernels can signal or trace the other's. A uid is free again once its sandbox is gone."""
    from msb_kernels.backends.namespace import uids

    first, second = await gateway_factory(), await gateway_factory()
    kernels = [(gateway, await gateway.start_kernel()) for gateway in (first, second)]
    records = [next(r for r in gateway.sandboxes() if r.sandbox_id == kernel_id) for gateway, kernel_id in kernels]
    host_uids = [record.details["uid"] for record in records]
    assert host_uids[0] != host_uids[1], host_uids
    assert [os.stat(f"/proc/{record.details['init_pid']}").st_uid for record in records] == host_uids
    gateway, kernel_id = kernels[0]
    assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    assert not (uids.HOST_UIDS_DIR / str(host_uids[0])).exists()
    assert (uids.HOST_UIDS_DIR / str(host_uids[1])).exists()


async def test_by_default_cpus_do_not_limit_how_many_kernels_start(gateway_factory) -> None:
    """Idle kernels use no CPU, and each is held to its flavor's CPUs by its quota: by default the gateway admits
    more small kernels than 4 x the host's cores (the old default stopped at that), and memory is the limit."""
    from msb_kernels.gateway.host import host_cpus, host_memory_mib

    count = 4 * host_cpus() + 1
    gateway = await gateway_factory(extra_env={"MSB_MAX_SESSIONS": str(count + 1)})
    for _ in range(count):
        await gateway.start_kernel("msb-python-small")
    stats = await gateway.stats()
    assert stats["total_cpus"] == count and stats["capacity"] == {"memory_mb": host_memory_mib(), "cpus": None}, stats
    assert stats["available"]["cpus"] is None and stats["utilization"]["cpus"] == round(100.0 * count / host_cpus(), 1)
