"""The Jupyter-over-WebSocket format that the bridge, the gateway tests and the bench share.

The round trip through a real gateway is in tests/msb_kernels/gateway (KernelSocket) and
tests/mcp_bridge/test_transports.py (the bridge's gateway sessions); these pin the edges.
"""

from __future__ import annotations

import json

from mcp_bridge import jupyter_ws
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_channels_url_follows_the_scheme_of_the_server():
    assert jupyter_ws.channels_url("http://127.0.0.1:8888/", "k1", "s1") == "ws://127.0.0.1:8888/api/kernels/k1/channels?session_id=s1"
    assert jupyter_ws.channels_url("https://lab.example/base", "k1", "s1") == "wss://lab.example/base/api/kernels/k1/channels?session_id=s1"


def test_a_request_carries_its_channel_and_a_fresh_id():
    first = jupyter_ws.message("shell", "execute_request", jupyter_ws.execute_content("1+1"), session="s", username="u")
    second = jupyter_ws.message("shell", "execute_request", {}, session="s", username="u")
    assert first["channel"] == "shell" and first["header"]["msg_type"] == "execute_request"
    assert first["header"]["msg_id"] != second["header"]["msg_id"]
    assert first["header"]["date"].endswith("Z")
    assert json.loads(jupyter_ws.encode(first)) == first


def test_parse_gives_msg_type_and_channel_and_skips_what_is_not_a_message():
    reply = {"header": {"msg_type": "status", "msg_id": "x"}, "parent_header": {"msg_id": "p"}, "content": {}}
    parsed = jupyter_ws.parse(json.dumps(reply))
    assert (parsed["msg_type"], parsed["channel"], jupyter_ws.parent_id(parsed)) == ("status", "iopub", "p")
    assert jupyter_ws.parse(b"\x00binary buffers") is None
    assert jupyter_ws.parse("not json") is None
    assert jupyter_ws.parse(None) is None
