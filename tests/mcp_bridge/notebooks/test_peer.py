"""jupyter-mcp-server 2.2.4, unchanged and with its default settings, against JupyterLab on our gateway.

It starts its kernels as `python3`, as most notebooks from elsewhere name theirs; the gateway must give it
a sandboxed kernel of the default flavor (the conventional names), so its cells run in the sandbox.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from tests.mcp_bridge.notebooks.conftest import call, mcp_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PEER = Path(sys.prefix) / "share" / "msb-kernels" / "peers" / "jupyter-mcp-server" / "bin" / "jupyter-mcp-server"


def peer_server(lab) -> StdioServerParameters:
    if not PEER.exists():
        pytest.skip(f"jupyter-mcp-server 2.2.4 is not installed at {PEER}; `bash scripts/test` installs it (pip)")
    env = {**os.environ, "JUPYTER_URL": lab.url, "JUPYTER_TOKEN": lab.token}
    return StdioServerParameters(command=str(PEER), args=[], env=env)


async def test_jupyter_mcp_server_runs_its_cells_in_our_sandbox(lab, notebook_gateway):
    path = f"work/peer-{uuid.uuid4().hex[:6]}.ipynb"
    async with Client(peer_server(lab)) as peer:
        used = await peer.call_tool("use_notebook", {"notebook_name": "peer", "notebook_path": path, "mode": "create"})
        assert not used.is_error, used.content[0].text
        ran = await peer.call_tool(
            "insert_execute_code_cell",
            {"cell_index": -1, "cell_source": "import os; print('uid', os.getuid(), 'home', os.path.expanduser('~'))"},
        )
        text = "\n".join(getattr(part, "text", "") for part in ran.content)
        assert not ran.is_error and "uid 1000 home /home/sandbox" in text, text
        read = await peer.call_tool("read_notebook", {"notebook_name": "peer"})
        assert "import os; print('uid'" in "\n".join(getattr(part, "text", "") for part in read.content)

    # The kernel it got is one of the gateway's sandboxed kernels, the default flavor's, reported by the name it asked
    # for (which it saves); our tools see its cell.
    sessions = [s for s in (await lab.request("GET", "/api/sessions")).json if s["path"] == path]
    assert sessions and sessions[0]["kernel"]["name"] == "python3", sessions
    stats = await notebook_gateway.stats()
    assert [k["kernel_name"] for k in stats["kernels"] if k["id"] == sessions[0]["kernel"]["id"]] == ["msb-python-small"], stats
    async with mcp_client(notebook_gateway) as assistant:
        cells = (await call(assistant, "read_notebook", notebook=path))["cells"]
        assert any("uid 1000 home /home/sandbox" in (cell["outputs"] or "") for cell in cells), cells
