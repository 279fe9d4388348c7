"""The gateway under JupyterHub, as a team runs it: deploy/jupyterhub/jupyterhub_config.py, two people, one gateway.

JupyterHub 6 from PyPI with configurable-http-proxy from npm (tests/hub.py), DummyAuthenticator with a shared
password, SimpleLocalProcessSpawner (``--allow-root`` as root), and the gateway as the Hub's managed service. Each
person's JupyterLab sends the gateway its own server token. Chromium logs in and runs a cell as a person does.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.hub import Hub, UserServer, launch_hub
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, LabPage, browser, screenshot_on_failure  # noqa: F401 (browser is a fixture)
from tests.skips import needs_hub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), needs_hub]

# Until the gateway checks Hub tokens: it serves under the service prefix (its config file) with one token, which
# the servers send instead of their own. Only the plumbing is shown with this.
_TOKEN = secrets.token_hex(16)
_PLUMBING = f"""
import os
_gw = c.JupyterHub.services[0]
_dir = os.path.join(os.path.dirname(c.JupyterHub.db_url.split("sqlite:///", 1)[1]), "gateway-config")
os.makedirs(_dir, exist_ok=True)
open(os.path.join(_dir, "msb_kernels_serve_config.py"), "w").write("c.MsbGatewayApp.base_url = '/services/msb-kernels/'\\n")
_gw["environment"].update(JUPYTER_CONFIG_DIR=_dir, MSB_TOKEN={_TOKEN!r}, MSB_PORT=_gw["url"].rsplit(":", 1)[1])
c.Spawner.environment["JUPYTER_GATEWAY_AUTH_TOKEN"] = {_TOKEN!r}
"""


@pytest.fixture(scope="module")
async def hub() -> AsyncIterator[Hub]:
    server = await launch_hub(extra_config=_PLUMBING)
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def alice_server(hub: Hub) -> UserServer:
    return await hub.start_server("alice")


@pytest.fixture
def driver(request: pytest.FixtureRequest, browser: Any, tmp_path: Path) -> Any:
    """The module's Chromium, for a test that leaves a screenshot when it fails."""
    screenshot_on_failure(request, browser, tmp_path)
    return browser


async def test_alice_logs_in_and_runs_a_cell_in_her_lab(hub: Hub, alice_server: UserServer, driver: Any) -> None:
    hub.login(driver, "alice")
    page = LabPage(driver, alice_server)
    page.open_lab()
    page.new_notebook(PYTHON)
    cell = page.run("x = 41; x + 1")
    assert page.wait_for_text(cell, "text/plain", "42").strip() == "42"
    # The kernel is the gateway's, in a sandbox, and Lab lists it through the gateway.
    kernels = (await alice_server.request("GET", "/api/kernels")).json
    assert len(kernels) == 1, kernels
    on_gateway = await hub.gateway("GET", f"api/kernels/{kernels[0]['id']}", token=_TOKEN)
    assert on_gateway.code == 200, (on_gateway.code, on_gateway.body)
    shown = page.wait_for_text(page.run("import os; print('sandbox:', os.environ['MSB_SANDBOX'])"), STDOUT, "sandbox:")
    assert shown.split()[1] in ("namespace", "gvisor", "microsandbox"), shown
