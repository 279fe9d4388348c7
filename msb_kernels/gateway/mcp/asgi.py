"""Serve an ASGI app (the MCP bridge's streamable-HTTP app) from tornado, in the gateway's process.

``AsgiHandler`` turns one tornado request into one ASGI ``http`` call: the request body is
received at once, response bodies are written and flushed as they come (so server-sent
event streams reach the client while they run), and a client that goes away gets
``http.disconnect``. The app authenticates every request itself (McpHttpApp checks the
server's token), so jupyter_server's identity lookup is left out. ``AsgiLifespan`` runs the app's lifespan protocol, which Starlette
apps (and MCP's session manager) need before their first request.

The app is mounted under a prefix such as ``/mcp``: the ASGI scope gets ``root_path`` set
to it and ``path`` relative to it, so an app that serves at its root answers ``/mcp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from tornado import web

from msb_kernels.jupyter.compat import response_finished, set_current_user

log = logging.getLogger("msb_kernels")

AsgiApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class AsgiLifespan:
    """Start and stop an ASGI app's lifespan; apps without one are fine."""

    def __init__(self, app: AsgiApp, timeout: float = 30.0):
        self.app = app
        self.timeout = timeout
        self._inbox: asyncio.Queue[dict] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self.app(scope, self._inbox.get, self._outbox.put)
        except Exception as exc:  # an app without lifespan support raises here, which the spec allows
            await self._outbox.put({"type": "lifespan.unsupported", "message": str(exc)})

    async def _exchange(self, message: str) -> None:
        await self._inbox.put({"type": message})
        reply = await asyncio.wait_for(self._outbox.get(), self.timeout)
        if reply["type"].endswith(".failed"):
            raise RuntimeError(f"ASGI {message} failed: {reply.get('message', '')}")
        if reply["type"] == "lifespan.unsupported":
            log.debug("ASGI app has no lifespan: %s", reply.get("message"))
            self._task = None

    async def startup(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        await self._exchange("lifespan.startup")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
            await self._exchange("lifespan.shutdown")
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, 5)


class AsgiHandler(APIHandler):
    """One tornado handler in front of an ASGI app that checks the server's token on every request itself.

    jupyter_server's identity lookup is skipped: it only repeated the app's check, and it answered
    the token with a login cookie that HTTP clients then sent back on every call, to be verified
    again. CORS headers stay jupyter_server's (its allow_origin settings), and a request the app
    accepts still counts as API activity, as an authenticated one would.
    """

    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")

    def initialize(self, app: AsgiApp, root_path: str) -> None:
        self.asgi_app = app
        self.root_path = root_path.rstrip("/")
        self._disconnected = asyncio.Event()
        self._started = False

    async def prepare(self) -> None:  # type: ignore[override]
        set_current_user(self, None)
        self.set_cors_headers()

    def check_origin(self, origin_to_satisfy_tornado: str = "") -> bool:
        return True  # the ASGI app checks Origin itself (MCP's allowed_origins)

    def check_xsrf_cookie(self) -> None:
        return None  # requests are authenticated by the Authorization header, not cookies

    def on_connection_close(self) -> None:
        self._disconnected.set()

    @allow_unauthenticated
    async def get(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def head(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def post(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def delete(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def patch(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def put(self, *args: Any) -> None:
        await self._serve()

    @allow_unauthenticated
    async def options(self, *args: Any) -> None:
        await self._serve()

    def _scope(self) -> dict:
        request = self.request
        full_path = request.path
        prefix = self.base_url.rstrip("/") + self.root_path
        relative = full_path[len(prefix) :] if full_path.startswith(prefix) else full_path
        host, _, port = (request.host or "127.0.0.1").partition(":")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version.split("/")[-1] if request.version else "1.1",
            "method": request.method,
            "scheme": request.protocol,
            "path": relative or "/",
            "raw_path": (relative or "/").encode(),
            "root_path": prefix,
            "query_string": request.query.encode(),
            "headers": [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in request.headers.get_all()],
            "client": (request.remote_ip, 0),
            "server": (host, int(port) if port.isdigit() else (443 if request.protocol == "https" else 80)),
            "state": {},
        }

    async def _serve(self) -> None:
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": self.request.body or b"", "more_body": False}
            await self._disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if self._disconnected.is_set():
                return
            if message["type"] == "http.response.start":
                self._started = True
                self.set_status(message["status"])
                if message["status"] < 400:  # the app took the token: activity, for ServerApp.shutdown_no_activity_timeout
                    self.settings["api_last_activity"] = datetime.now(timezone.utc)
                self.clear_header("Content-Type")
                for raw_name, raw_value in message.get("headers", []):
                    name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
                    if name.lower() in ("content-length", "transfer-encoding", "connection"):
                        continue  # tornado frames the body itself
                    self.add_header(name, value)
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    self.write(chunk)
                if message.get("more_body", False):
                    with contextlib.suppress(Exception):
                        await self.flush()
                elif not response_finished(self):
                    self.finish()

        try:
            await self.asgi_app(self._scope(), receive, send)
        finally:
            self._disconnected.set()
        if not response_finished(self):
            if not self._started:
                raise web.HTTPError(500, "the ASGI app sent no response")
            self.finish()


def asgi_route(prefix: str, app: AsgiApp) -> list[tuple[str, type, dict]]:
    """Tornado routes that send ``prefix`` and everything under it to ``app``."""
    prefix = "/" + prefix.strip("/")
    return [(prefix + r"(/.*)?", AsgiHandler, {"app": app, "root_path": prefix})]
