"""JupyterLab in headless Chromium, driven by selenium: the browser fixture and the gestures a notebook user makes.

Shared by every test that watches what a person sees (tests/msb_kernels/gateway/test_jupyterlab_browser.py,
tests/mcp_bridge/notebooks/). Every wait is on a DOM condition with a generous timeout: the test machine is
small and shared. A test that uses ``page`` leaves a screenshot when it fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.browser import NoChromium, headless_chromium
from tests.msb_kernels.gateway.conftest import SCREENSHOT_ON_FAILURE, HttpServer

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test extra: pip install -e '.[test]'")
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KERNEL_TIMEOUT = 180.0  # a sandbox start, through two servers, on a loaded 2-core machine
OUTPUT_TIMEOUT = 90.0
# The default flavor's cards: listed as python3 and javascript, in place of msb-python-small and msb-node-small.
PYTHON = "Default: Python 3 (sandbox, small)"
NODE = "JavaScript (Node.js) (sandbox, small, default)"
STDOUT, STDERR = "application/vnd.jupyter.stdout", "application/vnd.jupyter.stderr"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        driver = headless_chromium()
    except NoChromium as exc:
        pytest.skip(str(exc))
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

    def running_items(self) -> list[str]:
        """Open the running-sessions sidebar; the text of each item listed (a kernel shows its display name)."""
        tab = self.wait(lambda: self.find('.lm-TabBar-tab[data-id="jp-running-sessions"]'), "the running-sessions tab")[0]
        if "lm-mod-current" not in (tab.get_attribute("class") or ""):
            tab.click()
        self.wait(lambda: self.find("#jp-running-sessions .jp-RunningSessions-section"), "the running-sessions panel")
        return [item.text for item in self.find("#jp-running-sessions .jp-RunningSessions-item")]

    def file_browser_names(self, refresh: bool = False) -> list[str]:
        """The names Lab's file browser lists (its tab opened first); refresh: press its refresh button, as a person does
        when a file a kernel wrote has not shown yet (Lab polls the folder only every so often)."""
        tab = self.wait(lambda: self.find('.lm-TabBar-tab[data-id="filebrowser"]'), "the file browser's tab")[0]
        if "lm-mod-current" not in (tab.get_attribute("class") or ""):
            tab.click()
        if refresh:
            buttons = [b for b in self.find('#filebrowser jp-button[data-command="filebrowser:refresh"]') if b.is_displayed()]
            if buttons:
                buttons[0].click()
        return [item.text for item in self.find("#filebrowser .jp-DirListing-itemText")]

    def open_with(self, name: str, factory: str) -> None:
        """Right-click a file in the file browser and pick Open With > factory (e.g. "Editor"); wait for its tab."""
        from selenium.webdriver.common.action_chains import ActionChains

        self.file_browser_names()
        item = self.wait(
            lambda: [e for e in self.find("#filebrowser .jp-DirListing-item") if e.get_attribute("title") and name in e.text.split("\n")],
            f"{name!r} in the file browser",
        )[0]
        ActionChains(self.driver).context_click(item).perform()
        opener = self.wait(lambda: [e for e in self.find(".lm-Menu-item") if e.text.strip() == "Open With"], "Open With in the menu")[0]
        ActionChains(self.driver).move_to_element(opener).click().perform()
        choice = self.wait(lambda: [e for e in self.find(".lm-Menu-item") if e.text.strip() == factory], f"{factory} under Open With")[0]
        ActionChains(self.driver).move_to_element(choice).click().perform()
        self.wait(
            lambda: [t for t in self.find(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current") if name in t.text], f"{name!r} opened"
        )

    def type_in_editor(self, text: str, save: bool = False) -> None:
        """Type at the end of the current file editor's text; save: press Ctrl+S and wait until Lab shows it saved."""
        editor = self.wait(lambda: [e for e in self.find(".jp-FileEditor .cm-content") if e.is_displayed()], "the file editor")[0]
        editor.click()
        editor.send_keys(Keys.CONTROL, Keys.END)
        editor.send_keys(text)
        if save:
            editor.send_keys(Keys.CONTROL, "s")
            self.wait(
                lambda: (
                    not [
                        t
                        for t in self.find(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
                        if "jp-mod-dirty" in t.get_attribute("class")
                    ]
                ),
                "the editor's file saved",
            )

    def activate_tab(self, text: str) -> None:
        """Bring the main area's tab whose label holds text to the front."""
        tab = self.wait(lambda: [t for t in self.find(".lm-DockPanel-tabBar .lm-TabBar-tab") if text in t.text], f"a tab named {text!r}")[0]
        tab.click()
        self.wait(lambda: "lm-mod-current" in (tab.get_attribute("class") or ""), f"the tab {text!r} in front")

    def prompt(self, cell: WebElement) -> str:
        return cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text


def screenshot_on_failure(request: pytest.FixtureRequest, driver: Any, tmp_path: Path) -> None:
    """If the test that asked fails, save what the browser shows, and say where in the failure."""

    def screenshot() -> str:
        path = tmp_path / "screenshot.png"
        driver.save_screenshot(str(path))
        return str(path)

    request.node.stash[SCREENSHOT_ON_FAILURE] = screenshot


@pytest.fixture
def driver(request: pytest.FixtureRequest, browser: Any, tmp_path: Path) -> Any:
    """The module's Chromium, for a test that drives it itself (logs in first, say), leaving a screenshot if it fails."""
    screenshot_on_failure(request, browser, tmp_path)
    return browser


@pytest.fixture
async def page(request: pytest.FixtureRequest, browser: Any, lab: HttpServer, tmp_path: Path) -> AsyncIterator[LabPage]:
    """A fresh Lab workspace; the kernels this test started are shut down after it."""
    screenshot_on_failure(request, browser, tmp_path)
    lab_page = LabPage(browser, lab)
    lab_page.open_lab()
    yield lab_page
    for session in (await lab.request("GET", "/api/sessions")).json:
        await lab.request("DELETE", f"/api/sessions/{session['id']}", timeout=KERNEL_TIMEOUT)
