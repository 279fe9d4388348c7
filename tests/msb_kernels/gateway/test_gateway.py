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
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from tornado.httpclient import HTTPClientError

from mcp_bridge import jupyter_ws
from msb_kernels.backends.core import cgroups
from msb_kernels.templates import TEMPLATES
from tests.conftest import TEST_BASE, VENV_BIN
from tests.mcp_bridge.conftest import TICKS, call_with_progress
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, free_port, init_pids, launch_jupyter_server, pid_alive, wait_until

pytestmark = pytest.mark.timeout(240)


# -- through jupyter_server's GatewayClient ---------------------------------------------------


async def test_jupyter_server_runs_its_kernels_in_our_sandboxes(gateway: Gateway, jupyter_server) -> None:
    js = jupyter_server
    # kernelspecs: only sandboxed ones, with their flavors
    specs = (await js.request("GET", "/api/kernelspecs")).json
    assert {"msb-python-small", "msb-python-medium", "msb-python-large"} <= set(specs["kernelspecs"])
    assert all(name.startswith("msb-") for name in specs["kernelspecs"]), "a kernelspec that runs outside a sandbox is offered"
    # jupyter_server takes the gateway's default from its first fetch on (it answers its own the first time)
    assert (await js.request("GET", "/api/kernelspecs")).json["default"] == "msb-python-small"
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
    """KERNEL_FLAVOR in the start request's env, the stats, interrupt/restart/delete and JSON 404s."""
    kernel_id = await gateway.start_kernel("msb-python-small", env={"KERNEL_FLAVOR": "medium", "NOT_KERNEL": "x"})
    try:
        ws = await KernelSocket.open(gateway, kernel_id)
        reply = await ws.execute(
            "import os\nprint(os.environ['MSB_FLAVOR'], os.environ.get('NOT_KERNEL'), "
            "os.environ.get('MSB_TOKEN'), os.environ.get('KERNEL_FLAVOR'))"
        )
        assert reply.stdout.split() == ["medium", "None", "None", "medium"]  # the gateway's token stays out
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
    for refused in ("python3", "msb-python-huge"):
        response = await gateway.request("POST", "/api/kernels", {"name": refused})
        assert response.code == 404, response.body
        assert "msb-python-small" in " ".join(response.json["suggestions"])
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
    health = await gateway.request("GET", "/api/msb/health", token=None)
    assert health.code == 200 and health.json["status"] == "ok"
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


async def test_max_sessions_and_capacity_refusals(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_MAX_SESSIONS": "2", "MSB_CAPACITY_MEMORY_MIB": "3072", "MSB_CAPACITY_CPUS": "8"})
    medium = await gateway.start_kernel("msb-python-medium")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-medium"})
    assert refused.code == 429, refused.body
    body = refused.json
    assert body["type"] == body["reason"] == "ResourceLimitExceeded"
    assert body["limit"] == "capacity_memory"
    assert "MSB_CAPACITY_MEMORY_MIB=3072" in body["message"]
    assert any("stop a session" in s for s in body["suggestions"])
    assert any("smaller flavor" in s and "small" in s for s in body["suggestions"])
    # KERNEL_FLAVOR asks for more than the kernelspec: the same check
    env_refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_FLAVOR": "large"}})
    assert env_refused.code == 429 and env_refused.json["limit"] == "capacity_memory"

    small = await gateway.start_kernel("msb-python-small")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"})
    assert refused.code == 429 and refused.json["limit"] == "max_sessions", refused.body
    assert "MSB_MAX_SESSIONS=2" in refused.json["message"]
    assert any("stop a session" in s for s in refused.json["suggestions"])
    stats = await gateway.stats()
    assert stats["active_sessions"] == 2 and stats["max_sessions"] == 2
    (fork_server,) = stats["fork_servers"]  # it forked both kernels, and counts toward no limit
    assert fork_server["kernels_forked"] >= 2 and fork_server["python"].endswith("python"), fork_server
    assert (stats["total_memory_mb"], stats["total_cpus"]) == (3072, 3)
    assert stats["available"] == {"memory_mb": 0, "cpus": 5}
    assert stats["utilization"]["sessions"] == 100.0 and stats["utilization"]["memory"] == 100.0
    assert len(gateway.sandboxes()) == 2, "a refused start left a sandbox"

    # stopping a session frees its share: the refused start now works
    assert (await gateway.request("DELETE", f"/api/kernels/{medium}")).code == 204
    again = await gateway.start_kernel("msb-python-medium")
    assert {k["id"] for k in (await gateway.stats())["kernels"]} == {small, again}

    # a refusal through jupyter_server's GatewayClient reaches its user with the reason and the advice
    js = await launch_jupyter_server(gateway)
    try:
        response = await js.request("POST", "/api/kernels", {"name": "msb-python-small"})
        assert response.code == 429, response.body
        # jupyter_server 2.21 sends its client the unformatted "Error from Gateway: [%s] %s" (its own bug),
        # and logs the gateway's message and advice in full:
        await wait_until(lambda: "MSB_MAX_SESSIONS=2" in js.log(), 5, "the refusal in jupyter_server's log")
        assert "stop a session" in js.log() and "ResourceLimitExceeded" in js.log()
    finally:
        js.stop()


async def test_idle_kernels_are_culled_honouring_the_kernelspec_override(gateway_factory, installed_kernelspecs: Path) -> None:
    # The installed kernelspecs carry the timeout install wrote (1800): the server's MSB_SESSION_TIMEOUT_SECONDS
    # decides for them. A kernelspec whose cull_idle_timeout was edited by hand overrides it.
    spec_dir = installed_kernelspecs / "msb-python-keep-meta"
    spec_dir.mkdir(exist_ok=True)
    spec = json.loads((installed_kernelspecs / "msb-python-small" / "kernel.json").read_text())
    assert spec["metadata"]["cull_idle_timeout"] == spec["metadata"]["msb"]["installed_cull_idle_timeout"] == 1800
    spec["metadata"]["cull_idle_timeout"] = 3600
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    # 5 s idle: enough to read the first kernel's pid on a loaded host; whether it is culled before or
    # after the second kernel is up does not matter.
    gateway = await gateway_factory(extra_env={"MSB_SESSION_TIMEOUT_SECONDS": "5", "MSB_CULL_INTERVAL_SECONDS": "1"})
    culled = await gateway.start_kernel("msb-python-small")
    pid = init_pids(gateway)[culled]
    kept = await gateway.start_kernel("msb-python-keep-meta")  # its kernelspec says 3600 s: the override wins

    async def listed() -> list[str]:
        return [k["id"] for k in (await gateway.request("GET", "/api/kernels")).json]

    # What a user sees decides: the kernel leaves /api/kernels a few awaits after its sandbox stops, so
    # waiting on the sandbox alone raced the listing on a loaded host.
    async def culled_is_gone() -> bool:
        return culled not in await listed()

    await wait_until(culled_is_gone, 40, "the idle kernel to be culled")
    assert culled not in init_pids(gateway) and not pid_alive(pid), "culling left the sandbox's processes"
    assert await listed() == [kept]
    stats = await gateway.stats()
    assert stats["active_sessions"] == 1 and stats["total_memory_mb"] == 1024
    (stopped,) = [s for s in stats["recently_stopped"] if s["id"] == culled]
    assert stopped["status"] == "stopped" and "culled" in stopped["reason"]
    assert stats["culling"] == {"idle_timeout": 5, "interval": 1, "connected": False, "busy": False}
    (entry,) = stats["kernels"]
    assert entry["cull_idle_timeout"] == 3600


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_clean_stop_leaves_no_sandbox(gateway_factory, signum: int, tmp_path: Path) -> None:
    """Quickly too: a kernel that is busy and ignores the shutdown request does not hold the stop up for
    shutdown_wait_time (set to 60 s here, so waiting for it would fail the 20 s bound)."""
    (tmp_path / "msb_kernels_serve_config.py").write_text("c.KernelManager.shutdown_wait_time = 60\n")
    gateway = await gateway_factory(extra_env={"JUPYTER_CONFIG_DIR": str(tmp_path)})
    kernel_id, stubborn_id = await gateway.start_kernel(), await gateway.start_kernel()
    pids = init_pids(gateway)
    assert set(pids) == {kernel_id, stubborn_id}
    ws = await KernelSocket.open(gateway, kernel_id)
    await ws.execute("import subprocess\nchild = subprocess.Popen(['sleep', '600'])")  # something more to stop
    stubborn = await KernelSocket.open(gateway, stubborn_id)
    busy = stubborn.send(
        "execute_request",
        jupyter_ws.execute_content(
            "import signal\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\nprint('busy', flush=True)\nwhile True: pass"
        ),
    )
    await stubborn.wait_for(busy, lambda m: m["msg_type"] == "stream", 60)
    assert gateway.stop(signum, timeout=20) == 0, gateway.log()[-3000:]
    assert not gateway.sandboxes(), "a sandbox outlived the server"
    assert not any(pid_alive(pid) for pid in pids.values())
    assert not list(gateway.runtime_dir.glob("*/state.json"))


async def test_without_a_grace_period_kill_9_ends_the_kernels_and_the_restart_leaves_no_orphan(gateway_factory) -> None:
    """MSB_ADOPT_GRACE_SECONDS=0: kernels end with the gateway, as they did before restarts kept them (test_adoption.py)."""
    gateway = await gateway_factory(extra_env={"MSB_ADOPT_GRACE_SECONDS": "0"})
    kernel_id = await gateway.start_kernel()
    pid = init_pids(gateway)[kernel_id]
    gateway.process.kill()
    gateway.process.wait(10)
    await wait_until(lambda: not pid_alive(pid), 20, "the sandbox to die with its owner")
    (record,) = gateway.sandboxes()
    assert not record.owner_alive  # state a killed process could not remove (its init may linger as a zombie)

    again = await gateway_factory(runtime_dir=gateway.runtime_dir, extra_env={"MSB_ADOPT_GRACE_SECONDS": "0"})
    assert not again.sandboxes(), "the restarted server left an orphan"
    assert "left behind" in again.log()
    assert (await again.stats())["active_sessions"] == 0


async def test_debug_lines_are_written_at_the_debug_log_level_only(gateway: Gateway, gateway_factory) -> None:
    """--log-level DEBUG shows jupyter_server's debug lines (a request's, here); the default level builds none."""
    debug = await gateway_factory(args=["--log-level", "DEBUG"])
    for server in (gateway, debug):
        assert (await server.request("GET", "/api/kernelspecs")).code == 200
    await wait_until(lambda: "200 GET /api/kernelspecs" in debug.log(), 5, "the request's debug line")
    assert "200 GET /api/kernelspecs" not in gateway.log()


async def test_a_second_gateway_on_the_same_runtime_dir_is_refused(gateway_factory) -> None:
    """It stops at once, saying whose dir it is and what to do, and the first one's kernel is unharmed."""
    first = await gateway_factory()
    kernel_id = await first.start_kernel()
    second = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "serve", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env={**first.env, "MSB_TOKEN": "another"},
    )
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"another msb-kernels serve (pid {first.process.pid}) already uses the runtime dir {first.runtime_dir}" in second.stderr
    assert "MSB_RUNTIME_DIR" in second.stderr
    ws = await KernelSocket.open(first, kernel_id)
    assert (await ws.execute("1 + 1")).result == "2"


def test_bad_settings_stop_the_start_with_a_clear_message(tmp_path: Path) -> None:
    for variable, value in (("MSB_CAPACITY_CPUS", "many"), ("MSB_PORT", "99999"), ("MSB_CULL_BUSY", "maybe"), ("MSB_MAX_SESSIONS", "0")):
        result = subprocess.run(
            [str(VENV_BIN / "msb-kernels"), "serve"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, variable: value, "MSB_RUNTIME_DIR": str(TEST_BASE / "bad")},
        )
        assert result.returncode == 2, (variable, result.stderr)
        assert variable in result.stderr and "Traceback" not in result.stderr, result.stderr


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

    # A browser's jupyter_server login cookie, without the bearer token, does not drive /mcp.
    status = await gateway.request("GET", "/api/status")
    cookie = status.headers.get("Set-Cookie", "").split(";")[0]
    assert cookie.startswith("username-"), status.headers
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
