"""The gateway's own HTTP handlers, on top of jupyter_server's.

- ``GET /api/msb/health``: the one endpoint that answers without a token.
- ``GET /api/msb/stats``: resource stats and one entry per kernel.
- ``POST /api/kernels``: jupyter_server's handler, except that the body's ``env`` (KERNEL_* variables, as the
  Jupyter kernel gateway reads them, and the session's own) becomes the kernel's StartRequest
  (msb_kernels.start_request), so that ``KERNEL_FLAVOR`` picks the flavor; and errors carry the MsbError's suggestions.
- ``POST /api/sessions``: jupyter_server's handler, with the same error bodies.

Every answer of the gateway is JSON, its errors included (MsbErrorsMixin): no handler here renders jupyter_server's
HTML pages, which print the page's token for any logged-in user.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import jupyter_server
from jupyter_client.jsonutil import json_default
from jupyter_client.session import json_packer
from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from jupyter_server.base.handlers import APIHandler, APIVersionHandler, PrometheusMetricsHandler
from jupyter_server.kernelspecs.handlers import KernelSpecResourceHandler
from jupyter_server.services.api.handlers import APIStatusHandler
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from jupyter_server.services.kernels.handlers import KernelActionHandler, KernelHandler, MainKernelHandler
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler
from jupyter_server.services.kernelspecs.handlers import KernelSpecHandler, MainKernelSpecHandler
from jupyter_server.services.kernelspecs.handlers import kernel_name_regex as KERNEL_NAME_REGEX
from jupyter_server.services.sessions.handlers import SessionHandler, SessionRootHandler
from jupyter_server.utils import ensure_async, url_escape, url_path_join
from tornado import web
from tornado.httputil import responses

from msb_kernels import __version__, audit
from msb_kernels.compat import (
    KERNEL_ACTION_REGEX,
    KERNEL_ID_REGEX,
    SESSION_ID_REGEX,
    dropped_give_up_timer,
    replace_not_found_handler,
    stop_ping,
)
from msb_kernels.gateway.errors import MsbHTTPError, msb_error_in
from msb_kernels.identity.people import Person, acting, acting_as, acting_client
from msb_kernels.start_request import START_REQUEST, StartRequest


class MsbErrorsMixin:
    """Where an error becomes its HTTP answer, for every handler the gateway serves: a JSON body, never a page (whose
    template prints the token) nor a traceback. An MsbError from below (the kernel manager, the provisioner) carries
    its type, suggestions and limit (errors.py)."""

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        error = msb_error_in(value)
        if error is None:
            super().log_exception(typ, value, tb)  # type: ignore[misc]
            return
        answer = MsbHTTPError(error)
        self.log.warning("%s %s: %d %s", self.request.method, self.request.uri, answer.status_code, error.message)  # type: ignore[attr-defined]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        error = msb_error_in(exc)
        if error is not None:
            answer = MsbHTTPError(error)
            self.set_status(answer.status_code)
            payload = answer.payload
        elif isinstance(exc, web.HTTPError):
            payload = {"message": (exc.log_message % exc.args if exc.args else exc.log_message) or exc.reason or responses.get(status_code)}
            payload["reason"] = exc.reason
        else:
            payload = {"message": responses.get(status_code, "Unknown HTTP Error") if exc is None else "Unhandled error", "reason": None}
        self.clear_header("Content-Disposition")  # type: ignore[attr-defined]
        self.set_header("Content-Type", "application/json")  # type: ignore[attr-defined]
        self.finish(json.dumps(payload))  # type: ignore[attr-defined]


class MsbMainKernelHandler(MsbErrorsMixin, MainKernelHandler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        km = self.kernel_manager
        model = self.get_json_body() or {}
        kernel_name = str(model.get("name") or km.default_kernel_name)
        # What the client asks for; who it is (the owner, the volume) the kernel manager adds from its token alone.
        request = StartRequest.from_variables(model.get("env"))
        kernel_id = await ensure_async(
            km.start_kernel(kernel_name=kernel_name, kernel_id=model.get("kernel_id"), **{START_REQUEST: request})
        )
        model = await ensure_async(km.kernel_model(kernel_id))
        self.set_header("Location", url_path_join(self.base_url, "api", "kernels", url_escape(kernel_id)))
        self.set_status(201)
        self.finish(json.dumps(model, default=str))


class MsbSessionRootHandler(MsbErrorsMixin, SessionRootHandler):
    pass


class MsbSessionHandler(MsbErrorsMixin, SessionHandler):
    pass


class MsbKernelHandler(MsbErrorsMixin, KernelHandler):
    pass


class MsbMainKernelSpecHandler(MsbErrorsMixin, MainKernelSpecHandler):
    pass


class MsbKernelSpecHandler(MsbErrorsMixin, KernelSpecHandler):
    pass


class MsbKernelSpecResourceHandler(MsbErrorsMixin, KernelSpecResourceHandler):
    """A kernelspec's logos (JupyterLab's launcher asks for them): jupyter_server's, with JSON errors, not its page."""


class AdminStatusHandler(MsbErrorsMixin, APIStatusHandler):
    """``GET /api/status``: jupyter_server's (the server's start, its last activity, its kernels and connections), for
    admins only: its last activity and counts are everyone's."""

    auth_resource = "status"


class MsbKernelActionHandler(MsbErrorsMixin, KernelActionHandler):
    """``POST /api/kernels/{id}/interrupt|restart``: jupyter_server's, but a kernel that does not exist for the caller
    (gone, or another person's) is a 404, where jupyter_server answers a failed restart with a 500. The lookup is the
    kernel manager's own (get_kernel), so the refusal of another person's kernel reaches the audit trail as on every
    other route."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        self.kernel_manager.get_kernel(kernel_id)
        await super().post(kernel_id, action)


class StatsHandler(MsbErrorsMixin, APIHandler):
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        stats = await self.kernel_manager.stats(self.settings.get("session_manager"))
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(stats, default=str))


class HealthHandler(APIHandler):
    @allow_unauthenticated
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": "ok", "version": __version__}))


class AuthenticatedVersionHandler(APIVersionHandler):
    """``GET /api``: jupyter_server answers it without a token; here only health does."""

    @web.authenticated
    def get(self) -> None:
        self.finish(json.dumps({"version": jupyter_server.__version__, "msb_kernels": __version__}))


class JsonNotFoundHandler(APIHandler):
    """Unknown paths: a JSON 404 (after the token check), not jupyter_server's HTML page."""

    async def prepare(self) -> None:
        await super().prepare()
        raise web.HTTPError(404, f"no such endpoint: {self.request.path}")


class AdminMetricsHandler(MsbErrorsMixin, PrometheusMetricsHandler):
    """``GET /metrics``: jupyter_server's, for admins only (its sessions per person name every person)."""

    auth_resource = "metrics"

    @web.authenticated
    @authorized
    def get(self) -> None:
        super().get()


class ProtectedResourceHandler(APIHandler):
    """RFC 9728 metadata for /mcp: what an MCP client reads after a 401 to learn which tokens this resource takes.

    Served at ``<base_url>.well-known/oauth-protected-resource/mcp`` (the RFC's own place when the gateway is at /;
    behind a Hub's proxy only the service's prefix reaches it, so the 401's ``resource_metadata`` names this path).
    Under JupyterHub the Hub is the authorization server; it has no client registration and no RFC 8414 metadata,
    so a client gets its token at /hub/token rather than through an OAuth flow. Elsewhere no authorization server
    exists (the users file and the single token are handed out by the operator), which the SDK's
    ProtectedResourceMetadata cannot say (it requires one), so the document is written here.
    """

    @allow_unauthenticated
    def get(self) -> None:
        base = f"{self.request.protocol}://{self.request.host}"
        document: dict[str, Any] = {
            "resource": base + url_path_join(self.base_url, "mcp"),
            "bearer_methods_supported": ["header"],
            "resource_name": "msb-kernels: sandboxed Jupyter kernels",
        }
        hub = self.settings.get("msb_hub_service")
        if hub is not None:
            document["authorization_servers"] = [base + "/hub/"]
            document["scopes_supported"] = [hub.access_scope]
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(document))


def use_json_not_found(web_app: web.Application) -> None:
    """Swap jupyter_server's catch-all HTML 404 handler for the JSON one."""
    replace_not_found_handler(web_app, JsonNotFoundHandler)


class PerSocketIdentityConnection(ZMQChannelsWebsocketConnection):
    """Each WebSocket gets its own ZMQ identity, not its client's session id alone.

    JupyterLab's server reconnects with the same session id, sometimes while the old socket is
    still open, and always after a restart. With one identity for both, the kernel's ROUTER
    answers whichever peer connected last: without ZMQ_ROUTER_HANDOVER (tslab) the old one;
    after a restart, where the old peer reconnects too, even ipykernel may pick it. The
    client never sees the identity, and a socket's four channels still share one, so stdin
    requests reach the socket that asked.
    """

    person: Person | None = None  # who opened this WebSocket (the audit trail's person for what it sends)
    client: str | None = None

    def create_stream(self) -> None:
        identity = f"{self.session.session}-{uuid.uuid4().hex[:12]}".encode()
        for channel in ("iopub", "shell", "control", "stdin"):
            stream = getattr(self.kernel_manager, f"connect_{channel}")(identity=identity)
            stream.channel = channel
            self.channels[channel] = stream
        if (record := self.multi_kernel_manager.record(self.kernel_id)) is not None:
            record.websockets.add(self)
        self.multi_kernel_manager.tell_lost_executions(self.kernel_id)

    async def prepare(self) -> None:
        """jupyter_server's prepare, less its give-up timer once the kernel has answered. The timer (kernel_info_timeout,
        60 s) holds this connection, and through its context the WebSocket handler, for that long whatever happens:
        under load, a minute of closed WebSockets with their sessions and requests, among which later objects land,
        so the allocator keeps their pages (bench/gateway_soak.py: RSS after ten runs +9.7% with the timer, +2.8%
        without)."""
        self.person, self.client = acting(), acting_client()
        with dropped_give_up_timer(self):
            # A hibernated kernel is restored before jupyter_server's nudge asks it for kernel_info (hibernation.py).
            await self.multi_kernel_manager.wake_kernel(self.kernel_id)
            await super().prepare()

    def handle_incoming_message(self, incoming_msg: str) -> None:
        """jupyter_server's, after a wake of a hibernated kernel is under way: ZMQ holds the message until it runs.
        An execute_request is a line of the audit trail, as the person who opened this WebSocket."""
        self.multi_kernel_manager.wake_soon(self.kernel_id)
        code = executed_code(incoming_msg, self.subprotocol == "v1.kernel.websocket.jupyter.org", self.session.unpack)
        if code is not NOT_EXECUTED:
            with acting_as(self.person, self.client):
                audit.record("execute", "sent", self.kernel_id, **audit.code_fields(code))
        super().handle_incoming_message(incoming_msg)

    def follow_kernel(self) -> None:
        """The kernel is reached at a new address (a cluster kernel restarted as a new task): the same WebSocket, new channels."""
        if not self.channels:
            return
        stale = self.channels
        self.channels = {}
        self.create_stream()
        for stream in self.channels.values():
            stream.on_recv_stream(self.handle_outgoing_message)
        for stream in stale.values():
            if not stream.closed():
                stream.close()

    def disconnect(self) -> None:
        if (record := self.multi_kernel_manager.record(self.kernel_id)) is not None:
            record.websockets.discard(self)
        super().disconnect()
        # jupyter_server's prepare() left a timer (kernel_info_timeout, 60 s) whose closure holds this connection: let it
        # hold an empty one, not the ZMQ streams (a last connection's are the offline buffer's now, which closes them).
        self.channels = {}

    @property
    def write_message(self) -> Any:
        """jupyter_server's alias of the handler's write_message, less the messages for a socket that is closing. A
        socket replaced by a reconnect under the same session id (JupyterLab's) is closed at once, but its ZMQ
        streams deliver until its client answers the close: each message raised WebSocketClosedError, which has no
        text, and jupyter_server logged it as a blank warning (49 in one short Lab session). The client is gone: there
        is no one to tell."""
        return self._write_while_open

    def _write_while_open(self, message: str | bytes, binary: bool = False) -> Any:
        connection = self.websocket_handler.ws_connection
        if connection is None or connection.is_closing():
            return None
        return self.websocket_handler.write_message(message, binary=binary)

    def send_to_client(self, message: dict, channel: str) -> None:
        """A message the gateway itself says on the kernel's behalf (see MsbKernelManager.tell_lost_executions)."""
        if self.subprotocol == "v1.kernel.websocket.jupyter.org":
            self.write_message(serialize_msg_to_ws_v1(message, channel, pack=json_packer), binary=True)
        else:
            self.write_message(json.dumps({**message, "channel": channel}, default=json_default))


NOT_EXECUTED = object()  # executed_code's answer for a message that runs no code


def executed_code(message: str | bytes, v1: bool, unpack: Callable[[bytes], Any]) -> Any:
    """What a client's message over the WebSocket runs, read as the kernel will read it: the code of an
    execute_request (None where it is one whose code cannot be read), or NOT_EXECUTED.

    The header is parsed with the kernel's own unpacker (``unpack``: its Session's), on every channel, so that every
    spelling that runs is one the audit sees: a JSON escape in msg_type (``execute\\u005frequest``) is the same
    msg_type to the kernel, and a kernel runs an execute_request on control as well as on shell. A message whose header
    does not parse never runs (jupyter_server refuses it, or the kernel drops it)."""
    try:
        if v1:  # jupyter_server passes the frames on as they are: the kernel parses them
            _, parts = deserialize_msg_from_ws_v1(message)
            header = unpack(parts[0])
        else:  # jupyter_server parses the message and sends what it parsed
            parsed = deserialize_binary_message(message) if isinstance(message, bytes) else json.loads(message)
            header = parsed.get("header") if isinstance(parsed, dict) else None
    except Exception:
        return NOT_EXECUTED
    if not isinstance(header, dict) or header.get("msg_type") != "execute_request":
        return NOT_EXECUTED
    try:
        content = unpack(parts[3]) if v1 else parsed.get("content")
    except Exception:
        return None
    code = content.get("code") if isinstance(content, dict) else None
    return code if isinstance(code, str) else None


class NoDelayKernelWebsocketHandler(MsbErrorsMixin, KernelWebsocketHandler):
    """Kernel channels with TCP_NODELAY: a reply is several small frames, and with Nagle's algorithm
    each one after the first waits for the client's delayed ACK (about 40 ms per execute)."""

    async def open(self, kernel_id: str) -> None:  # type: ignore[override]
        self.set_nodelay(True)
        await super().open(kernel_id)

    def on_close(self) -> None:
        """jupyter_server stops its ping timer only at the next ping after the close (30 s on), and the timer holds this
        handler and its connection till then: stop it now, so that a closed WebSocket's memory goes with it."""
        stop_ping(self)
        super().on_close()


def gateway_handlers() -> list[tuple[str, type]]:
    """(pattern, handler) pairs, before base_url is added: every route the gateway serves (serve_only drops the rest of
    jupyter_server's), each with JSON errors. Kernels, kernelspecs and sessions as jupyter_server serves them, the
    project's own routes; /mcp is mounted beside them (mcp.py)."""
    return [
        (r"/api/?", AuthenticatedVersionHandler),
        (r"/api/msb/health", HealthHandler),
        (r"/api/msb/stats", StatsHandler),
        (r"/api/status", AdminStatusHandler),
        (r"/metrics", AdminMetricsHandler),
        (r"/\.well-known/oauth-protected-resource/mcp", ProtectedResourceHandler),
        (r"/api/kernels", MsbMainKernelHandler),
        (rf"/api/kernels/{KERNEL_ID_REGEX}", MsbKernelHandler),
        (rf"/api/kernels/{KERNEL_ID_REGEX}/{KERNEL_ACTION_REGEX}", MsbKernelActionHandler),
        (rf"/api/kernels/{KERNEL_ID_REGEX}/channels", NoDelayKernelWebsocketHandler),
        (r"/api/kernelspecs", MsbMainKernelSpecHandler),
        (rf"/api/kernelspecs/{KERNEL_NAME_REGEX}", MsbKernelSpecHandler),
        (rf"/kernelspecs/{KERNEL_NAME_REGEX}/(?P<path>.*)", MsbKernelSpecResourceHandler),
        (r"/api/sessions", MsbSessionRootHandler),
        (rf"/api/sessions/{SESSION_ID_REGEX}", MsbSessionHandler),
    ]


def serve_only(web_app: web.Application, allowed: set[type]) -> list[str]:
    """Drop every route whose handler is not in ``allowed`` from the web app's routers: what jupyter_server serves
    beside the kernel services (its static files, /files/ of its root directory, /api/resolvePath, /api/me,
    /api/spec.yaml, its redirects) is not the gateway's to serve, and answers the JSON 404 of any unknown path.
    Returns the patterns dropped, for the log."""
    dropped: list[str] = []

    def prune(router: Any) -> None:
        kept = []
        for rule in router.rules:
            target = rule.target
            if hasattr(target, "rules"):  # a host's own router (add_handlers)
                prune(target)
                kept.append(rule)
            elif isinstance(target, type) and target in allowed:
                kept.append(rule)
            else:
                dropped.append(getattr(getattr(rule.matcher, "regex", None), "pattern", str(rule.matcher)))
        router.rules = kept

    prune(web_app.default_router)
    prune(web_app.wildcard_router)
    return dropped
