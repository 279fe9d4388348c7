"""jupyter_server's sessions (``/api/sessions``), per person: each person's sessions are theirs alone.

jupyter_server keeps one table of sessions (a notebook's path, its kernel) for the whole server, and finds a session by
path with the first row that has it. With people, two of them may have the same path open (``Untitled.ipynb``): each
keeps one kernel for it, and a lookup by path, id or kernel finds the caller's own row, never another person's. A row
is the caller's where its kernel is (the kernel manager's lookup, the one ownership check); another person's row is
skipped, never deleted, and answered as if it did not exist.

A session's kernel is started for its notebook's path alone: never with this server's environment, which jupyter_server
would hand to it (``get_kernel_env``), nor a working directory on this host.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.services.sessions.sessionmanager import SessionManager
from tornado import web

from msb_kernels.identity.people import SYSTEM, acting_as
from msb_kernels.jupyter.compat import kernels_of
from msb_kernels.provisioning.start_request import NOTEBOOK, START_REQUEST, StartRequest

COLUMNS = ("session_id", "path", "name", "type", "kernel_id")  # jupyter_server's session table


class MsbSessionManager(SessionManager):
    async def kernel_culled(self, kernel_id: str) -> bool:
        with acting_as(SYSTEM):  # gone for everyone, not merely another person's
            return kernel_id not in self.kernel_manager

    async def row_to_model(self, row: Any, tolerate_culled: bool = False) -> dict | None:
        if not await self.kernel_culled(row["kernel_id"]) and row["kernel_id"] not in self.kernel_manager:
            if tolerate_culled:
                return None
            raise KeyError("no such session")  # list_sessions skips it; get_session answers 404
        return await super().row_to_model(row, tolerate_culled)

    async def list_sessions(self) -> list[dict]:
        """jupyter_server's, at the cost of the caller's own rows: another person's row is skipped by its kernel id
        alone, where jupyter_server's builds each row's model (and this class refused it) for every person's session
        on the gateway. Rows whose kernel is gone for everyone are deleted, as jupyter_server's listing deletes them."""
        everyone = kernels_of(self.kernel_manager)
        mine = set(self.kernel_manager.list_kernel_ids())
        models = []
        for row in self.cursor.execute("SELECT * FROM session").fetchall():  # all fetched: rows may be deleted below
            if row["kernel_id"] in mine:
                try:
                    models.append(await self.row_to_model(row))
                except KeyError:  # gone while this listed
                    pass
            elif row["kernel_id"] not in everyone:
                self.cursor.execute("DELETE FROM session WHERE session_id=?", (row["session_id"],))
        return models

    async def _caller_row(self, **kwargs: Any) -> Any:
        """The first session row matching kwargs whose kernel is the caller's (rows of culled kernels go, as
        jupyter_server's own lookups delete them); None where the caller has none."""
        unknown = [column for column in kwargs if column not in COLUMNS]
        if not kwargs or unknown:
            raise TypeError(f"sessions are looked up by {', '.join(COLUMNS)}, not {', '.join(unknown) or 'nothing'}")
        query = "SELECT * FROM session WHERE " + " AND ".join(f"{column}=?" for column in kwargs)  # column names checked above
        for row in self.cursor.execute(query, list(kwargs.values())).fetchall():
            if await self.kernel_culled(row["kernel_id"]):
                self.cursor.execute("DELETE FROM session WHERE session_id=?", (row["session_id"],))
            elif row["kernel_id"] in self.kernel_manager:
                return row
        return None

    async def session_exists(self, path: str) -> bool:
        return await self._caller_row(path=path) is not None

    async def get_session(self, **kwargs: Any) -> dict:
        row = await self._caller_row(**kwargs)
        if row is None:
            raise web.HTTPError(404, "Session not found: " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))
        try:
            return await self.row_to_model(row)
        except KeyError:
            raise web.HTTPError(404, "Session not found: " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())) from None

    def get_kernel_env(self, path: str | None, name: Any = None) -> dict[str, str]:
        """What a rename tells the kernel manager (update_env): the notebook's path, and nothing of this process's."""
        return {NOTEBOOK: path} if path else {}

    async def start_kernel_for_session(
        self, session_id: str, path: str | None, name: Any, type: str | None, kernel_name: str | None, kernel_id: str | None = None
    ) -> str:
        """A session's kernel, for its notebook's path: the kernel manager adds the caller's owner and volume."""
        request = StartRequest(notebook_path=path or None)
        return await self.kernel_manager.start_kernel(kernel_name=kernel_name, kernel_id=kernel_id, **{START_REQUEST: request})
