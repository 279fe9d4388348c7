"""The tools' shared arguments: checked once, looked up once, and the session a run goes to.

A tool body (mcp_bridge.tools) calls these before it starts anything, so that a bad argument
is an InvalidRequest naming it and the accepted values, never a half-started kernel.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field

from mcp_bridge.options import BridgeOptions
from mcp_bridge.sessions import KernelSessions, SessionInfo
from msb_kernels.errors import InvalidRequest, SandboxError
from msb_kernels.kernelspecs.choice import DEFAULT_ENVIRONMENT, KernelChoice
from msb_kernels.kernelspecs.flavors import Flavor, get_flavor
from msb_kernels.kernelspecs.templates import TEMPLATES, Template, get_template
from msb_kernels.provisioning.start_request import WHOLE_VOLUME, StartRequest, check_env
from msb_kernels.settings.config import MsbSettings


def check_timeout(options: BridgeOptions, timeout: float | None) -> float:
    """The timeout argument in seconds: the default when omitted, else checked against MSB_MCP_MAX_TIMEOUT_SECONDS."""
    if timeout is None:
        return options.default_timeout_seconds
    if not (timeout > 0) or timeout > options.max_timeout_seconds:
        raise InvalidRequest(f"timeout={timeout!r} is out of range; use seconds between 0 and {options.max_timeout_seconds:g}")
    return float(timeout)


def check_size(options: BridgeOptions, name: str, text: str) -> None:
    if len(text) > options.max_code_chars:
        raise InvalidRequest(
            f"{name} is {len(text)} characters, over the limit of {options.max_code_chars} (MSB_MCP_MAX_CODE_CHARS)",
            suggestions=[
                "write large data to a file in the shared volume and read it from the code",
                "send the code in smaller pieces; the session keeps its state",
            ],
        )


def requested(language: str | None, template: str | None, flavor: str | None) -> tuple[Template | None, Flavor | None]:
    """The tool's language/template and flavor arguments, each checked and looked up once (None: not asked for)."""
    by_language = get_template(language) if language is not None else None
    by_template = get_template(template, argument="template") if template is not None else None
    if by_language and by_template and by_language is not by_template:
        raise InvalidRequest(f"language={language!r} and template={template!r} disagree; pass only one of them")
    return by_language or by_template, get_flavor(flavor) if flavor is not None else None


@dataclass(frozen=True)
class EnvironmentFacts:
    """An environment as its kernelspecs describe it (msb metadata): what list_environments shows of it."""

    name: str
    python_version: str | None
    packages: list[str]


async def environments_of(sessions: KernelSessions) -> dict[str, EnvironmentFacts]:
    """The default environment and each one a python kernelspec names (msb-<env>-python-<flavor>), where the kernels
    start: this host's kernelspecs, or a remote gateway's, so the names are the ones a start can use."""
    found = {DEFAULT_ENVIRONMENT: EnvironmentFacts(DEFAULT_ENVIRONMENT, platform.python_version() if sessions.local_kernels else None, [])}
    for name, spec in sorted((await sessions.kernelspecs()).items()):
        msb = (spec.get("metadata") or {}).get("msb") or {}
        choice = KernelChoice.from_kernel_name(msb.get("stands_for") or name)  # a gateway lists python3 for its default
        if choice is None or choice.template.name != "python":
            continue
        known = found.get(choice.environment_name)
        if known is None or known.python_version is None:
            found[choice.environment_name] = EnvironmentFacts(
                choice.environment_name,
                msb.get("python_version") or (known.python_version if known else None),
                list(msb.get("packages") or []),
            )
    return found


async def requested_environment(sessions: KernelSessions, environment: str | None) -> str | None:
    """The environment argument checked against those that exist (None: not asked for); an unknown name lists them."""
    if environment is None:
        return None
    name = str(environment).strip().lower()
    known = list(await environments_of(sessions))
    if name not in known:
        raise InvalidRequest(
            f"environment={environment!r} is not an environment here; use one of {', '.join(known)}",
            ["list_environments lists them with their Python and packages", "omit environment for the default one"],
        )
    return name


@dataclass(frozen=True)
class NewSession:
    """What a new session asks for beyond its language and flavor: its kernel's variables, a network allow-list
    narrower than the server's, and secrets (msb_kernels.egress); its StartRequest carries them."""

    env: dict[str, str] = field(default_factory=dict)
    network_allow: str | list[str] | None = None
    secrets: dict[str, dict] | None = None

    def __bool__(self) -> bool:
        return bool(self.env) or self.network_allow is not None or bool(self.secrets)

    def start_request(self) -> StartRequest:
        """The session's StartRequest; InvalidRequest names a variable the deny list refuses. Its volume is the whole
        one, as for any local start; a gateway sets the caller's own in its place."""
        env = check_env(self.env, "env")  # KERNEL_* too: a session sets those through its own arguments
        rules = None
        if self.network_allow is not None:
            rules = self.network_allow if isinstance(self.network_allow, str) else ",".join(self.network_allow)
            rules = rules.strip() or "none"
        secrets = None
        if self.secrets:
            declared = {name: value.model_dump() if hasattr(value, "model_dump") else value for name, value in self.secrets.items()}
            clash = sorted(set(declared) & set(env))
            if clash:
                raise InvalidRequest(f"{', '.join(clash)} is both in env and in secrets; a secret's placeholder is its variable")
            secrets = json.dumps(declared)
        return StartRequest(
            env=env,
            network_allow=rules,
            secrets=secrets,
            argument_names=("network_allow", "secrets"),  # the gateway's refusals name these arguments, not its variables
            volume=WHOLE_VOLUME,
        )


async def resolve_session(
    sessions: KernelSessions,
    settings: MsbSettings,
    session_id: str | None,
    template: Template | None,
    flavor: Flavor | None,
    new: NewSession | None = None,
    environment: str | None = None,
) -> tuple[SessionInfo, bool]:
    """The session to run in: the one named (checked against what was asked for), or a new one.

    environment: a checked name (requested_environment), None where the caller did not ask for one."""
    if session_id is not None:
        if not session_id.strip():
            raise InvalidRequest("session_id is empty; omit it to get a new session")
        if new:
            raise InvalidRequest(
                "env, network_allow and secrets set up a new session; a running session keeps what it started with",
                ["omit them to use this session", "omit session_id to start a new session with them"],
            )
        info = await sessions.info(session_id)
        if not info.sandboxed:
            raise InvalidRequest(
                f"session {session_id} is a {info.kernel_name} kernel, which is not sandboxed; the MCP tools only run code in msb kernels",
                suggestions=["omit session_id to get a new sandboxed session"],
            )
        if template is not None and template.name != info.language:
            raise InvalidRequest(
                f"session {session_id} runs {info.language}, but language={template.name!r} was asked for",
                suggestions=[
                    f"omit language to run {info.language} code in this session",
                    f"omit session_id to start a new {template.name} session",
                ],
            )
        if flavor is not None and flavor.name != info.flavor:
            raise InvalidRequest(
                f"session {session_id} is flavor {info.flavor}; a running session cannot change flavor",
                suggestions=["omit flavor", f"omit session_id to start a new {flavor.name} session"],
            )
        if environment is not None and environment != info.environment:
            raise InvalidRequest(
                f"session {session_id} runs the {info.environment} environment, but environment={environment!r} was asked for",
                ["omit environment to use this session", f"omit session_id to start a new session in {environment}"],
            )
        if info.status == "error" and await sessions.restarted_after_death(session_id):
            info = await sessions.info(session_id)  # its fresh kernel: the supervisor says what became of the old one
        if info.status == "error":
            reason = await sessions.death_reason(session_id)
            raise SandboxError(
                f"the kernel of session {session_id} died{f': {reason}' if reason else ''}; its state is gone",
                suggestions=["restart_session to get a fresh kernel in this session", "omit session_id to start a new session"],
            )
        return info, False
    chosen = template or TEMPLATES["python"]
    flavor = flavor or get_flavor(settings.default_flavor)
    choice = KernelChoice.of(chosen.name, flavor.name, environment)
    reason = choice.template.unavailable_reason() if sessions.local_kernels else None
    if reason:
        raise InvalidRequest(f"{choice.template.name} sessions are not available here: {reason}")
    new_id = await sessions.create(choice, (new or NewSession()).start_request())
    return await sessions.info(new_id), True
