"""At the edge of the capacity nothing is lost (issue 39): a gateway filled to its memory capacity refuses the next
start, over REST and over MCP, with the setting that moves the limit, while its sessions keep their state and it
keeps answering. The thousand-session run is bench/scale.py's."""

from __future__ import annotations

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
