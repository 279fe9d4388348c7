"""Each person's assistant in their own notebook, under JupyterHub (mcp_bridge/notebooks/hub.py).

One Hub (tests/hub.py, the shipped deploy config), alice's JupyterLab open in Chromium. The MCP Inspector CLI
(TypeScript SDK) with alice's own Hub token, through the Hub's proxy, inserts a cell into the notebook she has
open and runs it: her browser shows both. With bob's token, the same calls cannot read or write her notebook, and
her notebook is as she left it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.hub import Hub, UserServer, launch_hub
from tests.mcp_bridge.notebooks.hub_tab import cell_texts, inspector_as, open_notebook
from tests.mcp_bridge.test_inspector import inspector_missing
from tests.msb_kernels.gateway.browser import STDOUT, By, LabPage, browser, screenshot_on_failure  # noqa: F401 (browser is a fixture)
from tests.skips import needs_hub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    needs_hub,
    pytest.mark.skipif(inspector_missing() is not None, reason=str(inspector_missing())),
]


@pytest.fixture(scope="module")
async def hub() -> AsyncIterator[Hub]:
    server = await launch_hub(users=("alice", "bob"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def alice_server(hub: Hub) -> UserServer:
    return await hub.start_server("alice")


@pytest.fixture
def driver(request: pytest.FixtureRequest, browser: Any, tmp_path: Path) -> Any:
    screenshot_on_failure(request, browser, tmp_path)
    return browser


async def test_alices_assistant_works_in_her_notebook_and_bobs_cannot(hub: Hub, alice_server: UserServer, driver: Any) -> None:
    path = f"analysis-{uuid.uuid4().hex[:6]}.ipynb"
    page = await open_notebook(hub, alice_server, driver, path, "")

    alice = inspector_as(hub, hub.tokens["alice"])
    inserted = (await alice.call("insert_cell", notebook=path, source="shared = 6 * 7; print('assistant says', shared)")).result
    assert not inserted.get("isError"), inserted
    cell = inserted["structuredContent"]["cells"][0]
    await asyncio.to_thread(page.wait, lambda: "assistant says" in "".join(cell_texts(page)), "the assistant's cell in her browser", 60)
    ran = (await alice.call("execute_cell", notebook=path, cell_id=cell["id"])).result
    assert ran["structuredContent"]["status"] in ("ok", "running"), ran
    element = page.find(".jp-NotebookPanel .jp-Cell")[cell["index"]]
    await asyncio.to_thread(page.wait_for_text, element, STDOUT, "assistant says 42", 120)

    bob_token = await hub.token_for("bob")
    bob = inspector_as(hub, bob_token)
    for tool, arguments in (
        ("read_notebook", {"notebook": path}),
        ("insert_cell", {"notebook": path, "source": "print('bob was here')"}),
        ("execute_cell", {"notebook": path, "cell_id": cell["id"]}),
    ):
        refused = (await bob.call(tool, **arguments)).result
        assert refused.get("isError") is True, (tool, refused)
        text = json.dumps(refused)
        assert "assistant says" not in text and "/user/alice" not in text, (tool, text[:800])
    # Her notebook is as her assistant left it: bob's insert reached nothing of hers.
    assert not [t for t in cell_texts(page) if "bob was here" in t]
    read = (await alice.call("read_notebook", notebook=path)).result["structuredContent"]
    assert [c["source"] for c in read["cells"] if "bob" in c["source"]] == [], read


async def test_the_notebook_tools_never_connect_where_a_request_header_points(hub: Hub, alice_server: UserServer) -> None:
    """The gateway finds alice's Lab from configuration (the shipped config's MSB_HUB_PROXY_URL), never from the
    request: a call that names another host in X-Forwarded-Host (or Host) reaches her own Lab, and nothing connects to
    the host it named."""
    connections: list[Any] = []
    trap = await asyncio.start_server(lambda reader, writer: (connections.append(writer), writer.close()), "127.0.0.1", 0)
    named = f"127.0.0.1:{trap.sockets[0].getsockname()[1]}"
    try:
        headers = {"X-Forwarded-Host": named, "X-Forwarded-Proto": "http", "X-Forwarded-For": "127.0.0.1"}
        async with hub.mcp(hub.tokens["alice"], direct=True, headers=headers) as alice:
            listed = await alice.call_tool("list_notebooks", {})
        assert not listed.is_error, listed.structured_content
    finally:
        trap.close()
    assert connections == [], f"the gateway connected to {named}, a host a request header named"


def test_without_a_configured_proxy_the_notebook_tools_name_the_missing_setting() -> None:
    """No MSB_HUB_PROXY_URL and no JupyterHub public_url: the tools say which setting is missing (whatever the
    request says of its host)."""
    from mcp_bridge.notebooks.hub import PersonalLabs
    from msb_kernels.errors import InvalidRequest
    from msb_kernels.identity.people import Person

    with pytest.raises(InvalidRequest, match="MSB_HUB_PROXY_URL is unset") as refused:
        PersonalLabs(None).documents(Person("alice", source="hub"), "a-token")
    assert "c.JupyterHub.public_url" in " ".join(refused.value.suggestions)
