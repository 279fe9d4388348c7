"""Secrets a kernel uses without holding them: it sees a placeholder, the proxy puts the value into requests for the
secret's hosts, in the one header its declaration names, and takes it out of what they answer.

A declaration (MSB_NETWORK_SECRETS_FILE, an MCP session's ``secrets``, a start request's ``KERNEL_SECRETS``) is a
JSON object of variable names, each ``{"value": "...", "hosts": ["api.example.com", "*.corp.example"]}``, with
``"header"`` (default ``Authorization``) naming where the value may go. The kernel's variable holds
``msb-secret-<random>``; the proxy replaces that text in that header only (a Basic ``Authorization`` decoded and
encoded again), of requests bound for one of the hosts over TLS, and nowhere else: never in the URL or another header,
never over plain HTTP unless the operator's own declaration says ``"plain_http": true``, and sent anywhere else the
placeholder is just text. Bodies are not rewritten.

What the host answers never carries the value back to the kernel: an echo, a redirect or an error page that repeats
the request has every form of the value that was sent masked (Redaction); an answer that holds a piece of it in any
other form a reflecting host is likely to use is refused (reflection.py); and such a request asks for an unencoded
answer, which the proxy can read (an encoded one is refused).
"""

from __future__ import annotations

import base64
import functools
import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ahocorasick_rs

from msb_kernels.egress.policy import Policy, PolicyError, Rule, normalize_name, parse_rule

PLACEHOLDER_PREFIX = "msb-secret-"
MAX_SECRETS = 32
MAX_VALUE_BYTES = 8192
DEFAULT_HEADER = "authorization"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HEADER = re.compile(r"^[A-Za-z0-9-]{1,64}$")
DECLARATION_FORM = '{"NAME": {"value": "...", "hosts": ["api.example.com"], "header": "Authorization"}}'
BASIC_HEADERS = (b"authorization", b"proxy-authorization")


@dataclass(frozen=True)
class Secret:
    name: str  # the variable the kernel sees
    value: str = field(repr=False)
    hosts: tuple[Rule, ...]
    placeholder: str
    header: str = DEFAULT_HEADER  # the one header (lower case) whose value may carry it
    plain_http: bool = False  # the operator's word that it may go over plain HTTP too

    def bound_for(self, host: str, port: int) -> bool:
        name = normalize_name(host)
        return any(rule.matches_name(name) and rule.allows_port(port) for rule in self.hosts)

    def held_by(self, host: str) -> bool:
        """Whether host, on any port, is one the value goes to."""
        name = normalize_name(host)
        return any(rule.matches_name(name) for rule in self.hosts)

    def public(self) -> dict:
        """What may be shown of it (stats, get_sessions): never the value."""
        return {"name": self.name, "hosts": [str(rule) for rule in self.hosts], "header": self.header, "plain_http": self.plain_http}


def parse_declarations(raw: Any, where: str, *, operator: bool = False) -> dict[str, dict]:
    """The declarations in raw (a JSON text or an already-decoded object), checked; PolicyError names what is wrong.
    operator: the operator's file, which alone may say ``plain_http``."""
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
    keys = {"value", "hosts", "header", *({"plain_http"} if operator else set())}
    for name, declaration in raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise PolicyError(f"{where}: {name!r} is not a variable name (letters, digits and _, not starting with a digit)")
        if not isinstance(declaration, dict) or set(declaration) - keys:
            extra = sorted(set(declaration) - keys) if isinstance(declaration, dict) else []
            why = (
                "plain_http is the operator's to say (MSB_NETWORK_SECRETS_FILE): a session's secrets go over TLS only"
                if extra == ["plain_http"]
                else f"{name} must be an object with {', '.join(sorted(keys))} only: {DECLARATION_FORM}"
            )
            raise PolicyError(f"{where}: {why}")
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
        header = declaration.get("header", DEFAULT_HEADER)
        if not isinstance(header, str) or not _HEADER.match(header) or header.lower() in ("host", "content-length", "transfer-encoding"):
            raise PolicyError(f"{where}: {name}'s header must be a header name such as Authorization or X-Api-Key")
        plain = declaration.get("plain_http", False)
        if not isinstance(plain, bool):
            raise PolicyError(f"{where}: {name}'s plain_http must be true or false")
        checked[name] = {"value": value, "hosts": [str(rule) for rule in rules], "header": header.lower(), "plain_http": plain}
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
        made.append(
            Secret(
                name,
                declaration["value"],
                rules,
                placeholder(name),
                declaration.get("header", DEFAULT_HEADER),
                bool(declaration.get("plain_http", False)),
            )
        )
    return made


def substitute(text: str, secrets: list[Secret]) -> str:
    """text with the placeholders of secrets replaced by their values."""
    for secret in secrets:
        if secret.placeholder in text:
            text = text.replace(secret.placeholder, secret.value)
    return text


def sendable(secrets: list[Secret], host: str, port: int, tls: bool) -> list[Secret]:
    """The secrets that may go into a request to host:port: bound for it, over TLS or (the operator's word) plain HTTP."""
    return [secret for secret in secrets if secret.bound_for(host, port) and (tls or secret.plain_http)]


def substitute_headers(
    headers: list[tuple[bytes, bytes]], secrets: list[Secret]
) -> tuple[list[tuple[bytes, bytes]], list[tuple[str, bytes]]]:
    """A request's headers with each secret put into the one header its declaration names (a Basic credential
    decoded and encoded again), and every form of a value that went in, with its secret's name (for Redaction and
    reflection.Reflection): the header as sent, the credential the proxy built, the value."""
    if not secrets:
        return headers, []
    rewritten, sent = [], []
    for name, value in headers:
        mine = [secret for secret in secrets if secret.header.encode() == name.lower()]
        if not mine:
            rewritten.append((name, value))
            continue
        text = original = value.decode("latin-1")
        decoded = None
        if name.lower() in BASIC_HEADERS and text[:6].lower() == "basic ":
            try:
                decoded = base64.b64decode(text[6:].strip(), validate=True).decode("latin-1")
            except (ValueError, UnicodeError):
                decoded = None
            if decoded is not None:
                replaced = substitute(decoded, mine)
                if replaced != decoded:
                    text = text[:6] + base64.b64encode(replaced.encode("latin-1")).decode("ascii")
        final = substitute(text, mine)
        used = [secret for secret in mine if secret.placeholder in original or (decoded is not None and secret.placeholder in decoded)]
        if used and final != original:
            for secret in used:
                sent += [(secret.name, final.encode("latin-1")), (secret.name, secret.value.encode())]
                if decoded is not None:
                    sent.append((secret.name, substitute(decoded, [secret]).encode("latin-1")))
        rewritten.append((name, final.encode("latin-1")))
    return rewritten, sent


class Redaction:
    """Masks every form of the values a request sent out of its answer (headers and body, a byte for a byte, so the
    framing holds), across the answer's chunks: the raw value, as the header carried it, base64 and URL-encoded. What
    repeats a request (an echo, a redirect, an error page) hands the kernel asterisks, never the value."""

    def __init__(self, sent: list[tuple[str, bytes]]):
        forms: set[bytes] = set()
        for _, value in sent:
            forms |= {value, base64.b64encode(value), urllib.parse.quote(value.decode("latin-1"), safe="").encode()}
        self.forms = sorted((form for form in forms if len(form) >= 4), key=len, reverse=True)
        self.keep = max((len(form) for form in self.forms), default=1) - 1
        self.pending = b""
        self._matcher = _matcher_of(tuple(self.forms)) if self.forms else None

    def __bool__(self) -> bool:
        return bool(self.forms)

    def mask(self, data: bytes) -> bytes:
        found = self._matcher.find_matches_as_indexes(data) if self._matcher is not None else []
        if not found:
            return data
        masked = bytearray(data)
        for _, start, end in found:
            masked[start:end] = b"*" * (end - start)
        return bytes(masked)

    def feed(self, chunk: bytes) -> bytes:
        """What of the body so far can go on: all but the last bytes a value could still be starting in."""
        data = self.mask(self.pending + chunk)
        cut = max(0, len(data) - self.keep)
        self.pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        data, self.pending = self.mask(self.pending), b""
        return data


@functools.lru_cache(maxsize=16)
def _matcher_of(forms: tuple[bytes, ...]) -> ahocorasick_rs.BytesAhoCorasick:
    """One SIMD pass for every form, the longest first where two start together (the header before the value in it):
    built once for the forms a kernel's requests carry, not again at each request."""
    return ahocorasick_rs.BytesAhoCorasick(list(forms), matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)
