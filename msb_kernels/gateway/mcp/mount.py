"""Mount the MCP bridge's streamable-HTTP app at /mcp, on the gateway's own kernels.

MCP sessions are the kernels JupyterLab sees, under the same limits and culling:
``ManagedKernelSessions`` wraps the gateway's kernel and session managers. The bridge ships
in the same wheel, so a failure to build it is a failure to start the gateway, not a
gateway quietly missing /mcp.
"""

from __future__ import annotations

from typing import Any

from mcp_bridge.auth import PersonVerifier
from mcp_bridge.http import McpHttpApp
from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.notebooks.hub import PersonalLabs
from msb_kernels.gateway.mcp.asgi import AsgiLifespan, asgi_route

MCP_PATH = "/mcp"


def mount_mcp(server_app: Any) -> AsgiLifespan:
    """Add /mcp to the server's web app; return its lifespan for the app to start and stop.

    Called by ``GatewayApp.initialize_handlers``, once the kernel and session managers exist.
    """
    host = server_app.ip or "127.0.0.1"
    port = server_app.port
    hosts = sorted({host, "127.0.0.1", "localhost", f"{host}:{port}", f"127.0.0.1:{port}", f"localhost:{port}"})
    origins = sorted({f"http://{h}" for h in hosts if ":" in h})
    sessions = ManagedKernelSessions(server_app.kernel_manager, session_manager=server_app.session_manager)
    # Reached by whatever names its network gives it, or (a Hub service) by the Hub's public name through its proxy:
    # no Host list can hold them. Every call carries its token in a header all the same.
    hub = getattr(server_app, "hub_service", None)
    everywhere = host in ("0.0.0.0", "::", "") or hub is not None
    # The gateway's one IdentityProvider decides who each /mcp request is, as it does for every other route.
    app = McpHttpApp(
        sessions,
        PersonVerifier(server_app.identity_provider.person_for),
        allowed_hosts=None if everywhere else hosts,
        allowed_origins=origins,
        resource_metadata_path=server_app.base_url.rstrip("/") + "/.well-known/oauth-protected-resource/mcp",
        # Under JupyterHub, each person's notebook tools act in their own server (mcp_bridge.notebooks.hub).
        personal_labs=PersonalLabs(hub.proxy_origin(server_app.msb_settings.hub_proxy_url)) if hub is not None else None,
    )
    server_app.web_app.add_handlers(
        ".*$", [(server_app.base_url.rstrip("/") + pattern, handler, kwargs) for pattern, handler, kwargs in asgi_route(MCP_PATH, app)]
    )
    server_app.kernel_manager.mcp_sizes = app.sizes
    server_app.log.info("MCP streamable HTTP at %s%s", server_app.connection_url.rstrip("/").split("?")[0], MCP_PATH)
    return AsgiLifespan(app)
