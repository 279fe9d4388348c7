"""Headless Chromium as the tests and the benches drive it: one way to start it, and one reason when it cannot start."""

from __future__ import annotations

import shutil
from typing import Any

GET_CHROMIUM = (
    "install Debian's chromium and its driver: `apt-get install -y chromium chromium-driver` "
    "(`source scripts/bootstrap.sh test` does it when run as root)"
)


class NoChromium(RuntimeError):
    """Chromium or its driver is missing, or did not start; the message says which, and how to get them."""


def missing() -> str | None:
    """Why Chromium cannot be driven here (with how to install it); None where it can be tried."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    return f"chromium or chromedriver is not installed; {GET_CHROMIUM}"


def headless_chromium() -> Any:
    """A selenium driver of headless Chromium, 1400x1000 (Lab's launcher and a notebook fit); NoChromium if it cannot be."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException

    if (reason := missing()) is not None:
        raise NoChromium(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    try:
        return webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)
    except WebDriverException as exc:
        raise NoChromium(f"chromium did not start ({exc.msg}); {GET_CHROMIUM}") from exc
