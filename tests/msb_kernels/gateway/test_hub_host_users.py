"""A person's own files under JupyterHub's LocalProcessSpawner, with real host users, in Chromium.

The shipped config with its defaults, PAM and LocalProcessSpawner: each person logs in with their host password, and
their JupyterLab runs as their own host user, from their home in /home. In Chromium, ann drops a file on her Lab's
file browser, her notebook's kernel reads it and writes another, and she opens that one in Lab's editor and saves an
edit, which her kernel then reads. On the host every file is
ann's, whichever of her Lab and her sandboxed kernel wrote it. ben's kernel, asked to start in her folder, sees none
of it. (tests/msb_kernels/gateway/test_hub.py runs the same Hub with SimpleLocalProcessSpawner, where every Lab is
root's.)
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from mcp_bridge import jupyter_ws
from tests.conftest import REPO
from tests.host_users import delete_host_user
from tests.hub import PASSWORD, Hub, UserServer, launch_hub
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, LabPage, browser, driver  # noqa: F401 (fixtures)
from tests.msb_kernels.gateway.conftest import KernelSocket, sandbox_records
from tests.skips import needs_hub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    needs_hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="LocalProcessSpawner starts each person's server as their host user: run as root"),
]

PEOPLE = ("msbt-ann", "msbt-ben")  # host users this module makes, with homes in /home, and deletes after
SYSTEM_PYTHON = "/usr/bin/python3"

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


@pytest.fixture(scope="module")
def servers_venv() -> Iterator[Path]:
    """What every person's server runs from: this checkout, JupyterHub and JupyterLab, in a venv of the system's
    Python that every host user can run. (The suite's own venv may rest on an interpreter no one else can reach, as a
    pyenv one under /root does: an operator of LocalProcessSpawner installs where every person can run it.)"""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing: install Debian's python3 and python3-venv")
    venv = Path(tempfile.mkdtemp(prefix="msbt-servers-", dir="/tmp"))
    try:
        os.chmod(venv, 0o755)
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, capture_output=True)
        wanted = [str(REPO), f"jupyterhub=={version('jupyterhub')}", f"jupyterlab=={version('jupyterlab')}"]
        installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *wanted], capture_output=True, text=True, timeout=600)
        assert installed.returncode == 0, installed.stderr[-3000:]
        yield venv
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@pytest.fixture(scope="module")
async def hub(host_users: dict, servers_venv: Path) -> AsyncIterator[Hub]:
    server = await launch_hub(
        users=PEOPLE,
        # The shipped config as the docs run it: PAM (the host's users, with their own passwords), LocalProcessSpawner.
        env={"MSB_HUB_AUTHENTICATOR": "", "MSB_HUB_SPAWNER": "", "MSB_HUB_ALLOW_ROOT": ""},
        extra_config=f"c.Spawner.cmd = [{str(servers_venv / 'bin' / 'jupyterhub-singleuser')!r}]",
    )
    yield server
    server.stop()
    assert not sandbox_records(server.runtime_dir), sandbox_records(server.runtime_dir)


def owners(folder: Path) -> dict[str, int]:
    return {entry.name: entry.stat().st_uid for entry in folder.iterdir() if not entry.name.startswith(".")}


async def test_ann_uploads_edits_and_runs_in_her_lab_as_her_host_user_and_ben_sees_none_of_it(
    hub: Hub, host_users: dict, driver: Any
) -> None:
    ann, ben = (host_users[name] for name in PEOPLE)
    home = Path(ann.pw_dir)
    server: UserServer = await hub.start_server(ann.pw_name)
    hub.login(driver, ann.pw_name)
    page = LabPage(driver, server)
    page.open_lab()
    assert "data.csv" not in page.file_browser_names()
    driver.execute_script(DROP, "a,b\n1,2\n", "data.csv")
    page.wait(lambda: "data.csv" in page.file_browser_names(), "the dropped file in her file browser")

    page.new_notebook(PYTHON)
    cell = page.run("import os; open('out.csv', 'w').write('x,y\\n3,4\\n'); print(os.getcwd(), open('data.csv').read().split())")
    assert page.wait_for_text(cell, STDOUT, "a,b").split() == [str(home), "['a,b',", "'1,2']"]
    page.wait(lambda: "out.csv" in page.file_browser_names(refresh=True), "her kernel's file in her file browser")

    # Lab opens it in its editor, as her, and saves her edit over what her kernel wrote.
    page.open_with("out.csv", "Editor")
    page.type_in_editor("5,6\n", save=True)
    page.wait(lambda: (home / "out.csv").read_text() == "x,y\n3,4\n5,6\n", "her edit on disk")
    page.activate_tab(".ipynb")
    assert page.wait_for_text(page.run("print(open('out.csv').read().split())"), STDOUT, "5,6").split() == ["['x,y',", "'3,4',", "'5,6']"]
    # Her Lab wrote two of these and her sandboxed kernel one: each is hers, as her host user.
    files = owners(home)
    assert {"data.csv", "out.csv"} <= files.keys() and set(files.values()) == {ann.pw_uid}, (files, ann.pw_uid)

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
