"""The kernel WebSocket: jupyter_server's connection and handler, with a ZMQ identity per socket, TCP_NODELAY, a wake
of a hibernated kernel before its first message, each execute_request in the audit trail, and no timer that holds a
closed socket; and, on the kernel manager, the buffer jupyter_server keeps for a notebook client whose WebSocket
closed, held to MSB_OFFLINE_BUFFER_MIB."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_client.session import json_packer
from jupyter_server.services.kernels.connection.base import (
    deserialize_binary_message,
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler
from tornado.ioloop import IOLoop

from msb_kernels.gateway.http_errors import MsbErrorsMixin
from msb_kernels.identity.people import Person, acting, acting_as, acting_client
from msb_kernels.jupyter.compat import captured_ports_of, connection_counts_of, dropped_give_up_timer, offline_buffers_of, stop_ping
from msb_kernels.observability import audit


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


class ClosedClientBuffersMixin:
    """MsbKernelManager's side of the WebSocket: the buffer a closed notebook client's messages wait in, bounded."""

    def start_buffering(self, kernel_id: str, session_key: str, channels: dict) -> None:
        """jupyter_server's buffer for a notebook client whose WebSocket closed, held to MSB_OFFLINE_BUFFER_MIB.

        Called by jupyter_server's WebSocket connection when a client that named a session goes
        away. Its buffer has no bound: while an assistant keeps running code on a kernel its
        notebook user left, every output would stay in the gateway's memory. Past the bound the
        buffer is dropped, and the client reconnects without a replay, as if it had none.
        """
        limit = self.msb_settings.offline_buffer_mib * 1024 * 1024
        if limit == 0:
            for stream in channels.values():
                stream.close()
            return
        super().start_buffering(kernel_id, session_key, channels)
        held = offline_buffers_of(self).get(kernel_id)
        if not held or held.get("channels") is not channels:
            return  # jupyter_server's own buffer_offline_messages=False: nothing is kept
        size = 0

        def keep(channel: str, frames: list) -> None:
            nonlocal size
            if held.get("dropped"):
                return
            size += sum(len(frame) for frame in frames)
            if size <= limit:
                held["buffer"].append((channel, frames))
                return
            held["dropped"] = True
            self.log.warning(
                "kernel %s: dropped the %d messages kept for a closed WebSocket (session %s): they passed "
                "MSB_OFFLINE_BUFFER_MIB=%d; the client reconnects without them",
                kernel_id,
                len(held["buffer"]),
                session_key,
                self.msb_settings.offline_buffer_mib,
            )
            held["buffer"].clear()
            # Closed from the loop, not from inside this stream's own callback; a client that reconnected
            # since then has buffering of its own, which must stay.
            IOLoop.current().add_callback(self._stop_dropped_buffering, kernel_id, held)

        for channel, stream in channels.items():
            stream.on_recv(functools.partial(keep, channel))

    def websocket_sizes(self) -> dict[str, int]:
        """The offline buffers' entries and the connections counted per kernel (retained_sizes)."""
        buffers = offline_buffers_of(self)
        return {
            "offline_buffers": len(buffers),
            "offline_buffered_messages": sum(len(held.get("buffer", ())) for held in list(buffers.values())),
            "kernel_connections": len(connection_counts_of(self)),
            "kernel_ports": len(captured_ports_of(self)),
        }

    def _stop_dropped_buffering(self, kernel_id: str, held: dict) -> None:
        if offline_buffers_of(self).get(kernel_id) is held:
            self.stop_buffering(kernel_id)
