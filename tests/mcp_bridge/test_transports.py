"""The MCP server over its transports: stdio (`msb-mcp`), streamable HTTP, and attached to a gateway."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from mcp_bridge import jupyter_ws
from mcp_bridge.http import asgi_app
from mcp_bridge.local_sessions import ManagedKernelSessions, standalone_kernel_manager
from mcp_bridge.server import build_server
from msb_kernels.backends import get_backend
from msb_kernels.identity.people import local_person
from msb_kernels.settings.config import load_settings
from tests.kernel_helpers import execute
from tests.mcp_bridge.conftest import (
    TEST_OPTIONS,
    TICKS,
    VENV_BIN,
    call_with_progress,
    child_env,
    free_port,
    result_error,
    stop_process,
    wait_for_port,
)

pytestmark = pytest.mark.asyncio

TOKEN = "test-token-" + uuid.uuid4().hex


def running_sandboxes() -> set[str]:
    return {record.sandbox_id for record in get_backend(load_settings()).list_sandboxes() if record.running}


async def wait_until(predicate, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.2)


# -- stdio -----------------------------------------------------------------------------------------


async def test_stdio_server_runs_code_and_stops_its_kernels_on_exit(tmp_path):
    params = StdioServerParameters(command=str(VENV_BIN / "msb-mcp"), args=[], env=child_env(), cwd=str(tmp_path))
    async with Client(params) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert {"execute_code", "execute_command", "get_sessions"} <= tools
        first = await client.call_tool("execute_code", {"code": "via_stdio = 6 * 7\nprint('over stdio')"})
        assert not first.is_error, first.content[0].text
        session_id = first.structured_content["session_id"]
        assert first.structured_content["stdout"] == "over stdio\n"
        second = await client.call_tool("execute_code", {"code": "via_stdio", "session_id": session_id})
        assert second.structured_content["results"][0]["data"]["text/plain"] == "42"
        bad = await client.call_tool("execute_code", {"code": ["not", "a", "string"]})
        assert result_error(bad)["type"] == "InvalidRequest"
        assert session_id in running_sandboxes()
        assert not list(tmp_path.iterdir()), "msb-mcp wrote files into the directory it was started in"
    # The client closed stdin: the server stops every kernel it started before it exits.
    await wait_until(lambda: session_id not in running_sandboxes(), 20, "msb-mcp left its kernel running after it exited")


async def test_stdio_server_stops_its_kernels_on_sigterm(tmp_path):
    process = subprocess.Popen(
        [str(VENV_BIN / "msb-mcp")],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:

        def send(message: dict) -> None:
            process.stdin.write((json.dumps(message) + "\n").encode())
            process.stdin.flush()

        def receive(msg_id: int) -> dict:
            while True:
                line = process.stdout.readline()
                assert line, f"msb-mcp closed stdout: {process.stderr.read().decode()[-2000:]}"
                message = json.loads(line)
                if message.get("id") == msg_id:
                    return message

        send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw-test", "version": "0"}},
            }
        )
        assert "result" in await asyncio.to_thread(receive, 1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "execute_code", "arguments": {"code": "1 + 1"}}})
        reply = await asyncio.to_thread(receive, 2)
        session_id = reply["result"]["structuredContent"]["session_id"]
        assert session_id in running_sandboxes()
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 30)
        assert session_id not in running_sandboxes(), "SIGTERM left the kernel running"
    finally:
        stop_process(process)


# -- streamable HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server():
    port = free_port()
    process = subprocess.Popen(
        [str(VENV_BIN / "msb-mcp"), "--http", f"127.0.0.1:{port}", "--token", TOKEN],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_for_port(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process)


def http_client(headers: dict | None = None) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(headers=headers or {}, timeout=httpx2.Timeout(120))


async def test_http_runs_tools_with_a_bearer_token(http_server):
    answered_as = []  # each tool call's response Content-Type

    async def record(response: httpx2.Response) -> None:
        if response.request.method == "POST" and b'"tools/call"' in response.request.content:
            answered_as.append(response.headers.get("content-type", "").split(";")[0])

    async with httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=httpx2.Timeout(120), event_hooks={"response": [record]}
    ) as http:
        async with Client(streamable_http_client(http_server + "/", http_client=http)) as client:
            first, progress = await call_with_progress(client, {"code": "over_http = 'yes'\n" + TICKS})
            assert not first.is_error, first.content[0].text
            session_id = first.structured_content["session_id"]
            assert any(m.startswith("tick") for m in progress), progress
            again = await client.call_tool("execute_code", {"code": "over_http", "session_id": session_id})
            assert again.structured_content["results"][0]["data"]["text/plain"] == "'yes'"
            # A call that asks for progress streams (server-sent events); one that does not is answered as one JSON body.
            assert answered_as == ["text/event-stream", "application/json"], answered_as
            missing = await client.call_tool("execute_code", {"code": "1", "session_id": "nope"})
            assert result_error(missing)["type"] == "SessionNotFound"
            stopped = await client.call_tool("stop_session", {"session_id": session_id})
            assert stopped.structured_content["success"] is True


async def test_a_call_that_asks_for_no_progress_is_served_without_watching_for_notifications():
    """2026-era calls: one with a progress token goes to the manager that streams, one without to the one that
    answers as plain JSON, in the request itself (the SDK answers JSON for both when nothing streamed, so only
    the manager that served a call tells them apart)."""
    app = asgi_app(ManagedKernelSessions(start_timeout=60), TOKEN, ["test"], [], load_settings(), TEST_OPTIONS)
    served: list[str] = []
    for name in ("manager", "unstreamed"):
        manager = getattr(app, name)

        async def recorded(scope, receive, send, handle=manager.handle_request, name=name):
            served.append(name)
            await handle(scope, receive, send)

        manager.handle_request = recorded
    await app.start()
    try:
        async with (
            httpx2.AsyncClient(
                transport=httpx2.ASGITransport(app=app), base_url="http://test", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as http,
            Client(streamable_http_client("http://test/", http_client=http)) as client,
        ):
            served.clear()
            first, progress = await call_with_progress(client, {"code": TICKS})
            assert not first.is_error and served[0] == "manager", (served, first.content[0].text)
            assert any(m.startswith("tick") for m in progress), progress
            served.clear()
            second = await client.call_tool("execute_code", {"code": "6 * 7", "session_id": first.structured_content["session_id"]})
            assert second.structured_content["results"][0]["data"]["text/plain"] == "42" and served == ["unstreamed"], served
    finally:
        await app.close()


async def test_http_refuses_missing_token_wrong_host_and_foreign_origin(http_server):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    port = http_server.rsplit(":", 1)[1]
    async with http_client() as http:
        no_token = await http.post(http_server + "/", json=body, headers=headers)
        assert no_token.status_code == 401 and "Bearer" in no_token.headers.get("www-authenticate", "")
        wrong_token = await http.post(http_server + "/", json=body, headers={**headers, "Authorization": "Bearer wrong"})
        assert wrong_token.status_code == 401
        rebinding = await http.post(
            http_server + "/", json=body, headers={**headers, "Authorization": f"Bearer {TOKEN}", "Host": f"attacker.example:{port}"}
        )
        assert rebinding.status_code == 421
        foreign = await http.post(
            http_server + "/", json=body, headers={**headers, "Authorization": f"Bearer {TOKEN}", "Origin": "http://attacker.example"}
        )
        assert foreign.status_code == 403
        local_origin = await http.post(
            http_server + "/", json=body, headers={**headers, "Authorization": f"Bearer {TOKEN}", "Origin": f"http://localhost:{port}"}
        )
        assert local_origin.status_code not in (401, 403, 421)
        # A 2026-era body nested past Python's recursion limit gets the SDK's parse error, not a crash.
        nested = await http.post(
            http_server + "/",
            content=b"[" * 100_000,
            headers={**headers, "Authorization": f"Bearer {TOKEN}", "MCP-Protocol-Version": "2026-07-28"},
        )
        assert nested.status_code == 400 and nested.json()["error"]["code"] == -32700, nested.text


# -- sharing kernels with Jupyter clients --------------------------------------------------------------


async def test_assistant_and_a_plain_jupyter_client_share_a_kernel_in_process():
    """ManagedKernelSessions over a kernel manager that Jupyter code also uses (the gateway's arrangement)."""
    kernel_manager = standalone_kernel_manager()
    sessions = ManagedKernelSessions(kernel_manager)
    server = build_server(sessions, load_settings(), TEST_OPTIONS, local_caller=local_person())
    kernel_id = await kernel_manager.start_kernel(kernel_name="msb-python-small")
    kc = kernel_manager.get_kernel(kernel_id).client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        assert (await execute(kc, "from_notebook = 'set by a Jupyter client'")).status == "ok"
        async with Client(server) as client:
            listed = await client.call_tool("get_sessions", {})
            (summary,) = [s for s in listed.structured_content["sessions"] if s["id"] == kernel_id]
            assert summary["started_by"] == "other" and summary["language"] == "python" and summary["flavor"] == "small"
            read = await client.call_tool("execute_code", {"code": "from_notebook", "session_id": kernel_id})
            assert read.structured_content["results"][0]["data"]["text/plain"] == "'set by a Jupyter client'"
            await client.call_tool("execute_code", {"code": "from_assistant = from_notebook.upper()", "session_id": kernel_id})

            # The notebook's cell runs first; the assistant's timeout starts only when its own code does,
            # so the notebook's cell is not interrupted.
            notebook_cell = asyncio.create_task(execute(kc, "import time\ntime.sleep(2)\nnotebook_cell_done = True"))
            await asyncio.sleep(0.3)
            queued = await client.call_tool("execute_code", {"code": "print('assistant ran')", "session_id": kernel_id, "timeout": 1})
            if queued.structured_content["status"] == "running":
                queued = await client.call_tool(
                    "get_execution_output", {"session_id": kernel_id, "execution_id": queued.structured_content["execution_id"]}
                )
            assert queued.structured_content["status"] == "ok", queued.content[0].text
            assert queued.structured_content["stdout"] == "assistant ran\n"
            assert (await notebook_cell).status == "ok", "the assistant's timeout interrupted the notebook user's cell"
        assert (await execute(kc, "from_assistant")).result == "'SET BY A JUPYTER CLIENT'"
        await sessions.close()
        assert kernel_id in kernel_manager.list_kernel_ids(), "closing the bridge stopped a kernel it did not start"
    finally:
        kc.stop_channels()
        await kernel_manager.shutdown_all(now=True)


class JupyterWebsocket:
    """A minimal Jupyter websocket client, as JupyterLab talks to a gateway (not through the bridge's sessions)."""

    def __init__(self, ws):
        self.ws = ws
        self.session = uuid.uuid4().hex

    @classmethod
    async def connect(cls, base: str, kernel_id: str, token: str) -> JupyterWebsocket:
        return cls(await jupyter_ws.connect(jupyter_ws.channels_url(base, kernel_id, uuid.uuid4().hex), token, 60))

    async def execute(self, code: str, timeout: float = 60) -> dict:
        request = jupyter_ws.message(
            "shell", "execute_request", jupyter_ws.execute_content(code), session=self.session, username="notebook-user"
        )
        msg_id = request["header"]["msg_id"]
        self.ws.write_message(jupyter_ws.encode(request))
        outputs: dict = {"stdout": "", "result": None, "status": None}
        idle = False
        deadline = time.monotonic() + timeout
        while not (idle and outputs["status"]):
            raw = await asyncio.wait_for(self.ws.read_message(), max(0.1, deadline - time.monotonic()))
            assert raw is not None, "the gateway closed the websocket"
            message = jupyter_ws.parse(raw)
            if message is None or jupyter_ws.parent_id(message) != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                outputs["stdout"] += message["content"]["text"]
            elif kind == "execute_result":
                outputs["result"] = message["content"]["data"]["text/plain"]
            elif kind == "execute_reply":
                outputs["status"] = message["content"]["status"]
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                idle = True
        return outputs

    def close(self) -> None:
        self.ws.close()
