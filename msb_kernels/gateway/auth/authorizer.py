"""What a person may do, on every route of the gateway: jupyter_server's Authorizer hook, and where the rest is.

Two checks, each in one place:

- which kernels are the caller's: the kernel manager's lookup (kernels/manager.py, ``MsbKernelManager.visible``, which
  ``in``, ``get_kernel`` and ``list_kernel_ids`` go through): a kernel that is not the caller's does not exist for
  them, on every route, REST, the WebSocket, /api/sessions and /mcp;
- which routes are for admins only: this Authorizer. /metrics names every person, and /api/status counts everyone's
  kernels.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.authorizer import Authorizer
from tornado import web

ADMIN_RESOURCES = ("metrics", "status")  # /metrics names every person and kernel; /api/status counts everyone's


class MsbAuthorizer(Authorizer):
    """Every person may use the kernel routes (the kernel manager decides which kernels are theirs); /metrics and
    /api/status, which speak of everyone's kernels, are for admins."""

    def is_authorized(self, handler: web.RequestHandler, user: Any, action: str, resource: str) -> bool:
        if resource in ADMIN_RESOURCES:
            person = getattr(user, "person", None)
            return person is not None and person.admin
        return True
