"""A person's notebook open in their JupyterLab under JupyterHub, in Chromium, and their assistant beside it: the MCP
Inspector CLI with a Hub token of theirs, through the Hub's proxy."""

from __future__ import annotations

from typing import Any

from tests.hub import Hub, UserServer
from tests.mcp_bridge.test_inspector import FETCH_PRELOAD, Inspector, inspector_env
from tests.msb_kernels.gateway.browser import By, LabPage


def inspector_as(hub: Hub, token: str) -> Inspector:
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN=token)
    return Inspector([hub.gateway_url + "/mcp"], env)


async def open_notebook(hub: Hub, server: UserServer, driver: Any, path: str, source: str) -> LabPage:
    """A notebook of one cell made in the person's server, open in their browser (logged in as them) with its kernel idle."""
    notebook = {
        "cells": [{"cell_type": "code", "source": source, "metadata": {}, "outputs": [], "execution_count": None}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    made = await server.request("PUT", f"/api/contents/{path}", {"type": "notebook", "content": notebook})
    assert made.code in (200, 201), (made.code, made.body)
    hub.login(driver, server.user)
    page = LabPage(driver, server)
    driver.get(f"{server.url}/lab/tree/{path}?reset")
    page.wait(lambda: page.find(".jp-NotebookPanel .jp-Cell"), "the notebook to open", 180)
    page.wait_for_kernel("idle")
    return page


def cell_texts(page: LabPage) -> list[str]:
    return [cell.find_element(By.CSS_SELECTOR, ".cm-content").text for cell in page.find(".jp-NotebookPanel .jp-Cell")]
