"""A person's JupyterLab and the gateway it runs its kernels on, started as the README says, and MCP clients of the gateway.

The gateway is told where that JupyterLab is (MSB_LAB_URL, MSB_LAB_TOKEN) before Lab starts, so
Lab's port and token are chosen first. jupyter-collaboration is installed in Lab's environment
(the test extras), as the README asks of a person who wants the notebook tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import TEST_BASE
from tests.msb_kernels.gateway.conftest import Gateway, HttpServer, free_port, launch_gateway, launch_jupyter_server

RUNNING_AFTER_SECONDS = 4.0  # short, so the hand-off to get_execution_output is exercised by a 10-second cell


@pytest.fixture(scope="package")
async def lab_and_gateway() -> AsyncIterator[tuple[HttpServer, Gateway]]:
    port, token = free_port(), secrets.token_hex(16)
    root = TEST_BASE / f"js-root-{port}"  # where launch_jupyter_server roots Lab; shown in the sandboxes
    (root / "work").mkdir(parents=True, exist_ok=True)
    env = {
        "MSB_LAB_ROOT_PATH": str(root),
        "MSB_LAB_URL": f"http://127.0.0.1:{port}",
        "MSB_LAB_TOKEN": token,
        "MSB_MCP_RUNNING_AFTER_SECONDS": str(RUNNING_AFTER_SECONDS),
    }
    gateway = await launch_gateway(extra_env=env)
    lab = await launch_jupyter_server(gateway, app="lab", port=port, token=token)
    yield lab, gateway
    lab.stop()
    gateway.stop()


@pytest.fixture(scope="package")
def lab(lab_and_gateway) -> HttpServer:
    return lab_and_gateway[0]


@pytest.fixture(scope="package")
def notebook_gateway(lab_and_gateway) -> Gateway:
    return lab_and_gateway[1]


@contextlib.asynccontextmanager
async def mcp_client(gateway: Gateway) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=180) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client:
            yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict:
    """A tool call that must succeed; its structured content."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool}{arguments}: {result.content[0].text}"
    return result.structured_content


async def finished(client: Client, answer: dict, timeout: float = 120) -> dict:
    """Follow a 'running' answer with get_execution_output until the run is over; the last answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while answer["status"] == "running":
        assert loop.time() < deadline, f"still running after {timeout} s: {answer}"
        result = await client.call_tool(
            "get_execution_output", {"session_id": answer["session_id"], "execution_id": answer["execution_id"]}
        )
        answer = result.structured_content
    return answer


async def wait_for(check: Callable[[], Any], what: str, timeout: float = 60, interval: float = 0.2) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert loop.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(interval)


def code_cells(notebook: dict) -> list[dict]:
    """The cells of a read_notebook answer that have source (Lab gives a new notebook one empty cell)."""
    return [cell for cell in notebook["cells"] if cell["source"].strip()]
