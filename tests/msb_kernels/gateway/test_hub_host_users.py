"""A person's own files under JupyterHub's LocalProcessSpawner, with real host users, in Chromium.

docs/teams.md's install and its command to run the shipped config, word for word (but for the people's names), so
the defaults, PAM and LocalProcessSpawner: each person logs in with their host password, and their JupyterLab runs as
their own host user, from their home in /home. In Chromium, ann drops a file on her Lab's
file browser, her notebook's kernel reads it and writes another, and she opens that one in Lab's editor and saves an
edit, which her kernel then reads. On the host every file is
ann's, whichever of her Lab and her sandboxed kernel wrote it. ben's kernel, asked to start in her folder, sees none
of it. Then the Hub restarts with her notebook open in her browser, while her assistant (the MCP Inspector CLI with
her Hub token) edits it: her tab shows the file as it is, and so does a browser of a fresh profile. (tests/msb_kernels/gateway/test_hub.py runs the same Hub with SimpleLocalProcessSpawner, where every Lab is
root's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.keys import Keys

from bench.browser import headless_chromium
from mcp_bridge import jupyter_ws
from msb_kernels.backends.core import hostpaths
from tests.conftest import REPO, copy_checkout
from tests.host_users import delete_host_user
from tests.hub import PASSWORD, Hub, UserServer, launch_hub_as_documented
from tests.mcp_bridge.notebooks.hub_tab import cell_texts, inspector_as, open_notebook
from tests.mcp_bridge.test_inspector import inspector_missing
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, By, LabPage, browser, driver  # noqa: F401 (fixtures)
from tests.msb_kernels.gateway.conftest import KernelSocket, sandbox_records, wait_until
from tests.parallel import HOST_USERS
from tests.skips import needs_hub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    HOST_USERS,
    needs_hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="LocalProcessSpawner starts each person's server as their host user: run as root"),
]

PEOPLE = ("msbt-ann", "msbt-ben")  # host users this module makes, with homes in /home, and deletes after
SYSTEM_PYTHON = "/usr/bin/python3"
TEAMS_MD = REPO / "docs" / "teams.md"

# Lab's file browser uploads what is dropped on it (DirListing.evtNativeDrop -> FileBrowserModel.upload -> PUT
# /api/contents). A test cannot hand Chromium a file from the desktop, so the drop event carries one made here.
DROP = """
const [content, name] = arguments;
const listing = document.querySelector('#filebrowser .jp-DirListing-content');
const drop = new Event('drop', {bubbles: true, cancelable: true});
Object.defineProperty(drop, 'dataTransfer', {value: {files: [new File([content], name, {type: 'text/csv'})]}});
listing.dispatchEvent(drop);
"""


@pytest.fixture(scope="module")
def host_users() -> Iterator[dict[str, pwd.struct_passwd]]:
    """ann and ben as host users, each with a home of their own (0700), as an operator's useradd makes them."""

    for name in PEOPLE:
        delete_host_user(name)  # a run killed before its cleanup left them
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--user-group", name], check=True, capture_output=True)
        subprocess.run(["chpasswd"], input=f"{name}:{PASSWORD}\n", text=True, check=True, capture_output=True)  # PAM's
        os.chmod(f"/home/{name}", 0o700)
    try:
        yield {name: pwd.getpwnam(name) for name in PEOPLE}
    finally:
        for name in PEOPLE:
            delete_host_user(name)


def teams_block(heading: str) -> str:
    """The first bash block after ``heading`` in docs/teams.md, as written."""
    text = TEAMS_MD.read_text()
    found = re.search(r"```bash\n(.*?)```", text[text.index(heading) :], re.S)
    assert found, f"no bash block after {heading!r} in {TEAMS_MD}"
    return found.group(1)


@pytest.fixture(scope="module")
def install() -> Iterator[Path]:
    """docs/teams.md's team install, its commands as written, where it says /opt/msb-kernels: a copy of this checkout
    (its clone, which the test makes as a copy so that it holds what is being tested), installed from the system's
    Python by scripts/run, then the Hub and what each person's server runs, by its pip line. Its proxy is the suite's
    (``npm install -g`` would put it on PATH: launch_hub_as_documented does)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing: install Debian's python3 and python3-venv")
    clone, _, command = hostpaths.TEAM_INSTALL_COMMAND.partition(" && ")
    assert clone.startswith("git clone ") and hostpaths.TEAM_INSTALL_COMMAND in TEAMS_MD.read_text()
    (pip,) = [line for line in teams_block("Then, from `/opt/msb-kernels`").splitlines() if "pip install" in line]
    where = Path(tempfile.mkdtemp(prefix="msbt-install-", dir="/tmp"))
    try:
        os.chmod(where, 0o755)  # as /opt/msb-kernels is: every person's server runs from it
        copy_checkout(where)
        for line in (command.replace(hostpaths.TEAM_INSTALL, str(where)), pip):
            ran = subprocess.run(["bash", "-c", line], cwd=where, capture_output=True, text=True, timeout=900)
            assert ran.returncode == 0, (line, ran.stdout[-2000:], ran.stderr[-3000:])
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module", params=["gvisor", "namespace"])
async def hub(request: pytest.FixtureRequest, host_users: dict, install: Path) -> AsyncIterator[Hub]:
    """The Hub as docs/teams.md runs it, word for word but for the names of its people (the module's host users): PAM
    (each logs in with their host password), LocalProcessSpawner, the install's venv for everything; its gateway's
    MSB_BACKEND in the operator's environment. ann, its admin, makes the token the harness drives the Hub's API with at
    /hub/token."""
    (command,) = teams_block("### Run the shipped config").strip().splitlines()
    assert "MSB_HUB_ALLOWED_USERS=ann,ben MSB_HUB_ADMIN_USERS=ann " in command, command
    ann, ben = PEOPLE
    named = command.replace("=ann,ben", f"={ann},{ben}").replace("=ann ", f"={ann} ")
    server = await launch_hub_as_documented(named, install, env={"MSB_BACKEND": request.param})
    assert f"every kernel runs in a {request.param} sandbox" in server.log(), server.log()[-3000:]
    try:
        server.token = await server.token_by_login(ann)
        yield server
    finally:
        server.stop()
    assert not sandbox_records(server.runtime_dir), sandbox_records(server.runtime_dir)


def owners(folder: Path) -> dict[str, int]:
    return {entry.name: entry.stat().st_uid for entry in folder.iterdir() if not entry.name.startswith(".")}


async def test_ann_uploads_edits_and_runs_in_her_lab_as_her_host_user_and_ben_sees_none_of_it(
    hub: Hub, host_users: dict, driver: Any
) -> None:
    ann, ben = (host_users[name] for name in PEOPLE)
    data, out = (f"{name}-{uuid.uuid4().hex[:6]}.csv" for name in ("data", "out"))  # her home is kept across backends
    home = Path(ann.pw_dir)
    server: UserServer = await hub.start_server(ann.pw_name)
    hub.login(driver, ann.pw_name)
    page = LabPage(driver, server)
    page.open_lab()
    assert data not in page.file_browser_names()
    driver.execute_script(DROP, "a,b\n1,2\n", data)
    page.wait(lambda: data in page.file_browser_names(), "the dropped file in her file browser")

    page.new_notebook(PYTHON)
    cell = page.run(f"import os; open({out!r}, 'w').write('x,y\\n3,4\\n'); print(os.getcwd(), open({data!r}).read().split())")
    assert page.wait_for_text(cell, STDOUT, "a,b").split() == [str(home), "['a,b',", "'1,2']"]
    page.wait(lambda: out in page.file_browser_names(refresh=True), "her kernel's file in her file browser")

    # Lab opens it in its editor, as her, and saves her edit over what her kernel wrote.
    page.open_with(out, "Editor")
    page.type_in_editor("5,6\n", save=True)
    page.wait(lambda: (home / out).read_text() == "x,y\n3,4\n5,6\n", "her edit on disk")
    page.activate_tab(".ipynb")
    assert page.wait_for_text(page.run(f"print(open({out!r}).read().split())"), STDOUT, "5,6").split() == ["['x,y',", "'3,4',", "'5,6']"]
    # Nothing of the operator's shows in her sandbox (issue 55, point 10): not the checkout the suite runs from, nor the
    # suite's interpreter under /root; of /home, only her own home (and the sandbox's).
    look = f"import os, json; print(json.dumps([[p for p in ({str(REPO)!r}, {sys.base_prefix!r}, '/root') if os.path.exists(p)], os.listdir('/home')]))"
    found, homes = json.loads(page.wait_for_text(page.run(look), STDOUT, "]"))
    assert found == [] and ann.pw_name in homes and set(homes) <= {ann.pw_name, "sandbox"}, (found, homes)
    # Her Lab wrote two of these and her sandboxed kernel one: each is hers, as her host user.
    files = owners(home)
    assert {data, out} <= files.keys() and set(files.values()) == {ann.pw_uid}, (files, ann.pw_uid)

    # ben's kernel, even asked to start in her home, starts in the sandbox's own, sees his Lab's root and nothing of hers.
    token = await hub.token_for(ben.pw_name)
    started = await hub.gateway("POST", "api/kernels", token, {"name": "msb-python-small", "env": {"KERNEL_WORKING_DIR": str(home)}})
    assert started.code == 201, (started.code, started.body)
    kernel = started.json["id"]
    socket = KernelSocket(await jupyter_ws.connect(jupyter_ws.channels_url(hub.gateway_url, kernel, uuid.uuid4().hex), token, 60))
    try:
        seen = await socket.execute(f"import os; print(os.getcwd(), os.path.exists({str(home)!r}), os.path.isdir({ben.pw_dir!r}))")
        assert seen.stdout.split() == ["/home/sandbox", "False", "True"], seen.messages
    finally:
        socket.close()
        with contextlib.suppress(Exception):
            await hub.gateway("DELETE", f"api/kernels/{kernel}", token=token)


@pytest.mark.skipif(inspector_missing() is not None, reason=str(inspector_missing()))
async def test_after_a_hub_restart_her_open_notebook_shows_the_file_and_her_assistants_edit(hub: Hub, driver: Any) -> None:
    """ann's notebook stays open in her browser while the Hub restarts (every Lab stops with it, and JupyterHub
    forgets the token in her tab's cookie) and comes back; her assistant adds a cell meanwhile. Her tab says its server
    went away and offers to restart it; once she accepts, it shows what the file holds, her assistant's next edit
    appears in it, and a save from it keeps every cell."""
    ann = PEOPLE[0]
    server = await hub.start_server(ann)
    path = f"restart-{uuid.uuid4().hex[:6]}.ipynb"
    page = await open_notebook(hub, server, driver, path, "print('hers')")
    assistant = inspector_as(hub, hub.tokens[ann])

    async def file_sources() -> list[str]:
        # jupyter_server writes a file in place (its atomic_writing keeps a backup copy, not a temp file to rename): a
        # read during one of the room's saves can find it empty (400 "Unreadable Notebook"), and the next one whole.
        async def readable() -> Any:
            response = await server.request("GET", f"/api/contents/{path}?content=1")
            return None if response.code == 400 and b"Unreadable Notebook" in response.body else response

        response = await wait_until(readable, 5, f"{path} readable between saves", interval=0.25)
        assert response.code == 200, (response.code, response.body[:500])
        return [cell["source"] for cell in response.json["content"]["cells"]]

    async def insert(source: str, shown: bool = True) -> None:
        inserted = (await assistant.call("insert_cell", notebook=path, source=source)).result
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
    server = await hub.start_server(ann)
    await insert("print('while her tab was away')", shown=False)
    # The Hub is back: she accepts the offer.
    her_tab = driver.current_window_handle
    restart[0].click()
    await asyncio.to_thread(
        page.wait, lambda: "print('while her tab was away')" in cell_texts(page), "the file's latest content in her tab", 180
    )
    # The offer opened /hub/spawn in a tab of its own, in front: she closes it and goes back to hers. (Left in front,
    # it hides hers, whose Lab then stops polling and rendering.)
    for handle in set(driver.window_handles) - {her_tab}:
        driver.switch_to.window(handle)
        driver.close()
    driver.switch_to.window(her_tab)
    assert cell_texts(page) == await file_sources(), (cell_texts(page), await file_sources())
    await insert("print('after the restart')")
    assert cell_texts(page) == await file_sources(), (cell_texts(page), await file_sources())

    # A save from her tab keeps every cell. (Her notebook's tab is the active one: a click on a cell could land on a
    # dialog instead, such as the "Kernel died unexpectedly" a run here showed for its kernel after the restart.)
    driver.find_element(By.CSS_SELECTOR, "body").send_keys(Keys.CONTROL, "s")
    await asyncio.sleep(3)
    expected = ["print('hers')", "print('before the restart')", "print('while her tab was away')", "print('after the restart')"]
    assert sorted(await file_sources()) == sorted(expected) and cell_texts(page) == await file_sources(), await file_sources()

    # In a browser of a fresh profile (where the issue still saw the old version), she opens it as the file holds it.
    fresh = await asyncio.to_thread(headless_chromium)
    try:
        await asyncio.to_thread(hub.login, fresh, ann)
        other = LabPage(fresh, server)
        fresh.get(f"{server.url}/lab/tree/{path}?reset")
        await asyncio.to_thread(other.wait, lambda: len(cell_texts(other)) >= len(expected), "her notebook in a fresh browser", 180)
        assert cell_texts(other) == await file_sources(), (cell_texts(other), await file_sources())
    finally:
        fresh.quit()
