"""What an execution keeps and hands back: kept executions, offsets, caps; and the session
controls (interrupt, restart, stop) in-process and through a gateway."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from mcp import Client, StdioServerParameters

from mcp_bridge.server import build_server
from msb_kernels.identity.people import local_person
from msb_kernels.settings.config import load_settings
from tests.mcp_bridge.conftest import TEST_OPTIONS, VENV_BIN, child_env, result_error, wait_until_running
from tests.msb_kernels.gateway.conftest import init_pids, launch_gateway, wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def small_caps_server(mcp_sessions):
    """Two kept executions and 1000 characters of output, so the caps are reached in a few lines."""
    options = dataclasses.replace(TEST_OPTIONS, kept_executions=2, max_output_chars=1000)
    return build_server(mcp_sessions, load_settings(), options, local_caller=local_person())


async def test_only_the_last_kept_executions_can_be_fetched(small_caps_server):
    async with Client(small_caps_server) as client:
        first = await client.call_tool("execute_code", {"code": "print('first')"})
        session_id = first.structured_content["session_id"]
        ids = [first.structured_content["execution_id"]]
        for n in (2, 3):
            result = await client.call_tool("execute_code", {"code": f"print('run {n}')", "session_id": session_id})
            ids.append(result.structured_content["execution_id"])
        evicted = await client.call_tool("get_execution_output", {"session_id": session_id, "execution_id": ids[0]})
        error = result_error(evicted)
        assert error["type"] == "InvalidRequest" and "only the last 2 are kept" in error["message"]
        kept = await client.call_tool("get_execution_output", {"session_id": session_id, "execution_id": ids[2]})
        assert kept.structured_content["stdout"] == "run 3\n"
        await client.call_tool("stop_session", {"session_id": session_id})


async def test_since_counts_both_streams_and_past_the_end_gives_nothing(mcp_server, python_session):
    async with Client(mcp_server) as client:
        code = "import sys\nprint('0123456789', end='', flush=True)\nprint('abcde', end='', file=sys.stderr, flush=True)"
        result = await client.call_tool("execute_code", {"code": code, "session_id": python_session})
        execution_id = result.structured_content["execution_id"]
        assert result.structured_content["output_offset"] == 15

        async def since(offset: int) -> tuple[str, str]:
            fetched = await client.call_tool(
                "get_execution_output", {"session_id": python_session, "execution_id": execution_id, "since": offset}
            )
            return fetched.structured_content["stdout"], fetched.structured_content["stderr"]

        assert await since(8) == ("89", "abcde")
        assert await since(10) == ("", "abcde")
        assert await since(12) == ("", "cde")
        assert await since(15) == ("", "")
        assert await since(10_000) == ("", "")


# Every iopub message of the kernel leaves IOPUB_LAG_SECONDS late, in order, while shell replies
# do not: the busy host of the 50-session load test (tests/mcp_bridge/test_load.py) made on purpose.
IOPUB_LAG_SECONDS = 4
LAGGING_IOPUB = f"""
def _msb_lag_iopub(lag={IOPUB_LAG_SECONDS}):
    import threading
    kernel = get_ipython().kernel
    send, pub = kernel.session.send, kernel.iopub_thread

    def lagging(stream, msg_or_type, *args, **kwargs):
        if stream is not kernel.iopub_socket and stream is not pub:
            return send(stream, msg_or_type, *args, **kwargs)
        later = lambda: pub.io_loop.call_later(lag, lambda: send(stream, msg_or_type, *args, **kwargs))
        if threading.current_thread() is pub.thread:
            later()
        else:
            pub.io_loop.add_callback(later)

    kernel.session.send = lagging


_msb_lag_iopub()
"""


@pytest.mark.slow
async def test_output_that_lags_the_reply_by_seconds_is_kept(mcp_sessions):
    """On a busy host iopub lagged the shell reply by 3.8 s; the bridge waited 2 s and answered ok
    with empty stdout. A result now waits for the kernel's idle status, so nothing is lost."""
    # Calls answer within 30 s here, so the lag shows in the result instead of in a "running" status.
    server = build_server(
        mcp_sessions, load_settings(), dataclasses.replace(TEST_OPTIONS, running_after_seconds=30.0), local_caller=local_person()
    )
    async with Client(server) as client:
        setup = await client.call_tool("execute_code", {"code": LAGGING_IOPUB})
        session_id = setup.structured_content["session_id"]
        try:
            assert setup.structured_content["status"] == "ok", setup.structured_content
            result = await client.call_tool("execute_code", {"code": "print('late marker')", "session_id": session_id})
            assert result.structured_content["status"] == "ok", result.structured_content
            assert result.structured_content["stdout"] == "late marker\n"
        finally:
            await client.call_tool("stop_session", {"session_id": session_id})


async def test_stderr_past_the_cap_is_truncated_with_a_note(small_caps_server):
    async with Client(small_caps_server) as client:
        result = await client.call_tool("execute_code", {"code": "import sys\nsys.stderr.write('e' * 5000)\nprint('done')"})
        content = result.structured_content
        assert content["truncated"] is True
        assert len(content["stdout"]) + len(content["stderr"]) == 1000 and set(content["stderr"]) == {"e"}
        assert "output truncated" in result.content[0].text and "MSB_MCP_MAX_OUTPUT_CHARS" in result.content[0].text
        await client.call_tool("stop_session", {"session_id": content["session_id"]})


async def test_rich_outputs_are_capped_in_number_and_size(small_caps_server):
    async with Client(small_caps_server) as client:
        many = "from IPython.display import HTML, display\nfor i in range(25):\n    display(HTML(f'<b>{i}</b>'))"
        result = await client.call_tool("execute_code", {"code": many})
        session_id = result.structured_content["session_id"]
        assert len(result.structured_content["results"]) == 20
        assert "[5 more rich outputs were dropped" in result.content[0].text
        # 4 x MSB_MCP_MAX_OUTPUT_CHARS of rich data at most: a 5000-character HTML does not fit in 4000.
        big = await client.call_tool(
            "execute_code", {"code": "display(HTML('x' * 5000))\ndisplay(HTML('small'))", "session_id": session_id}
        )
        assert [r["data"]["text/html"] for r in big.structured_content["results"]] == ["small"]
        assert "[1 more rich outputs were dropped" in big.content[0].text
        await client.call_tool("stop_session", {"session_id": session_id})


async def test_restart_during_a_run_ends_that_run_and_gives_a_fresh_kernel(mcp_server, mcp_sessions):
    async with Client(mcp_server) as client:
        first = await client.call_tool("execute_code", {"code": "before_restart = 1"})
        session_id = first.structured_content["session_id"]
        run = asyncio.ensure_future(
            client.call_tool(
                "execute_code", {"code": "import time\nprint('started', flush=True)\ntime.sleep(600)", "session_id": session_id}
            )
        )
        await wait_until_running(client, session_id, 60, "the long run to start")
        restarted = await client.call_tool("restart_session", {"session_id": session_id})
        assert restarted.structured_content["success"] is True
        ended = await asyncio.wait_for(run, 60)
        assert ended.structured_content["stdout"] == "started\n"
        error = result_error(ended)
        assert error["type"] == "SystemError" and "was restarted (restart_session) while this ran" in error["message"]
        assert "died" not in error["message"] and "state" in error["message"] and "is gone" in error["message"]
        fresh = await client.call_tool("execute_code", {"code": "'before_restart' in globals()", "session_id": session_id})
        assert fresh.structured_content["results"][0]["data"]["text/plain"] == "False"
        await client.call_tool("stop_session", {"session_id": session_id})


@pytest.mark.slow
async def test_interrupt_restart_and_stop_through_a_gateway():
    gateway = await launch_gateway()
    try:
        params = StdioServerParameters(
            command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway.url, "--token", gateway.token], env=child_env()
        )
        async with Client(params) as assistant:
            first = await assistant.call_tool("execute_code", {"code": "kept = 'yes'"})
            session_id = first.structured_content["session_id"]
            run = asyncio.ensure_future(
                assistant.call_tool(
                    "execute_code",
                    {"code": "import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.1)", "session_id": session_id},
                )
            )
            await wait_until_running(assistant, session_id, 60, "the loop to start at the gateway")
            interrupted = await assistant.call_tool("interrupt_session", {"session_id": session_id})
            assert interrupted.structured_content["success"] is True
            looped = await asyncio.wait_for(run, 60)
            assert result_error(looped)["type"] == "RuntimeError" and "interrupted" in result_error(looped)["message"]
            kept = await assistant.call_tool("execute_code", {"code": "kept", "session_id": session_id})
            assert kept.structured_content["results"][0]["data"]["text/plain"] == "'yes'"

            sandbox_before = init_pids(gateway)[session_id]
            restarted = await assistant.call_tool("restart_session", {"session_id": session_id})
            assert restarted.structured_content["success"] is True
            assert init_pids(gateway)[session_id] != sandbox_before, "the restart reused the old sandbox"
            gone = await assistant.call_tool("execute_code", {"code": "'kept' in globals()", "session_id": session_id})
            assert gone.structured_content["results"][0]["data"]["text/plain"] == "False"

            stopped = await assistant.call_tool("stop_session", {"session_id": session_id})
            assert stopped.structured_content["success"] is True
            assert (await gateway.request("GET", f"/api/kernels/{session_id}")).code == 404
            await wait_until(lambda: session_id not in init_pids(gateway), 30, "the stopped session's sandbox to go")
    finally:
        gateway.stop()
