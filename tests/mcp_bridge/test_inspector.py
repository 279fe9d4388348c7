"""The MCP Inspector CLI, a client built on the TypeScript SDK, against `msb-mcp` (stdio) and a gateway's /mcp (HTTP).

The TypeScript SDK checks every result against its tool's outputSchema, error results included,
so this is where a result that does not fit shows up as the client's own -32602 failure.
The assertions read what the Inspector prints: the result as JSON, or its error and exit status.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from tests.mcp_bridge.conftest import VENV_BIN, child_env
from tests.msb_kernels.gateway.conftest import Gateway, launch_gateway

# Where scripts/bootstrap.sh (test mode) installs it with npm.
INSPECTOR_PREFIX = Path(sys.prefix) / "share" / "msb-kernels" / "inspector"
INSPECTOR = INSPECTOR_PREFIX / "node_modules" / "@modelcontextprotocol" / "inspector" / "cli" / "build" / "cli.js"
FETCH_PRELOAD = Path(__file__).with_name("inspector_fetch.mjs")
MODERN_PROTOCOL = "2026-07-28"
assert MODERN_PROTOCOL in MODERN_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS


def inspector_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed; install Node.js >= 18 with npm, then run `source scripts/bootstrap.sh test` (it installs the MCP Inspector)"
    if not INSPECTOR.exists():
        return f"the MCP Inspector CLI is not in {INSPECTOR_PREFIX}; run `source scripts/bootstrap.sh test` (it installs it with npm)"
    return None


pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.skipif(inspector_missing() is not None, reason=str(inspector_missing()))]


@dataclass
class Printed:
    """What one Inspector run printed and how it exited."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def result(self) -> dict:
        assert self.exit_code == 0, f"the Inspector failed (exit {self.exit_code}): {self.stderr.strip()[-2000:]}"
        return json.loads(self.stdout)

    @property
    def error(self) -> dict:
        """The structured error of an isError result, checked for what a model needs to act on it."""
        result = self.result
        assert result.get("isError") is True, result
        error = result["structuredContent"]["error"]
        text = result["content"][0]["text"]
        assert error["message"] in text and all(suggestion in text for suggestion in error["suggestions"]), (error, text)
        assert error["suggestions"], error
        return error

    @property
    def structured(self) -> dict:
        return self.result["structuredContent"]


@dataclass
class Inspector:
    """`mcp-inspector --cli` pointed at one MCP server."""

    target: list[str]
    env: dict[str, str]
    fetch_log: Path | None = None
    runs: list[Printed] = field(default_factory=list)

    async def run(self, *options: str) -> Printed:
        process = await asyncio.create_subprocess_exec(
            "node",
            str(INSPECTOR),
            "--cli",
            *self.target,
            *options,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 180)
        printed = Printed(process.returncode, stdout.decode(), stderr.decode())
        self.runs.append(printed)
        return printed

    async def call(self, tool: str, **arguments: object) -> Printed:
        pairs = [f"{name}={value if isinstance(value, str) else json.dumps(value)}" for name, value in arguments.items()]
        return await self.run("--method", "tools/call", "--tool-name", tool, *(["--tool-arg", *pairs] if pairs else []))


def inspector_env(**extra: str) -> dict[str, str]:
    # A long "running" threshold: these runs must finish in one call, even on a busy machine.
    return child_env(MSB_MCP_RUNNING_AFTER_SECONDS="120", **extra)


@pytest.fixture(scope="module")
async def gateway() -> Gateway:
    server = await launch_gateway()
    yield server
    server.stop()


def gateway_inspector(gateway: Gateway, log_dir: Path) -> Inspector:
    """The Inspector CLI on a gateway's /mcp, with its bearer token; each fetch logged in log_dir/fetch.jsonl."""
    log = log_dir / "fetch.jsonl"
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN=gateway.token, MSB_TEST_FETCH_LOG=str(log))
    return Inspector([gateway.url + "/mcp"], env, fetch_log=log)


@pytest.fixture(scope="module")
def http_inspector(gateway, tmp_path_factory) -> Inspector:
    return gateway_inspector(gateway, tmp_path_factory.mktemp("inspector"))


@pytest.fixture(scope="module", params=["stdio", "http"])
def inspector(request) -> Inspector:
    if request.param == "stdio":
        return Inspector([str(VENV_BIN / "msb-mcp")], inspector_env())
    return request.getfixturevalue("http_inspector")


# -- every transport ---------------------------------------------------------------------------------


async def test_tools_are_listed_with_output_schemas(inspector):
    tools = {tool["name"]: tool for tool in (await inspector.run("--method", "tools/list")).result["tools"]}
    assert {"execute_code", "execute_command", "get_sessions", "stop_session", "get_execution_output"} <= set(tools)
    for tool in tools.values():
        assert tool["outputSchema"]["type"] == "object" and "error" in tool["outputSchema"]["properties"], tool["name"]


async def test_a_file_goes_into_a_sandbox_and_back_through_the_typescript_client(http_inspector):
    """Over the gateway's /mcp, where a session outlives one Inspector run (each run is a process of its own)."""
    inspector = http_inspector
    started = await inspector.call("execute_code", code="print('ready')")
    session = started.structured["session_id"]
    written = await inspector.call("upload_file", session_id=session, path="notes/hello.txt", content="hello from the inspector")
    assert written.structured["path"] == "/home/sandbox/notes/hello.txt" and written.structured["size"] == 24, written.result
    seen = await inspector.call("execute_code", code="print(open('notes/hello.txt').read())", session_id=session)
    assert seen.structured["stdout"] == "hello from the inspector\n", seen.result
    read = await inspector.call("download_file", session_id=session, path="/home/sandbox/notes/hello.txt")
    assert read.structured["content"] == "hello from the inspector" and read.structured["encoding"] == "text", read.result
    assert read.structured["sha256"] == written.structured["sha256"]
    await inspector.call("stop_session", session_id=session)


async def test_unknown_session_reaches_the_client_as_session_not_found(inspector):
    printed = await inspector.call("execute_code", code="1", session_id="no-such-session")
    error = printed.error
    assert error["type"] == "SessionNotFound" and "no-such-session" in error["message"]
    assert any("get_sessions" in suggestion for suggestion in error["suggestions"])


async def test_bad_flavor_names_the_accepted_flavors(inspector):
    error = (await inspector.call("execute_code", code="1", flavor="huge")).error
    assert error["type"] == "InvalidRequest" and "'huge'" in error["message"] and "small, medium, large" in error["message"]


async def test_bad_argument_and_unknown_tool_are_invalid_requests(inspector):
    error = (await inspector.call("execute_code", code="1", timeout="soon")).error
    assert error["type"] == "InvalidRequest" and "'timeout'" in error["message"]
    unknown = (await inspector.call("no_such_tool", code="1")).error
    assert unknown["type"] == "InvalidRequest" and "no_such_tool" in unknown["message"]


async def test_syntax_error_is_a_compilation_error_with_the_session(inspector):
    printed = await inspector.call("execute_code", code="def broken(:\n    pass")
    error = printed.error
    assert error["type"] == "CompilationError" and "SyntaxError" in error["message"]
    assert printed.structured["status"] == "error" and printed.structured["session_created"] is True


HOSTILE = ["; rm -rf /tmp/canary", "$(id)", "`id`", "$(touch /tmp/pwned)", "&& echo pwned", "a b", "*", "'\"\\"]


async def test_execute_command_passes_hostile_args_literally(inspector):
    plain = await inspector.call("execute_command", command="printf", args=["%s\n", *HOSTILE])
    assert plain.structured["exit_code"] == 0 and plain.structured["stdout"] == "".join(f"{arg}\n" for arg in HOSTILE), plain.stdout
    positional = await inspector.call("execute_command", command='printf "%s|" "$@"', args=HOSTILE, shell=True)
    assert positional.structured["stdout"] == "".join(f"{arg}|" for arg in HOSTILE), positional.stdout


async def test_matplotlib_figure_is_image_content(inspector):
    code = "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    result = (await inspector.call("execute_code", code=code)).result
    assert result.get("isError") is not True, result["content"][0]["text"]
    images = [block for block in result["content"] if block["type"] == "image"]
    assert len(images) == 1 and images[0]["mimeType"] == "image/png"
    assert base64.b64decode(images[0]["data"]).startswith(b"\x89PNG")


# -- HTTP: sessions that outlive one client, the token, and both protocol eras ----------------------------


async def test_two_calls_share_a_session_over_http(http_inspector):
    first = (await http_inspector.call("execute_code", code="open('/tmp/canary', 'w').write('x')\nkept_by_inspector = 6 * 7")).structured
    session_id = first["session_id"]
    try:
        second = (await http_inspector.call("execute_code", code="print(kept_by_inspector)", session_id=session_id)).structured
        assert second["stdout"] == "42\n" and second["session_created"] is False
        hostile = (
            await http_inspector.call("execute_command", command="printf", args=["%s\n", *HOSTILE], session_id=session_id)
        ).structured
        assert hostile["stdout"] == "".join(f"{arg}\n" for arg in HOSTILE)
        check = (
            await http_inspector.call("execute_command", command="ls", args=["/tmp/canary", "/tmp/pwned"], session_id=session_id)
        ).structured
        assert "/tmp/canary" in check["stdout"] and "/tmp/pwned" in check["stderr"], "an argument was run by a shell"
    finally:
        stopped = await http_inspector.call("stop_session", session_id=session_id)
    assert stopped.structured["success"] is True


async def test_http_without_the_token_is_refused(gateway):
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN="wrong-token")
    printed = await Inspector([gateway.url + "/mcp"], env).run("--method", "tools/list")
    # /mcp checks the token itself (jupyter_server's login is left out there), and says what it wants.
    assert printed.exit_code != 0 and "Authorization: Bearer <token>" in printed.stderr, (printed.stdout, printed.stderr)


class HeaderLog:
    """Response headers an httpx client saw, to tell which protocol era it spoke."""

    def __init__(self):
        self.session_ids: list[str | None] = []

    async def __call__(self, response: httpx2.Response) -> None:
        if response.request.method == "POST":
            self.session_ids.append(response.headers.get("mcp-session-id"))


async def python_client_call(gateway: Gateway, mode: str, code: str, session_id: str | None = None) -> tuple[str, dict, HeaderLog]:
    headers = HeaderLog()
    async with httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {gateway.token}"}, timeout=120, event_hooks={"response": [headers]}
    ) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http), mode=mode) as client:
            arguments = {"code": code, **({"session_id": session_id} if session_id else {})}
            result = await client.call_tool("execute_code", arguments)
            assert not result.is_error, result.content[0].text
            return client.protocol_version, result.structured_content, headers


async def test_both_protocol_eras_share_sessions_on_one_gateway(gateway, http_inspector):
    """2025-era clients (initialize, Mcp-Session-Id) and 2026-07-28 clients (sessionless) on the same /mcp."""
    version, first, legacy_headers = await python_client_call(gateway, "legacy", "shared_across_eras = 'both'")
    assert version in HANDSHAKE_PROTOCOL_VERSIONS
    assert legacy_headers.session_ids and legacy_headers.session_ids[0], "a 2025-era server hands out an Mcp-Session-Id"
    session_id = first["session_id"]

    version, seen, modern_headers = await python_client_call(gateway, MODERN_PROTOCOL, "print(shared_across_eras)", session_id)
    assert version == MODERN_PROTOCOL and seen["stdout"] == "both\n"
    assert modern_headers.session_ids and not any(modern_headers.session_ids), "the 2026-07-28 protocol is sessionless"

    http_inspector.fetch_log.unlink(missing_ok=True)
    printed = await http_inspector.call("execute_code", code="print(shared_across_eras)", session_id=session_id)
    assert printed.structured["stdout"] == "both\n"
    exchanges = [json.loads(line) for line in http_inspector.fetch_log.read_text().splitlines()]
    assert exchanges[0]["method"] == "initialize" and exchanges[0]["session_id"], exchanges
    later = [e for e in exchanges[1:] if e["method"]]
    assert later and all(e["protocol_version"] in HANDSHAKE_PROTOCOL_VERSIONS for e in later), exchanges
    stopped = await http_inspector.call("stop_session", session_id=session_id)
    assert stopped.structured["success"] is True
