"""Secrets a kernel uses without holding them: it sees a placeholder, the proxy puts the value into requests for the
secret's hosts.

A declaration (MSB_NETWORK_SECRETS_FILE, an MCP session's ``secrets``, a start request's ``KERNEL_SECRETS``) is a
JSON object of variable names, each ``{"value": "...", "hosts": ["api.example.com", "*.corp.example"]}``. The
kernel's variable holds ``msb-secret-<random>``; the proxy replaces that text in the request line and headers
(a Basic ``Authorization`` decoded and encoded again) of requests bound for one of the hosts, and nowhere else:
sent to any other host, the placeholder is just text. Bodies are not rewritten.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msb_kernels.egress.policy import Policy, PolicyError, Rule, normalize_name, parse_rule

PLACEHOLDER_PREFIX = "msb-secret-"
MAX_SECRETS = 32
MAX_VALUE_BYTES = 8192
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
DECLARATION_FORM = '{"NAME": {"value": "...", "hosts": ["api.example.com"]}}'


@dataclass(frozen=True)
class Secret:
    name: str  # the variable the kernel sees
    value: str = field(repr=False)
    hosts: tuple[Rule, ...]
    placeholder: str

    def bound_for(self, host: str, port: int) -> bool:
        name = normalize_name(host)
        return any(rule.matches_name(name) and rule.allows_port(port) for rule in self.hosts)

    def public(self) -> dict:
        """What may be shown of it (stats, get_sessions): never the value."""
        return {"name": self.name, "hosts": [str(rule) for rule in self.hosts]}


def parse_declarations(raw: Any, where: str) -> dict[str, dict]:
    """The declarations in raw (a JSON text or an already-decoded object), checked; PolicyError names what is wrong."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            raise PolicyError(f"{where} is not JSON ({exc}); use {DECLARATION_FORM}") from None
    if not isinstance(raw, dict):
        raise PolicyError(f"{where} must be a JSON object: {DECLARATION_FORM}")
    if len(raw) > MAX_SECRETS:
        raise PolicyError(f"{where} declares {len(raw)} secrets, over the limit of {MAX_SECRETS}")
    checked = {}
    for name, declaration in raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise PolicyError(f"{where}: {name!r} is not a variable name (letters, digits and _, not starting with a digit)")
        if not isinstance(declaration, dict) or set(declaration) - {"value", "hosts"}:
            raise PolicyError(f"{where}: {name} must be an object with value and hosts only: {DECLARATION_FORM}")
        value, hosts = declaration.get("value"), declaration.get("hosts")
        if not isinstance(value, str) or not value:
            raise PolicyError(f"{where}: {name}'s value must be a non-empty string")
        if len(value) > MAX_VALUE_BYTES or not value.isascii() or not value.isprintable():
            raise PolicyError(f"{where}: {name}'s value must be printable ASCII (a token), at most {MAX_VALUE_BYTES} characters")
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
            raise PolicyError(f'{where}: {name}\'s hosts must be a list of host names such as ["api.example.com"]')
        rules = [parse_rule(host) for host in hosts]
        if any(rule.host is None or rule.host == "*" for rule in rules):
            raise PolicyError(f"{where}: {name}'s hosts must be host names or wildcards such as *.example.com, not * or networks")
        checked[name] = {"value": value, "hosts": [str(rule) for rule in rules]}
    return checked


def make_secrets(declarations: dict[str, dict], policy: Policy, where: str, placeholder: Callable[[str], str]) -> list[Secret]:
    """One Secret per declaration, each with placeholder(name); every host must be one the policy allows."""
    made = []
    for name, declaration in declarations.items():
        rules = tuple(parse_rule(host) for host in declaration["hosts"])
        for rule in rules:
            if not any(own.covers(rule) for own in policy.rules):
                raise PolicyError(
                    f"{where}: {name} is for {rule}, which this kernel's network allow-list ({policy or 'empty'}) does not allow"
                )
        made.append(Secret(name, declaration["value"], rules, placeholder(name)))
    return made


def substitute(text: str, secrets: list[Secret], host: str, port: int) -> str:
    """text with the placeholders of the secrets bound for host:port replaced by their values."""
    for secret in secrets:
        if secret.placeholder in text and secret.bound_for(host, port):
            text = text.replace(secret.placeholder, secret.value)
    return text


def substitute_headers(headers: list[tuple[bytes, bytes]], secrets: list[Secret], host: str, port: int) -> list[tuple[bytes, bytes]]:
    """A request's headers with the secrets bound for host:port put in, Basic credentials included."""
    if not secrets:
        return headers
    rewritten = []
    for name, value in headers:
        text = value.decode("latin-1")
        if name.lower() in (b"authorization", b"proxy-authorization") and text[:6].lower() == "basic ":
            try:
                decoded = base64.b64decode(text[6:].strip(), validate=True).decode("latin-1")
            except (ValueError, UnicodeError):
                decoded = None
            if decoded is not None:
                replaced = substitute(decoded, secrets, host, port)
                if replaced != decoded:
                    text = text[:6] + base64.b64encode(replaced.encode("latin-1")).decode("ascii")
        rewritten.append((name, substitute(text, secrets, host, port).encode("latin-1")))
    return rewritten
