"""Every MCP tool, through a real MCP client (mcp.Client, in memory) and real sandboxed kernels."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from collections.abc import Callable

import pytest
from mcp import Client

from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.server import build_server
from msb_kernels.identity.people import local_person
from msb_kernels.provisioning import registry
from msb_kernels.settings.config import load_settings
from tests.conftest import make_persons
from tests.mcp_bridge.conftest import TEST_OPTIONS, result_error, wait_until_running

pytestmark = pytest.mark.asyncio


async def call(server, tool: str, arguments: dict, **kwargs):
    async with Client(server) as client:
        return await client.call_tool(tool, arguments, **kwargs)


# -- discovery ------------------------------------------------------------------------------------


async def test_tools_are_listed_with_schemas_and_choices(mcp_server):
    async with Client(mcp_server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(tools) >= {
            "execute_code",
            "execute_command",
            "get_sessions",
            "stop_session",
            "get_volume_path",
            "interrupt_session",
            "restart_session",
            "get_execution_output",
            "list_flavors",
            "list_languages",
        }
        schema = tools["execute_code"].input_schema
        assert schema["required"] == ["code"]
        assert schema["properties"]["language"]["enum"] == ["python", "node", "javascript"]
        assert schema["properties"]["flavor"]["enum"] == ["small", "medium", "large"]
        assert "template" in schema["properties"] and "timeout" in schema["properties"]
        assert tools["execute_command"].input_schema["properties"]["args"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
        assert set(tools["execute_code"].output_schema["properties"]) >= {
            "session_id",
            "stdout",
            "stderr",
            "execution_time_ms",
            "session_created",
            "status",
            "error",
            "results",
        }
        assert set(tools["get_sessions"].output_schema["$defs"]["SessionSummary"]["properties"]) >= {
            "id",
            "language",
            "flavor",
            "status",
            "created_at",
            "last_accessed",
            "uptime_seconds",
            "notebook_path",
        }

        flavors = await client.call_tool("list_flavors", {})
        assert not flavors.is_error
        assert [(f["name"], f["cpus"], f["memory_mib"], f["disk_mib"]) for f in flavors.structured_content["flavors"]] == [
            ("small", 1, 1024, 2048),
            ("medium", 2, 2048, 4096),
            ("large", 4, 4096, 8192),
        ]
        assert "small: 1 CPU, 1024 MiB, 2048 MiB disk" in flavors.content[0].text
        languages = await client.call_tool("list_languages", {})
        names = {lang["name"]: lang for lang in languages.structured_content["languages"]}
        assert set(names) == {"python", "node"} and "javascript" in names["node"]["aliases"]

        resource = await client.read_resource("msb://choices")
        assert json.loads(resource.contents[0].text)["flavors"][0]["name"] == "small"


# -- execute_code -----------------------------------------------------------------------------------


async def test_execute_code_creates_a_session_and_keeps_state_across_calls(mcp_server, mcp_sessions):
    async with Client(mcp_server) as client:
        first = await client.call_tool("execute_code", {"code": "counter = 41\nprint('hello')\ncounter + 1"})
        assert not first.is_error, first.content[0].text
        data = first.structured_content
        assert data["session_created"] is True and data["status"] == "ok"
        assert data["stdout"] == "hello\n" and data["stderr"] == ""
        assert data["results"][0]["data"]["text/plain"] == "42"
        assert isinstance(data["execution_time_ms"], int) and data["error"] is None
        assert "hello" in first.content[0].text and "42" in first.content[0].text
        session_id = data["session_id"]
        assert session_id in mcp_sessions.kernel_manager.list_kernel_ids(), "a session id is a kernel id"

        second = await client.call_tool("execute_code", {"code": "counter += 1\nprint(counter)", "session_id": session_id})
        assert second.structured_content["stdout"] == "42\n" and second.structured_content["session_created"] is False

        listed = await client.call_tool("get_sessions", {"session_id": session_id})
        (summary,) = listed.structured_content["sessions"]
        assert summary["id"] == session_id and summary["language"] == "python" and summary["flavor"] == "small"
        assert summary["status"] == "ready" and summary["started_by"] == "mcp" and summary["uptime_seconds"] >= 0
        assert summary["created_at"].endswith("Z") and summary["last_accessed"] >= summary["created_at"]
        everything = await client.call_tool("get_sessions", {})
        assert session_id in {s["id"] for s in everything.structured_content["sessions"]}

        stopped = await client.call_tool("stop_session", {"session_id": session_id})
        assert stopped.structured_content == {
            "session_id": session_id,
            "success": True,
            "message": f"session {session_id} stopped",
            "error": None,
        }
        assert session_id not in mcp_sessions.kernel_manager.list_kernel_ids()
        gone = await client.call_tool("execute_code", {"code": "counter", "session_id": session_id})
        error = result_error(gone)
        assert error["type"] == "SessionNotFound" and any("omit session_id" in s for s in error["suggestions"])
        again = await client.call_tool("stop_session", {"session_id": session_id})
        assert result_error(again)["type"] == "SessionNotFound"


async def test_sessions_are_isolated_from_each_other(mcp_server, python_session):
    async with Client(mcp_server) as client:
        await client.call_tool(
            "execute_code", {"code": "secret = 'only-here'\nopen('/tmp/mark', 'w').write('x')", "session_id": python_session}
        )
        other = await client.call_tool("execute_code", {"code": "import os\nprint(os.path.exists('/tmp/mark'))\nsecret"})
        other_id = other.structured_content["session_id"]
        try:
            assert other_id != python_session
            assert other.structured_content["stdout"] == "False\n", "the sandboxes share /tmp"
            error = result_error(other)
            assert error["type"] == "RuntimeError" and "NameError" in error["message"]
            same = await client.call_tool("execute_code", {"code": "secret", "session_id": python_session})
            assert same.structured_content["results"][0]["data"]["text/plain"] == "'only-here'"
        finally:
            await client.call_tool("stop_session", {"session_id": other_id})


async def test_matplotlib_figure_comes_back_as_image_content(mcp_server, python_session):
    code = "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('mcp')\nplt.show()"
    result = await call(mcp_server, "execute_code", {"code": code, "session_id": python_session})
    assert not result.is_error, result.content[0].text
    images = [block for block in result.content if block.type == "image"]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
    assert any("image/png" in r["data"] for r in result.structured_content["results"])


async def test_node_code_runs_and_keeps_state(mcp_server, node_session):
    async with Client(mcp_server) as client:
        first = await client.call_tool(
            "execute_code",
            {
                "code": "let total = 40; console.log('node says hi'); console.error('to stderr')",
                "session_id": node_session,
                "template": "node",
            },
        )
        assert not first.is_error, first.content[0].text
        assert first.structured_content["stdout"] == "node says hi\n" and first.structured_content["stderr"] == "to stderr\n"
        second = await client.call_tool("execute_code", {"code": "total + 2", "session_id": node_session, "language": "javascript"})
        assert second.structured_content["stdout"].strip() == "42" and second.structured_content["language"] == "node"


async def progress_until(client, session_id: str, code: str, seen: Callable[[list[str]], bool]):
    """Run code that would go on for minutes; interrupt it once the progress messages so far satisfy
    ``seen``. The result can only come after that, so progress that came only with the result would
    never satisfy it, and the call would end at the test's timeout instead."""
    progress: list[str] = []
    enough = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")
        if seen(progress):
            enough.set()

    call = asyncio.ensure_future(client.call_tool("execute_code", {"code": code, "session_id": session_id}, progress_callback=on_progress))
    await asyncio.wait_for(enough.wait(), 60)
    assert not call.done(), "the call returned before its progress"
    await client.call_tool("interrupt_session", {"session_id": session_id})
    return await asyncio.wait_for(call, 60), progress


async def test_progress_notifications_arrive_before_the_result(mcp_server, python_session):
    code = "import time\nfor i in range(3):\n    print(f'tick {i}', flush=True)\ntime.sleep(300)"
    async with Client(mcp_server) as client:
        result, progress = await progress_until(client, python_session, code, lambda p: any(m.startswith("tick 2") for m in p))
    assert result.structured_content["stdout"] == "tick 0\ntick 1\ntick 2\n"
    assert "interrupted" in result_error(result)["message"]


async def test_long_run_returns_running_then_get_execution_output_has_the_rest(mcp_server, python_session):
    code = "import time\nfor i in range(10):\n    print(f'step {i}', flush=True)\n    time.sleep(0.5)\ndone_marker = 'finished'"
    async with Client(mcp_server) as client:
        started = time.monotonic()
        first = await client.call_tool("execute_code", {"code": code, "session_id": python_session})
        waited = time.monotonic() - started
        data = first.structured_content
        assert data["status"] == "running" and not first.is_error, first.content[0].text
        # The call returns after MSB_MCP_RUNNING_AFTER_SECONDS (3 s here); the upper bound only has to
        # tell "returned early" from "waited for the whole 5 s run", so it leaves a loaded host room.
        assert TEST_OPTIONS.running_after_seconds <= waited < TEST_OPTIONS.running_after_seconds + 15
        assert data["stdout"].startswith("step 0\n") and "step 9" not in data["stdout"]
        assert data["execution_id"] in first.content[0].text and "get_execution_output" in first.content[0].text

        # As a client does: fetch what is new until the execution is over.
        collected, offset, status = data["stdout"], data["output_offset"], "running"
        deadline = time.monotonic() + 120
        while status == "running":
            assert time.monotonic() < deadline, "the long run never finished"
            rest = await client.call_tool(
                "get_execution_output", {"session_id": python_session, "execution_id": data["execution_id"], "since": offset}
            )
            collected += rest.structured_content["stdout"]
            offset, status = rest.structured_content["output_offset"], rest.structured_content["status"]
        assert status == "ok", rest.content[0].text
        assert collected == "".join(f"step {i}\n" for i in range(10))
        whole = await client.call_tool("get_execution_output", {"session_id": python_session, "execution_id": data["execution_id"]})
        assert whole.structured_content["stdout"] == "".join(f"step {i}\n" for i in range(10))
        assert whole.structured_content["execution_time_ms"] >= 4500
        kept = await client.call_tool("execute_code", {"code": "done_marker", "session_id": python_session})
        assert kept.structured_content["results"][0]["data"]["text/plain"] == "'finished'", "the kernel did not finish the long run"


async def test_timeout_interrupts_the_kernel_and_keeps_state(mcp_server, python_session):
    async with Client(mcp_server) as client:
        await client.call_tool("execute_code", {"code": "before_timeout = 'kept'", "session_id": python_session})
        started = time.monotonic()
        result = await client.call_tool(
            "execute_code",
            {"code": "import time\nprint('sleeping', flush=True)\ntime.sleep(30)", "session_id": python_session, "timeout": 1.5},
        )
        assert time.monotonic() - started < 10
        error = result_error(result)
        assert result.structured_content["status"] == "timeout" and error["type"] == "ExecutionTimeout"
        assert "interrupted" in error["message"] and "kept" in error["message"]
        assert result.structured_content["stdout"] == "sleeping\n"
        after = await client.call_tool("execute_code", {"code": "before_timeout", "session_id": python_session})
        assert after.structured_content["results"][0]["data"]["text/plain"] == "'kept'"


async def test_output_past_the_cap_is_truncated_with_a_note(mcp_server, python_session):
    cap = TEST_OPTIONS.max_output_chars
    result = await call(mcp_server, "execute_code", {"code": f"print('y' * {cap * 3})\nprint('tail')", "session_id": python_session})
    data = result.structured_content
    assert data["truncated"] is True and len(data["stdout"]) == cap and "tail" not in data["stdout"]
    assert "output truncated" in result.content[0].text


async def test_executions_on_one_session_run_in_order(mcp_server, python_session):
    async with Client(mcp_server) as client:
        await client.call_tool("execute_code", {"code": "order = []", "session_id": python_session})
        slow = asyncio.create_task(
            client.call_tool("execute_code", {"code": "import time\ntime.sleep(1.5)\norder.append('first')", "session_id": python_session})
        )
        await wait_until_running(client, python_session, 30, "the first execution to hold the session")
        fast = await client.call_tool("execute_code", {"code": "order.append('second')\norder", "session_id": python_session})
        assert slow.done(), "the second execution finished before the first one"
        assert (await slow).structured_content["status"] == "ok"
        assert fast.structured_content["results"][0]["data"]["text/plain"] == "['first', 'second']"


async def test_ten_sessions_run_in_parallel(mcp_sessions, monkeypatch):
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(registry.default().session_kernel_ids) + 12))
    patient = build_server(
        mcp_sessions, load_settings(), dataclasses.replace(TEST_OPTIONS, running_after_seconds=120), local_caller=local_person()
    )
    async with Client(patient) as client:
        created = await asyncio.gather(*[client.call_tool("execute_code", {"code": f"mine = {i}"}) for i in range(10)])
        ids = [r.structured_content["session_id"] for r in created]
        try:
            assert not any(r.is_error for r in created), [r.content[0].text for r in created if r.is_error]
            assert len(set(ids)) == 10
            # Each run says when it began and ended (one host clock for all sandboxes). In parallel, every run
            # begins before any ends; one after another, the second begins only after the first has ended.
            code = "import time\nbegan = time.time()\ntime.sleep(8)\nprint(mine, began, time.time())"
            runs = await asyncio.gather(*[client.call_tool("execute_code", {"code": code, "session_id": sid}) for sid in ids])
            fields = [r.structured_content["stdout"].split() for r in runs]
            assert [f[0] for f in fields] == [str(i) for i in range(10)]
            began, ended = [float(f[1]) for f in fields], [float(f[2]) for f in fields]
            assert max(began) < min(ended), "the sessions' runs did not overlap: they ran one after another"
        finally:
            await asyncio.gather(*[client.call_tool("stop_session", {"session_id": sid}) for sid in ids])


# -- execute_command ----------------------------------------------------------------------------------


async def test_execute_command_streams_stdout_and_stderr_apart_and_returns_the_exit_code(mcp_server, python_session):
    async with Client(mcp_server) as client:
        listing = await client.call_tool("execute_command", {"command": "ls", "args": ["-1", "/"], "session_id": python_session})
        assert not listing.is_error, listing.content[0].text
        assert listing.structured_content["exit_code"] == 0 and "usr\n" in listing.structured_content["stdout"]

        mixed = await client.call_tool(
            "execute_command", {"command": "echo out; echo err >&2; exit 3", "shell": True, "session_id": python_session}
        )
        error = result_error(mixed)
        assert error["type"] == "RuntimeError" and "status 3" in error["message"]
        assert mixed.structured_content["stdout"] == "out\n" and mixed.structured_content["stderr"] == "err\n"
        assert mixed.structured_content["exit_code"] == 3

        missing = await client.call_tool("execute_command", {"command": "no-such-program-here", "session_id": python_session})
        assert missing.structured_content["exit_code"] == 127 and "not found" in missing.structured_content["stderr"]


async def test_execute_command_never_pastes_args_into_shell_text(mcp_server, python_session):
    hostile = ["$(touch /tmp/pwned)", "; touch /tmp/pwned", "*", "a b"]
    async with Client(mcp_server) as client:
        result = await client.call_tool("execute_command", {"command": "printf", "args": ["%s\\n", *hostile], "session_id": python_session})
        assert result.structured_content["stdout"] == "".join(f"{arg}\n" for arg in hostile)
        positional = await client.call_tool(
            "execute_command", {"command": 'printf "%s|" "$@"', "args": hostile, "shell": True, "session_id": python_session}
        )
        assert positional.structured_content["stdout"] == "".join(f"{arg}|" for arg in hostile)
        check = await client.call_tool("execute_command", {"command": "ls", "args": ["/tmp/pwned"], "session_id": python_session})
        assert check.structured_content["exit_code"] != 0, "an argument was run by a shell"


async def test_execute_command_leaves_no_trace_in_namespace_or_history(mcp_server, python_session):
    probe = "(sorted(k for k in globals() if not k.startswith('_')), len(In), get_ipython().execution_count)"
    async with Client(mcp_server) as client:
        before = await client.call_tool("execute_code", {"code": probe, "session_id": python_session})
        await client.call_tool("execute_command", {"command": "echo", "args": ["hi"], "session_id": python_session})
        await client.call_tool("execute_command", {"command": "true", "session_id": python_session})
        after = await client.call_tool("execute_code", {"code": probe, "session_id": python_session})
    names_before, inputs_before, count_before = eval(before.structured_content["results"][0]["data"]["text/plain"])
    names_after, inputs_after, count_after = eval(after.structured_content["results"][0]["data"]["text/plain"])
    assert names_after == names_before
    assert inputs_after == inputs_before + 1 and count_after == count_before + 1, "the commands were stored in the history"


async def test_execute_command_times_out_kills_the_process_and_keeps_the_session(mcp_server, python_session):
    async with Client(mcp_server) as client:
        result = await client.call_tool(
            "execute_command", {"command": "sleep", "args": ["30"], "timeout": 1.5, "session_id": python_session}
        )
        assert result_error(result)["type"] == "ExecutionTimeout"
        ps = await client.call_tool("execute_command", {"command": "ps", "args": ["-eo", "args"], "session_id": python_session})
        assert "sleep 30" not in ps.structured_content["stdout"]


async def test_execute_command_in_a_node_session(mcp_server, node_session):
    async with Client(mcp_server) as client:
        result = await client.call_tool(
            "execute_command", {"command": "sh", "args": ["-c", "echo from-node; echo oops >&2; exit 4"], "session_id": node_session}
        )
        assert result.structured_content["stdout"] == "from-node\n" and result.structured_content["stderr"] == "oops\n"
        assert result.structured_content["exit_code"] == 4 and result_error(result)["type"] == "RuntimeError"
        fine = await client.call_tool(
            "execute_command", {"command": "node", "args": ["-e", "console.log(6*7)"], "session_id": node_session}
        )
        assert fine.structured_content["stdout"] == "42\n" and fine.structured_content["exit_code"] == 0 and not fine.is_error


# -- session tools ----------------------------------------------------------------------------------------


async def test_interrupt_and_restart_session(mcp_server):
    async with Client(mcp_server) as client:
        first = await client.call_tool("execute_code", {"code": "survives_interrupt = 1"})
        session_id = first.structured_content["session_id"]
        try:
            result, _ = await progress_until(
                client,
                session_id,
                "import time\nprint('sleeping', flush=True)\ntime.sleep(300)",
                lambda p: any(m.startswith("sleeping") for m in p),
            )
            error = result_error(result)
            assert error["type"] == "RuntimeError" and "interrupted" in error["message"]
            kept = await client.call_tool("execute_code", {"code": "survives_interrupt", "session_id": session_id})
            assert kept.structured_content["results"][0]["data"]["text/plain"] == "1"

            restarted = await client.call_tool("restart_session", {"session_id": session_id})
            assert restarted.structured_content["success"] is True, restarted.content[0].text
            forgotten = await client.call_tool("execute_code", {"code": "survives_interrupt", "session_id": session_id})
            assert "NameError" in result_error(forgotten)["message"]
        finally:
            await client.call_tool("stop_session", {"session_id": session_id})


async def test_get_volume_path_without_and_with_a_shared_volume(mcp_server, tmp_path, monkeypatch):
    result = await call(mcp_server, "get_volume_path", {})
    assert result.structured_content["available"] is False and result.structured_content["volume_path"] == "/shared"
    assert "MSB_SHARED_VOLUME_PATH" in result.structured_content["description"]
    assert result_error(await call(mcp_server, "get_volume_path", {"session_id": "no-such"}))["type"] == "SessionNotFound"

    shared = tmp_path / "shared"
    shared.mkdir()
    make_persons(shared)
    monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", str(shared))
    sessions = ManagedKernelSessions(start_timeout=60)
    server = build_server(sessions, load_settings(), TEST_OPTIONS, local_caller=local_person())
    try:
        async with Client(server) as client:
            volume = await client.call_tool("get_volume_path", {})
            assert volume.structured_content == {
                "volume_path": "/shared",
                "available": True,
                "error": None,
                "description": volume.structured_content["description"],
            }
            assert str(shared) in volume.structured_content["description"]
            wrote = await client.call_tool("execute_code", {"code": "open('/shared/from-sandbox.txt', 'w').write('hello host')"})
            assert not wrote.is_error, wrote.content[0].text
        assert (shared / "from-sandbox.txt").read_text() == "hello host"
    finally:
        await sessions.close()


# -- errors ---------------------------------------------------------------------------------------------------


async def test_progress_keeps_coming_while_the_code_prints_nothing(mcp_server, python_session):
    """Two heartbeats ("running for N s") arrive while a silent cell still runs."""
    async with Client(mcp_server) as client:
        result, progress = await progress_until(
            client, python_session, "import time\ntime.sleep(300)", lambda p: sum(m.startswith("running for") for m in p) >= 2
        )
    assert "interrupted" in result_error(result)["message"]


async def test_max_sessions_counts_the_sessions_served_from_the_warm_pool(monkeypatch):
    """Before: a session taken from the pool was never checked, so MSB_MAX_SESSIONS=2 let 3 start (4 sandboxes)."""
    monkeypatch.setenv("MSB_POOL_SIZE", "python-small=1")
    held = [
        k for k in registry.default().live_sandboxes if k not in registry.default().pooled_kernel_ids
    ]  # this process's other tests' sessions
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(held) + 2))
    sessions = ManagedKernelSessions(start_timeout=60)
    pool = sessions.kernel_manager.pool
    pool.fill()
    server = build_server(sessions, load_settings(), TEST_OPTIONS, local_caller=local_person())
    try:
        outcomes = []
        async with Client(server) as client:
            for _ in range(3):
                deadline = time.monotonic() + 60
                while pool.waiting() < 1:  # every start finds a ready pooled kernel, as on an idle server
                    assert time.monotonic() < deadline, "the pool did not refill"
                    await asyncio.sleep(0.1)
                outcomes.append(await client.call_tool("execute_code", {"code": "1"}))
        assert [r.is_error for r in outcomes] == [False, False, True], [r.content[0].text for r in outcomes]
        error = result_error(outcomes[2])
        assert error["type"] == "ResourceLimitExceeded" and "MSB_MAX_SESSIONS" in error["message"], error
        assert pool.waiting() == 1, "the refused start took the pooled kernel"
        mine = [r.structured_content["session_id"] for r in outcomes[:2]]
        assert len(sessions.started_here()) == 2 and set(mine) <= set(registry.default().live_sandboxes)
    finally:
        await sessions.close()
