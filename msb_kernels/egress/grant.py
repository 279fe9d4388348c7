"""What one kernel's start is granted: the operator's list or a narrower one the session asked for, and its secrets.

One definition for every way a kernel starts (the gateway's REST API, MCP sessions, nbclient and papermill): a
StartRequest (msb_kernels.provisioning.start_request) asks with its ``network_allow`` (rules, or ``none``; the wire's
``KERNEL_NETWORK_ALLOW``) and its ``secrets`` (JSON, secrets.py; ``KERNEL_SECRETS``); neither ever reaches the kernel's
environment, and a refusal names them as the client called them (the MCP tools' ``network_allow`` and ``secrets``).
The operator's list is MSB_NETWORK_ALLOW, or the public internet where MSB_ALLOW_NETWORK is true; a request may narrow
it, never widen it: ``*`` never covers a private range, so no session's list reaches the LAN that the operator's does
not name (policy.Rule.covers).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from msb_kernels.egress.policy import RULE_FORMS, Policy, PolicyError
from msb_kernels.egress.secrets import PLACEHOLDER_PREFIX, Secret, make_secrets, parse_declarations
from msb_kernels.egress.tls import CA_DIR
from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.provisioning.start_request import NETWORK_ALLOW, StartRequest

NO_NETWORK = "none"
SESSION_SOURCE = f"this session's network_allow ({NETWORK_ALLOW})"


@dataclass
class KernelNetwork:
    """A kernel's way out: through the proxy with this policy, or (policy None) none or MSB_ALLOW_NETWORK's own."""

    policy: Policy | None
    source: str = ""
    secrets: list[Secret] = field(default_factory=list)
    public: bool = False  # no proxy, MSB_ALLOW_NETWORK's own way out (slirp4netns, a microVM's policy)

    @property
    def proxied(self) -> bool:
        return self.policy is not None

    def describe(self) -> str:
        """Its way out in a word or a list: "none", "public internet", or "allow-list: ..." (stats, get_sessions)."""
        if self.policy is None:
            return "public internet" if self.public else "none"
        return f"allow-list: {self.policy or 'nothing'}"


def operator_policy(allow_network: bool, network_allow: str | None) -> Policy | None:
    """The widest list a kernel may get here; None: no network at all."""
    if network_allow:
        return Policy.parse(network_allow)
    return Policy.everything() if allow_network else None


def operator_secrets(path: str | None, policy: Policy | None) -> dict[str, dict]:
    """MSB_NETWORK_SECRETS_FILE's declarations; ConfigError names the file and what is wrong."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"MSB_NETWORK_SECRETS_FILE={path!r} cannot be read: {exc.strerror}") from None
    try:
        declarations = parse_declarations(text, f"MSB_NETWORK_SECRETS_FILE ({path})", operator=True)
        if declarations and policy is None:
            raise PolicyError("MSB_NETWORK_SECRETS_FILE declares secrets, but kernels have no network (set MSB_NETWORK_ALLOW)")
        for name, declaration in declarations.items():
            if not _allowed(policy, declaration["hosts"]):
                raise PolicyError(
                    f"MSB_NETWORK_SECRETS_FILE: {name} is for {', '.join(declaration['hosts'])}, outside MSB_NETWORK_ALLOW ({policy})"
                )
    except PolicyError as exc:
        raise ConfigError(str(exc), ["fix the file, or unset MSB_NETWORK_SECRETS_FILE"]) from None
    return declarations


def placeholder_maker(runtime_root: Path, kernel_id: str):
    """Placeholders that are the same for the same kernel and name in this runtime dir (an adopting gateway derives
    the ones the kernel was started with) and that no kernel can derive: an HMAC under a key kept with the CA."""
    directory = runtime_root / CA_DIR
    key_path = directory / "placeholder.key"
    try:
        key = key_path.read_bytes()
    except FileNotFoundError:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = os.urandom(32)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
    return lambda name: PLACEHOLDER_PREFIX + hmac.new(key, f"{kernel_id}\0{name}".encode(), hashlib.sha256).hexdigest()[:32]


def network_for(
    allow_network: bool, network_allow: str | None, secrets_file: str | None, request: StartRequest, runtime_root: Path, kernel_id: str
) -> KernelNetwork:
    """The way out for a kernel started with request; InvalidRequest names the variable (or the client's argument)
    that asks too much, and what the client can do about it."""
    operator = operator_policy(allow_network, network_allow)
    requested = request.network_allow
    declared = request.secrets
    allow_name, secrets_name = request.argument_names
    widen = "ask the operator to add it to MSB_NETWORK_ALLOW" if network_allow else "ask the operator to allow it"
    if requested is not None and requested.strip().lower() == NO_NETWORK:
        if declared:
            raise InvalidRequest(f"{secrets_name} declares secrets for a kernel with {allow_name}=none, which reaches no host")
        return KernelNetwork(None, "none")
    policy, source = operator, "MSB_NETWORK_ALLOW" if network_allow else "MSB_ALLOW_NETWORK"
    if requested is not None:
        if operator is None:
            raise InvalidRequest(
                f"{allow_name}={requested!r} asks for network, but this server gives kernels none "
                "(MSB_NETWORK_ALLOW and MSB_ALLOW_NETWORK are unset)",
                ["ask the operator to set MSB_NETWORK_ALLOW", f"or start the kernel without {allow_name}"],
            )
        try:
            policy, source = operator.narrowed_to(Policy.parse(requested)), SESSION_SOURCE
        except PolicyError as exc:
            raise InvalidRequest(
                f"{allow_name}={requested!r}: {exc}",
                [f"ask only for hosts within {operator}", f"for a host outside it, {widen}", f"rules are {RULE_FORMS}"],
            ) from None
    try:
        session_secrets = parse_declarations(declared, secrets_name) if declared else {}
    except PolicyError as exc:
        raise InvalidRequest(str(exc)) from None
    if session_secrets and policy is None:
        raise InvalidRequest(
            f"{secrets_name} declares secrets, but this server gives kernels no network (MSB_NETWORK_ALLOW is unset)",
            ["ask the operator to set MSB_NETWORK_ALLOW", f"or leave {secrets_name} out"],
        )
    if policy is None:
        return KernelNetwork(None, "none")
    if not network_allow and requested is None and not session_secrets and not secrets_file:
        return KernelNetwork(None, source, public=True)  # MSB_ALLOW_NETWORK's own way out
    placeholder = placeholder_maker(runtime_root, kernel_id)
    usable = {name: d for name, d in operator_secrets(secrets_file, operator).items() if _allowed(policy, d["hosts"])}
    try:
        secrets = make_secrets({**usable, **session_secrets}, policy, secrets_name, placeholder)
    except PolicyError as exc:
        outside = [name for name, d in session_secrets.items() if not _allowed(operator, d["hosts"])]
        advice = f"for {', '.join(outside)}'s host, {widen}" if outside else f"add the host to {allow_name}"
        raise InvalidRequest(str(exc), [advice, "or leave the secret out"]) from None
    return KernelNetwork(policy, source, secrets)


def _allowed(policy: Policy, hosts: list[str]) -> bool:
    try:
        policy.narrowed_to(Policy.parse(hosts))
    except PolicyError:
        return False
    return True
