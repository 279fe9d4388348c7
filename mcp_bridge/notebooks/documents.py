"""Notebooks as live Y documents: one connection per notebook to its JupyterLab collaboration room.

The bridge joins the room as one more collaborator (pycrdt's Provider over a WebSocket), so
every change it makes is a Y update the person's browser applies as it arrives, and every
keystroke of the person's is in the bridge's copy before its next read: nothing is read from
disk. A connection stays open while the bridge runs; a dropped one is opened again, with a
fresh document, on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from jupyter_ydoc import YNotebook
from pycrdt import Provider
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from mcp_bridge.notebooks.lab import LabServer, Room
from msb_kernels.errors import SandboxError

log = logging.getLogger("mcp_bridge.notebooks")

SYNC_TIMEOUT_SECONDS = 30.0


class RoomChannel:
    """pycrdt's Channel over a websockets connection; the end of the stream marks the notebook closed."""

    def __init__(self, websocket: ClientConnection, path: str, closed: asyncio.Event):
        self.websocket = websocket
        self._path = path
        self.closed = closed

    @property
    def path(self) -> str:
        return self._path

    def __aiter__(self) -> RoomChannel:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.recv()
        except (WebSocketException, OSError):
            self.closed.set()
            raise StopAsyncIteration from None

    async def send(self, message: bytes) -> None:
        with contextlib.suppress(WebSocketException, OSError):
            await self.websocket.send(message)

    async def recv(self) -> bytes:
        while True:
            message = await self.websocket.recv()
            if isinstance(message, bytes):  # awareness and sync messages are binary; nothing else is sent
                return message


class LiveNotebook:
    """One notebook's Y document, kept in step with its room for as long as the connection lasts."""

    def __init__(self, path: str, room: Room):
        self.path = path
        self.room = room
        self.model = YNotebook()
        self.closed = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def live(self) -> bool:
        return self.task is not None and not self.task.done() and not self.closed.is_set()

    async def open(self, url: str, headers: dict[str, str] | None = None) -> None:
        synced = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._run(url, synced, headers or {}))
        try:
            await asyncio.wait_for(asyncio.shield(synced), SYNC_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            await self.close()
            raise SandboxError(
                f"JupyterLab did not send notebook {self.path} within {SYNC_TIMEOUT_SECONDS:g} s", ["try again; check JupyterLab's log"]
            ) from None
        except BaseException:
            await self.close()
            raise

    async def _run(self, url: str, synced: asyncio.Future, headers: dict[str, str]) -> None:
        try:
            async with connect(url, max_size=None, open_timeout=SYNC_TIMEOUT_SECONDS, additional_headers=headers) as websocket:
                channel = RoomChannel(websocket, self.room.room_id, self.closed)
                async with Provider(self.model.ydoc, channel, log=log) as provider:
                    await provider.synced.wait()
                    if not synced.done():
                        synced.set_result(None)
                    await self.closed.wait()
        except Exception as exc:
            if not synced.done():
                synced.set_exception(SandboxError(f"cannot join the collaboration room of {self.path}: {type(exc).__name__}: {exc}"))
            else:
                log.warning("the connection to notebook %s ended: %r", self.path, exc)
        finally:
            self.closed.set()

    async def close(self) -> None:
        self.closed.set()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


class NotebookDocuments:
    """The notebooks this bridge has joined, by path; one live document each."""

    def __init__(self, lab: LabServer):
        self.lab = lab
        self.notebooks: dict[str, LiveNotebook] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    async def get(self, path: str) -> LiveNotebook:
        async with self.locks.setdefault(path, asyncio.Lock()):
            notebook = self.notebooks.get(path)
            if notebook is not None and notebook.live:
                return notebook
            room = await self.lab.room(path)
            notebook = LiveNotebook(path, room)
            await notebook.open(self.lab.room_url(room), self.lab.room_headers())
            self.notebooks[path] = notebook
            return notebook

    async def close(self) -> None:
        for notebook in list(self.notebooks.values()):
            await notebook.close()
        self.notebooks.clear()
        await self.lab.close()
