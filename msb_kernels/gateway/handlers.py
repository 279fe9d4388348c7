"""The gateway's routes, on top of jupyter_server's: the table of them all (gateway_handlers), and the handlers that
belong to no service package.

- ``GET /api/msb/health`` and ``GET /`` (JupyterHub checks each service's health at its root every minute): the only
  endpoints that answer without a token.
- ``GET /api/msb/stats``: resource stats and one entry per kernel.
- ``/api/sessions`` and ``/api/kernelspecs``: jupyter_server's handlers, with the gateway's error bodies.
- ``/api/kernels`` and its WebSocket: kernels/handlers.py and kernels/websocket.py; /mcp's metadata: mcp/metadata.py.

Every answer of the gateway is JSON, its errors included (MsbErrorsMixin): no handler here renders jupyter_server's
HTML pages, which print the page's token for any logged-in user.
"""

from __future__ import annotations

import json
from typing import Any

import jupyter_server
from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from jupyter_server.base.handlers import APIHandler, APIVersionHandler, PrometheusMetricsHandler
from jupyter_server.kernelspecs.handlers import KernelSpecResourceHandler
from jupyter_server.services.api.handlers import APIStatusHandler
from jupyter_server.services.kernelspecs.handlers import KernelSpecHandler, MainKernelSpecHandler
from jupyter_server.services.kernelspecs.handlers import kernel_name_regex as KERNEL_NAME_REGEX
from jupyter_server.services.sessions.handlers import SessionHandler, SessionRootHandler
from tornado import web

from msb_kernels import __version__
from msb_kernels.gateway.http_errors import MsbErrorsMixin
from msb_kernels.gateway.kernels.handlers import MsbKernelActionHandler, MsbKernelHandler, MsbMainKernelHandler
from msb_kernels.gateway.kernels.websocket import NoDelayKernelWebsocketHandler
from msb_kernels.gateway.mcp.metadata import ProtectedResourceHandler
from msb_kernels.jupyter.compat import KERNEL_ACTION_REGEX, KERNEL_ID_REGEX, SESSION_ID_REGEX, replace_not_found_handler


class MsbSessionRootHandler(MsbErrorsMixin, SessionRootHandler):
    pass


class MsbSessionHandler(MsbErrorsMixin, SessionHandler):
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


def use_json_not_found(web_app: web.Application) -> None:
    """Swap jupyter_server's catch-all HTML 404 handler for the JSON one."""
    replace_not_found_handler(web_app, JsonNotFoundHandler)


def gateway_handlers() -> list[tuple[str, type]]:
    """(pattern, handler) pairs, before base_url is added: every route the gateway serves (serve_only drops the rest of
    jupyter_server's), each with JSON errors. Kernels, kernelspecs and sessions as jupyter_server serves them, the
    project's own routes; /mcp is mounted beside them (mcp/mount.py)."""
    return [
        (r"/api/?", AuthenticatedVersionHandler),
        (r"/api/msb/health", HealthHandler),
        (r"/?", HealthHandler),  # the root: JupyterHub's check of its services' health GETs it every minute
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
