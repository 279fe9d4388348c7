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
from selenium.webdriver.common.keys import Keys

from tests.hub import Hub, UserServer, launch_hub
from tests.mcp_bridge.test_inspector import FETCH_PRELOAD, Inspector, inspector_env, inspector_missing
from tests.msb_kernels.gateway.browser import STDOUT, By, LabPage, browser, screenshot_on_failure  # noqa: F401 (browser is a fixture)
from tests.msb_kernels.gateway.conftest import wait_until
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


def inspector_as(hub: Hub, token: str) -> Inspector:
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN=token)
    return Inspector([hub.gateway_url + "/mcp"], env)


async def open_her_notebook(hub: Hub, alice_server: UserServer, driver: Any, path: str, source: str) -> LabPage:
    """A notebook of one cell made in alice's server, open in her browser with its kernel idle."""
    notebook = {
        "cells": [{"cell_type": "code", "source": source, "metadata": {}, "outputs": [], "execution_count": None}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    made = await alice_server.request("PUT", f"/api/contents/{path}", {"type": "notebook", "content": notebook})
    assert made.code in (200, 201), (made.code, made.body)
    hub.login(driver, "alice")
    page = LabPage(driver, alice_server)
    driver.get(f"{alice_server.url}/lab/tree/{path}?reset")
    page.wait(lambda: page.find(".jp-NotebookPanel .jp-Cell"), "her notebook to open", 180)
    page.wait_for_kernel("idle")
    return page


def cell_texts(page: LabPage) -> list[str]:
    return [cell.find_element(By.CSS_SELECTOR, ".cm-content").text for cell in page.find(".jp-NotebookPanel .jp-Cell")]


async def test_alices_assistant_works_in_her_notebook_and_bobs_cannot(hub: Hub, alice_server: UserServer, driver: Any) -> None:
    path = f"analysis-{uuid.uuid4().hex[:6]}.ipynb"
    page = await open_her_notebook(hub, alice_server, driver, path, "")

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


async def test_after_a_hub_restart_her_open_notebook_shows_the_file_and_her_assistants_edit(
    hub: Hub, alice_server: UserServer, driver: Any
) -> None:
    """alice's notebook stays open in her browser while the Hub restarts (every Lab stops with it, and JupyterHub
    forgets the token in her tab's cookie) and comes back; her assistant adds a cell meanwhile. Her tab says its server
    went away and offers to restart it; once she accepts, it shows what the file holds, her assistant's next edit
    appears in it, and a save from it keeps every cell."""
    path = f"restart-{uuid.uuid4().hex[:6]}.ipynb"
    page = await open_her_notebook(hub, alice_server, driver, path, "print('hers')")
    alice = inspector_as(hub, hub.tokens["alice"])

    async def file_sources() -> list[str]:
        response = await alice_server.request("GET", f"/api/contents/{path}?content=1")
        assert response.code == 200, (response.code, response.body[:500])
        return [cell["source"] for cell in response.json["content"]["cells"]]

    async def insert(source: str, shown: bool = True) -> None:
        inserted = (await alice.call("insert_cell", notebook=path, source=source)).result
        assert not inserted.get("isError"), inserted
        if shown:
            await asyncio.to_thread(page.wait, lambda: source in cell_texts(page), f"{source!r} in her browser", 120)

        async def saved() -> bool:
            return source in await file_sources()

        await wait_until(saved, 60, f"{source!r} in the file")

    await insert("print('before the restart')")
    hub.stop()
    # While the Hub is down, JupyterHub's Lab extension sees her tab's polls fail to connect and offers to restart her
    # server. (Its polls run every 10 s and only a failure to connect makes the offer: a Hub back within a poll's
    # interval would leave her tab without it, so the Hub stays down until her tab has said so.)
    restart = await asyncio.to_thread(
        page.wait, lambda: [b for b in page.find(".jp-Dialog .jp-mod-accept") if b.text == "Restart"], "the offer to restart", 90
    )
    await hub.start()
    alice_server = await hub.start_server("alice")
    await insert("print('while her tab was away')", shown=False)
    # The Hub is back: she accepts the offer.
    restart[0].click()
    await asyncio.to_thread(
        page.wait, lambda: "print('while her tab was away')" in cell_texts(page), "the file's latest content in her tab", 180
    )
    assert cell_texts(page) == await file_sources(), (cell_texts(page), await file_sources())
    await insert("print('after the restart')")
    assert cell_texts(page) == await file_sources(), (cell_texts(page), await file_sources())

    # A save from her tab keeps every cell. (Her notebook's tab is the active one: a click on a cell could land on a
    # dialog instead, such as the "Kernel died unexpectedly" a run here showed for its kernel after the restart.)
    driver.find_element(By.CSS_SELECTOR, "body").send_keys(Keys.CONTROL, "s")
    await asyncio.sleep(3)
    expected = ["print('hers')", "print('before the restart')", "print('while her tab was away')", "print('after the restart')"]
    assert sorted(await file_sources()) == sorted(expected) and cell_texts(page) == await file_sources(), await file_sources()
