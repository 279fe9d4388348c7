"""The MCP server over streamable HTTP, as an ASGI app the gateway mounts (at /mcp).

Every request must carry ``Authorization: Bearer <token>`` and pass the Host and
Origin checks (DNS-rebinding protection) before the MCP transport sees it. The token
names a person (mcp_bridge.auth): the MCP session is theirs, and so is every tool call
on it. A request without a valid token is answered 401 with ``WWW-Authenticate`` that
points at the RFC 9728 protected-resource metadata, where the gateway serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import TokenVerifier
from mcp.server.streamable_http import MCP_PROTOCOL_VERSION_HEADER
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from mcp_bridge.auth import single_token
from mcp_bridge.notebooks.hub import PersonalLabs
from mcp_bridge.options import BridgeOptions
from mcp_bridge.server import build_server
from mcp_bridge.sessions import KernelSessions
from mcp_bridge.supervisor import bridge_of
from msb_kernels.errors import ConfigError, MsbError
from msb_kernels.identity.people import local_person
from msb_kernels.settings.config import MsbSettings


class McpHttpApp:
    """ASGI app: bearer token, Host/Origin checks, then MCP streamable HTTP (at any path under its mount)."""

    def __init__(
        self,
        sessions: KernelSessions,
        verifier: TokenVerifier,
        allowed_hosts: list[str] | None,
        allowed_origins: list[str],
        settings: MsbSettings | None = None,
        options: BridgeOptions | None = None,
        resource_metadata_path: str | None = None,
        personal_labs: PersonalLabs | None = None,
    ):
        self.sessions = sessions
        self.server = build_server(sessions, settings, options, personal_labs=personal_labs, local_caller=None)  # every call is HTTP
        self.bridge = bridge_of(self.server)
        self.verifier = verifier
        self.resource_metadata_path = resource_metadata_path  # where the host serves RFC 9728 metadata, from its root
        # allowed_hosts None: a server on every interface, reached by names it cannot know (a swarm's nodes). The Host
        # check guards against DNS rebinding of a local server's cookies or open endpoints; here every call carries
        # the token in a header, which a page of another origin cannot read or send, as jupyter_server's own
        # allow_remote_access reasons for its API.
        self.security = TransportSecuritySettings(
            enable_dns_rebinding_protection=allowed_hosts is not None,
            allowed_hosts=list(allowed_hosts or []),
            allowed_origins=list(allowed_origins),
        )
        self._checks = TransportSecurityMiddleware(self.security)
        self.manager = StreamableHTTPSessionManager(app=self.server._lowlevel_server, security_settings=self.security)
        # A 2026-era request is one exchange, with no session. When it asks for no progress, nothing can stream on
        # it, and this manager answers it as JSON, awaited in the request itself, where the one above runs it under a
        # task group that watches for notifications and commits to SSE at the first: 0.14 to 0.22 ms less a call
        # (bench/side_by_side.py). Until its answer, such a call sends nothing, for up to MSB_MCP_RUNNING_AFTER_SECONDS.
        self.unstreamed = StreamableHTTPSessionManager(
            app=self.server._lowlevel_server, security_settings=self.security, json_response=True, stateless=True
        )
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._start_lock = asyncio.Lock()

    def sizes(self) -> dict[str, int]:
        """The bridge's structures, and the MCP SDK's open streamable-HTTP sessions (ended by a client's DELETE or
        after the SDK's idle timeout)."""
        return {**self.bridge.sizes(), "transport_sessions": len(getattr(self.manager, "_server_instances", ()))}

    async def start(self) -> None:
        """Start the transport's task group (done on the first request when nobody called it)."""
        async with self._start_lock:
            if self._task is None:
                self._task = asyncio.create_task(self._serve())
        await self._ready.wait()

    async def _serve(self) -> None:
        async with self.manager.run(), self.unstreamed.run():
            self._ready.set()
            await self._stop.wait()

    async def close(self) -> None:
        """Stop the transport, the executions still running, and the kernels this bridge started."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        await self.bridge.close()
        with contextlib.suppress(Exception):
            await self.sessions.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        refusal = await self._checks.validate_request(Request(scope), is_post=False)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        try:
            access = await self.verifier.verify_token(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        except MsbError as exc:  # the token's issuer (JupyterHub) did not answer: nothing to do with this token
            await _json(send, 503, {"error": {"type": type(exc).__name__, "message": exc.message, "suggestions": exc.suggestions}})
            return
        if access is None:
            await _json(
                send,
                401,
                {"error": {"type": "Unauthorized", "message": "a valid `Authorization: Bearer <token>` header is required"}},
                [(b"www-authenticate", self._challenge(scope, headers))],
            )
            return
        scope = {**scope, "user": AuthenticatedUser(access)}  # the SDK binds the MCP session to this principal
        await self.start()
        manager = self.manager
        if scope["method"] == "POST" and _single_exchange(headers):
            body, receive = await _read_body(receive, headers, self.manager.max_request_body_size)
            if body is not None and not _asks_for_progress(body):
                manager = self.unstreamed
        await manager.handle_request(scope, receive, send)

    def _challenge(self, scope: Scope, headers: dict[bytes, bytes]) -> bytes:
        """RFC 6750's challenge, with RFC 9728's resource_metadata where the host serves that document."""
        challenge = 'Bearer realm="msb-kernels", error="invalid_token"'
        if self.resource_metadata_path:
            host = headers.get(b"x-forwarded-host", headers.get(b"host", b"")).decode("latin-1")
            proto = headers.get(b"x-forwarded-proto", scope.get("scheme", "http").encode()).decode("latin-1")
            challenge += f', resource_metadata="{proto}://{host}{self.resource_metadata_path}"'
        return challenge.encode("latin-1")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _single_exchange(headers: dict[bytes, bytes]) -> bool:
    """A request of the 2026 protocol (or a version the SDK will refuse): the SDK's own test for its era."""
    version = headers.get(MCP_PROTOCOL_VERSION_HEADER.lower().encode())
    return version is not None and version.decode("latin-1") not in HANDSHAKE_PROTOCOL_VERSIONS


async def _read_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> tuple[bytes | None, Receive]:
    """The request's body and a receive that hands it on; None (nothing read) without a Content-Length within ``limit``,
    which the SDK then enforces itself."""
    length = headers.get(b"content-length", b"")
    if not length.isdigit() or int(length) > limit:
        return None, receive
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, _replay([message], receive)
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    return body, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list[dict], receive: Receive) -> Receive:
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()

    return replayed


def _asks_for_progress(body: bytes) -> bool:
    """Whether a JSON-RPC request carries a progress token: then its output may stream, as notifications."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):  # the SDK answers such a body with its parse error
        return False
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and meta.get("progressToken") is not None


async def _json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def asgi_app(
    sessions: KernelSessions,
    token: str,
    allowed_hosts: list[str] | None,
    allowed_origins: list[str],
    settings: MsbSettings | None = None,
    options: BridgeOptions | None = None,
) -> Any:
    """MCP streamable HTTP at the app's root path, behind one bearer token (one person) and Host/Origin checks.

    ``allowed_hosts`` are Host header values ("127.0.0.1:8888", or "localhost:*" for any port), None for any;
    ``allowed_origins`` are Origin values ("http://localhost:8888", "http://localhost:*").
    Requests without an Origin header (non-browser clients) pass the Origin check.
    """
    if not token:
        raise ConfigError("the MCP HTTP endpoint needs a token; set one (it is checked as `Authorization: Bearer <token>`)")
    return McpHttpApp(sessions, single_token(token, local_person()), allowed_hosts, allowed_origins, settings, options)
