"""Jupyter messages over a kernel's ``/api/kernels/<id>/channels`` WebSocket, as JupyterLab sends them.

Each frame is one JSON message with a ``channel`` key (jupyter_server's default protocol,
not v1.kernel.websocket.jupyter.org). Used by the bridge's gateway sessions
(mcp_bridge.gateway_sessions), the gateway tests (tests/msb_kernels/gateway/conftest.py)
and the benchmark (bench/servers.py), so that all three speak it the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from msb_kernels.observability.status import iso_utc

PROTOCOL_VERSION = "5.3"
# Large enough for a figure or a big stream; tornado's default (10 MiB) closes the socket on one.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def channels_url(base_url: str, kernel_id: str, client_session: str) -> str:
    """The channels WebSocket of ``kernel_id`` on the server at ``base_url`` (http(s):// or ws(s)://)."""
    if base_url.startswith("https://"):
        base_url = "wss://" + base_url[len("https://") :]
    elif base_url.startswith("http://"):
        base_url = "ws://" + base_url[len("http://") :]
    return f"{base_url.rstrip('/')}/api/kernels/{kernel_id}/channels?session_id={client_session}"


async def connect(url: str, token: str | None, timeout: float) -> Any:
    """Open the WebSocket at ``url`` (a tornado WebSocketClientConnection), with ``token`` when given."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    headers = {"Authorization": f"token {token}"} if token else {}
    request = HTTPRequest(url, headers=headers, connect_timeout=timeout, request_timeout=timeout)
    return await asyncio.wait_for(websocket_connect(request, max_message_size=MAX_MESSAGE_BYTES), timeout)


def message(channel: str, msg_type: str, content: dict, *, session: str, username: str) -> dict:
    """A new request for ``channel`` (shell, control, stdin); its id is ``message["header"]["msg_id"]``."""
    header = {
        "msg_id": uuid.uuid4().hex,
        "msg_type": msg_type,
        "username": username,
        "session": session,
        "date": iso_utc(time.time()),
        "version": PROTOCOL_VERSION,
    }
    return {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": channel, "buffers": []}


def encode(request: dict) -> str:
    return json.dumps(request)


def parse(raw: str | bytes | None) -> dict | None:
    """One received frame as a message with ``msg_type`` and ``channel`` at the top; None for a frame that is not one.

    Binary frames carry buffers, which none of the readers needs.
    """
    if raw is None or isinstance(raw, bytes):
        return None
    try:
        received = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(received, dict) or not isinstance(received.get("header"), dict):
        return None
    received.setdefault("msg_type", received["header"].get("msg_type"))
    received.setdefault("channel", "iopub")
    return received


def parent_id(received: dict) -> str | None:
    """The msg_id of the request ``received`` answers, if any."""
    return (received.get("parent_header") or {}).get("msg_id")


def execute_content(code: str, *, silent: bool = False, store_history: bool = True, stop_on_error: bool = True) -> dict:
    """The content of an execute_request (no user_expressions, no stdin)."""
    return {
        "code": code,
        "silent": silent,
        "store_history": store_history,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": stop_on_error,
    }
