"""What an MCP client reads to learn which tokens /mcp takes (RFC 9728)."""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join


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
