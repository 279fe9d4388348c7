"""jupyter_server's sessions (``/api/sessions``), seen through the kernel manager's ownership.

jupyter_server takes a session whose kernel is not ``in`` the kernel manager for culled, and deletes its row. With
ownership, another person's kernel is not ``in`` it for the caller either: their session must be skipped, not
deleted, and answered as if it did not exist.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.services.sessions.sessionmanager import SessionManager
from tornado import web

from msb_kernels.identity.people import acting_as


class MsbSessionManager(SessionManager):
    async def kernel_culled(self, kernel_id: str) -> bool:
        with acting_as(None):  # gone for everyone, not merely another person's
            return kernel_id not in self.kernel_manager

    async def row_to_model(self, row: Any, tolerate_culled: bool = False) -> dict | None:
        if not await self.kernel_culled(row["kernel_id"]) and row["kernel_id"] not in self.kernel_manager:
            if tolerate_culled:
                return None
            raise KeyError("no such session")  # list_sessions skips it; get_session answers 404
        return await super().row_to_model(row, tolerate_culled)

    async def get_session(self, **kwargs: Any) -> dict:
        try:
            return await super().get_session(**kwargs)
        except KeyError:
            raise web.HTTPError(404, "Session not found: " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())) from None
