"""`msb-mcp` on its own, as a desktop assistant starts it: zero setup, and idle sessions end."""

from __future__ import annotations

import sys

import pytest
from mcp import Client, StdioServerParameters

from tests.conftest import VENV_BIN
from tests.mcp_bridge.conftest import child_env
from tests.msb_kernels.gateway.conftest import wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

# msb-mcp with this environment's packages but a Python prefix of its own, which holds no kernelspecs:
# the state of a fresh install. jupyter_core reads sys.prefix when imported, so it is set first.
FRESH_PREFIX_MSB_MCP = "import sys; sys.prefix = sys.argv.pop(1); from mcp_bridge.cli import main; sys.exit(main())"


async def test_first_run_installs_the_missing_kernelspecs(tmp_path):
    prefix = tmp_path / "prefix"
    env = child_env(
        JUPYTER_PATH="", JUPYTER_DATA_DIR=str(tmp_path / "data"), PATH=f"{VENV_BIN}:/usr/sbin:/sbin"
    )  # no node: the Python kernelspecs alone, and no npm install
    params = StdioServerParameters(command=sys.executable, args=["-c", FRESH_PREFIX_MSB_MCP, str(prefix)], env=env)
    kernels = prefix / "share" / "jupyter" / "kernels"
    assert not kernels.exists()
    async with Client(params) as client:
        assert sorted(p.name for p in kernels.iterdir()) == ["msb-python-large", "msb-python-medium", "msb-python-small"]
        result = await client.call_tool("execute_code", {"code": "print('first run', 6 * 7)"})
        assert not result.is_error, result.content[0].text
        assert result.structured_content["stdout"] == "first run 42\n"


async def test_idle_sessions_are_stopped_and_busy_ones_kept():
    params = StdioServerParameters(
        command=str(VENV_BIN / "msb-mcp"), args=[], env=child_env(MSB_SESSION_TIMEOUT_SECONDS="2", MSB_MCP_RUNNING_AFTER_SECONDS="1")
    )
    async with Client(params) as client:
        busy = (await client.call_tool("execute_code", {"code": "y = 1"})).structured_content["session_id"]
        long_run = await client.call_tool("execute_code", {"code": "import time\ntime.sleep(30)", "session_id": busy})
        assert long_run.structured_content["status"] == "running"
        # Last used after the busy one: once it is culled, the busy one has sat as long and was passed over.
        idle = (await client.call_tool("execute_code", {"code": "x = 1"})).structured_content["session_id"]

        async def session_ids() -> set[str]:
            listed = await client.call_tool("get_sessions", {})
            return {s["id"] for s in listed.structured_content["sessions"]}

        async def idle_gone() -> bool:
            return idle not in await session_ids()

        await wait_until(idle_gone, 60, "the idle session to be stopped")
        assert busy in await session_ids(), "a session with a running execution was culled"
        missing = await client.call_tool("execute_code", {"code": "x", "session_id": idle})
        assert missing.is_error and "culled after being idle" in missing.content[0].text
