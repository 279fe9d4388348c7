"""`msb-kernels serve` end to end: real servers, real sandboxes, real WebSockets.

jupyter_server's GatewayClient (`jupyter server --gateway-url`, what JupyterLab runs) drives
the first test; the rest talk to the gateway's REST API directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from tornado.httpclient import HTTPClientError

from mcp_bridge import jupyter_ws
from msb_kernels.backends.core import cgroups
from msb_kernels.kernelspecs.templates import TEMPLATES
from tests.mcp_bridge.conftest import TICKS, call_with_progress
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, init_pids, pid_alive, wait_until
from tests.skips import needs_runsc

pytestmark = pytest.mark.timeout(240)


# -- through jupyter_server's GatewayClient ---------------------------------------------------


async def test_jupyter_server_runs_its_kernels_in_our_sandboxes(gateway: Gateway, jupyter_server) -> None:
    js = jupyter_server
    # kernelspecs: only sandboxed ones, with their flavors
    specs = (await js.request("GET", "/api/kernelspecs")).json
    assert {"python3", "msb-python-medium", "msb-python-large"} <= set(specs["kernelspecs"])  # python3: the default flavor's
    assert all(
        spec["spec"]["metadata"]["kernel_provisioner"]["provisioner_name"] == "msb-sandbox" for spec in specs["kernelspecs"].values()
    ), "a kernelspec that runs outside a sandbox is offered"
    # jupyter_server takes the gateway's default from its first fetch on (it answers its own the first time)
    assert (await js.request("GET", "/api/kernelspecs")).json["default"] == "python3"
    assert specs["kernelspecs"]["msb-python-medium"]["spec"]["metadata"]["msb"]["flavor"] == "medium"

    # start a kernel for a notebook (a Jupyter session, as JupyterLab opens one)
    created = await js.request(
        "POST",
        "/api/sessions",
        {"path": "work/analysis.ipynb", "type": "notebook", "name": "analysis.ipynb", "kernel": {"name": "msb-python-small"}},
    )
    assert created.code == 201, created.body
    session_id, kernel_id = created.json["id"], created.json["kernel"]["id"]
    assert [k["id"] for k in (await gateway.request("GET", "/api/kernels")).json] == [kernel_id]
    assert kernel_id in init_pids(gateway), "no sandbox on the gateway for the new kernel"

    # execute over the WebSocket that jupyter_server relays to the gateway
    ws = await KernelSocket.open(js, kernel_id)
    reply = await ws.execute("import os, socket\nx = 6 * 7\nprint(x, os.environ.get('MSB_SANDBOX'), socket.gethostname())")
    assert reply.reply["content"]["status"] == "ok", reply.error
    assert reply.stdout.split() == ["42", "namespace", "sandbox"]

    stats = await gateway.stats()
    (entry,) = [k for k in stats["kernels"] if k["id"] == kernel_id]
    assert entry["flavor"] == "small" and entry["template"] == "python" and entry["backend"] == "namespace"
    assert entry["status"] == "ready"
    assert entry["notebook_path"].endswith("work/analysis.ipynb")  # jupyter_server sends the full path

    # interrupt a long cell
    msg_id = ws.send(
        "execute_request",
        {
            "code": "import time\ntime.sleep(120)",
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    )
    await ws.wait_for(msg_id, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "busy", 30)

    async def stats_say_running() -> bool:
        return [k["status"] for k in (await gateway.stats())["kernels"]] == ["running"]

    await wait_until(stats_say_running, 30, "the stats to show the kernel running")
    started = time.monotonic()
    interrupted = await js.request("POST", f"/api/kernels/{kernel_id}/interrupt")
    assert interrupted.code == 204, interrupted.body
    error = await ws.wait_for(msg_id, lambda m: m["msg_type"] == "error", 30)
    assert error["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 30
    await ws.wait_for(msg_id, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle", 30)
    assert "42" in (await ws.execute_after_error("print(x)")).stdout, "the interrupt lost the kernel's state"
    ws.close()

    # restart: a fresh interpreter in a fresh sandbox
    pid_before = init_pids(gateway)[kernel_id]
    restarted = await js.request("POST", f"/api/kernels/{kernel_id}/restart", timeout=90)
    assert restarted.code == 200, restarted.body
    ws = await KernelSocket.open(js, kernel_id)
    reply = await ws.execute("print('x' in globals())")
    assert reply.stdout.strip() == "False"
    pid_after = init_pids(gateway)[kernel_id]
    assert pid_after != pid_before
    assert not pid_alive(pid_before)
    ws.close()

    # delete the session and its kernel: the sandbox goes too
    deleted = await js.request("DELETE", f"/api/sessions/{session_id}")
    assert deleted.code == 204, deleted.body
    assert (await gateway.request("GET", "/api/kernels")).json == []
    await wait_until(lambda: not gateway.sandboxes(), 15, "the sandbox to be removed")
    assert not pid_alive(pid_after)
    stats = await gateway.stats()
    assert stats["active_sessions"] == 0 and stats["total_memory_mb"] == 0
    assert [s["id"] for s in stats["recently_stopped"] if s["status"] == "stopped"][-1] == kernel_id


async def test_kernel_gateway_api_directly(gateway: Gateway) -> None:
    """KERNEL_FLAVOR in the start request's env, the stats, interrupt/restart/delete and JSON 404s. The kernel gets the
    session's own variables and what its sandbox needs: a KERNEL_* name the start request reads into a field of its own
    (the flavor) is the request's, not the kernel's, and nothing of the gateway's environment reaches it."""
    same_as_the_hosts = {"JUPYTER_RUNTIME_DIR": os.environ["JUPYTER_RUNTIME_DIR"]}  # asked for, so passed on all the same
    kernel_id = await gateway.start_kernel("msb-python-small", env={"KERNEL_FLAVOR": "medium", "NOT_KERNEL": "x", **same_as_the_hosts})
    try:
        ws = await KernelSocket.open(gateway, kernel_id)
        reply = await ws.execute(
            "import os\nprint(os.environ['MSB_FLAVOR'], os.environ.get('NOT_KERNEL'), os.environ.get('MSB_TOKEN'), "
            "os.environ.get('KERNEL_FLAVOR'), os.environ.get('JUPYTER_RUNTIME_DIR'), os.environ.get('KERNEL_ENV_NAMES'))"
        )
        expected = ["medium", "x", "None", "None", os.environ["JUPYTER_RUNTIME_DIR"], "None"]
        assert reply.stdout.split() == expected  # the gateway's own token stays out; what the request set is passed
        ws.close()
        stats = await gateway.stats()
        assert stats["active_sessions"] == 1
        assert stats["flavor_counts"] == {"small": 0, "medium": 1, "large": 0}
        assert (stats["total_memory_mb"], stats["total_cpus"]) == (2048, 2)
        (entry,) = stats["kernels"]
        assert entry["id"] == kernel_id and entry["flavor"] == "medium" and entry["status"] in ("ready", "running")
        if cgroups.detect()[0] is not None:  # the cgroup counts the sandbox's memory, so the stats must show it
            assert entry["memory_bytes"] > 0
        else:
            assert entry["memory_bytes"] is None
        assert (await gateway.request("POST", f"/api/kernels/{kernel_id}/interrupt")).code == 204
        assert (await gateway.request("POST", f"/api/kernels/{kernel_id}/restart", timeout=90)).code == 200
        assert (await gateway.request("GET", f"/api/kernels/{kernel_id}")).json["id"] == kernel_id
    finally:
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    assert not gateway.sandboxes()

    missing = await gateway.request("GET", "/api/kernels/00000000-0000-4000-8000-000000000000")
    assert missing.code == 404 and "does not exist" in missing.json["message"]
    assert (await gateway.request("DELETE", "/api/kernels/00000000-0000-4000-8000-000000000000")).code == 404
    unknown = await gateway.request("GET", "/api/no/such/thing")
    assert unknown.code == 404 and unknown.json["message"]
    for refused in ("no-such-kernel", "msb-python-huge"):  # python3 is served (test_notebook_users.py)
        response = await gateway.request("POST", "/api/kernels", {"name": refused})
        assert response.code == 404, response.body
        assert "python3" in response.json["suggestions"][0] and "msb-python-medium" in response.json["suggestions"][0]
    bad_flavor = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_FLAVOR": "xl"}})
    assert bad_flavor.code == 400 and "KERNEL_FLAVOR" in bad_flavor.json["message"]
    assert "traceback" not in bad_flavor.body.decode().lower()
    # the host's files and terminals are not served: they would bypass every sandbox
    for path in ("/api/contents", "/api/terminals", "/files/etc/passwd", "/api/nbconvert"):
        assert (await gateway.request("GET", path)).code == 404, path


LATE_STATUS = """
import threading
from jupyter_client.session import Session
kernel = get_ipython().kernel

def late_status(state, key=None):
    session = kernel.session if key is None else Session(key=key, username="forger")
    parent = {"header": {"msg_id": "late-" + state, "msg_type": "execute_request", "session": "late", "username": "late",
                         "date": "2026-01-01T00:00:00Z", "version": "5.3"}}
    session.send(kernel.iopub_socket, "status", {"execution_state": state}, parent=parent)

threading.Timer(0.3, late_status, ("busy", b"not-the-kernels-key")).start()
threading.Timer(3.0, late_status, ("busy",)).start()
threading.Timer(4.5, late_status, ("idle",)).start()
"""


async def test_activity_and_execution_state_follow_only_the_kernels_signed_messages(gateway: Gateway) -> None:
    """The gateway's activity watch, which culling reads: busy while a cell runs, idle after, last_activity moving. A
    status on iopub without the kernel's signature changes nothing and is reported; the kernel's own, as late, counts."""
    kernel_id = await gateway.start_kernel()
    ws = await KernelSocket.open(gateway, kernel_id)

    async def state() -> tuple[str, str]:
        model = (await gateway.request("GET", f"/api/kernels/{kernel_id}")).json
        return model["execution_state"], model["last_activity"]

    def state_is(expected: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return (await state())[0] == expected

        return check

    try:
        await ws.execute("1")
        execution_state, first_activity = await state()
        assert execution_state == "idle"
        ws.send("execute_request", jupyter_ws.execute_content("import time\ntime.sleep(2)"))
        await wait_until(state_is("busy"), 10, "execution_state busy while a cell runs")
        await wait_until(state_is("idle"), 10, "execution_state idle after the cell")
        assert (await state())[1] > first_activity  # ISO dates of one format: their order is their strings'

        # A forged status 0.3 s after the cell, then the kernel's own at 3 and 4.5 s. (The forged one also ends this
        # WebSocket's iopub: jupyter_server closes a kernel's stream at a message it cannot verify.)
        await ws.execute(LATE_STATUS)
        await wait_until(lambda: "its signature is not the kernel's" in gateway.log(), 5, "the forged status reported")
        assert (await state())[0] == "idle"
        await wait_until(state_is("busy"), 10, "the kernel's own late status taken")
        await wait_until(state_is("idle"), 10, "the kernel's own late idle status taken")
    finally:
        ws.close()
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204


@pytest.mark.slow
@pytest.mark.parametrize("template", sorted(TEMPLATES))
async def test_a_second_socket_of_the_same_session_is_answered(gateway: Gateway, template: str) -> None:
    """JupyterLab's server reconnects with the same session_id while the old socket is still open,
    and again after each restart. The gateway logs "Replacing stale connection"; the kernel must
    answer the newest socket, or Lab shows the kernel as Unknown and its cells hang."""
    if TEMPLATES[template].unavailable_reason():
        pytest.skip(f"{template} kernels unavailable: {TEMPLATES[template].unavailable_reason()}")
    kernel_id = await gateway.start_kernel(f"msb-{template}-small")
    session_id = uuid.uuid4().hex
    try:
        first = await KernelSocket.open(gateway, kernel_id, session_id)
        msg_id = first.send("kernel_info_request", {})
        await first.wait_for(msg_id, lambda m: m["msg_type"] == "kernel_info_reply", 60)
        second = await KernelSocket.open(gateway, kernel_id, session_id)
        msg_id = second.send("kernel_info_request", {})
        await second.wait_for(msg_id, lambda m: m["msg_type"] == "kernel_info_reply", 30)
        code = "print(6 * 7)" if template == "python" else "console.log(6 * 7)"
        assert (await second.execute(code)).stdout.strip() == "42"
        assert "Replacing stale connection" in gateway.log()
        first.close()
        # After a restart Lab's server opens yet another socket of the session; the old one reconnects too.
        assert (await gateway.request("POST", f"/api/kernels/{kernel_id}/restart", timeout=90)).code == 200
        third = await KernelSocket.open(gateway, kernel_id, session_id)
        assert (await third.execute(code, timeout=30)).stdout.strip() == "42", "no answer after a restart"
        second.close()
        third.close()
    finally:
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204


async def test_every_endpoint_but_health_needs_the_token(gateway: Gateway) -> None:
    for path in ("/api/msb/health", "/"):  # the root: JupyterHub checks each service's health there, every minute
        health = await gateway.request("GET", path, token=None)
        assert health.code == 200 and health.json["status"] == "ok", path
    for method, path in (
        ("GET", "/api"),
        ("GET", "/api/kernels"),
        ("GET", "/api/kernelspecs"),
        ("GET", "/api/sessions"),
        ("GET", "/api/msb/stats"),
        ("POST", "/api/kernels"),
        ("GET", "/api/status"),
        ("GET", "/api/no/such/thing"),
        ("GET", "/login"),
        ("POST", "/mcp"),
    ):
        for token in (None, "wrong-token"):
            response = await gateway.request(method, path, token=token)
            assert response.code in (401, 403, 404), (method, path, token, response.code)
            assert b"kernelspecs" not in response.body and b"active_sessions" not in response.body
    # A real kernel's channels: refused without the token or with a wrong one, served with the right one.
    kernel_id = await gateway.start_kernel()
    for token in (None, "wrong-token"):
        with pytest.raises(HTTPClientError) as refused:
            await KernelSocket.open(gateway, kernel_id, token=token)
        assert refused.value.code in (401, 403), (token, refused.value.code)
    socket = await KernelSocket.open(gateway, kernel_id)
    try:
        assert (await socket.execute("6 * 7")).result == "42"
    finally:
        socket.close()
    assert (await gateway.request("GET", "/api/kernels")).code == 200
    assert (await gateway.request("GET", "/api/kernels", token=None, headers={"Authorization": f"Bearer {gateway.token}"})).code == 200


# -- limits, culling, stopping -------------------------------------------------------------


def _jsonrpc(response) -> dict:
    """A JSON-RPC reply, sent as JSON or as one server-sent event."""
    text = response.body.decode()
    if response.headers.get("Content-Type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        return json.loads(data[-1])
    return json.loads(text)


async def _stdout_replayed(socket: KernelSocket, seconds: float = 3.0) -> str:
    """The stream text a reconnected client gets within ``seconds`` (the replay comes first)."""
    text = []
    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
        while True:
            message = await socket.receive(seconds)
            if message["msg_type"] == "stream":
                text.append(message["content"]["text"])
    return "".join(text)


async def test_a_closed_websockets_messages_are_replayed_at_its_return_and_dropped_past_their_bound(gateway_factory) -> None:
    # When a kernel's last WebSocket closes, jupyter_server keeps the kernel's messages for its reconnection,
    # without a bound. An assistant working over /mcp on a kernel its notebook user left would fill the
    # gateway's memory with its outputs. MSB_OFFLINE_BUFFER_MIB bounds it.
    gateway = await gateway_factory(extra_env={"MSB_OFFLINE_BUFFER_MIB": "1"})
    kernel_id = await gateway.start_kernel()
    away = uuid.uuid4().hex
    user = await KernelSocket.open(gateway, kernel_id, session_id=away)
    assert (await user.execute("1+1")).result == "2"
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=120) as http,
        Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as assistant,
    ):

        async def run(code: str) -> str:
            result = await assistant.call_tool("execute_code", {"code": code, "session_id": kernel_id})
            assert not result.is_error, result.content[0].text
            return result.structured_content["stdout"]

        user.close()
        await wait_until(lambda: gateway.log().count("Starting buffering") == 1, 30, "the gateway to keep the closed socket's messages")
        assert await run("print('while you were away')") == "while you were away\n"
        user = await KernelSocket.open(gateway, kernel_id, session_id=away)
        assert "while you were away" in await _stdout_replayed(user)  # a short absence loses nothing

        user.close()
        await wait_until(lambda: gateway.log().count("Starting buffering") == 2, 30, "the gateway to keep the closed socket's messages")
        # 2 MiB of output, past the 1 MiB bound (the tool's result keeps MSB_MCP_MAX_OUTPUT_CHARS of it)
        assert (await run("for _ in range(20): print('x' * 100_000)")).startswith("x" * 100_000)
        await wait_until(lambda: "MSB_OFFLINE_BUFFER_MIB=1" in gateway.log(), 30, "the gateway to drop what it kept")
        user = await KernelSocket.open(gateway, kernel_id, session_id=away)
        assert "x" * 1000 not in await _stdout_replayed(user)
        # Both go on as before, in the same kernel.
        assert (await user.execute("1+1")).result == "2"
        assert await run("print(len('y' * 7))") == "7\n"
    user.close()


async def test_mcp_bridge_is_served_on_the_same_kernels(gateway: Gateway) -> None:
    assert "MCP streamable HTTP at" in gateway.log()
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {gateway.token}",
    }
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "gateway-test", "version": "0"}},
    }
    refused = await gateway.request(
        "POST", "/mcp", initialize, token=None, headers={k: v for k, v in headers.items() if k != "Authorization"}
    )
    assert refused.code == 401 and b"Authorization: Bearer" in refused.body, (refused.code, refused.body)
    response = await gateway.request("POST", "/mcp", initialize, token=None, headers=headers)
    assert response.code == 200, response.body
    # /mcp checks the bearer token itself on every call: no jupyter_server login cookie to send back
    assert not any(k.lower() == "set-cookie" for k in response.headers), response.headers
    assert _jsonrpc(response)["result"]["serverInfo"]["name"]
    session = {k: v for k, v in response.headers.items() if k.lower() == "mcp-session-id"}
    headers.update(session)
    await gateway.request("POST", "/mcp", {"jsonrpc": "2.0", "method": "notifications/initialized"}, token=None, headers=headers)

    # No route hands out a jupyter_server login cookie (every request carries its token), and a cookie does not drive /mcp.
    status = await gateway.request("GET", "/api/status")
    assert not any(k.lower() == "set-cookie" for k in status.headers), status.headers
    cookie = f"username-127-0-0-1-{gateway.port}=forged"
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "list_flavors", "arguments": {}}}
    by_cookie = await gateway.request(
        "POST", "/mcp", call, token=None, headers={**{k: v for k, v in headers.items() if k != "Authorization"}, "Cookie": cookie}
    )
    assert by_cookie.code == 401, (by_cookie.code, by_cookie.body)

    # An accepted call is API activity (ServerApp.shutdown_no_activity_timeout reads it); a refused one is not.
    def last_activity(reply) -> datetime.datetime:
        return datetime.datetime.fromisoformat(json.loads(reply.body)["last_activity"].replace("Z", "+00:00"))

    before = last_activity(await gateway.request("GET", "/api/status"))
    await asyncio.sleep(0.05)
    assert (await gateway.request("POST", "/mcp", call, token=None, headers={**headers, "Authorization": "Bearer wrong"})).code == 401
    assert last_activity(await gateway.request("GET", "/api/status")) == before
    assert (await gateway.request("POST", "/mcp", call, token=None, headers=headers)).code == 200
    assert last_activity(await gateway.request("GET", "/api/status")) > before

    # a kernel started over the Jupyter API is an MCP session too: one process, one set of kernels
    kernel_id = await gateway.start_kernel()
    try:
        listed = await gateway.request(
            "POST",
            "/mcp",
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "get_sessions", "arguments": {}}},
            token=None,
            headers=headers,
        )
        assert listed.code == 200, listed.body
        assert kernel_id in json.dumps(_jsonrpc(listed)), listed.body[:2000]
    finally:
        assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204


async def test_mcp_over_the_gateway_streams_progress_to_the_official_client(gateway: Gateway) -> None:
    """The official Python client (2026-era requests) over /mcp: a call with a progress callback gets its output as
    it runs, and a plain call on the same session is answered too (as JSON, by the manager that awaits it)."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=httpx2.Timeout(120)) as http,
        Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client,
    ):
        ticking, progress = await call_with_progress(client, {"code": TICKS})
        assert ticking.structured_content["status"] == "ok", ticking.content[0].text
        assert any(m.startswith("tick") for m in progress), progress
        plain = await client.call_tool("execute_code", {"code": "6 * 7", "session_id": ticking.structured_content["session_id"]})
        assert plain.structured_content["results"][0]["data"]["text/plain"] == "42", plain.content[0].text
        await client.call_tool("stop_session", {"session_id": ticking.structured_content["session_id"]})


async def test_after_a_kernels_death_an_assistant_is_told_once_and_its_next_call_runs_in_the_fresh_kernel(gateway: Gateway) -> None:
    """The gateway's kernel manager restarts a dead kernel at its restarter's next poll (up to 3 s later); meanwhile the
    kernel is neither alive nor starting. The call it died in says so; every later call, from this client or another,
    waits for the fresh kernel and runs there: the session is kept, and never "stop_session and start a new one"."""

    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=httpx2.Timeout(120)) as http,
        Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client,
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=httpx2.Timeout(120)) as other_http,
        Client(streamable_http_client(gateway.url + "/mcp", http_client=other_http)) as other,
    ):
        first = await client.call_tool("execute_code", {"code": "x = 41"})
        session = first.structured_content["session_id"]
        try:
            died = await client.call_tool("execute_code", {"code": "import os; os._exit(3)", "session_id": session})
            assert died.is_error and "died" in died.structured_content["error"]["message"], died.content[0].text
            # At once, before the restarter's poll, from another client: it waits, and runs in the fresh kernel.
            fresh = await other.call_tool("execute_code", {"code": "'x' in dir()", "session_id": session})
            assert not fresh.is_error, fresh.content[0].text
            assert fresh.structured_content["results"][0]["data"]["text/plain"] == "False"
            again = await client.call_tool("execute_code", {"code": "x = 1; x + 1", "session_id": session})
            assert again.structured_content["results"][0]["data"]["text/plain"] == "2", again.content[0].text
            listed = await client.call_tool("get_sessions", {"session_id": session})
            assert listed.structured_content["sessions"][0]["status"] != "error", listed.structured_content
        finally:
            await client.call_tool("stop_session", {"session_id": session})


async def test_a_new_session_is_served_from_the_warm_pool(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_POOL_SIZE": "python-small=1", "MSB_MAX_SESSIONS": "1"})

    async def pool_ready() -> dict | None:
        stats = await gateway.stats()
        return stats if stats["pool"]["waiting"]["msb-python-small"] == 1 else None

    stats = await wait_until(pool_ready, 60, "the pool to hold a started kernel")
    (pooled,) = gateway.sandboxes()
    assert stats["active_sessions"] == 0, "a waiting pooled kernel is nobody's session"
    assert stats["pool"]["sizes"] == {"msb-python-small": 1}

    kernel_id = await gateway.start_kernel()
    assert kernel_id == pooled.sandbox_id, "the session did not get the pooled kernel"
    ws = await KernelSocket.open(gateway, kernel_id)
    reply = await ws.execute("len(In)")
    assert reply.result == "2", "the pooled kernel had run code before"
    ws.close()
    stats = await gateway.stats()
    assert stats["active_sessions"] == 1 and stats["pool"]["handed_out"] == 1
    # Refilled in the background, even at MSB_MAX_SESSIONS: the pool is not counted (MSB_POOL_COUNTS_AS_SESSIONS=false).
    await wait_until(lambda: len(gateway.sandboxes()) == 2, 60, "the pool to refill")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"})
    assert refused.code == 429 and refused.json["limit"] == "max_sessions"
    assert gateway.stop() == 0, gateway.log()[-3000:]
    assert not gateway.sandboxes(), "pooled kernels outlived the server"


@pytest.mark.parametrize("backend", [pytest.param("namespace"), pytest.param("gvisor", marks=needs_runsc)])
async def test_a_restrictive_umask_changes_nothing_in_the_sandbox(gateway_factory, backend: str) -> None:
    """Hardened hosts run services with umask 077: the sandbox's own directories (its home, /tmp, io dir) still have
    the modes its unprivileged kernel needs, so a kernel starts and runs code, and writes where it should."""
    gateway = await gateway_factory(extra_env={"MSB_BACKEND": backend}, umask=0o077)
    kernel_id = await gateway.start_kernel()
    ws = await KernelSocket.open(gateway, kernel_id)
    try:
        code = "import os, pathlib\npathlib.Path('~/made').expanduser().write_text('x')\nprint(os.listdir(os.path.expanduser('~')))"
        reply = await ws.execute(code)
        assert reply.error is None and "made" in reply.stdout, (reply.error, gateway.log()[-3000:])
    finally:
        ws.close()
    assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    assert "Traceback" not in gateway.log(), gateway.log()[-3000:]
