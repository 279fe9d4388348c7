"""JupyterLab in headless Chromium against `msb-kernels serve`: what a notebook user does, click by click.

`jupyter lab --gateway-url` runs as the README tells users to run it; Debian's chromium, driven by
selenium, clicks the launcher, types into cells and reads what Lab renders. Every wait is on a DOM
condition with a generous timeout: the test machine is small and shared. A failing test leaves a
screenshot; its path is in the failure's "browser screenshot" section.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.msb_kernels.gateway.browser import (  # noqa: F401 (browser and page are fixtures)
    KERNEL_TIMEOUT,
    NODE,
    PYTHON,
    STDERR,
    STDOUT,
    By,
    Keys,
    LabPage,
    browser,
    page,
)
from tests.msb_kernels.gateway.conftest import Gateway, HttpServer, launch_jupyter_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
async def lab(gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(gateway, app="lab")
    yield server
    server.stop()


def test_the_launcher_lists_the_sandboxed_kernels_by_display_name(page: LabPage) -> None:
    from msb_kernels.kernelspecs.choice import KernelChoice
    from msb_kernels.kernelspecs.templates import TEMPLATES

    for category in ("Notebook", "Console"):
        titles = page.launcher_titles(category)
        assert PYTHON in titles, titles
        if TEMPLATES["node"].unavailable_reason() is None:
            assert NODE in titles, titles
        assert not any(KernelChoice.of("python", "small").kernel_name in title for title in titles), "a name instead of a display name"
        # One card per kernel: python3 is listed in place of the default flavor's kernelspec, not beside it (issue 55).
        assert [title for title in titles if title.endswith("Python 3 (sandbox, small)")] == [PYTHON], titles
        assert len(titles) == len(set(titles)), titles
        assert not any(title.startswith("Python 3 (ipykernel)") for title in titles), "a host kernel is offered"


def test_a_python_notebook_shows_output_stderr_and_a_plot(page: LabPage) -> None:
    page.new_notebook(PYTHON)
    cell = page.run('import sys; print("hello from the sandbox"); print("careful", file=sys.stderr)')
    assert page.wait_for_text(cell, STDOUT, "hello from the sandbox").strip() == "hello from the sandbox"
    assert page.wait_for_text(cell, STDERR, "careful").strip() == "careful"

    cell = page.run("import matplotlib.pyplot as plt; plt.plot([1, 3, 2]); plt.show()")
    image = page.wait(
        lambda: cell.find_elements(By.CSS_SELECTOR, '.jp-OutputArea-output[data-mime-type="image/png"] img'), "the plot's image"
    )[0]
    width = page.wait(
        lambda: page.driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image), "the plot's image to load"
    )
    assert width > 100, f"the plot is {width} px wide"
    assert page.prompt(cell) == "[2]:"


PYTHON3_METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
    "language_info": {"name": "python"},
}


@pytest.mark.parametrize("metadata", [PYTHON3_METADATA, {}], ids=["python3", "no-metadata"])
def test_a_notebook_naming_python3_opens_in_a_sandbox_without_a_kernel_dialog(page: LabPage, metadata: dict) -> None:
    """A notebook from elsewhere: its metadata names ipykernel's python3, or (as tools and scripts write them) no
    kernel at all. Lab starts it at once, on the default sandboxed Python kernel. With only the flavors' names listed,
    it asked which kernel to use; without metadata it asked too, with the first by display name preselected (a large
    Node kernel), until the settings msb-kernels installs beside Lab had it start the server's default."""
    import nbformat

    from tests.conftest import TEST_BASE

    cells = [nbformat.v4.new_code_cell("print('written elsewhere')"), nbformat.v4.new_code_cell("")]
    name = f"wild-{len(metadata)}.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata=metadata, cells=cells), TEST_BASE / f"js-root-{page.lab.port}" / "work" / name)
    page.driver.get(f"{page.lab.url}/lab/tree/work/{name}?reset&token={page.lab.token}")
    page.wait(
        lambda: [e for e in page.find(".jp-NotebookPanel .jp-Toolbar-kernelName") if "(sandbox" in e.text] or page.find(".jp-Dialog"),
        "a sandboxed kernel for the notebook",
        KERNEL_TIMEOUT,
    )
    assert not page.find(".jp-Dialog"), "JupyterLab asked which kernel to use"
    page.wait_for_kernel("idle")
    code = "import os, sys; print('sandbox:', os.environ['MSB_SANDBOX'], os.getuid(), os.environ['MSB_FLAVOR'], sys.version_info[0])"
    shown = page.wait_for_text(page.run(code), STDOUT, "sandbox:").split()
    assert shown[2:] == ["1000", "small", "3"] and shown[1] in ("namespace", "gvisor", "microsandbox"), shown


async def test_a_lab_from_another_environment_preselects_the_default_python(gateway: Gateway, browser) -> None:
    """A Lab without msb-kernels' settings (another environment's, as the README's `jupyter lab --gateway-url` gives
    one) asks which kernel a notebook without metadata should use, and preselects the first kernelspec by display
    name: the default Python's card, not a large Node kernel. Accepting it starts msb-python-small."""
    import nbformat

    from tests.conftest import TEST_BASE

    foreign = await launch_jupyter_server(gateway, app="lab", our_settings=False)
    try:
        page = LabPage(browser, foreign)
        nbformat.write(
            nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("")]), TEST_BASE / f"js-root-{foreign.port}" / "work" / "bare.ipynb"
        )
        page.driver.get(f"{foreign.url}/lab/tree/work/bare.ipynb?reset&token={foreign.token}")
        select = page.wait(lambda: page.find(".jp-Dialog select"), "Lab's kernel dialog", KERNEL_TIMEOUT)[0]
        chosen = page.driver.execute_script("return arguments[0].selectedOptions[0].text", select)
        assert chosen == "Default: Python 3 (sandbox, small)", chosen
        page.find(".jp-Dialog .jp-mod-accept")[0].click()
        page.wait_for_kernel("idle")
        (session,) = (await foreign.request("GET", "/api/sessions")).json
        assert session["kernel"]["name"] == "python3", session  # the name Lab saves: it opens here and anywhere
        stats = await gateway.stats()
        assert [k["kernel_name"] for k in stats["kernels"] if k["id"] == session["kernel"]["id"]] == ["msb-python-small"], stats
        await foreign.request("DELETE", f"/api/sessions/{session['id']}", timeout=KERNEL_TIMEOUT)
    finally:
        foreign.stop()


def test_a_shell_escape_runs_in_the_sandbox(page: LabPage) -> None:
    page.new_notebook(PYTHON)
    cell = page.run("!echo hi from a shell")
    assert page.wait_for_text(cell, STDOUT, "hi from a shell").strip() == "hi from a shell"


def test_interrupt_and_restart_from_the_toolbar(page: LabPage) -> None:
    page.new_notebook(PYTHON)
    page.wait_for_text(page.run("x = 42; print(x)"), STDOUT, "42")
    cell = page.run("import time; time.sleep(600)")
    page.wait(lambda: page.prompt(cell) == "[*]:" and page.kernel_status() == "busy", "the cell to run")
    page.click_toolbar("notebook:interrupt-kernel")
    page.wait_for_text(cell, STDERR, "KeyboardInterrupt")
    page.wait_for_kernel("idle")
    assert page.wait_for_text(page.run("print(x)"), STDOUT, "42").strip() == "42", "the interrupt lost the kernel's state"

    page.click_toolbar("notebook:restart-kernel")
    page.wait(lambda: page.find(".jp-Dialog .jp-mod-accept"), "the restart dialog")[0].click()
    page.wait(lambda: not page.find(".jp-Dialog"), "the restart dialog to close")
    page.wait_for_kernel("idle")
    cell = page.run("print('x' in globals())")
    assert page.wait_for_text(cell, STDOUT, "False", KERNEL_TIMEOUT).strip() == "False", "the restart kept the old kernel"


def test_a_node_notebook_runs_without_a_reload(page: LabPage) -> None:
    from msb_kernels.kernelspecs.templates import TEMPLATES

    if reason := TEMPLATES["node"].unavailable_reason():
        pytest.skip(f"node kernels unavailable: {reason}")
    page.new_notebook(NODE)
    cell = page.run("console.log(1+1)")
    assert page.wait_for_text(cell, STDOUT, "2").strip() == "2"
