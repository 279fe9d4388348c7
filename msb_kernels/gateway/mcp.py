"""Mount the MCP bridge's streamable-HTTP app at /mcp, on the gateway's own kernels.

The contract with mcp_bridge:

- ``mcp_bridge.sessions.ManagedKernelSessions(kernel_manager, session_manager=None)`` wraps
  jupyter_server's kernel manager (here: the gateway's MsbKernelManager), so MCP sessions
  are the same kernels that JupyterLab sees, under the same limits and culling;
- ``mcp_bridge.http.asgi_app(sessions, token, allowed_hosts, allowed_origins)`` returns an
  ASGI app that serves streamable HTTP at its root path.

Where mcp_bridge.http is missing or fails to load, the gateway runs without /mcp and logs why.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from msb_kernels.gateway.asgi import AsgiLifespan, asgi_route

log = logging.getLogger("msb_kernels")

MCP_PATH = "/mcp"


def load_mcp_app(kernel_manager: Any, session_manager: Any, token: str, allowed_hosts: list[str],
                 allowed_origins: list[str]) -> tuple[Any | None, str]:
    """The MCP bridge's ASGI app, or None and the reason it is not there."""
    try:
        http = importlib.import_module("mcp_bridge.http")
        sessions_module = importlib.import_module("mcp_bridge.sessions")
    except ImportError as exc:
        return None, f"mcp_bridge.http is not available ({exc})"
    factory = getattr(http, "asgi_app", None)
    sessions_class = getattr(sessions_module, "ManagedKernelSessions", None)
    if factory is None or sessions_class is None:
        return None, "mcp_bridge has no http.asgi_app or sessions.ManagedKernelSessions"
    try:
        sessions = sessions_class(kernel_manager, session_manager=session_manager)
        app = factory(sessions, token=token, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
    except Exception as exc:  # the gateway still serves Jupyter clients without the bridge
        log.warning("MCP bridge failed to start: %s", exc, exc_info=True)
        return None, f"mcp_bridge failed to start: {type(exc).__name__}: {exc}"
    return app, "ok"


def mount_mcp(server_app: Any) -> AsgiLifespan | None:
    """Add /mcp to the server's web app when the bridge is there; return its lifespan to start and stop."""
    host = server_app.ip or "127.0.0.1"
    port = server_app.port
    hosts = sorted({host, "127.0.0.1", "localhost", f"{host}:{port}", f"127.0.0.1:{port}", f"localhost:{port}"})
    origins = sorted({f"http://{h}" for h in hosts if ":" in h})
    app, why = load_mcp_app(server_app.kernel_manager, server_app.session_manager, server_app.identity_provider.token,
                            hosts, origins)
    if app is None:
        server_app.log.info("MCP endpoint not mounted: %s", why)
        server_app.mcp_status = why
        return None
    server_app.web_app.add_handlers(".*$", [(server_app.base_url.rstrip("/") + pattern, handler, kwargs)
                                            for pattern, handler, kwargs in asgi_route(MCP_PATH, app)])
    server_app.mcp_status = "ok"
    server_app.log.info("MCP streamable HTTP at %s%s", server_app.connection_url.rstrip("/").split("?")[0], MCP_PATH)
    return AsgiLifespan(app)
