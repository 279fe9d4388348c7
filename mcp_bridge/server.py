"""The MCP server: tools over sandboxed, stateful kernels. A session id is a kernel id.

Every tool answers with a CallToolResult: text for the model, structured content for
apps (the design's ExecutionResponse, SessionSummary, StopSessionResponse and
VolumePathResponse), images as image content. Every failure is an ``isError`` result
carrying ``{type, message, suggestions}`` from the design's error classes; nothing
reaches the client as a crash or a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from typing import Annotated, Any, Literal

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, Field, ValidationError

from msb_kernels.config import MsbSettings, load_settings
from msb_kernels.errors import InvalidRequest, MsbError, SandboxError
from msb_kernels.flavors import FLAVORS, get_flavor
from msb_kernels.templates import LANGUAGE_ALIASES, TEMPLATES, get_template

from mcp_bridge.commands import command_argv, new_marker, runner_code
from mcp_bridge.executions import Execution
from mcp_bridge.options import BridgeOptions
from mcp_bridge.sessions import KernelConnection, KernelSessions, SessionInfo

log = logging.getLogger("mcp_bridge")

LANGUAGE_CHOICES = ["python", "node", "javascript"]

# -- response models (the design's, plus what long runs and rich output need) ---------------------


class ErrorInfo(BaseModel):
    type: str
    message: str
    suggestions: list[str] = []


class RichOutput(BaseModel):
    output_type: str = Field(description="execute_result or display_data")
    data: dict[str, Any] = Field(description="MIME type -> value (images base64)")


class ExecutionResponse(BaseModel):
    session_id: str
    execution_id: str
    language: str
    flavor: str | None = None
    status: Literal["ok", "error", "timeout", "running"]
    stdout: str
    stderr: str
    exit_code: int | None = Field(None, description="exit status of execute_command; None for code")
    execution_time_ms: int
    session_created: bool
    results: list[RichOutput] = []
    error: ErrorInfo | None = None
    truncated: bool = False
    output_offset: int = Field(0, description="pass as `since` to get_execution_output to get only newer output")


class SessionSummary(BaseModel):
    id: str
    language: str
    flavor: str
    status: str
    created_at: str | None
    last_accessed: str | None
    uptime_seconds: int
    kernel_name: str | None = None
    notebook_path: str | None = None
    started_by: str = "other"
    sandboxed: bool = True


class SessionListResponse(BaseModel):
    sessions: list[SessionSummary]


class StopSessionResponse(BaseModel):
    session_id: str
    success: bool
    message: str | None = None


class VolumePathResponse(BaseModel):
    volume_path: str
    description: str
    available: bool


class FlavorInfo(BaseModel):
    name: str
    cpus: int
    memory_mib: int
    description: str
    default: bool


class LanguageInfo(BaseModel):
    name: str
    aliases: list[str]
    available: bool
    reason: str | None = None


class ChoicesResponse(BaseModel):
    flavors: list[FlavorInfo]
    languages: list[LanguageInfo]


# -- results ----------------------------------------------------------------------------------


FALLBACK_SUGGESTIONS = {
    "InvalidRequest": "check the arguments against the tool's input schema (tools/list); list_flavors and list_languages give the accepted values",
    "SystemError": "try again; if it keeps failing, check the host with `msb-kernels doctor`",
}


def error_info(error: MsbError) -> dict:
    info = error.to_dict()
    if not info["suggestions"]:
        info["suggestions"] = [FALLBACK_SUGGESTIONS.get(info["type"], "try again")]
    return info


def error_result(error: MsbError, extra: dict | None = None) -> CallToolResult:
    info = error_info(error)
    lines = [f"{info['type']}: {info['message']}"]
    lines += [f"- {suggestion}" for suggestion in info["suggestions"]]
    structured = {**(extra or {}), "error": info}
    return CallToolResult(content=[TextContent(type="text", text="\n".join(lines))], structured_content=structured, is_error=True)


def model_result(model: BaseModel, text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=model.model_dump(mode="json"))


def _validation_error(tool: str, exc: ValidationError) -> InvalidRequest:
    problems = []
    for err in exc.errors():
        name = ".".join(str(part) for part in err.get("loc", ())) or "arguments"
        if err.get("type") == "missing":
            problems.append(f"argument {name!r} is required")
            continue
        expected = err.get("msg", "is invalid").replace("Input should be", "must be")
        given = err.get("input")
        shown = repr(given) if len(repr(given)) <= 60 else repr(given)[:57] + "..."
        problems.append(f"argument {name!r} {expected} (got {type(given).__name__} {shown})")
    return InvalidRequest(f"{tool}: " + "; ".join(problems), suggestions=[f"see the input schema of {tool} (tools/list)"])


class BridgeServer(MCPServer):
    """MCPServer whose argument and internal errors come back as the design's error results."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None):
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, MsbError):
                return error_result(cause)
            log.error("tool %s failed: %r", name, cause)
            return error_result(SandboxError(f"{name} failed inside the MCP bridge: {type(cause).__name__}: {cause}",
                                             suggestions=["try again", "report this if it keeps happening"]))
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                return error_result(_validation_error(name, cause))
            if isinstance(cause, MsbError):
                return error_result(cause)
            message = str(exc)
            if message.startswith("Unknown tool"):
                return error_result(InvalidRequest(f"there is no tool named {name!r}", suggestions=["list the tools with tools/list"]))
            return error_result(InvalidRequest(message))


# -- per-session bookkeeping --------------------------------------------------------------------


class SessionState:
    """Executions of one session run one at a time, in order; finished ones are kept a while."""

    def __init__(self, kept: int):
        self.lock = asyncio.Lock()
        self.executions: collections.OrderedDict[str, Execution] = collections.OrderedDict()
        self.kept = kept

    def add(self, execution: Execution) -> None:
        self.executions[execution.id] = execution
        finished = [key for key, e in self.executions.items() if e.done.is_set()]
        while len(self.executions) > self.kept and finished:
            self.executions.pop(finished.pop(0), None)


class Bridge:
    """What the tools do, apart from the MCP plumbing."""

    def __init__(self, sessions: KernelSessions, settings: MsbSettings, options: BridgeOptions):
        self.sessions = sessions
        self.settings = settings
        self.options = options
        self.states: dict[str, SessionState] = {}
        self.tasks: set[asyncio.Task] = set()

    def state(self, session_id: str) -> SessionState:
        if session_id not in self.states:
            self.states[session_id] = SessionState(self.options.kept_executions)
        return self.states[session_id]

    # -- argument checks --------------------------------------------------------------------

    def check_timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.options.default_timeout_seconds
        if not (timeout > 0) or timeout > self.options.max_timeout_seconds:
            raise InvalidRequest(f"timeout={timeout!r} is out of range; use seconds between 0 and {self.options.max_timeout_seconds:g}")
        return float(timeout)

    def check_size(self, name: str, text: str) -> None:
        if len(text) > self.options.max_code_chars:
            raise InvalidRequest(f"{name} is {len(text)} characters, over the limit of {self.options.max_code_chars} (MSB_MCP_MAX_CODE_CHARS)",
                                 suggestions=["write large data to a file in the shared volume and read it from the code",
                                              "send the code in smaller pieces; the session keeps its state"])

    @staticmethod
    def pick_language(language: str | None, template: str | None) -> str | None:
        if language is not None and template is not None and get_template(language).name != get_template(template, argument="template").name:
            raise InvalidRequest(f"language={language!r} and template={template!r} disagree; pass only one of them")
        if language is not None:
            return get_template(language).name
        if template is not None:
            return get_template(template, argument="template").name
        return None

    async def resolve_session(self, session_id: str | None, language: str | None, flavor: str | None) -> tuple[SessionInfo, bool]:
        """The session to run in: the one named (checked), or a new one."""
        if session_id is not None:
            if not session_id.strip():
                raise InvalidRequest("session_id is empty; omit it to get a new session")
            info = await self.sessions.info(session_id)
            if not info.sandboxed:
                raise InvalidRequest(f"session {session_id} is a {info.kernel_name} kernel, which is not sandboxed; the MCP tools only run code in msb kernels",
                                     suggestions=["omit session_id to get a new sandboxed session"])
            if language is not None and language != info.language:
                raise InvalidRequest(
                    f"session {session_id} runs {info.language}, but language={language!r} was asked for",
                    suggestions=[f"omit language to run {info.language} code in this session",
                                 f"omit session_id to start a new {language} session"])
            if flavor is not None and get_flavor(flavor).name != info.flavor:
                raise InvalidRequest(f"session {session_id} is flavor {info.flavor}; a running session cannot change flavor",
                                     suggestions=["omit flavor", f"omit session_id to start a new {get_flavor(flavor).name} session"])
            if info.status == "error":
                raise SandboxError(f"the kernel of session {session_id} is dead",
                                   suggestions=["restart_session to get a fresh kernel in this session", "omit session_id to start a new session"])
            return info, False
        template = get_template(language or "python")
        reason = template.unavailable_reason() if self.sessions.local_kernels else None
        if reason:
            raise InvalidRequest(f"{template.name} sessions are not available here: {reason}")
        chosen = get_flavor(flavor) if flavor is not None else get_flavor(self.settings.default_flavor)
        new_id = await self.sessions.create(template, chosen)
        return await self.sessions.info(new_id), True

    # -- executions --------------------------------------------------------------------------

    def submit(self, info: SessionInfo, execution: Execution, code: str, silent: bool) -> None:
        self.sessions.touch(info.id)
        self.state(info.id).add(execution)
        task = asyncio.create_task(self._run(execution, code, silent))
        execution.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, execution: Execution, code: str, silent: bool) -> None:
        state = self.state(execution.session_id)
        try:
            async with state.lock:
                connection = await self.sessions.connection(execution.session_id)
                execution.start()
                msg_id = await connection.execute(code, silent=silent, store_history=not silent)
                connection.listen(msg_id, execution.handle)
                try:
                    await self._supervise(execution, connection)
                finally:
                    connection.unlisten(msg_id)
                if execution.language == "node" and (execution.reply or {}).get("status") != "ok":
                    await asyncio.sleep(0.3)  # tslab aborts requests that arrive within 200 ms of an error
        except MsbError as exc:
            execution.fail(exc)
        except asyncio.CancelledError:
            execution.fail(SandboxError("the MCP bridge shut down while this ran"))
            raise
        except Exception as exc:
            log.error("execution %s failed: %r", execution.id, exc)
            execution.fail(SandboxError(f"the execution failed inside the MCP bridge: {type(exc).__name__}: {exc}"))
        finally:
            execution.decide()
            self.sessions.touch(execution.session_id)
            execution.done.set()

    async def _supervise(self, execution: Execution, connection: KernelConnection) -> None:
        given_up_at = None
        while not execution.complete.is_set():
            now = time.monotonic()
            # The timeout runs from when the kernel began this request: a shared kernel may first
            # finish a notebook user's cell, which an interrupt must not hit.
            began = execution.kernel_began
            if not execution.timed_out and began is not None and now >= began + execution.timeout:
                execution.timed_out = True
                given_up_at = now + 15
                with contextlib.suppress(MsbError):
                    await self.sessions.interrupt(execution.session_id)
            if given_up_at is not None and now >= given_up_at:
                execution.fail(SandboxError(
                    f"the execution ran past its timeout of {execution.timeout:g} s and the kernel did not stop when interrupted; it is still busy",
                    suggestions=["restart_session (this loses the session's state)", "stop_session and start a new one"]))
                return
            if execution.reply is not None and not execution.idle:
                # the reply came; the idle status normally follows at once
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(execution.complete.wait(), 2.0)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(execution.complete.wait(), 1.0)
            if execution.complete.is_set():
                return
            reason = await connection.death_reason()
            if reason:
                execution.fail(SandboxError(
                    f"the kernel of session {execution.session_id} died: {reason}",
                    suggestions=self._death_suggestions(execution, reason)))
                return

    @staticmethod
    def _death_suggestions(execution: Execution, reason: str) -> list[str]:
        suggestions = []
        if "out of memory" in reason:
            flavor = FLAVORS.get(execution.flavor or "")
            larger = flavor.next_larger() if flavor else None
            if larger:
                suggestions.append(f"omit session_id and pass flavor={larger.name!r} to get a session with more memory")
            suggestions.append("use less memory (process data in chunks)")
        if "restarted" in reason:
            suggestions.append("the session already has a fresh kernel: run the code that set up its state again")
        else:
            suggestions.append("restart_session to get a fresh kernel in this session (its state is lost)")
        return suggestions

    async def wait(self, execution: Execution, ctx: Context | None) -> None:
        """Wait for the execution, up to the "running" threshold, sending progress as output comes."""
        end = time.monotonic() + self.options.running_after_seconds
        last_sent = time.monotonic()
        last_version = execution.output.version
        step = 0
        while not execution.done.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(execution.done.wait()), min(0.25, remaining))
            if execution.done.is_set() or ctx is None:
                continue
            now = time.monotonic()
            fresh = execution.output.version != last_version
            if (fresh and now - last_sent >= 0.25) or now - last_sent >= self.options.progress_interval_seconds:
                step += 1
                last_sent, last_version = now, execution.output.version
                status = "queued behind an earlier execution" if execution.status == "queued" else "running"
                message = execution.output.latest_line or f"{status} for {execution.elapsed:.0f} s"
                with contextlib.suppress(Exception):
                    await ctx.report_progress(step, None, message)

    def respond(self, execution: Execution, since: int = 0) -> CallToolResult:
        running = not execution.done.is_set()
        stdout, stderr = execution.output.read(since)
        status = "running" if running else execution.status
        error = error_info(execution.error) if (execution.error and not running) else None
        response = ExecutionResponse(
            session_id=execution.session_id, execution_id=execution.id, language=execution.language, flavor=execution.flavor,
            status=status, stdout=stdout, stderr=stderr, exit_code=None if running else execution.exit_code,
            execution_time_ms=execution.execution_time_ms, session_created=execution.session_created,
            results=[RichOutput(**r) for r in execution.results], error=ErrorInfo(**error) if error else None,
            truncated=execution.output.truncated, output_offset=execution.output.size,
        )
        content: list[Any] = [TextContent(type="text", text=self._text(execution, response))]
        for result in execution.results:
            for mime in ("image/png", "image/jpeg"):
                if mime in result["data"]:
                    content.append(ImageContent(type="image", data=str(result["data"][mime]).strip(), mime_type=mime))
        return CallToolResult(content=content, structured_content=response.model_dump(mode="json"),
                              is_error=status in ("error", "timeout"))

    def _text(self, execution: Execution, response: ExecutionResponse) -> str:
        what = "command" if execution.kind == "command" else "code"
        head = [f"status: {response.status}", f"session_id: {response.session_id} ({response.language}, {response.flavor})"
                + (" [new session]" if response.session_created else "")]
        if response.status == "running":
            head.append(f"execution_id: {response.execution_id}")
            head.append(f"the {what} is still running after {execution.elapsed:.0f} s; the kernel keeps running it. "
                        f"Call get_execution_output(session_id={response.session_id!r}, execution_id={response.execution_id!r}, "
                        f"since={response.output_offset}) for the rest.")
        else:
            head.append(f"execution_time_ms: {response.execution_time_ms}")
        if response.exit_code is not None:
            head.append(f"exit_code: {response.exit_code}")
        parts = ["\n".join(head)]
        if response.stdout:
            parts.append("--- stdout ---\n" + response.stdout.rstrip("\n"))
        if response.stderr:
            parts.append("--- stderr ---\n" + response.stderr.rstrip("\n"))
        if response.truncated:
            parts.append(execution.output.note())
        for result in execution.results:
            data = result["data"]
            if "text/plain" in data and not any(m.startswith("image/") for m in data):
                label = "result" if result["output_type"] == "execute_result" else "display"
                parts.append(f"--- {label} ---\n{data['text/plain']}")
            elif any(m.startswith("image/") for m in data):
                parts.append("--- image --- (attached)")
        if execution.results_dropped:
            parts.append(f"[{execution.results_dropped} more rich outputs were dropped (too many or too large)]")
        if response.error:
            parts.append(f"error: {response.error.type}: {response.error.message}"
                         + "".join(f"\n- {s}" for s in response.error.suggestions))
        return "\n\n".join(parts)

    async def run_and_respond(self, info: SessionInfo, created: bool, kind: str, code: str, timeout: float,
                              ctx: Context | None, marker: str | None = None) -> CallToolResult:
        execution = Execution(session_id=info.id, language=info.language or "python", flavor=info.flavor, kind=kind,
                              timeout=timeout, max_output_chars=self.options.max_output_chars, session_created=created, marker=marker)
        self.submit(info, execution, code, silent=(kind == "command"))
        await self.wait(execution, ctx)
        return self.respond(execution)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task


# -- the server -----------------------------------------------------------------------------------

INSTRUCTIONS = """\
Run Python or JavaScript (Node.js) in sandboxed, stateful Jupyter kernels.
- execute_code without session_id starts a new session and returns its session_id; pass it back to keep variables.
- Sessions are Jupyter kernels; JupyterLab users of the same gateway may share them (get_sessions lists them).
- Long runs return status "running" with an execution_id; get_execution_output fetches the rest.
- Flavors: small (1 CPU, 1 GiB), medium (2 CPU, 2 GiB), large (4 CPU, 4 GiB); see list_flavors.
"""

SessionId = Annotated[str, Field(description="the session (kernel) id from an earlier call")]
OptionalSessionId = Annotated[str | None, Field(description="a session id from an earlier call; omit it to start a new session")]
Flavor = Annotated[str | None, Field(description="small (1 CPU, 1 GiB), medium (2 CPU, 2 GiB) or large (4 CPU, 4 GiB); for new sessions only",
                                     json_schema_extra={"enum": list(FLAVORS)})]
Language = Annotated[str | None, Field(description="python (default) or node/javascript",
                                       json_schema_extra={"enum": LANGUAGE_CHOICES})]
Template = Annotated[str | None, Field(description="alias of language, as in the design: python or node",
                                       json_schema_extra={"enum": ["python", "node"]})]
Timeout = Annotated[float | None, Field(description="seconds before the kernel is interrupted (state is kept); default from MSB_MCP_DEFAULT_TIMEOUT_SECONDS")]


def build_server(sessions: KernelSessions, settings: MsbSettings | None = None, options: BridgeOptions | None = None,
                 *, name: str = "msb-kernels") -> MCPServer:
    """The MCP server over ``sessions``. ``server.bridge`` holds the state (for shutdown)."""
    settings = settings or load_settings()
    options = options or BridgeOptions.from_settings(settings)
    bridge = Bridge(sessions, settings, options)
    server = BridgeServer(name, instructions=INSTRUCTIONS, version="0.1.0")
    server.bridge = bridge  # type: ignore[attr-defined]

    @server.tool(description="Run code in a sandboxed, stateful kernel. Without session_id a new session (kernel) starts; "
                             "pass its session_id back to keep variables. Output streams as progress while it runs; after "
                             f"about {options.running_after_seconds:g} s the call returns status 'running' and an execution_id "
                             "(use get_execution_output). Matplotlib figures come back as images.")
    async def execute_code(code: Annotated[str, Field(description="the code to run")],
                           ctx: Context,
                           language: Language = None,
                           session_id: OptionalSessionId = None,
                           flavor: Flavor = None,
                           timeout: Timeout = None,
                           template: Template = None) -> Annotated[CallToolResult, ExecutionResponse]:
        bridge.check_size("code", code)
        seconds = bridge.check_timeout(timeout)
        chosen = bridge.pick_language(language, template)
        if flavor is not None:
            get_flavor(flavor)
        info, created = await bridge.resolve_session(session_id, chosen, flavor)
        return await bridge.run_and_respond(info, created, "code", code, seconds, ctx)

    @server.tool(description="Run a program inside a session's sandbox (no shell unless shell=true; args are passed as a list, "
                             "never pasted into shell text). Leaves no trace in the session's variables or history. "
                             "stdout and stderr are kept apart; exit_code is returned.")
    async def execute_command(command: Annotated[str, Field(description="the program (a name on PATH or a path); with shell=true, shell text")],
                              ctx: Context,
                              args: Annotated[list[str] | None, Field(description="arguments, one per item")] = None,
                              session_id: OptionalSessionId = None,
                              flavor: Flavor = None,
                              template: Template = None,
                              timeout: Timeout = None,
                              shell: Annotated[bool, Field(description="run command with /bin/sh -c; args become $1, $2, ...")] = False,
                              language: Language = None) -> Annotated[CallToolResult, ExecutionResponse]:
        if not command.strip():
            raise InvalidRequest("command is empty; name a program, e.g. command='ls', args=['-la']")
        argv = command_argv(command, list(args or []), shell)
        bridge.check_size("command with its args", "\0".join(argv))
        if any("\0" in part for part in argv):
            raise InvalidRequest("command and args may not contain NUL characters")
        seconds = bridge.check_timeout(timeout)
        chosen = bridge.pick_language(language, template)
        if flavor is not None:
            get_flavor(flavor)
        info, created = await bridge.resolve_session(session_id, chosen if session_id is None else None, flavor)
        marker = new_marker()
        code = runner_code(info.language or "python", argv, marker)
        return await bridge.run_and_respond(info, created, "command", code, seconds, ctx, marker=marker)

    @server.tool(description="Fetch the output of a long execution (one that returned status 'running'). Waits up to "
                             f"about {options.running_after_seconds:g} s for it to finish. `since` skips output already seen "
                             "(use output_offset from the previous answer).")
    async def get_execution_output(session_id: SessionId, execution_id: Annotated[str, Field(description="execution_id from execute_code")],
                                   ctx: Context,
                                   since: Annotated[int, Field(description="output_offset from the previous answer; 0 for all", ge=0)] = 0
                                   ) -> Annotated[CallToolResult, ExecutionResponse]:
        state = bridge.states.get(session_id)
        execution = state.executions.get(execution_id) if state else None
        if execution is None:
            await sessions.info(session_id)  # SessionNotFound first, when the session is gone
            raise InvalidRequest(f"session {session_id} has no execution {execution_id!r} (only the last {options.kept_executions} are kept)")
        await bridge.wait(execution, ctx)
        return bridge.respond(execution, since)

    @server.tool(description="List sessions (kernels): the ones this assistant started and the ones notebook users started on the same gateway.",
                 annotations=ToolAnnotations(read_only_hint=True))
    async def get_sessions(session_id: Annotated[str | None, Field(description="only this session")] = None
                           ) -> Annotated[CallToolResult, SessionListResponse]:
        infos = [await sessions.info(session_id)] if session_id is not None else await sessions.list()
        for info in infos:
            state = bridge.states.get(info.id)
            if state is not None and state.lock.locked() and info.status == "ready":
                info.status = "running"
        response = SessionListResponse(sessions=[SessionSummary(**info.summary()) for info in infos])
        if not infos:
            text = "no sessions; execute_code without session_id starts one"
        else:
            text = "\n".join(
                f"{s.id}: {s.language} {s.flavor}, {s.status}, up {s.uptime_seconds} s, last used {s.last_accessed}"
                + (f", notebook {s.notebook_path}" if s.notebook_path else "") + f" (started by {s.started_by})"
                for s in response.sessions)
        return model_result(response, text)

    @server.tool(description="Stop a session: its kernel and sandbox go away with all state.",
                 annotations=ToolAnnotations(destructive_hint=True))
    async def stop_session(session_id: SessionId) -> Annotated[CallToolResult, StopSessionResponse]:
        await sessions.stop(session_id)
        bridge.states.pop(session_id, None)
        response = StopSessionResponse(session_id=session_id, success=True, message=f"session {session_id} stopped")
        return model_result(response, response.message)

    @server.tool(description="Interrupt what a session is running (like Ctrl-C); the session keeps its state.")
    async def interrupt_session(session_id: SessionId) -> Annotated[CallToolResult, StopSessionResponse]:
        await sessions.info(session_id)
        state = bridge.states.get(session_id)
        if state is not None:
            for execution in state.executions.values():
                if not execution.done.is_set() and execution.status == "running":
                    execution.interrupted_by_request = True
        await sessions.interrupt(session_id)
        response = StopSessionResponse(session_id=session_id, success=True, message=f"session {session_id} interrupted; its state is kept")
        return model_result(response, response.message)

    @server.tool(description="Restart a session's kernel: same session_id, fresh state (all variables are lost).",
                 annotations=ToolAnnotations(destructive_hint=True))
    async def restart_session(session_id: SessionId) -> Annotated[CallToolResult, StopSessionResponse]:
        await sessions.info(session_id)
        await sessions.restart(session_id)
        sessions.touch(session_id)
        response = StopSessionResponse(session_id=session_id, success=True, message=f"session {session_id} restarted with a fresh kernel; earlier variables are gone")
        return model_result(response, response.message)

    @server.tool(description="Where the shared volume (files shared with the user) is inside the sandboxes.",
                 annotations=ToolAnnotations(read_only_hint=True))
    async def get_volume_path(session_id: Annotated[str | None, Field(description="optional; checks that the session exists")] = None
                              ) -> Annotated[CallToolResult, VolumePathResponse]:
        if session_id is not None:
            await sessions.info(session_id)
        host = settings.shared_volume
        guest = settings.shared_volume_guest_path
        if host is not None:
            response = VolumePathResponse(volume_path=guest, available=True,
                                          description=f"Shared volume mounted at {guest} in every sandbox (host: {host}); files written there are visible to the user")
        else:
            response = VolumePathResponse(volume_path=guest, available=False,
                                          description="No shared volume is configured (set MSB_SHARED_VOLUME_PATH to a host directory)")
        return model_result(response, f"{response.volume_path} (available: {str(response.available).lower()}): {response.description}")

    def choices() -> ChoicesResponse:
        aliases: dict[str, list[str]] = {}
        for alias, target in LANGUAGE_ALIASES.items():
            aliases.setdefault(target, []).append(alias)
        return ChoicesResponse(
            flavors=[FlavorInfo(name=f.name, cpus=f.cpus, memory_mib=f.memory_mib, description=f.description,
                                default=f.name == settings.default_flavor) for f in FLAVORS.values()],
            languages=[LanguageInfo(name=t.name, aliases=aliases.get(t.name, []), available=t.unavailable_reason() is None,
                                    reason=t.unavailable_reason()) for t in TEMPLATES.values()],
        )

    @server.tool(description="The flavors (sandbox sizes) a new session can have.", annotations=ToolAnnotations(read_only_hint=True))
    async def list_flavors() -> Annotated[CallToolResult, ChoicesResponse]:
        response = choices()
        text = "\n".join(f"{f.name}: {f.cpus} CPU, {f.memory_mib} MiB - {f.description}" + (" (default)" if f.default else "")
                         for f in response.flavors)
        return model_result(response, text)

    @server.tool(description="The languages a session can run.", annotations=ToolAnnotations(read_only_hint=True))
    async def list_languages() -> Annotated[CallToolResult, ChoicesResponse]:
        response = choices()
        text = "\n".join(f"{lang.name} (also: {', '.join(lang.aliases)})" + ("" if lang.available else f" - unavailable: {lang.reason}")
                         for lang in response.languages)
        return model_result(response, text)

    @server.resource("msb://choices", name="choices", mime_type="application/json",
                     description="Flavors and languages for new sessions (the same as list_flavors and list_languages)")
    def choices_resource() -> str:
        return json.dumps(choices().model_dump(mode="json"), indent=1)

    return server


def bridge_of(server: MCPServer) -> Bridge:
    return server.bridge  # type: ignore[attr-defined]
