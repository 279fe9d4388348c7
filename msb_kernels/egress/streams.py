"""Byte streams for the egress proxy: a socket's, and TLS over another stream, both able to take back bytes read.

Why not asyncio's own TLS: the proxy reads a ClientHello before it decides whether to end the TLS itself, and
asyncio cannot start TLS over bytes already read. A MemoryBIO-driven SSLObject can: what was read goes in first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable

CHUNK = 256 * 1024  # a read: fewer, larger pieces of data cost less each through h11 and the scan of an answer
HANDSHAKE_TIMEOUT = 15.0


class Stream:
    """A connection's bytes: recv (b"" at the end), send, unread, close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._back = b""

    def unread(self, data: bytes) -> None:
        self._back = data + self._back

    async def recv(self, size: int = CHUNK) -> bytes:
        if self._back:
            data, self._back = self._back[:size], self._back[size:]
            return data
        return await self.reader.read(size)

    async def send(self, data: bytes) -> None:
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def send_eof(self) -> None:
        if self.writer.can_write_eof() and not self.writer.is_closing():
            with contextlib.suppress(OSError, RuntimeError):
                self.writer.write_eof()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class TLSStream(Stream):
    """TLS over another Stream (whose unread bytes it reads first), as server or client."""

    def __init__(self, inner: Stream, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None):
        self.inner = inner
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side, server_hostname=server_hostname)
        self._back = b""

    async def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            await self.inner.send(pending)

    async def _fill(self) -> bool:
        data = await self.inner.recv()
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def handshake(self) -> None:
        async def run() -> None:
            while True:
                try:
                    self.tls.do_handshake()
                    await self._flush()
                    return
                except ssl.SSLWantReadError:
                    await self._flush()
                    if not await self._fill():
                        raise ConnectionError("the peer closed the connection during the TLS handshake") from None

        await asyncio.wait_for(run(), HANDSHAKE_TIMEOUT)

    async def recv(self, size: int = CHUNK) -> bytes:
        if self._back:
            data, self._back = self._back[:size], self._back[size:]
            return data
        while True:
            try:
                data = self.tls.read(size)
                # What else is decrypted already, up to size: one TLS record is 16 KiB at most, and each piece of data
                # costs its way through the proxy (h11, the scan of an answer for a secret) however small it is.
                while data and len(data) < size:
                    try:
                        more = self.tls.read(size - len(data))
                    except (ssl.SSLWantReadError, ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        break
                    if not more:
                        break
                    data += more
                return data
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self.tls.write(view[:CHUNK])
            view = view[written:]
            await self._flush()

    async def send_eof(self) -> None:
        with contextlib.suppress(ssl.SSLError, OSError):
            self.tls.unwrap()
            await self._flush()

    async def close(self) -> None:
        await self.inner.close()


async def splice(one: Stream, other: Stream, count: Callable[[int, int], None] | None = None) -> None:
    """Copy both ways until both directions end (or one fails), then close both. count(0, n): n bytes went from one
    to other; count(1, n): the other way."""

    async def copy(source: Stream, target: Stream, index: int) -> None:
        try:
            while data := await source.recv():
                await target.send(data)
                if count is not None:
                    count(index, len(data))
        finally:
            await target.send_eof()

    tasks = [asyncio.ensure_future(copy(one, other, 0)), asyncio.ensure_future(copy(other, one, 1))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
    finally:
        for task in tasks:
            task.cancel()
        await one.close()
        await other.close()
