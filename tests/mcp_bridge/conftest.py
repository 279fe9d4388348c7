"""MCP bridge fixtures: real kernels behind a real MCP server, reached by a real MCP client.

tests/conftest.py already isolates the environment (runtime dir, Jupyter paths) and
installs the msb kernelspecs once per session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.options import BridgeOptions
from mcp_bridge.server import build_server
from msb_kernels.identity.people import local_person
from msb_kernels.settings.config import load_settings
from tests.msb_kernels.gateway.conftest import wait_until

VENV_BIN = Path(sys.executable).parent

# Short waits so the long-run and timeout paths run in seconds, not minutes.
TEST_OPTIONS = BridgeOptions.from_settings(
    None,
    running_after_seconds=3.0,
    default_timeout_seconds=60.0,
    progress_interval_seconds=1.0,
    max_output_chars=20_000,
    max_code_chars=100_000,
    kernel_start_timeout_seconds=60.0,
)


def result_error(result) -> dict:
    assert result.is_error, f"expected a tool error, got {result.content[0].text}"
    error = (result.structured_content or {}).get("error")
    assert error and error["type"] and error["message"] and error["suggestions"], result.structured_content
    text = result.content[0].text
    for server_side in ("mcp_bridge/", "site-packages/mcp", "jupyter_client/", "pydantic"):
        assert server_side not in text, f"a server-side traceback or internals reached the client: {text}"
    return error


# A cell that prints a tick every 0.4 s, so its output comes as progress while it runs.
TICKS = "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.4)\n"


async def call_with_progress(client: Any, arguments: dict) -> tuple[Any, list[str]]:
    """execute_code with a progress callback (so the call carries a progress token): its result and progress messages."""
    progress: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    return await client.call_tool("execute_code", arguments, progress_callback=on_progress), progress


async def until_finished(client: Any, result: Any) -> Any:
    """Follow an execution that answered "running" with get_execution_output until it finishes, as an assistant does:
    on a busy host its end (a death, say, and the restart it waits for) can come after the short wait of TEST_OPTIONS."""
    while not result.is_error and result.structured_content.get("status") == "running":
        content = result.structured_content
        result = await client.call_tool(
            "get_execution_output", {"session_id": content["session_id"], "execution_id": content["execution_id"]}
        )
    return result


async def wait_until_running(client: Any, session_id: str, timeout: float, what: str) -> None:
    """Wait until get_sessions reports the session busy: an execution holds it (an event, not a sleep)."""

    async def running() -> bool:
        listed = await client.call_tool("get_sessions", {"session_id": session_id})
        return listed.structured_content["sessions"][0]["status"] == "running"

    await wait_until(running, timeout, what)


@pytest.fixture(scope="module")
async def mcp_sessions() -> AsyncIterator[ManagedKernelSessions]:
    """Standalone sessions (an in-process AsyncMultiKernelManager), as `msb-mcp` uses them."""
    sessions = ManagedKernelSessions(start_timeout=60)
    yield sessions
    await sessions.close()


@pytest.fixture(scope="module")
def mcp_server(mcp_sessions):
    server = build_server(mcp_sessions, load_settings(), TEST_OPTIONS, local_caller=local_person())
    yield server


@pytest.fixture(scope="module")
async def python_session(mcp_server) -> str:
    """One Python session for tests that only add uniquely named state to it."""
    from mcp import Client

    async with Client(mcp_server) as client:
        result = await client.call_tool("execute_code", {"code": "pass"})
    assert not result.is_error, result.content[0].text
    return result.structured_content["session_id"]


@pytest.fixture(scope="module")
async def node_session(mcp_server) -> str:
    from mcp import Client

    from msb_kernels.kernelspecs.templates import TEMPLATES

    reason = TEMPLATES["node"].unavailable_reason()
    if reason:
        pytest.skip(f"node sessions need node and tslab: {reason}")
    async with Client(mcp_server) as client:
        result = await client.call_tool("execute_code", {"code": "1", "language": "node"})
    assert not result.is_error, result.content[0].text
    return result.structured_content["session_id"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 60, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = (
                log.read_text(errors="replace")[-3000:] if log is not None else (process.stderr.read().decode() if process.stderr else "")
            )
            raise AssertionError(f"server exited early: {said}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    for name, value in TEST_OPTIONS.__dict__.items():
        env["MSB_MCP_" + name.upper()] = str(value)
    env.update(extra)
    return env


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@contextlib.contextmanager
def gateway_process(token: str, **env: str) -> Iterator[str]:
    """`msb-kernels serve` in a subprocess, with the MCP test options and ``env``; yields its URL."""
    port = free_port()
    token_file = Path(os.environ["MSB_RUNTIME_DIR"]).parent / f"gateway-token-{port}"
    token_file.write_text(token)
    # Its log goes to a file: a pipe nobody reads fills at 64 KiB (a busy gateway's audit lines), and the gateway
    # then blocks on its next log line.
    log = token_file.with_name(f"gateway-{port}.log")
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [str(VENV_BIN / "msb-kernels"), "serve", "--port", str(port), "--token-file", str(token_file)],
            env=child_env(**env),
            stdout=subprocess.DEVNULL,
            stderr=output,
            start_new_session=True,
        )
    try:
        wait_for_port(port, process, timeout=60, log=log)  # a gateway that does not start is a failure, not a skip
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process)
