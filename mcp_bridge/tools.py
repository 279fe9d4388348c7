"""The MCP tools, one function each; build_server registers every one in TOOLS.

A new tool is a function here, decorated with :func:`tool`: its name is the tool's name, its
arguments (``Annotated`` with a ``Field``) are the input schema, and its return annotation
names the models.py model that is its outputSchema. A tool reaches the shared state through
``ctx`` (see supervisor.bridge_of), which MCP leaves out of the schema.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, Field

from mcp_bridge import files
from mcp_bridge.arguments import NewSession, check_size, check_timeout, environments_of, requested, requested_environment, resolve_session
from mcp_bridge.commands import command_argv, new_marker
from mcp_bridge.models import (
    ChoicesResponse,
    EnvironmentInfo,
    EnvironmentsResponse,
    ExecutionResponse,
    FileResponse,
    FlavorInfo,
    LanguageInfo,
    SessionListResponse,
    SessionSummary,
    StopSessionResponse,
    VolumePathResponse,
)
from mcp_bridge.options import BridgeOptions
from mcp_bridge.rendering import execution_result, model_result
from mcp_bridge.sessions import SessionInfo
from mcp_bridge.supervisor import Bridge, bridge_of
from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import acting
from msb_kernels.identity.volumes import docker_volume, has_own_directory
from msb_kernels.kernelspecs.choice import DEFAULT_ENVIRONMENT
from msb_kernels.kernelspecs.flavors import FLAVORS, describe_flavors
from msb_kernels.kernelspecs.templates import LANGUAGE_ALIASES, TEMPLATES, get_template
from msb_kernels.provisioning.person_places import volume_key
from msb_kernels.settings.config import MsbSettings

LANGUAGE_CHOICES = ["python", "node", "javascript"]

SessionId = Annotated[str, Field(description="the session (kernel) id from an earlier call")]
OptionalSessionId = Annotated[str | None, Field(description="a session id from an earlier call; omit it to start a new session")]
FlavorArgument = Annotated[
    str | None, Field(description=f"{describe_flavors(' or ')}; for new sessions only", json_schema_extra={"enum": list(FLAVORS)})
]
Language = Annotated[str | None, Field(description="python (default) or node/javascript", json_schema_extra={"enum": LANGUAGE_CHOICES})]
TemplateArgument = Annotated[
    str | None, Field(description="alias of language: " + " or ".join(TEMPLATES), json_schema_extra={"enum": list(TEMPLATES)})
]
EnvArgument = Annotated[
    dict[str, str] | None,
    Field(description="variables for a new session's kernel; not LD_*, PYTHON*, MSB_*, JPY_* or KERNEL_*; for new sessions only"),
]
EnvironmentArgument = Annotated[
    str | None,
    Field(
        description="the Python environment of a new session (list_environments names them); default: the server's own; for new sessions only"
    ),
]
NetworkAllowArgument = Annotated[
    str | list[str] | None,
    Field(
        description="hosts a new session may reach, within the server's allow-list: names, *.wildcards or networks, "
        "each with :PORT if not 80 and 443 (e.g. pypi.org,*.pythonhosted.org); 'none' for no network; for new sessions only"
    ),
]


class SecretDeclaration(BaseModel):
    value: str = Field(description="the real value; the kernel never sees it")
    hosts: list[str] = Field(description="the hosts whose requests get it, e.g. ['api.example.com']")
    header: str = Field("Authorization", description="the one request header whose value may carry it")


SecretsArgument = Annotated[
    dict[str, SecretDeclaration] | None,
    Field(
        description="secrets for a new session, NAME -> {value, hosts, header}: the kernel's variable NAME holds a "
        "placeholder, which the network proxy replaces with the value in that header (default Authorization) of HTTPS "
        "requests to those hosts only, and masks in their answers; for new sessions only"
    ),
]
Timeout = Annotated[
    float | None,
    Field(description="seconds before the kernel is interrupted (state is kept); default from MSB_MCP_DEFAULT_TIMEOUT_SECONDS"),
]


@dataclass(frozen=True)
class ToolEntry:
    """One tool as build_server registers it; ``describe`` takes the options a description quotes."""

    function: Callable[..., Any]
    describe: Callable[[BridgeOptions], str]
    annotations: ToolAnnotations | None = None


TOOLS: list[ToolEntry] = []


def tool(description: str | Callable[[BridgeOptions], str], annotations: ToolAnnotations | None = None) -> Callable:
    """Add the decorated function to TOOLS (in order: that order is tools/list's)."""

    def add(function: Callable[..., Any]) -> Callable[..., Any]:
        describe = description if callable(description) else (lambda options, text=description: text)
        TOOLS.append(ToolEntry(function, describe, annotations))
        return function

    return add


@tool(
    lambda options: (
        "Run code in a sandboxed, stateful kernel. Without session_id a new session (kernel) starts; "
        "pass its session_id back to keep variables. Output streams as progress while it runs; after "
        f"about {options.running_after_seconds:g} s the call returns status 'running' and an execution_id "
        "(use get_execution_output). Matplotlib figures come back as images."
    )
)
async def execute_code(
    code: Annotated[str, Field(description="the code to run")],
    ctx: Context,
    language: Language = None,
    session_id: OptionalSessionId = None,
    flavor: FlavorArgument = None,
    timeout: Timeout = None,
    template: TemplateArgument = None,
    env: EnvArgument = None,
    network_allow: NetworkAllowArgument = None,
    secrets: SecretsArgument = None,
    environment: EnvironmentArgument = None,
) -> Annotated[CallToolResult, ExecutionResponse]:
    bridge = bridge_of(ctx)
    check_size(bridge.options, "code", code)
    seconds = check_timeout(bridge.options, timeout)
    new = NewSession(env or {}, network_allow, secrets)
    chosen = requested(language, template, flavor)
    info, created = await resolve_session(
        bridge.sessions, bridge.settings, session_id, *chosen, new, await requested_environment(bridge.sessions, environment)
    )
    return await bridge.run_and_respond(info, created, "code", code, seconds, ctx)


@tool(
    "Run a program inside a session's sandbox (no shell unless shell=true; args are passed as a list, "
    "never pasted into shell text). Leaves no trace in the session's variables or history. "
    "stdout and stderr are kept apart; exit_code is returned."
)
async def execute_command(
    command: Annotated[str, Field(description="the program (a name on PATH or a path); with shell=true, shell text")],
    ctx: Context,
    args: Annotated[list[str] | None, Field(description="arguments, one per item")] = None,
    session_id: OptionalSessionId = None,
    flavor: FlavorArgument = None,
    template: TemplateArgument = None,
    timeout: Timeout = None,
    shell: Annotated[bool, Field(description="run command with /bin/sh -c; args become $1, $2, ...")] = False,
    language: Language = None,
    env: EnvArgument = None,
    network_allow: NetworkAllowArgument = None,
    secrets: SecretsArgument = None,
) -> Annotated[CallToolResult, ExecutionResponse]:
    bridge = bridge_of(ctx)
    if not command.strip():
        raise InvalidRequest("command is empty; name a program, e.g. command='ls', args=['-la']")
    argv = command_argv(command, list(args or []), shell)
    check_size(bridge.options, "command with its args", "\0".join(argv))
    if any("\0" in part for part in argv):
        raise InvalidRequest("command and args may not contain NUL characters")
    seconds = check_timeout(bridge.options, timeout)
    chosen_template, chosen_flavor = requested(language, template, flavor)
    # A command runs in whatever language the named session has; the language only picks a new session's kernel.
    info, created = await resolve_session(
        bridge.sessions,
        bridge.settings,
        session_id,
        chosen_template if session_id is None else None,
        chosen_flavor,
        NewSession(env or {}, network_allow, secrets),
    )
    marker = new_marker()
    code = get_template(info.language or "python").command_code(argv, marker)
    return await bridge.run_and_respond(info, created, "command", code, seconds, ctx, marker=marker)


@tool(
    lambda options: (
        "Fetch the output of a long execution (one that returned status 'running'). Waits up to "
        f"about {options.running_after_seconds:g} s for it to finish. `since` skips output already seen "
        "(use output_offset from the previous answer)."
    )
)
async def get_execution_output(
    session_id: SessionId,
    execution_id: Annotated[str, Field(description="execution_id from execute_code")],
    ctx: Context,
    since: Annotated[int, Field(description="output_offset from the previous answer; 0 for all", ge=0)] = 0,
) -> Annotated[CallToolResult, ExecutionResponse]:
    bridge = bridge_of(ctx)
    await bridge.sessions.check(session_id)  # SessionNotFound first: gone, or not the caller's
    runs = bridge.runs_of(session_id)
    execution = runs.executions.get(execution_id) if runs else None
    if execution is None:
        raise InvalidRequest(
            f"session {session_id} has no execution {execution_id!r}: only the last {bridge.options.kept_executions} "
            "are kept, and none from before a restart of the server (the session and its variables outlive "
            "a gateway restart, but the output of what ran through it is lost)",
            ["run the code again, or read its effects from the session's variables"],
        )
    await bridge.wait(execution, ctx)
    return execution_result(execution, since)


@tool(
    "Start a new session (kernel) without running anything: its language, flavor, Python environment, variables, network "
    "allow-list and secrets. Pass the session_id it returns to execute_code."
)
async def start_session(
    ctx: Context,
    language: Language = None,
    flavor: FlavorArgument = None,
    template: TemplateArgument = None,
    env: EnvArgument = None,
    network_allow: NetworkAllowArgument = None,
    secrets: SecretsArgument = None,
    environment: EnvironmentArgument = None,
) -> Annotated[CallToolResult, SessionListResponse]:
    bridge = bridge_of(ctx)
    new = NewSession(env or {}, network_allow, secrets)
    chosen = requested(language, template, flavor)
    info, _ = await resolve_session(
        bridge.sessions, bridge.settings, None, *chosen, new, await requested_environment(bridge.sessions, environment)
    )
    return sessions_result(bridge, [info])


@tool(
    "List sessions (kernels): the ones this assistant started and the ones notebook users started on the same gateway.",
    ToolAnnotations(read_only_hint=True),
)
async def get_sessions(
    ctx: Context, session_id: Annotated[str | None, Field(description="only this session")] = None
) -> Annotated[CallToolResult, SessionListResponse]:
    bridge = bridge_of(ctx)
    infos = [await bridge.sessions.info(session_id)] if session_id is not None else await bridge.sessions.list()
    return sessions_result(bridge, infos)


def sessions_result(bridge: Bridge, infos: list[SessionInfo]) -> CallToolResult:
    """get_sessions' answer for these sessions (list_kernels' too)."""
    for info in infos:
        runs = bridge.runs_of(info.id)
        if runs is not None and runs.lock.locked() and info.status == "ready":
            info.status = "running"
    response = SessionListResponse(sessions=[SessionSummary(**info.summary()) for info in infos])
    if not infos:
        text = "no sessions; execute_code without session_id starts one"
    else:
        text = "\n".join(
            f"{s.id}: {s.language} {s.flavor}, {s.status}, up {s.uptime_seconds} s, last used {s.last_accessed}"
            + (f", notebook {s.notebook_path}" if s.notebook_path else "")
            + (f", network {s.network}" if s.network else "")
            + (f", environment {s.environment}" if s.environment and s.environment != DEFAULT_ENVIRONMENT else "")
            + f" (started by {s.started_by})"
            for s in response.sessions
        )
    return model_result(response, text)


@tool("Stop a session: its kernel and sandbox go away with all state.", ToolAnnotations(destructive_hint=True))
async def stop_session(session_id: SessionId, ctx: Context) -> Annotated[CallToolResult, StopSessionResponse]:
    bridge = bridge_of(ctx)
    await bridge.sessions.stop(session_id)
    response = StopSessionResponse(session_id=session_id, success=True, message=f"session {session_id} stopped")
    return model_result(response, response.message)


@tool("Interrupt what a session is running (like Ctrl-C); the session keeps its state.")
async def interrupt_session(session_id: SessionId, ctx: Context) -> Annotated[CallToolResult, StopSessionResponse]:
    bridge = bridge_of(ctx)
    await bridge.sessions.info(session_id)
    for execution in bridge.running_executions(session_id):
        execution.interrupted_by_request = True
    await bridge.sessions.interrupt(session_id)
    response = StopSessionResponse(session_id=session_id, success=True, message=f"session {session_id} interrupted; its state is kept")
    return model_result(response, response.message)


@tool("Restart a session's kernel: same session_id, fresh state (all variables are lost).", ToolAnnotations(destructive_hint=True))
async def restart_session(session_id: SessionId, ctx: Context) -> Annotated[CallToolResult, StopSessionResponse]:
    bridge = bridge_of(ctx)
    await bridge.sessions.info(session_id)
    for execution in bridge.running_executions(session_id):
        execution.restarted_by_request = True
    await bridge.sessions.restart(session_id)
    bridge.sessions.touch(session_id)
    response = StopSessionResponse(
        session_id=session_id, success=True, message=f"session {session_id} restarted with a fresh kernel; earlier variables are gone"
    )
    return model_result(response, response.message)


FilePath = Annotated[
    str,
    Field(
        description="a path in the sandbox: under /tmp, /home/sandbox, the shared volume or the notebooks' folder; a relative path is "
        "from the kernel's working directory (the notebook's folder), as open() in a cell reads it"
    ),
]
Encoding = Annotated[str, Field(description="text (UTF-8) or base64 (any bytes)", json_schema_extra={"enum": ["text", "base64"]})]


@tool(
    "Write a file into a session's sandbox (its /tmp, home or the shared volume), as UTF-8 text or base64 bytes, "
    "up to the flavor's disk. Missing directories are made; an existing file is replaced only with overwrite=true."
)
async def upload_file(
    session_id: SessionId,
    path: FilePath,
    content: Annotated[str, Field(description="the file's content, in the given encoding")],
    ctx: Context,
    encoding: Encoding = "text",
    overwrite: Annotated[bool, Field(description="replace a file already at path")] = False,
) -> Annotated[CallToolResult, FileResponse]:
    bridge = bridge_of(ctx)
    data = decode_content(content, encoding)
    info = await bridge.sessions.info(session_id)
    answer = await files.upload(bridge, info, path, data, overwrite)
    response = FileResponse(session_id=info.id, path=answer["path"], size=answer["size"], sha256=answer["sha256"])
    return model_result(response, f"wrote {response.size} bytes to {response.path} (sha256 {response.sha256})")


@tool(
    "Read a file from a session's sandbox (its /tmp, home or the shared volume), up to the flavor's disk: as text when "
    "it is UTF-8 (or encoding=text), else base64.",
    ToolAnnotations(read_only_hint=True),
)
async def download_file(
    session_id: SessionId,
    path: FilePath,
    ctx: Context,
    encoding: Annotated[
        str | None, Field(description="text or base64; default: text if the file is UTF-8", json_schema_extra={"enum": ["text", "base64"]})
    ] = None,
) -> Annotated[CallToolResult, FileResponse]:
    bridge = bridge_of(ctx)
    if encoding not in (None, "text", "base64"):
        raise InvalidRequest(f"encoding={encoding!r} is not one of: text, base64", ["omit it to get text when the file is UTF-8"])
    info = await bridge.sessions.info(session_id)
    data, answer = await files.download(bridge, info, path)
    content, used = encode_content(data, encoding, path)
    response = FileResponse(
        session_id=info.id, path=answer["path"], size=answer["size"], sha256=answer["sha256"], encoding=used, content=content
    )
    text = content if used == "text" else f"{response.size} bytes of {response.path}, base64 in structured content"
    return model_result(response, text)


def decode_content(content: str, encoding: str) -> bytes:
    if encoding == "text":
        return content.encode()
    if encoding == "base64":
        try:
            return base64.b64decode(content, validate=True)
        except ValueError:
            raise InvalidRequest("content is not valid base64", ["send encoding='text' for text, or base64 of the bytes"]) from None
    raise InvalidRequest(f"encoding={encoding!r} is not one of: text, base64", ["use text for UTF-8 text, base64 for any bytes"])


def encode_content(data: bytes, encoding: str | None, path: str) -> tuple[str, str]:
    if encoding in (None, "text"):
        try:
            return data.decode(), "text"
        except UnicodeDecodeError:
            if encoding == "text":
                raise InvalidRequest(f"{path} is not UTF-8 text", ["ask for encoding='base64'"]) from None
    return base64.b64encode(data).decode(), "base64"


@tool("Where the shared volume (files shared with the user) is inside the sandboxes.", ToolAnnotations(read_only_hint=True))
async def get_volume_path(
    ctx: Context, session_id: Annotated[str | None, Field(description="optional; checks that the session exists")] = None
) -> Annotated[CallToolResult, VolumePathResponse]:
    bridge = bridge_of(ctx)
    if session_id is not None:
        await bridge.sessions.info(session_id)
    host = bridge.settings.shared_volume
    guest = bridge.settings.shared_volume_guest_path
    person = acting()
    if host is not None and has_own_directory(person):
        response = VolumePathResponse(
            volume_path=guest,
            available=True,
            description=f"{person.name}'s own directory of the shared volume, mounted at {guest} in each of {person.name}'s "
            f"sandboxes (host: {host / volume_key(bridge.settings, person)}); no other person's kernels see it",
        )
    elif host is None and bridge.settings.shared_volume_name:
        named = docker_volume(bridge.settings.shared_volume_name, volume_key(bridge.settings, person))
        whose = f"{person.name}'s own" if has_own_directory(person) else "the whole"
        response = VolumePathResponse(
            volume_path=guest,
            available=True,
            description=f"{whose} shared volume, the Docker named volume {named}, mounted at {guest} in each of the sandboxes "
            "it is for; no other person's kernels see a person's own",
        )
    elif host is not None:
        response = VolumePathResponse(
            volume_path=guest,
            available=True,
            description=f"Shared volume mounted at {guest} in every sandbox (host: {host}); files written there are visible to the user",
        )
    else:
        response = VolumePathResponse(
            volume_path=guest,
            available=False,
            description="No shared volume is configured (set MSB_SHARED_VOLUME_PATH to a host directory)",
        )
    return model_result(response, f"{response.volume_path} (available: {str(response.available).lower()}): {response.description}")


def choices(settings: MsbSettings) -> ChoicesResponse:
    """The flavors and languages a new session can have (list_flavors, list_languages, msb://choices)."""
    aliases: dict[str, list[str]] = {}
    for alias, target in LANGUAGE_ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    return ChoicesResponse(
        flavors=[
            FlavorInfo(
                name=f.name,
                cpus=f.cpus,
                memory_mib=f.memory_mib,
                disk_mib=f.disk_mib,
                description=f.description,
                default=f.name == settings.default_flavor,
            )
            for f in FLAVORS.values()
        ],
        languages=[
            LanguageInfo(
                name=t.name, aliases=aliases.get(t.name, []), available=t.unavailable_reason() is None, reason=t.unavailable_reason()
            )
            for t in TEMPLATES.values()
        ],
    )


def choices_json(settings: MsbSettings) -> str:
    """The msb://choices resource."""
    return json.dumps(choices(settings).model_dump(mode="json"), indent=1)


@tool("The flavors (sandbox sizes) a new session can have.", ToolAnnotations(read_only_hint=True))
async def list_flavors(ctx: Context) -> Annotated[CallToolResult, ChoicesResponse]:
    response = choices(bridge_of(ctx).settings)
    text = "\n".join(
        f"{f.name}: {f.cpus} CPU, {f.memory_mib} MiB, {f.disk_mib} MiB disk - {f.description}" + (" (default)" if f.default else "")
        for f in response.flavors
    )
    return model_result(response, text)


@tool("The languages a session can run.", ToolAnnotations(read_only_hint=True))
async def list_languages(ctx: Context) -> Annotated[CallToolResult, ChoicesResponse]:
    response = choices(bridge_of(ctx).settings)
    text = "\n".join(
        f"{lang.name} (also: {', '.join(lang.aliases)})" + ("" if lang.available else f" - unavailable: {lang.reason}")
        for lang in response.languages
    )
    return model_result(response, text)


async def environments(bridge: Bridge) -> EnvironmentsResponse:
    """The default environment (the server's own interpreter) and every one a kernelspec names (msb_kernels.environments)."""
    found = await environments_of(bridge.sessions)
    return EnvironmentsResponse(
        environments=[
            EnvironmentInfo(
                name=e.name,
                python_version=e.python_version or "unknown",
                packages=e.packages,
                default=e.name == DEFAULT_ENVIRONMENT,
                description="the server's own interpreter: what a session gets when it names no environment"
                if e.name == DEFAULT_ENVIRONMENT
                else f"its kernelspecs are msb-{e.name}-python-<flavor>",
            )
            for e in found.values()
        ]
    )


@tool(
    "The Python environments a new session can run (pass one as environment), with each one's Python and main packages.",
    ToolAnnotations(read_only_hint=True),
)
async def list_environments(ctx: Context) -> Annotated[CallToolResult, EnvironmentsResponse]:
    response = await environments(bridge_of(ctx))
    text = "\n".join(
        f"{e.name}: Python {e.python_version}" + (" (default)" if e.default else "") + (f" - {', '.join(e.packages)}" if e.packages else "")
        for e in response.environments
    )
    return model_result(response, text)
