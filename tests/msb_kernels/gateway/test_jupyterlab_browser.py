"""JupyterLab in headless Chromium against `msb-kernels serve`: what a notebook user does, click by click.

`jupyter lab --gateway-url` runs as the README tells users to run it; Debian's chromium, driven by
selenium, clicks the launcher, types into cells and reads what Lab renders. Every wait is on a DOM
condition with a generous timeout: the test machine is small and shared. A failing test leaves a
screenshot; its path is in the failure's "browser screenshot" section.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.msb_kernels.gateway.conftest import SCREENSHOT_ON_FAILURE, Gateway, HttpServer, launch_jupyter_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test extra: pip install -e '.[test]'")
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GET_CHROMIUM = (
    "install Debian's chromium and its driver: `apt-get install -y chromium chromium-driver` "
    "(`source scripts/bootstrap.sh test` does it when run as root)"
)
KERNEL_TIMEOUT = 180.0  # a sandbox start, through two servers, on a loaded 2-core machine
OUTPUT_TIMEOUT = 90.0
PYTHON = "Python 3 (sandbox, small)"
NODE = "JavaScript (Node.js) (sandbox, small)"
STDOUT, STDERR = "application/vnd.jupyter.stdout", "application/vnd.jupyter.stderr"


@pytest.fixture(scope="module")
async def lab(gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(gateway, app="lab")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip(f"chromium or chromedriver is not installed; {GET_CHROMIUM}")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(service=webdriver.ChromeService(chromedriver), options=options)
    except WebDriverException as exc:
        pytest.skip(f"chromium did not start ({exc.msg}); {GET_CHROMIUM}")
    yield driver
    driver.quit()


class LabPage:
    """JupyterLab in the browser, with the few gestures a notebook user makes."""

    def __init__(self, driver: Any, lab: HttpServer):
        self.driver = driver
        self.lab = lab

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = OUTPUT_TIMEOUT) -> Any:
        waiter = WebDriverWait(self.driver, timeout, poll_frequency=0.25, ignored_exceptions=(StaleElementReferenceException,))
        try:
            return waiter.until(lambda _: condition())
        except TimeoutException:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}") from None

    def find(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def open_lab(self) -> None:
        # ?reset: a fresh workspace, not the notebooks an earlier test left open
        self.driver.get(f"{self.lab.url}/lab?reset&token={self.lab.token}")
        self.wait(lambda: self.find(".jp-LauncherCard"), "the launcher", KERNEL_TIMEOUT)

    def launcher_titles(self, category: str) -> list[str]:
        return [card.get_attribute("title") for card in self.find(f'.jp-LauncherCard[data-category="{category}"]')]

    def new_notebook(self, display_name: str) -> None:
        """Click the kernel's card under Notebook in the launcher; wait until the kernel is idle."""
        card = self.wait(
            lambda: self.find(f'.jp-LauncherCard[data-category="Notebook"][title="{display_name}"]'), f"the launcher card {display_name!r}"
        )
        card[0].click()
        self.wait(
            lambda: [e for e in self.find(".jp-NotebookPanel .jp-Toolbar-kernelName") if e.text == display_name],
            f"a notebook with the kernel {display_name!r}",
        )
        self.wait_for_kernel("idle")

    def kernel_status(self) -> str | None:
        indicators = self.find(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator")
        return indicators[0].get_attribute("data-status") if indicators else None

    def wait_for_kernel(self, status: str) -> None:
        self.wait(lambda: self.kernel_status() == status, f"the kernel status {status!r} (it is {self.kernel_status()!r})", KERNEL_TIMEOUT)

    def run(self, code: str) -> WebElement:
        """Type code into the last cell and press Shift+Enter; return that cell."""
        cell = self.find(".jp-NotebookPanel .jp-CodeCell")[-1]
        editor = cell.find_element(By.CSS_SELECTOR, ".cm-content")
        editor.click()
        editor.send_keys(code)
        self.wait(lambda: editor.text == code, f"the cell to read {code!r} (it reads {editor.text!r})", 30)
        editor.send_keys(Keys.SHIFT, Keys.ENTER)
        return cell

    def outputs(self, cell: WebElement, mime_type: str) -> list[WebElement]:
        return cell.find_elements(By.CSS_SELECTOR, f'.jp-OutputArea-output[data-mime-type="{mime_type}"]')

    def wait_for_text(self, cell: WebElement, mime_type: str, text: str, timeout: float = OUTPUT_TIMEOUT) -> str:
        def shown() -> str | None:
            joined = "\n".join(output.text for output in self.outputs(cell, mime_type))
            return joined if text in joined else None

        try:
            return self.wait(shown, f"{text!r} in the cell's {mime_type} output", timeout)
        except AssertionError as exc:
            shows = "\n".join(output.text for output in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output"))
            raise AssertionError(f"{exc}; the cell shows:\n{shows[-1500:] or '(nothing)'}") from None

    def click_toolbar(self, command: str) -> None:
        buttons = [b for b in self.find(f'.jp-NotebookPanel jp-button[data-command="{command}"]') if b.is_displayed()]
        assert buttons, f"no toolbar button for {command}"
        buttons[0].click()

    def prompt(self, cell: WebElement) -> str:
        return cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text


@pytest.fixture
async def page(request: pytest.FixtureRequest, browser: Any, lab: HttpServer, tmp_path: Path) -> AsyncIterator[LabPage]:
    """A fresh Lab workspace; the kernels this test started are shut down after it."""

    def screenshot() -> str:
        path = tmp_path / "screenshot.png"
        browser.save_screenshot(str(path))
        return str(path)

    request.node.stash[SCREENSHOT_ON_FAILURE] = screenshot
    lab_page = LabPage(browser, lab)
    lab_page.open_lab()
    yield lab_page
    for session in (await lab.request("GET", "/api/sessions")).json:
        await lab.request("DELETE", f"/api/sessions/{session['id']}", timeout=KERNEL_TIMEOUT)


def test_the_launcher_lists_the_sandboxed_kernels_by_display_name(page: LabPage) -> None:
    from msb_kernels.choice import KernelChoice
    from msb_kernels.templates import TEMPLATES

    for category in ("Notebook", "Console"):
        titles = page.launcher_titles(category)
        assert PYTHON in titles, titles
        if TEMPLATES["node"].unavailable_reason() is None:
            assert NODE in titles, titles
        assert not any(KernelChoice.of("python", "small").kernel_name in title for title in titles), "a name instead of a display name"
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


def test_a_notebook_naming_python3_opens_in_a_sandbox_without_a_kernel_dialog(page: LabPage) -> None:
    """A notebook from elsewhere: its metadata names ipykernel's python3. Lab starts it at once, in a sandbox; with
    only the flavors' names listed, it asked which kernel to use (and offered a Node one first)."""
    import nbformat

    from tests.conftest import TEST_BASE

    metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
        "language_info": {"name": "python"},
    }
    cells = [nbformat.v4.new_code_cell("print('written elsewhere')"), nbformat.v4.new_code_cell("")]
    nbformat.write(nbformat.v4.new_notebook(metadata=metadata, cells=cells), TEST_BASE / f"js-root-{page.lab.port}" / "work" / "wild.ipynb")
    page.driver.get(f"{page.lab.url}/lab/tree/work/wild.ipynb?reset&token={page.lab.token}")
    page.wait(
        lambda: [e for e in page.find(".jp-NotebookPanel .jp-Toolbar-kernelName") if "(sandbox" in e.text] or page.find(".jp-Dialog"),
        "a sandboxed kernel for the notebook",
        KERNEL_TIMEOUT,
    )
    assert not page.find(".jp-Dialog"), "JupyterLab asked which kernel to use"
    page.wait_for_kernel("idle")
    shown = page.wait_for_text(page.run("import os; print('sandbox:', os.environ['MSB_SANDBOX'], os.getuid())"), STDOUT, "sandbox:")
    assert shown.split()[2:] == ["1000"] and shown.split()[1] in ("namespace", "gvisor", "microsandbox"), shown


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
    from msb_kernels.templates import TEMPLATES

    if reason := TEMPLATES["node"].unavailable_reason():
        pytest.skip(f"node kernels unavailable: {reason}")
    page.new_notebook(NODE)
    cell = page.run("console.log(1+1)")
    assert page.wait_for_text(cell, STDOUT, "2").strip() == "2"
