"""A new notebook's first cell in JupyterLab, in Chromium: from the launcher click to the cell's output, on the gateway
beside a plain JupyterLab with a local ipykernel on the same host (issue 55, point 11: "4.8 s from the launcher click").

Two Labs, as their users run them:

* sandboxed: `jupyter lab --gateway-url` on `msb-kernels serve` with its shipped pool (python-small=1), and the card
  a person clicks there, "Default: Python 3 (sandbox, small)";
* plain: `jupyter lab` with its own ipykernel, the card "Python 3 (ipykernel)".

Round by round, interleaved so both see the same minutes of this VM, headless Chromium opens each Lab's launcher,
clicks the card, types `print(6 * 7)` into the new notebook's cell as soon as its editor shows, runs it once Lab shows
its kernel idle (Lab drops a run asked for before that), and waits for `42`. The clock runs from the click to the
output on screen: Lab's own start of the notebook and its kernel, the gateway's hand-out, and the cell. Each round's notebook and kernel are shut down after it; the pool refills before
the next.

    .venv/bin/python bench/lab_first_cell.py                  # 8 rounds on namespace, about two minutes
    .venv/bin/python bench/lab_first_cell.py -n 20 --backend gvisor

It writes bench/results/lab_first_cell.json and prints a table of p50 and p95 and the ratio at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.browser import NoChromium, headless_chromium
from bench.environment import isolate, machine, settle
from bench.servers import Server, start_gateway, start_jupyter
from bench.stats import summary

RESULTS = Path(__file__).resolve().parent / "results"
CARDS = {"sandboxed": "Default: Python 3 (sandbox, small)", "plain": "Python 3 (ipykernel)"}
CODE, OUTPUT = "print(6 * 7)", "42"
TIMEOUT = 120.0  # a first cell on a loaded 2-core machine


def wait(browser: Any, condition: Any, what: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, TIMEOUT, poll_frequency=0.02, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda _: condition()
        )
    except TimeoutException:
        RESULTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(RESULTS / "lab_first_cell-timeout.png"))
        raise RuntimeError(
            f"timed out after {TIMEOUT:.0f} s waiting for {what} (screenshot: {RESULTS}/lab_first_cell-timeout.png)"
        ) from None


def first_cell(browser: Any, lab: Server, card: str) -> float:
    """The launcher's card clicked, to the first cell's output on screen, in seconds."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    def find(css: str) -> list:
        return browser.find_elements(By.CSS_SELECTOR, css)

    browser.get(f"{lab.url}/lab?reset&token={lab.token}")
    button = wait(browser, lambda: find(f'.jp-LauncherCard[data-category="Notebook"][title="{card}"]'), f"the card {card!r}")[0]
    began = time.perf_counter()
    button.click()
    editor = wait(browser, lambda: find(".jp-NotebookPanel .jp-CodeCell .cm-content"), "the new notebook's cell")[-1]
    editor.click()
    editor.send_keys(CODE)
    wait(browser, lambda: editor.text == CODE, "the cell to read the code")
    # Lab drops a run asked for before its kernel is connected (seen with the plain Lab): run it once Lab says idle.
    wait(browser, lambda: find('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status="idle"]'), "the kernel to be idle")
    editor.send_keys(Keys.SHIFT, Keys.ENTER)
    wait(browser, lambda: [e for e in find(".jp-NotebookPanel .jp-OutputArea-output") if e.text.strip() == OUTPUT], "the output")
    return time.perf_counter() - began


async def close_sessions(lab: Server) -> None:
    """Each round's notebook and kernel shut down, as closing the tab and its kernel does."""
    for session in await lab.request("GET", "/api/sessions"):
        await lab.request("DELETE", f"/api/sessions/{session['id']}")


async def pool_ready(gateway: Server) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if (await gateway.request("GET", "/api/msb/stats"))["pool"]["waiting"].get("msb-python-small"):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway's pool did not refill")


async def run(rounds: int, backend: str) -> dict:
    base = Path(tempfile.mkdtemp(prefix="msbf-", dir="/tmp"))
    isolate(base, max_sessions=20, backend=backend)
    (base / "plain").mkdir()
    gateway = start_gateway(base, pool_size="python-small=1")
    labs: dict[str, Server] = {}
    browser = None
    times: dict[str, list[float]] = {name: [] for name in CARDS}
    try:
        await gateway.wait_up()
        labs["sandboxed"] = start_jupyter(base, "lab", f"--gateway-url={gateway.url}", f"--GatewayClient.auth_token={gateway.token}")
        labs["plain"] = start_jupyter(base / "plain", "lab")
        for lab in labs.values():
            await lab.wait_up()
        try:
            browser = headless_chromium()
        except NoChromium as exc:
            raise SystemExit(f"lab_first_cell.py: {exc}") from None
        for round_ in range(rounds + 1):  # the first round of each is untimed: Lab's first page load, imports
            for name, lab in labs.items():
                if name == "sandboxed":
                    await pool_ready(gateway)
                await settle()
                took = await asyncio.to_thread(first_cell, browser, lab, CARDS[name])
                if round_:
                    times[name].append(took)
                await close_sessions(lab)
    finally:
        if browser is not None:
            browser.quit()
        for lab in labs.values():
            lab.stop()
        gateway.stop()
        shutil.rmtree(base, ignore_errors=True)
    figures = {name: summary(values) for name, values in times.items()}
    return {
        "machine": machine(),
        "backend": backend,
        "rounds": rounds,
        "figures": figures,
        "ratio_p50": figures["sandboxed"]["p50_ms"] / figures["plain"]["p50_ms"],
    }


def table(results: dict) -> str:
    lines = [f"| a new notebook's first cell, launcher click to output ({results['backend']}) | p50 ms | p95 ms |", "|---|---|---|"]
    for name, card in CARDS.items():
        figure = results["figures"][name]
        lines.append(f"| {name}: {card} | {figure['p50_ms']:.0f} | {figure['p95_ms']:.0f} |")
    lines += ["", f"- sandboxed / plain: {results['ratio_p50']:.2f} at p50 (n={results['rounds']})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=8, help="timed rounds of each Lab (default 8)")
    parser.add_argument("--backend", default="namespace", choices=("namespace", "gvisor"), help="the gateway's sandboxes")
    parser.add_argument("--output", type=Path, default=RESULTS / "lab_first_cell.json", help="where the figures go")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    results = asyncio.run(run(args.rounds, args.backend))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
