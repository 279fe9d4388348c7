"""The MCP server over its transports: stdio (`msb-mcp`), streamable HTTP, and attached to a gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from mcp_bridge import jupyter_ws
from mcp_bridge.http import asgi_app
from mcp_bridge.local_sessions import ManagedKernelSessions, standalone_kernel_manager
from mcp_bridge.server import build_server
from msb_kernels.backends import get_backend
from msb_kernels.backends.core import cgroups
from msb_kernels.config import load_settings
from tests.kernel_helpers import execute
from tests.mcp_bridge.conftest import (
    TEST_OPTIONS,
    TICKS,
    VENV_BIN,
    call_with_progress,
    child_env,
    free_port,
    gateway_process,
    result_error,
    stop_process,
    wait_for_port,
)

pytestmark = pytest.mark.asyncio

TOKEN = "test-token-" + uuid.uuid4().hex
needs_cgroups = pytest.mark.skipif(cgroups.detect()[0] is None, reason=f"flavor limits need cgroups: {cgroups.detect()[1]}")


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
    server = build_server(sessions, load_settings(), TEST_OPTIONS)
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


@pytest.fixture(scope="module")
def gateway():
    """`msb-kernels serve` in a subprocess (the gateway this bridge mounts into and attaches to), with a runtime
    dir of its own: the tests below start other gateways on the suite's while this one runs."""
    with gateway_process(TOKEN, MSB_RUNTIME_DIR=str(Path(os.environ["MSB_RUNTIME_DIR"]).parent / "gw-module")) as url:
        yield url


async def test_assistant_and_a_notebook_user_share_variables_through_the_gateway(gateway):
    headers = {"Authorization": f"token {TOKEN}"}
    async with httpx2.AsyncClient(base_url=gateway, headers=headers, timeout=120) as rest:
        # A notebook user opens analysis.ipynb: JupyterLab creates a session and its kernel over REST.
        created = await rest.post(
            "/api/sessions",
            json={"path": "analysis.ipynb", "name": "analysis.ipynb", "type": "notebook", "kernel": {"name": "msb-python-small"}},
        )
        assert created.status_code == 201, created.text
        kernel_id = created.json()["kernel"]["id"]
        notebook = await JupyterWebsocket.connect(gateway, kernel_id, TOKEN)
        try:
            assert (await notebook.execute("dataset = [3, 1, 2]"))["status"] == "ok"

            params = StdioServerParameters(
                command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway, "--token", TOKEN], env=child_env()
            )
            async with Client(params) as assistant:
                listed = await assistant.call_tool("get_sessions", {})
                (summary,) = [s for s in listed.structured_content["sessions"] if s["id"] == kernel_id]
                assert summary["notebook_path"] == "analysis.ipynb" and summary["started_by"] == "other"
                assert summary["language"] == "python" and summary["flavor"] == "small"
                read = await assistant.call_tool("execute_code", {"code": "sorted(dataset)", "session_id": kernel_id})
                assert read.structured_content["results"][0]["data"]["text/plain"] == "[1, 2, 3]", read.content[0].text
                wrote = await assistant.call_tool("execute_code", {"code": "summary = sum(dataset)", "session_id": kernel_id})
                assert not wrote.is_error
                command = await assistant.call_tool(
                    "execute_command", {"command": "echo", "args": ["via gateway"], "session_id": kernel_id}
                )
                assert command.structured_content["stdout"] == "via gateway\n" and command.structured_content["exit_code"] == 0
                own = await assistant.call_tool("execute_code", {"code": "print('assistant kernel')"})
                own_id = own.structured_content["session_id"]
                assert (await rest.get(f"/api/kernels/{own_id}")).status_code == 200

            assert (await notebook.execute("summary"))["result"] == "6"
            assert (await rest.get(f"/api/kernels/{kernel_id}")).status_code == 200, "the assistant stopped the notebook's kernel"
            for _ in range(50):
                if (await rest.get(f"/api/kernels/{own_id}")).status_code == 404:
                    break
                await asyncio.sleep(0.2)
            assert (await rest.get(f"/api/kernels/{own_id}")).status_code == 404, "msb-mcp left the kernel it started at the gateway"

            # The gateway's own /mcp endpoint reaches the same kernels.
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
                async with Client(streamable_http_client(gateway + "/mcp", http_client=http)) as over_http:
                    seen = await over_http.call_tool("execute_code", {"code": "summary * 2", "session_id": kernel_id})
                    assert seen.structured_content["results"][0]["data"]["text/plain"] == "12", seen.content[0].text
                    listed = await over_http.call_tool("get_sessions", {"session_id": kernel_id})
                    assert listed.structured_content["sessions"][0]["notebook_path"] == "analysis.ipynb"
        finally:
            notebook.close()
            await rest.delete(f"/api/sessions/{created.json()['id']}")


async def test_gateway_sessions_time_out_and_report_a_dead_kernel(gateway):
    params = StdioServerParameters(
        command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway, "--token", TOKEN], env=child_env(MSB_MCP_RUNNING_AFTER_SECONDS="20")
    )
    async with Client(params) as assistant:
        first = await assistant.call_tool("execute_code", {"code": "kept_at_gateway = 1"})
        session_id = first.structured_content["session_id"]
        slow = await assistant.call_tool("execute_code", {"code": "import time\ntime.sleep(20)", "session_id": session_id, "timeout": 1.5})
        assert result_error(slow)["type"] == "ExecutionTimeout"
        kept = await assistant.call_tool("execute_code", {"code": "kept_at_gateway", "session_id": session_id})
        assert kept.structured_content["results"][0]["data"]["text/plain"] == "1"
        died = await assistant.call_tool(
            "execute_code", {"code": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "session_id": session_id}
        )
        error = result_error(died)
        assert error["type"] == "SystemError" and "died" in error["message"]
        bad = await assistant.call_tool("execute_code", {"code": "1", "session_id": "not-a-kernel-at-the-gateway"})
        assert result_error(bad)["type"] == "SessionNotFound"


# -- honest errors at the gateway: limits and deaths ---------------------------------------------------


@contextlib.asynccontextmanager
async def assistants_of(gateway_url: str, token: str) -> AsyncIterator[dict[str, Client]]:
    """Both ways an assistant reaches a gateway: its /mcp endpoint, and `msb-mcp --gateway` over stdio."""
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120))
        over_http = await stack.enter_async_context(Client(streamable_http_client(gateway_url + "/mcp", http_client=http)))
        params = StdioServerParameters(
            command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway_url, "--token", token], env=child_env()
        )
        over_stdio = await stack.enter_async_context(Client(params))
        yield {"/mcp": over_http, "msb-mcp --gateway": over_stdio}


async def gateway_stats(gateway_url: str, token: str) -> dict:
    async with httpx2.AsyncClient(headers={"Authorization": f"token {token}"}, timeout=30) as rest:
        response = await rest.get(gateway_url + "/api/msb/stats")
    assert response.status_code == 200, response.text
    return response.json()


async def test_limit_refusals_through_the_gateway_are_resource_limit_exceeded_with_its_advice():
    """Before: SystemError "could not start ... HTTP 429: Too Many Requests", with the advice to run doctor."""
    with gateway_process(TOKEN, MSB_MAX_SESSIONS="2", MSB_CAPACITY_MEMORY_MIB="2560", MSB_POOL_SIZE="0") as url:
        async with assistants_of(url, TOKEN) as assistants:
            for how, assistant in assistants.items():
                too_big = await assistant.call_tool("execute_code", {"code": "1", "flavor": "large"})
                error = result_error(too_big)
                assert error["type"] == "ResourceLimitExceeded", (how, error)
                assert "MSB_CAPACITY_MEMORY_MIB=2560" in error["message"] and "(try:" not in error["message"], (how, error)
                assert any(s.startswith("pick a smaller flavor: small") and "medium" in s for s in error["suggestions"]), (how, error)
            started = []
            for assistant in assistants.values():
                result = await assistant.call_tool("execute_code", {"code": "1"})
                assert not result.is_error, result.content[0].text
                started.append(result.structured_content["session_id"])
            for how, assistant in assistants.items():
                refused = await assistant.call_tool("execute_code", {"code": "1"})
                error = result_error(refused)
                assert error["type"] == "ResourceLimitExceeded", (how, error)
                assert "MSB_MAX_SESSIONS=2" in error["message"], (how, error)
                assert any("raise MSB_MAX_SESSIONS" in s for s in error["suggestions"]), (how, error)
                assert not any("doctor" in s for s in error["suggestions"]), (how, error)
            assert (await gateway_stats(url, TOKEN))["active_sessions"] == 2


async def wait_for_stop_record(url: str, session_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        records = [r for r in (await gateway_stats(url, TOKEN))["recently_stopped"] if r["id"] == session_id]
        if records:
            return records[-1]
        await asyncio.sleep(0.3)
    raise AssertionError(f"/api/msb/stats has no recently_stopped entry for {session_id}")


async def test_a_kernel_killed_behind_the_gateway_is_reported_as_dead_with_its_state_gone():
    """Before: jupyter_server restarted it and the next call got NameError, with advice that state is kept."""
    with gateway_process(TOKEN, MSB_POOL_SIZE="0") as url:
        async with assistants_of(url, TOKEN) as assistants:
            for how, assistant in assistants.items():
                first = await assistant.call_tool("execute_code", {"code": "x_before = 1"})
                session_id = first.structured_content["session_id"]
                (record,) = [r for r in get_backend(load_settings()).list_sandboxes() if r.sandbox_id == session_id and r.running]
                os.kill(record.details["init_pid"], signal.SIGKILL)
                stopped = await wait_for_stop_record(url, session_id)
                assert stopped["status"] == "restarted" and "killed by signal SIGKILL" in stopped["reason"], stopped
                assert "state is lost" in stopped["reason"], stopped

                after = await assistant.call_tool("execute_code", {"code": "x_before", "session_id": session_id})
                error = result_error(after)
                assert error["type"] == "SystemError", (how, error)
                for words in ("died", "killed by signal SIGKILL", "restarted with a fresh kernel", "state", "is gone", "not run"):
                    assert words in error["message"], (how, words, error)
                assert "NameError" not in after.content[0].text, (how, after.content[0].text)
                assert any("run the code that set up its state again" in s for s in error["suggestions"]), (how, error)
                fresh = await assistant.call_tool(
                    "execute_code", {"code": "print('fresh kernel', 'x_before' in globals())", "session_id": session_id}
                )
                assert fresh.structured_content["stdout"] == "fresh kernel False\n", (how, fresh.content[0].text)


@needs_cgroups
async def test_a_kernel_killed_for_memory_behind_the_gateway_names_the_flavor_and_the_lost_state():
    code = "import mmap\nm = mmap.mmap(-1, 1536 * 2**20)\nfor i in range(0, len(m), 4096):\n    m[i] = 1"
    with gateway_process(TOKEN, MSB_POOL_SIZE="0") as url:
        async with assistants_of(url, TOKEN) as assistants:
            for how, assistant in assistants.items():
                first = await assistant.call_tool("execute_code", {"code": "x_before = 1"})
                session_id = first.structured_content["session_id"]
                result = await assistant.call_tool("execute_code", {"code": code, "session_id": session_id, "timeout": 50})
                while result.structured_content.get("status") == "running":
                    result = await assistant.call_tool(
                        "get_execution_output", {"session_id": session_id, "execution_id": result.structured_content["execution_id"]}
                    )
                stopped = await wait_for_stop_record(url, session_id)
                assert stopped["status"] == "restarted" and "out of memory for flavor small" in stopped["reason"], stopped
                error = result_error(result)
                assert error["type"] == "SystemError", (how, error)
                for words in ("died", "out of memory for flavor small (1024 MiB); try medium", "is gone"):
                    assert words in error["message"], (how, words, error)
                assert any("flavor='medium'" in s for s in error["suggestions"]), (how, error)
