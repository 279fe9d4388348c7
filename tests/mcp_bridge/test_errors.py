"""Errors as the MCP tools return them: compilation, runtime, bad requests, limits and dead kernels."""

from __future__ import annotations

import logging

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS

from msb_kernels.provisioning import registry
from tests.mcp_bridge.conftest import TEST_OPTIONS, result_error, until_finished
from tests.mcp_bridge.test_tools import call
from tests.skips import needs_cgroups


async def test_compilation_errors_in_python_and_node(mcp_server, python_session, node_session):
    async with Client(mcp_server) as client:
        syntax = await client.call_tool("execute_code", {"code": "def f(:\n    pass", "session_id": python_session})
        assert result_error(syntax)["type"] == "CompilationError" and "SyntaxError" in result_error(syntax)["message"]
        indent = await client.call_tool("execute_code", {"code": "if True:\nprint(1)", "session_id": python_session})
        assert result_error(indent)["type"] == "CompilationError" and "IndentationError" in result_error(indent)["message"]
        js = await client.call_tool("execute_code", {"code": "let broken = ;", "session_id": node_session})
        assert result_error(js)["type"] == "CompilationError"
        assert js.structured_content["status"] == "error"


async def test_runtime_errors_in_python_and_node(mcp_server, python_session, node_session):
    async with Client(mcp_server) as client:
        python = await client.call_tool("execute_code", {"code": "def f():\n    return 1 / 0\nf()", "session_id": python_session})
        error = result_error(python)
        assert error["type"] == "RuntimeError" and error["message"] == "ZeroDivisionError: division by zero"
        assert "return 1 / 0" in python.structured_content["stderr"], "the user's traceback belongs in stderr"
        node = await client.call_tool("execute_code", {"code": "throw new TypeError('bad input')", "session_id": node_session})
        error = result_error(node)
        assert error["type"] == "RuntimeError" and "TypeError: bad input" in error["message"]
        after = await client.call_tool("execute_code", {"code": "console.log('still here')", "session_id": node_session})
        assert after.structured_content["stdout"] == "still here\n", after.content[0].text


async def test_invalid_requests_name_the_argument_and_accepted_values(mcp_server, python_session):
    async with Client(mcp_server) as client:
        cases = {
            "code wrong type": ({"code": 123}, "'code'"),
            "code missing": ({}, "'code' is required"),
            "session_id wrong type": ({"code": "1", "session_id": 5}, "'session_id'"),
            "timeout wrong type": ({"code": "1", "timeout": "soon"}, "'timeout'"),
            "timeout negative": ({"code": "1", "timeout": -1}, "timeout=-1"),
            "unknown flavor": ({"code": "1", "flavor": "huge"}, "small, medium, large"),
            "unknown language": ({"code": "1", "language": "ruby"}, "python"),
            "language and template disagree": ({"code": "1", "language": "python", "template": "node"}, "disagree"),
            "code over the cap": ({"code": "x" * (TEST_OPTIONS.max_code_chars + 1)}, "over the limit"),
            "empty session id": ({"code": "1", "session_id": " "}, "omit it"),
        }
        for name, (arguments, expected) in cases.items():
            result = await client.call_tool("execute_code", arguments)
            error = result_error(result)
            assert error["type"] == "InvalidRequest", (name, error)
            assert expected in error["message"], (name, error["message"])
            assert "pydantic" not in result.content[0].text, (name, result.content[0].text)

        args_wrong = await client.call_tool("execute_command", {"command": "ls", "args": [1, {"a": 2}]})
        assert result_error(args_wrong)["type"] == "InvalidRequest" and "'args" in result_error(args_wrong)["message"]
        unknown_session = await client.call_tool("execute_command", {"command": "ls", "session_id": "not-a-kernel"})
        assert result_error(unknown_session)["type"] == "SessionNotFound"
        unknown_execution = await client.call_tool("get_execution_output", {"session_id": python_session, "execution_id": "nope"})
        assert result_error(unknown_execution)["type"] == "InvalidRequest"
        unknown_tool = await client.call_tool("no_such_tool", {})
        assert result_error(unknown_tool)["type"] == "InvalidRequest"
        for tool in ("stop_session", "interrupt_session", "restart_session", "get_sessions"):
            assert result_error(await client.call_tool(tool, {"session_id": "missing-id"}))["type"] == "SessionNotFound", tool


async def test_language_mismatch_with_the_session_is_a_clear_error(mcp_server, python_session):
    result = await call(mcp_server, "execute_code", {"code": "console.log(1)", "language": "node", "session_id": python_session})
    error = result_error(result)
    assert error["type"] == "InvalidRequest"
    assert f"session {python_session} runs python, but language='node'" in error["message"]
    assert any("omit session_id to start a new node session" in s for s in error["suggestions"])
    flavor = await call(mcp_server, "execute_code", {"code": "1", "flavor": "large", "session_id": python_session})
    assert "cannot change flavor" in result_error(flavor)["message"]


async def test_resource_limit_exceeded_suggests_stopping_a_session(mcp_server, python_session, monkeypatch):
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(max(1, len(registry.default().session_kernel_ids))))
    result = await call(mcp_server, "execute_code", {"code": "1"})
    error = result_error(result)
    assert error["type"] == "ResourceLimitExceeded" and "MSB_MAX_SESSIONS" in error["message"]
    assert any("stop a session" in s for s in error["suggestions"]) and any("smaller flavor" in s for s in error["suggestions"])


async def test_a_kernel_that_dies_is_a_system_error(mcp_server):
    async with Client(mcp_server) as client:
        first = await client.call_tool("execute_code", {"code": "x = 1"})
        session_id = first.structured_content["session_id"]
        try:
            died = await until_finished(
                client,
                await client.call_tool(
                    "execute_code", {"code": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "session_id": session_id}
                ),
            )
            error = result_error(died)
            # jupyter_client's restarter starts it again; the call it died in waits for that, and says so once.
            assert error["type"] == "SystemError" and "died" in error["message"] and "restarted with a fresh kernel" in error["message"]
            assert any("already has a fresh kernel" in s for s in error["suggestions"]), error
            listed = await client.call_tool("get_sessions", {"session_id": session_id})
            assert listed.structured_content["sessions"][0]["status"] != "error"
            again = await client.call_tool("execute_code", {"code": "x", "session_id": session_id})  # runs in the fresh one
            assert "NameError" in result_error(again)["message"], result_error(again)
            restarted = await client.call_tool("restart_session", {"session_id": session_id})
            assert not restarted.is_error, restarted.content[0].text
            fresh = await client.call_tool("execute_code", {"code": "1 + 1", "session_id": session_id})
            assert fresh.structured_content["results"][0]["data"]["text/plain"] == "2"
        finally:
            await client.call_tool("stop_session", {"session_id": session_id})


@needs_cgroups
async def test_out_of_memory_kernel_death_names_the_flavor(mcp_server):
    code = "import mmap\nm = mmap.mmap(-1, 1536 * 2**20)\nfor i in range(0, len(m), 4096):\n    m[i] = 1"
    async with Client(mcp_server) as client:
        result = await client.call_tool("execute_code", {"code": code, "timeout": 50})
        session_id = result.structured_content["session_id"]
        try:
            error = result_error(await until_finished(client, result))
            assert error["type"] == "SystemError"
            assert "out of memory for flavor small (1024 MiB); try medium" in error["message"]
            assert any("flavor='medium'" in s for s in error["suggestions"])
        finally:
            await client.call_tool("stop_session", {"session_id": session_id})


async def test_an_unknown_prompt_is_the_clients_mistake_one_warning_and_no_traceback(mcp_server, caplog):
    """A fuzz run of 13,190 hostile calls left 68 full tracebacks at ERROR in the gateway's log, all for prompts/get
    of an unknown name, which the MCP SDK raises as ValueError. It is invalid params, and one warning line."""
    caplog.set_level(logging.DEBUG)
    async with Client(mcp_server) as client:
        with pytest.raises(MCPError) as refused:
            await client.get_prompt("no-such-prompt\n" + "x" * 500)
        assert refused.value.error.code == INVALID_PARAMS and "prompts/list" in refused.value.error.message, refused.value.error
        assert (await client.call_tool("list_flavors", {})).is_error is False  # the connection carries on
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [r.getMessage()[:200] for r in caplog.records]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and "prompt" in r.getMessage()]
    assert len(warning.getMessage()) < 200 and "\n" not in warning.getMessage(), warning.getMessage()
