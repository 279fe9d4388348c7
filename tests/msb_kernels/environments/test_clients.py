"""An environment's kernels from the clients people and assistants use: JupyterLab in headless Chromium picks the
environment's kernelspec from the launcher, and the MCP Inspector CLI (the TypeScript SDK) starts a session in it,
both over one gateway that reads the test's environments (MSB_ENVIRONMENTS_DIR; its kernelspecs on JUPYTER_PATH).

This file sorts before test_kernels.py on purpose: that module's last tests remove the session's `probe` environment.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest

from tests.mcp_bridge.test_inspector import Inspector, gateway_inspector, inspector_missing
from tests.msb_kernels.environments.wheels import PROBE_VALUE
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, LabPage, browser, page  # noqa: F401 (browser and page are fixtures)
from tests.msb_kernels.gateway.conftest import Gateway, HttpServer, launch_gateway, launch_jupyter_server
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROBE = "Python 3 (probe, sandbox, small)"
# One line each (Lab's editor would indent a block): where the kernel runs, and whether it finds the package.
WHERE = "import sys, importlib.util as u; print('exe', sys.executable, 'spec', u.find_spec('msbenvprobe') is not None)"


@pytest.fixture(scope="module")
async def gateway(probe_env) -> AsyncIterator[Gateway]:
    server = await launch_gateway(extra_env={"MSB_ENVIRONMENTS_DIR": str(probe_env.directory)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def lab(gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(gateway, app="lab")
    yield server
    server.stop()


def test_the_launcher_shows_the_environment_beside_the_default(page: LabPage) -> None:
    for category in ("Notebook", "Console"):
        titles = page.launcher_titles(category)
        assert PROBE in titles and PYTHON in titles, titles


def test_lab_picks_the_environments_kernel_from_the_launcher_and_a_cell_imports_its_package(page: LabPage, probe_env) -> None:
    page.new_notebook(PROBE)
    cell = page.run("import msbenvprobe; print('value', msbenvprobe.VALUE)")
    assert page.wait_for_text(cell, STDOUT, PROBE_VALUE).strip() == f"value {PROBE_VALUE}"
    cell = page.run(WHERE)
    python = probe_env.directory / "probe" / "bin" / "python"
    assert page.wait_for_text(cell, STDOUT, "spec").strip() == f"exe {python} spec True"


def test_the_default_kernel_in_lab_cannot_import_the_environments_package(page: LabPage) -> None:
    page.new_notebook(PYTHON)
    cell = page.run(WHERE)
    assert page.wait_for_text(cell, STDOUT, "spec").strip() == f"exe {sys.executable} spec False"


@pytest.fixture(scope="module")
async def gvisor_gateway(probe_env) -> AsyncIterator[Gateway]:
    server = await launch_gateway(extra_env={"MSB_ENVIRONMENTS_DIR": str(probe_env.directory), "MSB_BACKEND": "gvisor"})
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["namespace", pytest.param("gvisor", marks=needs_runsc)])
def inspector(request, tmp_path_factory) -> Inspector:
    """The Inspector on a gateway of each backend that runs environments by path (Swarm's image: test_kernels.py)."""
    if inspector_missing():
        pytest.skip(inspector_missing())
    gateway = request.getfixturevalue("gateway" if request.param == "namespace" else "gvisor_gateway")
    return gateway_inspector(gateway, tmp_path_factory.mktemp(f"inspector-{request.param}"))


async def test_the_inspector_lists_starts_and_imports_from_an_environment(inspector: Inspector) -> None:
    listed = (await inspector.call("list_environments")).structured["environments"]
    environments = {e["name"]: e for e in listed}
    assert set(environments) == {"default", "probe"} and environments["default"]["default"], environments
    assert "msbenvprobe 1.0" in environments["probe"]["packages"], environments["probe"]

    started = (await inspector.call("start_session", environment="probe")).structured
    (session,) = started["sessions"]
    assert session["environment"] == "probe" and session["kernel_name"] == "msb-probe-python-small", session
    ran = await inspector.call("execute_code", code="import msbenvprobe\nprint(msbenvprobe.VALUE)", session_id=session["id"])
    assert ran.structured["stdout"].strip() == PROBE_VALUE, ran.result
    default = await inspector.call("execute_code", code="import msbenvprobe")
    assert "No module named 'msbenvprobe'" in default.result["content"][0]["text"], default.result
    for sid in (session["id"], default.structured["session_id"]):
        await inspector.call("stop_session", session_id=sid)

    error = (await inspector.call("start_session", environment="nope")).error
    assert error["type"] == "InvalidRequest" and "'nope'" in error["message"] and "use one of default, probe" in error["message"], error
