"""At the edge of the capacity nothing is lost (issue 39): a gateway filled to its memory capacity refuses the next
start, over REST and over MCP, with the setting that moves the limit, while its sessions keep their state and it
keeps answering. The thousand-session run is bench/scale.py's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from tests.msb_kernels.gateway.conftest import KernelSocket, mcp_client

SMALL_MIB = 1024  # the small flavor, as the capacity check counts it
CAPACITY = 3  # small kernels that fit


async def test_a_start_past_the_capacity_is_refused_and_every_session_keeps_its_state(gateway_factory) -> None:
    gateway = await gateway_factory(
        extra_env={"MSB_CAPACITY_MEMORY_MIB": str(CAPACITY * SMALL_MIB), "MSB_MAX_SESSIONS": "10", "MSB_POOL_SIZE": "0"}
    )
    async with mcp_client(gateway) as mcp:
        rest = [await gateway.start_kernel() for _ in range(CAPACITY - 1)]
        started = await mcp.call_tool("start_session", {"flavor": "small"})
        assert not started.is_error, started.content[0].text
        by_mcp = started.structured_content["sessions"][0]["id"]
        for number, kernel in enumerate(rest):
            socket = await KernelSocket.open(gateway, kernel)
            try:
                assert (await socket.execute(f"kept = {number}; kept")).result == str(number)
            finally:
                socket.close()
        assert not (await mcp.call_tool("execute_code", {"code": "kept = 'mcp'", "session_id": by_mcp})).is_error

        refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"})
        assert refused.code == 429 and refused.json["limit"] == "capacity_memory", refused.body
        assert f"MSB_CAPACITY_MEMORY_MIB={CAPACITY * SMALL_MIB}" in refused.json["message"], refused.json
        for call, arguments in (("start_session", {"flavor": "small"}), ("execute_code", {"code": "1+1"})):
            answer = await mcp.call_tool(call, arguments)  # execute_code without a session starts one
            assert answer.is_error and f"MSB_CAPACITY_MEMORY_MIB={CAPACITY * SMALL_MIB}" in answer.content[0].text, answer.content

        # Every session is still there, with its state, and the gateway answers on each of its ways.
        assert (await gateway.request("GET", "/api/msb/health")).code == 200
        listed = await gateway.request("GET", "/api/kernels")
        assert listed.code == 200 and {k["id"] for k in listed.json} == {*rest, by_mcp}, listed.body
        sessions = await mcp.call_tool("get_sessions", {})
        assert {s["id"] for s in sessions.structured_content["sessions"]} == {*rest, by_mcp}
        for number, kernel in enumerate(rest):
            socket = await KernelSocket.open(gateway, kernel)
            try:
                assert (await socket.execute("kept")).result == str(number)
            finally:
                socket.close()
        kept = await mcp.call_tool("execute_code", {"code": "kept", "session_id": by_mcp})
        assert kept.structured_content["results"][0]["data"]["text/plain"] == "'mcp'", kept.content[0].text
    assert len(gateway.sandboxes()) == CAPACITY, "a refused start left a sandbox"
    assert "Traceback" not in gateway.log(), gateway.log()[-3000:]


PIDS = Path("/sys/fs/cgroup/pids")  # cgroup v1's pids hierarchy, where this host has one


def process_tree(pid: int) -> list[int]:
    found = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += process_tree(int(child))
    return found


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pids_group_of(pid: int) -> str | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.split(":", 2)[1] == "pids":
            return line.split(":", 2)[2]
    return None


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not (PIDS / "cgroup.procs").exists(), reason="needs root and cgroup v1's pids hierarchy")
async def test_a_start_past_the_task_limit_is_refused_naming_it_and_the_sessions_keep_their_state(gateway_factory) -> None:
    """systemd's TasksMax= (a pids cgroup) or kernel.pid_max full: fork fails with EAGAIN. The start is refused with
    the limit and what raises it (a 429, not a 500 with the exception's name), and the kernel that runs keeps its
    state; with room again, starts work."""
    gateway = await gateway_factory(extra_env={"MSB_POOL_SIZE": "0"})
    kept = await gateway.start_kernel()
    socket = await KernelSocket.open(gateway, kept)
    group = PIDS / f"msb-test-tasks-{os.getpid()}"
    group.mkdir()
    try:
        assert (await socket.execute("kept = 41 + 1; kept")).result == "42"
        # The gateway and its helpers (fork server, keeper), as a systemd unit's cgroup holds them; not the sandboxes,
        # which have pids groups of their own.
        for pid in process_tree(gateway.process.pid):
            if pids_group_of(pid) == "/":
                (group / "cgroup.procs").write_text(str(pid))
        (group / "pids.max").write_text((group / "pids.current").read_text().strip())

        began = time.monotonic()
        refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"})
        took = time.monotonic() - began
        assert refused.code == 429 and refused.json["limit"] == "host_tasks", refused.body
        # At once: the fork server answers the start itself (it waited out a 30 s report timeout before).
        assert took < 5, f"the refusal took {took:.1f} s"
        # And it does not spin on forks that fail while the limit stays full (it spent a whole CPU before).
        servers = [pid for pid in process_tree(gateway.process.pid) if "forkserver_program" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert servers, "the gateway has no fork server"
        before = [cpu_seconds(pid) for pid in servers]
        await asyncio.sleep(2)
        spent = [cpu_seconds(pid) - then for pid, then in zip(servers, before, strict=True)]
        assert max(spent) < 0.5, f"fork servers used {spent} s of CPU in 2 s"
        assert "pids.max" in refused.json["message"] and "kernel.pid_max" in refused.json["message"], refused.json
        assert any("TasksMax=infinity" in advice for advice in refused.json["suggestions"]), refused.json

        (group / "pids.max").write_text("max")
        assert (await socket.execute("kept")).result == "42"
        listed = await gateway.request("GET", "/api/kernels")
        assert [k["id"] for k in listed.json] == [kept], listed.body
        again = await gateway.start_kernel()
        assert again != kept
    finally:
        socket.close()
        (group / "pids.max").write_text("max")
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (PIDS / "cgroup.procs").write_text(pid)
        group.rmdir()
    # The operator's log says it in the gateway's words (jupyter_client logs the failed start's exception as well).
    assert "did not start: no process could be made for the kernel's sandbox" in gateway.log(), gateway.log()[-3000:]
