"""The MCP server: the tools of mcp_bridge.tools over sandboxed, stateful kernels. A session id is a kernel id.

Every tool answers with a CallToolResult (mcp_bridge.rendering); every failure, a bad
argument or a crash inside the bridge included, is an ``isError`` result that fits the
tool's outputSchema; nothing reaches the client as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS
from pydantic import ValidationError

from mcp_bridge.auth import calling_with, person_of_request
from mcp_bridge.notebooks.documents import NotebookDocuments
from mcp_bridge.notebooks.hub import PersonalLabs
from mcp_bridge.notebooks.lab import LabServer
from mcp_bridge.notebooks.tools import NOTEBOOK_INSTRUCTIONS
from mcp_bridge.options import BridgeOptions
from mcp_bridge.rendering import error_result, validation_error
from mcp_bridge.sessions import KernelSessions
from mcp_bridge.supervisor import Bridge
from mcp_bridge.tools import TOOLS, choices_json
from msb_kernels.errors import InvalidRequest, MsbError, SandboxError
from msb_kernels.identity.people import Person, acting_as
from msb_kernels.kernelspecs.flavors import describe_flavors
from msb_kernels.observability import audit
from msb_kernels.observability.metrics import MCP_CALLS
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("mcp_bridge")
TOOL_NAMES = {entry.function.__name__ for entry in TOOLS}  # a metric's labels: only names a tool has

INSTRUCTIONS = f"""\
Run Python or JavaScript (Node.js) in sandboxed, stateful Jupyter kernels.
- execute_code without session_id starts a new session and returns its session_id; pass it back to keep variables.
- Sessions are Jupyter kernels; JupyterLab users of the same gateway may share them (get_sessions lists them).
- Long runs return status "running" with an execution_id; get_execution_output fetches the rest.
- Flavors: {describe_flavors()}; see list_flavors.
{NOTEBOOK_INSTRUCTIONS}
"""


class BridgeServer(MCPServer):
    """MCPServer whose argument and internal errors come back as error results (see rendering.error_result).

    ``local_caller``: who a call that came with no HTTP request is (over stdio or an in-process client: the one user
    of a server that serves only them); None where every call comes over HTTP (the gateway's /mcp), so that a call
    without its request acts for nobody, who sees no kernel and may start none."""

    local_caller: Person | None = None

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None, context: Context | None = None):
        """An unknown name is the client's mistake: INVALID_PARAMS and one warning line. The SDK raises ValueError,
        which its dispatcher logs with a full traceback at ERROR (68 of them in a fuzz run of 13,190 calls)."""
        if name not in {prompt.name for prompt in await self.list_prompts()}:
            log.warning("mcp: prompts/get of a prompt this server does not have: %.100r", name)
            raise MCPError(INVALID_PARAMS, f"no prompt named {name[:100]!r}; prompts/list names the prompts there are")
        return await super().get_prompt(name, arguments, context)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        # The tool runs as the person whose token carried this call: the gateway's kernel manager then shows and
        # touches only their kernels (msb_kernels.identity.people.may_see).
        request_context = getattr(context, "_request_context", None)
        request = getattr(request_context, "request", None)
        caller = person_of_request(request) if request is not None else self.local_caller
        with acting_as(caller, client_name(request_context, request)), calling_with(request):
            result = await self._call_tool(name, arguments, context)
            error = (getattr(result, "structured_content", None) or {}).get("error") if getattr(result, "is_error", False) else None
            outcome = (error or {}).get("type", "error") if error is not None else "ok"
            session = arguments.get("session_id") or (getattr(result, "structured_content", None) or {}).get("session_id")
            audit.record(
                "mcp_call", outcome, session if isinstance(session, str) else None, tool=name, **audit.code_fields(_code_of(arguments))
            )
        MCP_CALLS.labels(name if name in TOOL_NAMES else "unknown", outcome).inc()
        return result

    async def _call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, MsbError):
                return error_result(cause)
            log.error("tool %s failed: %r", name, cause)
            return error_result(
                SandboxError(
                    f"{name} failed inside the MCP bridge: {type(cause).__name__}: {cause}",
                    suggestions=["try again", "report this if it keeps happening"],
                )
            )
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                return error_result(validation_error(name, cause))
            if isinstance(cause, MsbError):
                return error_result(cause)
            message = str(exc)
            if message.startswith("Unknown tool"):
                return error_result(InvalidRequest(f"there is no tool named {name!r}", suggestions=["list the tools with tools/list"]))
            return error_result(InvalidRequest(message))
        except BaseException as exc:
            # A Rust panic in pycrdt (pyo3's PanicException) is a BaseException: let it end the call, not the session.
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            log.error("tool %s panicked: %r", name, exc)
            return error_result(
                SandboxError(f"{name} failed inside the MCP bridge: {type(exc).__name__}: {exc}", suggestions=["try again"])
            )


def client_name(request_context: Any, request: Any) -> str:
    """The MCP client by the name it gave at initialize (the audit trail's "client"), else its User-Agent."""
    params = getattr(getattr(request_context, "session", None), "client_params", None)
    info = getattr(params, "client_info", None)
    if info is not None:
        return f"mcp: {info.name} {info.version}"[:80]
    agent = getattr(request, "headers", {}).get("user-agent") if request is not None else None
    return f"mcp: {agent}"[:80] if agent else "mcp"


def _code_of(arguments: dict[str, Any]) -> str | None:
    code = arguments.get("code", arguments.get("command", arguments.get("source")))
    return code if isinstance(code, str) else None


@contextlib.contextmanager
def root_logging_left_alone() -> Iterator[None]:
    """Undo what ``MCPServer()`` does to the root logger: ``logging.basicConfig(level=INFO)`` with a rich handler.

    Logging is the application's to configure. A process that builds the server and also makes
    HTTP calls (the bench, an embedding app) would otherwise format a record for every request it
    sends, on the path being timed.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


def build_server(
    sessions: KernelSessions,
    settings: MsbSettings | None = None,
    options: BridgeOptions | None = None,
    *,
    name: str = "msb-kernels",
    personal_labs: PersonalLabs | None = None,
    local_caller: Person | None,
) -> MCPServer:
    """The MCP server over ``sessions``. ``server.bridge`` holds the state (supervisor.bridge_of; for shutdown).
    ``personal_labs``: under JupyterHub, the notebook tools use each caller's own server (mcp_bridge.notebooks.hub).
    ``local_caller``: who calls without an HTTP request (BridgeServer), said by every caller of this function: the
    desktop's user (msb_kernels.identity.people.local_person) for a stdio server, None for one served over HTTP."""
    settings = settings or load_settings()
    options = options or BridgeOptions.from_settings(settings)
    with root_logging_left_alone():
        server = BridgeServer(name, instructions=INSTRUCTIONS, version="0.1.0")
    server.local_caller = local_caller
    server.bridge = Bridge(sessions, settings, options)  # type: ignore[attr-defined]
    server.bridge.personal_labs = personal_labs  # type: ignore[attr-defined]
    if settings.lab_url:
        server.bridge.notebooks = NotebookDocuments(LabServer(settings.lab_url, settings.lab_token))  # type: ignore[attr-defined]
    for entry in TOOLS:
        server.add_tool(entry.function, description=entry.describe(options), annotations=entry.annotations)

    @server.resource(
        "msb://choices",
        name="choices",
        mime_type="application/json",
        description="Flavors and languages for new sessions (the same as list_flavors and list_languages)",
    )
    def choices_resource() -> str:
        return choices_json(settings)

    return server
