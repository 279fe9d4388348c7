"""The MCP server over streamable HTTP, as an ASGI app the gateway mounts (at /mcp).

Every request must carry ``Authorization: Bearer <token>`` and pass the Host and
Origin checks (DNS-rebinding protection) before the MCP transport sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from mcp_bridge.options import BridgeOptions
from mcp_bridge.server import build_server
from mcp_bridge.sessions import KernelSessions
from mcp_bridge.supervisor import bridge_of
from msb_kernels.config import MsbSettings
from msb_kernels.errors import ConfigError


class McpHttpApp:
    """ASGI app: bearer token, Host/Origin checks, then MCP streamable HTTP (at any path under its mount)."""

    def __init__(self, sessions: KernelSessions, token: str, allowed_hosts: list[str], allowed_origins: list[str],
                 settings: MsbSettings | None = None, options: BridgeOptions | None = None):
        if not token:
            raise ConfigError("the MCP HTTP endpoint needs a token; set one (it is checked as `Authorization: Bearer <token>`)")
        self.sessions = sessions
        self.server = build_server(sessions, settings, options)
        self.bridge = bridge_of(self.server)
        self._expected = f"Bearer {token}".encode()
        self.security = TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                                  allowed_hosts=list(allowed_hosts), allowed_origins=list(allowed_origins))
        self._checks = TransportSecurityMiddleware(self.security)
        self.manager = StreamableHTTPSessionManager(app=self.server._lowlevel_server, security_settings=self.security)
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the transport's task group (done on the first request when nobody called it)."""
        async with self._start_lock:
            if self._task is None:
                self._task = asyncio.create_task(self._serve())
        await self._ready.wait()

    async def _serve(self) -> None:
        async with self.manager.run():
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
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            await _json(send, 401, {"error": {"type": "Unauthorized", "message": "a valid `Authorization: Bearer <token>` header is required"}},
                        [(b"www-authenticate", b'Bearer realm="msb-kernels"')])
            return
        await self.start()
        await self.manager.handle_request(scope, receive, send)

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


async def _json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


def asgi_app(sessions: KernelSessions, token: str, allowed_hosts: list[str], allowed_origins: list[str],
             settings: MsbSettings | None = None, options: BridgeOptions | None = None) -> Any:
    """MCP streamable HTTP at the app's root path, behind a bearer token and Host/Origin checks.

    ``allowed_hosts`` are Host header values ("127.0.0.1:8888", or "localhost:*" for any port);
    ``allowed_origins`` are Origin values ("http://localhost:8888", "http://localhost:*").
    Requests without an Origin header (non-browser clients) pass the Origin check.
    """
    return McpHttpApp(sessions, token, allowed_hosts, allowed_origins, settings, options)
