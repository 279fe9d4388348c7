"""What a JupyterLab user (`jupyter server --gateway-url`, as JupyterLab runs it) and an assistant
sharing their kernels see: the warm pool, notebook paths, the assistant's executions, and logos."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from mcp_bridge import jupyter_ws
from msb_kernels.kernelspecs.choice import LISTED_NAMES
from msb_kernels.kernelspecs.templates import TEMPLATES
from tests.conftest import REPO
from tests.msb_kernels.gateway.conftest import Gateway, HttpServer, KernelSocket, launch_gateway, launch_jupyter_server, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

VENV_BIN = Path(sys.executable).parent
# What JupyterLab's server puts in a start request besides the notebook's path (jupyter_server/gateway/managers.py):
# KERNEL_LAUNCH_TIMEOUT always, KERNEL_WORKING_DIR for a notebook's directory, KERNEL_USERNAME where set.
LAB_START_ENV = {
    "KERNEL_LAUNCH_TIMEOUT": "40",
    "KERNEL_WORKING_DIR": "/home/alice/work",
    "KERNEL_USERNAME": "alice",
    "JPY_SESSION_NAME": "/home/alice/work/report.ipynb",
}


@pytest.fixture(scope="module")
async def pooled_gateway() -> AsyncIterator[Gateway]:
    server = await launch_gateway(extra_env={"MSB_POOL_SIZE": "python-small=1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def lab(pooled_gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(pooled_gateway)
    yield server
    server.stop()


async def pool_ready(gateway: Gateway) -> dict:
    async def ready() -> dict | None:
        stats = await gateway.stats()
        return stats if stats["pool"]["waiting"].get("msb-python-small") == 1 else None

    return await wait_until(ready, 90, "a waiting pooled kernel")


def pooled_ids(gateway: Gateway, stats: dict) -> set[str]:
    return {r.sandbox_id for r in gateway.sandboxes()} - {k["id"] for k in stats["kernels"]}


@asynccontextmanager
async def assistants(gateway: Gateway) -> AsyncIterator[dict[str, Client]]:
    """An MCP client of the gateway's own /mcp, and one of `msb-mcp --gateway` (the gateway client)."""
    params = StdioServerParameters(
        command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway.url, "--token", gateway.token], env=dict(os.environ)
    )
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=120) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as over_http, Client(params) as over_stdio:
            yield {"/mcp": over_http, "msb-mcp --gateway": over_stdio}


async def listed_path(client: Client, kernel_id: str) -> str | None:
    listed = await client.call_tool("get_sessions", {"session_id": kernel_id})
    assert not listed.is_error, listed.content[0].text
    (session,) = listed.structured_content["sessions"]
    return session["notebook_path"]


async def stats_path(gateway: Gateway, kernel_id: str) -> str | None:
    (entry,) = [k for k in (await gateway.stats())["kernels"] if k["id"] == kernel_id]
    return entry["notebook_path"]


async def test_jupyterlab_starts_are_served_from_the_pool_unless_they_change_the_sandbox(pooled_gateway: Gateway, lab) -> None:
    stats = await pool_ready(pooled_gateway)
    (pooled,) = pooled_ids(pooled_gateway, stats)
    started = time.monotonic()
    created = await lab.request(
        "POST",
        "/api/sessions",
        {"path": "work/pooled.ipynb", "type": "notebook", "name": "pooled.ipynb", "kernel": {"name": "msb-python-small"}},
    )
    took = time.monotonic() - started
    assert created.code == 201, created.body
    kernel_id = created.json["kernel"]["id"]
    assert kernel_id == pooled, "JupyterLab's start (KERNEL_LAUNCH_TIMEOUT, KERNEL_WORKING_DIR, ...) did not get the pooled kernel"
    stats = await pooled_gateway.stats()
    assert stats["pool"]["handed_out"] == 1
    assert (await stats_path(pooled_gateway, kernel_id)).endswith("work/pooled.ipynb")
    print(f"JupyterLab session start served from the pool in {took * 1000:.0f} ms")

    # The same variables with another flavor: a different sandbox, so a kernel of its own.
    stats = await pool_ready(pooled_gateway)
    (refill,) = pooled_ids(pooled_gateway, stats)
    medium = await pooled_gateway.start_kernel("msb-python-small", env={**LAB_START_ENV, "KERNEL_FLAVOR": "medium"})
    assert medium != refill
    stats = await pooled_gateway.stats()
    assert stats["pool"]["handed_out"] == 1 and stats["pool"]["waiting"]["msb-python-small"] == 1
    assert [k["flavor"] for k in stats["kernels"] if k["id"] == medium] == ["medium"]
    # What JupyterLab sends, over the REST API directly: served by the waiting kernel.
    assert await pooled_gateway.start_kernel("msb-python-small", env=LAB_START_ENV) == refill
    assert (await stats_path(pooled_gateway, refill)) == LAB_START_ENV["JPY_SESSION_NAME"]
    for kernel in (medium, refill):
        assert (await pooled_gateway.request("DELETE", f"/api/kernels/{kernel}")).code == 204
    assert (await lab.request("DELETE", f"/api/sessions/{created.json['id']}")).code == 204


async def test_notebook_paths_follow_the_session_model_in_stats_and_get_sessions(pooled_gateway: Gateway, lab) -> None:
    gateway = pooled_gateway
    # A JupyterLab notebook: JupyterLab's server keeps the session and sends the path once, as JPY_SESSION_NAME.
    from_lab = await lab.request(
        "POST", "/api/sessions", {"path": "work/lab.ipynb", "type": "notebook", "name": "lab.ipynb", "kernel": {"name": "msb-python-small"}}
    )
    assert from_lab.code == 201, from_lab.body
    lab_kernel = from_lab.json["kernel"]["id"]
    # A session on the gateway itself, renamed as JupyterLab renames a notebook.
    created = await gateway.request(
        "POST",
        "/api/sessions",
        {"path": "work/draft.ipynb", "type": "notebook", "name": "draft.ipynb", "kernel": {"name": "msb-python-small"}},
    )
    assert created.code == 201, created.body
    session_id, kernel_id = created.json["id"], created.json["kernel"]["id"]
    try:
        async with assistants(gateway) as clients:
            assert (await stats_path(gateway, lab_kernel)).endswith("work/lab.ipynb")
            assert await stats_path(gateway, kernel_id) == "work/draft.ipynb"
            for name, client in clients.items():
                assert await listed_path(client, lab_kernel) == await stats_path(gateway, lab_kernel), name
                assert await listed_path(client, kernel_id) == "work/draft.ipynb", name

            renamed = await gateway.request("PATCH", f"/api/sessions/{session_id}", {"path": "work/final.ipynb", "name": "final.ipynb"})
            assert renamed.code == 200, renamed.body
            assert await stats_path(gateway, kernel_id) == "work/final.ipynb"
            for name, client in clients.items():
                assert await listed_path(client, kernel_id) == "work/final.ipynb", name
    finally:
        await gateway.request("DELETE", f"/api/sessions/{session_id}")
        await lab.request("DELETE", f"/api/sessions/{from_lab.json['id']}")


async def test_an_assistants_runs_leave_the_notebooks_counter_and_history_alone(pooled_gateway: Gateway, lab) -> None:
    created = await lab.request(
        "POST",
        "/api/sessions",
        {"path": "work/shared.ipynb", "type": "notebook", "name": "shared.ipynb", "kernel": {"name": "msb-python-small"}},
    )
    assert created.code == 201, created.body
    kernel_id = created.json["kernel"]["id"]
    notebook = await KernelSocket.open(lab, kernel_id)
    try:
        first = await notebook.execute("data = [3, 1, 2]")
        count = first.reply["content"]["execution_count"]
        async with assistants(pooled_gateway) as clients:
            for name, client in clients.items():
                ran = await client.call_tool(
                    "execute_code", {"session_id": kernel_id, "code": "total = sum(data)\nprint('assistant-output')\ntotal"}
                )
                assert not ran.is_error and "assistant-output" in ran.structured_content["stdout"], (name, ran.content[0].text)
        # Like a JupyterLab console with "Show All Kernel Activity": the assistant's code and output reach every client.
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while "assistant-output\n" not in seen and time.monotonic() < deadline:
            message = await notebook.receive(max(0.1, deadline - time.monotonic()))
            if message["msg_type"] == "execute_input" and "total = sum(data)" in message["content"]["code"]:
                seen.append("input")
            elif message["msg_type"] == "stream":
                seen.append(message["content"]["text"])
        assert seen[:2] == ["input", "assistant-output\n"], seen

        after = await notebook.execute("print(total, len([cell for cell in In if 'assistant-' + 'output' in cell]))")
        assert after.stdout.split() == ["6", "0"], "the assistant's code went into the notebook's input history"
        assert after.reply["content"]["execution_count"] == count + 1, "the assistant's runs advanced the notebook's counter"
    finally:
        notebook.close()
        await lab.request("DELETE", f"/api/sessions/{created.json['id']}")


@pytest.mark.parametrize("template", ["python", "node"])
async def test_every_kernelspec_has_logos_through_the_gateway(pooled_gateway: Gateway, lab, template: str) -> None:
    from PIL import Image

    reason = TEMPLATES[template].unavailable_reason()
    if reason:
        pytest.skip(f"no {template} kernelspecs here: {reason}")
    for size in (32, 64):
        for server in (pooled_gateway, lab):
            response = await server.request("GET", f"/kernelspecs/msb-{template}-small/logo-{size}x{size}.png")
            assert response.code == 200, (server.url, response.code)
            assert response.headers["Content-Type"] == "image/png"
            assert Image.open(io.BytesIO(response.body)).size == (size, size)
    spec = (await lab.request("GET", "/api/kernelspecs")).json["kernelspecs"][LISTED_NAMES[template]]  # listed for msb-*-small
    assert {"logo-32x32", "logo-64x64"} <= set(spec["resources"]), json.dumps(spec)


def documented_lab_commands(path: Path) -> list[tuple[str, ...]]:
    """Each `jupyter lab` command in a document's shell blocks, its continued lines joined, as shlex splits it."""
    commands, text = [], path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("jupyter lab "):
            commands.append(tuple(shlex.split(line, comments=True)))
    return commands


async def test_serve_says_what_serves_kernels_and_how_jupyterlab_connects(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_TOKEN": None})  # a generated token: jupyter_server's paste-this-URL case
    banner = await wait_until(lambda: "listening on" in gateway.log() and gateway.log(), 30, "the banner")
    token = banner.split("  token: ", 1)[1].split()[0]
    (command,) = [line.split("JupyterLab: ", 1)[1] for line in banner.splitlines() if "JupyterLab: " in line]
    assert shlex.split(command) == [
        "jupyter",
        "lab",
        "--IdentityProvider.token=<lab-token>",
        f"--gateway-url={gateway.url}",
        "--GatewayClient.auth_token=<token>",
        "--GatewayClient.allowed_envs=JPY_SESSION_NAME,KERNEL_FLAVOR",
    ]
    documented = [(name, doc) for name in ("README.md", "docs/notebooks.md") for doc in documented_lab_commands(REPO / name)]
    assert len(documented) >= 3, documented  # the README's start and shared notebooks, and docs/notebooks.md
    for name, doc in documented:
        assert list(doc) == shlex.split(command.replace(gateway.url, "http://127.0.0.1:8765")), (name, doc, command)
    assert "every kernel runs in a namespace sandbox" in banner
    for misleading in ("Serving notebooks from local directory", "copy and paste", "twice to skip confirmation"):
        assert misleading not in banner, misleading
    assert (await gateway.request("GET", "/api/msb/stats", token=token)).code == 200, "the printed token does not work"


async def test_a_kernels_own_output_stays_out_of_the_gateways_log(pooled_gateway: Gateway) -> None:
    gateway = pooled_gateway
    kernel_id = await gateway.start_kernel()
    ws = await KernelSocket.open(gateway, kernel_id)
    reply = await ws.execute("import os\nos.system('echo kernel-stderr-marker >&2')\nraise ValueError('user-code-error')")
    assert reply.error["evalue"] == "user-code-error"
    # A restart while busy: ipykernel prints a traceback of its own as its sockets close.
    ws.send(
        "execute_request",
        {
            "code": "import time\ntime.sleep(60)",
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    )
    await asyncio.sleep(1)
    assert (await gateway.request("POST", f"/api/kernels/{kernel_id}/restart", timeout=90)).code == 200
    ws.close()
    assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    await asyncio.sleep(1)
    log = gateway.log()
    for kernels_own in ("kernel-stderr-marker", "Traceback", "user-code-error", "ZMQError"):
        assert kernels_own not in log, f"{kernels_own!r} in the gateway's log:\n{log[-3000:]}"


async def test_a_replaced_kernel_connection_leaves_no_blank_or_ping_warning_in_the_log(gateway_factory) -> None:
    """JupyterLab replaces a kernel's WebSocket under the same session id when it reconnects: the log says so in words,
    and the start says nothing about WebSocket ping settings that the operator never set."""
    gateway = await gateway_factory()
    kernel_id = await gateway.start_kernel()
    session_id = uuid.uuid4().hex
    first = await KernelSocket.open(gateway, kernel_id, session_id)
    assert (await first.execute("print(1)")).stdout == "1\n"
    # Output streams while the first socket is replaced: some of it reaches that socket as it closes.
    first.send(
        "execute_request", jupyter_ws.execute_content("import time\nfor i in range(300):\n    print(i, flush=True)\n    time.sleep(0.005)")
    )
    await first.receive(30)
    second = await KernelSocket.open(gateway, kernel_id, session_id)  # the same session: the first is replaced
    assert (await second.execute("print(2)")).stdout == "2\n"
    second.close()
    first.close()
    assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204
    assert gateway.stop(timeout=20) == 0
    log = gateway.log()
    warnings = [line for line in log.splitlines() if line.startswith("[W ")]
    blank = [line for line in warnings if not line.split("]", 1)[1].strip()]
    assert blank == [], f"blank warnings in the gateway's log:\n{log[-3000:]}"
    assert "websocket_ping_timeout" not in log, log[-3000:]
    assert any("Replacing stale connection" in line for line in warnings), log[-3000:]


async def test_a_notebook_from_elsewhere_naming_python3_starts_in_a_sandbox(pooled_gateway: Gateway, lab) -> None:
    """Notebooks in the wild name ipykernel's python3 (or javascript, jslab): through the gateway each gets the sandboxed
    kernel of the default flavor, from the pool, and the listing says what it stands for."""
    specs = (await lab.request("GET", "/api/kernelspecs")).json["kernelspecs"]
    # the launcher's card says which kernel it is, and that it is the default (and sorts first: Lab's preselection)
    assert specs["python3"]["spec"]["display_name"] == "Default: Python 3 (sandbox, small)", specs["python3"]
    assert specs["python3"]["spec"]["metadata"]["msb"]["stands_for"] == "msb-python-small"
    assert specs["python3"]["spec"]["metadata"]["kernel_provisioner"]["provisioner_name"] == "msb-sandbox"
    assert "python" not in specs and "jslab" not in specs, "one listed name per language: no launcher card twice over"
    assert "msb-python-small" not in specs and "msb-node-small" not in specs, "the alias is listed in its place, not beside it"
    assert {"msb-python-medium", "msb-python-large"} <= specs.keys(), specs.keys()
    assert (await lab.request("GET", "/api/kernelspecs")).json["default"] == "python3"
    if TEMPLATES["node"].unavailable_reason() is None:
        assert specs["javascript"]["spec"]["metadata"]["msb"]["stands_for"] == "msb-node-small"
        assert specs["javascript"]["spec"]["display_name"] == "JavaScript (Node.js) (sandbox, small, default)"
    stats = await pool_ready(pooled_gateway)
    (pooled,) = pooled_ids(pooled_gateway, stats)
    created = await lab.request(
        "POST", "/api/sessions", {"path": "work/wild.ipynb", "type": "notebook", "name": "wild.ipynb", "kernel": {"name": "python3"}}
    )
    assert created.code == 201, created.body
    kernel_id = created.json["kernel"]["id"]
    assert kernel_id == pooled and created.json["kernel"]["name"] == "python3", created.json  # what Lab saves
    socket = await KernelSocket.open(lab, kernel_id)
    seen = await socket.execute("import os; print(os.environ['MSB_SANDBOX'], os.environ['MSB_FLAVOR'], os.getuid())")
    (backend,) = [k["backend"] for k in (await pooled_gateway.stats())["kernels"] if k["id"] == kernel_id]
    assert seen.stdout.split() == [backend, "small", "1000"], seen.messages
    socket.connection.close()
    unlisted = await pooled_gateway.start_kernel("python", env=LAB_START_ENV)  # resolved, though not listed
    assert [k["kernel_name"] for k in (await pooled_gateway.stats())["kernels"] if k["id"] == unlisted] == ["msb-python-small"]
    assert (await pooled_gateway.request("POST", "/api/kernels", {"name": "no-such-kernel"})).code == 404
    assert (await pooled_gateway.request("DELETE", f"/api/kernels/{unlisted}")).code == 204
    assert (await lab.request("DELETE", f"/api/sessions/{created.json['id']}")).code == 204
