"""A person's own packages: `%pip install --user` (or `!pip install --user`) in a kernel of theirs lands in their own volume, imports in their next
session, and never in another person's kernel. Real gateway with a users file and a shared volume (alice and bob), real
sandboxed kernels on namespace and gVisor, wheels made by the test (no registry)."""

from __future__ import annotations

import base64
import glob
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import TEST_BASE
from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, PROBE_VALUE, package_wheel, probe_wheel
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, Reply, add_user, launch_gateway, registered
from tests.skips import needs_runsc

pytestmark = pytest.mark.slow
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
SHADOWED = "nbformat"  # in the gateway's venv (the default environment), and no kernel imports it at start
BOOT_PACKAGE = "tornado"  # what ipykernel imports at start: a broken copy of the person's must not stop their kernels


def streams(reply: Reply) -> str:
    return "".join(m["content"]["text"] for m in reply.messages if m["msg_type"] == "stream")


def _wheels(directory: Path) -> dict[str, bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    made = [
        probe_wheel(directory),
        package_wheel(directory, SHADOWED, "99.0", {f"{SHADOWED}/__init__.py": "__version__ = '99.0'\n"}),
        package_wheel(directory, BOOT_PACKAGE, "99.0", {f"{BOOT_PACKAGE}/__init__.py": "raise ImportError('a broken tornado')\n"}),
    ]
    return {path.name: path.read_bytes() for path in made}


class People:
    def __init__(self, gateway: Gateway, tokens: dict[str, str], shared: Path, wheels: dict[str, bytes]):
        self.gateway, self.tokens, self.shared, self.wheels = gateway, tokens, shared, wheels

    async def session(self, who: str) -> tuple[str, KernelSocket]:
        started = await self.gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=self.tokens[who])
        assert started.code == 201, started.body
        kernel = started.json["id"]
        return kernel, await KernelSocket.open(self.gateway, kernel, token=self.tokens[who])

    async def end(self, who: str, kernel: str, socket: KernelSocket) -> None:
        socket.close()
        assert (await self.gateway.request("DELETE", f"/api/kernels/{kernel}", token=self.tokens[who])).code == 204

    async def put_wheels(self, socket: KernelSocket) -> None:
        """The wheels into the sandbox's own /tmp, as a person uploads a file: the host's /tmp is not shown there."""
        encoded = {name: base64.b64encode(data).decode() for name, data in self.wheels.items()}
        code = f"import base64\nfor n, d in {encoded!r}.items():\n    open('/tmp/' + n, 'wb').write(base64.b64decode(d))"
        assert (await socket.execute(code)).reply["content"]["status"] == "ok"


@pytest.fixture(scope="module", params=BACKENDS)
async def people(request) -> AsyncIterator[People]:
    backend = request.param
    users_file = TEST_BASE / f"own-packages-{backend}-users.json"
    tokens = {name: add_user(users_file, name) for name in ("alice", "bob")}
    shared = TEST_BASE / f"own-packages-{backend}-shared"
    shared.mkdir(mode=0o755)  # as an operator makes it: root's, 0755, nothing opened up for the sandboxes
    shared.chmod(0o755)
    gateway = await launch_gateway(
        extra_env={"MSB_USERS_FILE": str(users_file), "MSB_TOKEN": None, "MSB_SHARED_VOLUME_PATH": str(shared), "MSB_BACKEND": backend}
    )
    yield People(gateway, tokens, shared, _wheels(TEST_BASE / f"own-packages-{backend}-wheels"))
    gateway.stop()


WHERE = """
import json, sys
try:
    import {name}
    found = {{"file": {name}.__file__, "version": getattr({name}, "__version__", None), "value": getattr({name}, "VALUE", None)}}
except ImportError as exc:
    found = {{"error": repr(exc)}}
print(json.dumps(found))
"""


async def where(socket: KernelSocket, name: str) -> dict:
    reply = await socket.execute(WHERE.format(name=name))
    assert reply.reply["content"]["status"] == "ok", reply.messages
    return json.loads(reply.stdout)


async def test_a_user_install_is_kept_for_the_persons_next_session_and_for_nobody_else(people):
    kernel, alice = await people.session("alice")
    try:
        await people.put_wheels(alice)
        wheels = " ".join(f"/tmp/{name}" for name in people.wheels)
        installed = await alice.execute(f"%pip install --user --no-index {wheels}", timeout=180)
        text = streams(installed)
        assert installed.reply["content"]["status"] == "ok" and installed.error is None, text
        assert "Successfully installed" in text and f"{PROBE_PACKAGE}-1.0" in text, text
        # Imports in the session that installed it, from the person's volume.
        now = await where(alice, PROBE_PACKAGE)
        assert now.get("value") == PROBE_VALUE and now["file"].startswith("/shared/.python/default/lib/python3."), now
    finally:
        await people.end("alice", kernel, alice)
    on_host = glob.glob(
        str(people.shared / registered("alice").key / ".python" / "default" / "lib" / "python3.*" / "site-packages" / PROBE_PACKAGE)
    )
    assert len(on_host) == 1, list((people.shared / registered("alice").key).rglob("*"))[:20]

    kernel, alice = await people.session("alice")  # her next session: a new kernel
    try:
        again = await where(alice, PROBE_PACKAGE)
        assert again.get("value") == PROBE_VALUE, again
        # Her package shadows the environment's own copy, as Python's user site does outside a venv ...
        shadowed = await where(alice, SHADOWED)
        assert shadowed.get("version") == "99.0" and shadowed["file"].startswith("/shared/.python/"), shadowed
        # ... but not what the kernel itself imported before her packages went on the path: it still starts and runs.
        assert (await alice.execute("import tornado; tornado.version_info[0] >= 6")).result == "True"
        listed = await alice.execute("%pip list --user")
        assert PROBE_PACKAGE in streams(listed) and listed.error is None, streams(listed)
        removed = await alice.execute(f"%pip uninstall -y {SHADOWED}")
        assert f"Successfully uninstalled {SHADOWED}-99.0" in streams(removed), streams(removed)
    finally:
        await people.end("alice", kernel, alice)

    kernel, bob = await people.session("bob")
    try:
        assert "No module named" in (await where(bob, PROBE_PACKAGE)).get("error", ""), "bob imported alice's package"
        assert (await bob.execute("import os; sorted(os.listdir('/shared'))")).result == "[]"
        listed = await bob.execute("%pip list --user")
        assert PROBE_PACKAGE not in streams(listed), streams(listed)
        # The shell's way, as many notebooks write it: the same as %pip, not the venv's pip refusing --user.
        await people.put_wheels(bob)
        probe = next(name for name in people.wheels if name.startswith(PROBE_PACKAGE))
        installed = await bob.execute(f"!pip install --user --no-index /tmp/{probe}", timeout=180)
        assert "Successfully installed" in streams(installed) and installed.error is None, streams(installed)
        now = await where(bob, PROBE_PACKAGE)
        assert now.get("value") == PROBE_VALUE and now["file"].startswith("/shared/.python/default/"), now
        listed = await bob.execute("!python3 -m pip list --user")
        assert PROBE_PACKAGE in streams(listed), streams(listed)
        # In a cell magic's body the line is that language's, left as written.
        assert (await bob.execute("%%writefile /tmp/cell.txt\n!pip list --user\n")).error is None
        assert (await bob.execute("open('/tmp/cell.txt').read()")).result == repr("!pip list --user\n")
    finally:
        await people.end("bob", kernel, bob)
    assert glob.glob(
        str(people.shared / registered("bob").key / ".python" / "default" / "lib" / "python3.*" / "site-packages" / PROBE_PACKAGE)
    )
    # On the host, everything each person's kernels wrote is that person's alone, whichever sandbox wrote it.
    for who in ("alice", "bob"):
        own = people.shared / registered(who).key
        owners = {(path.lstat().st_uid, path.lstat().st_gid) for path in [own, *own.rglob("*")]}
        assert len(owners) == 1 and own.stat().st_mode & 0o777 == 0o700, (who, owners, oct(own.stat().st_mode))
    assert people.shared.stat().st_mode & 0o777 == 0o755 and people.shared.stat().st_uid == os.geteuid()
    assert (people.shared / registered("alice").key).stat().st_uid != (people.shared / registered("bob").key).stat().st_uid


async def test_packages_of_another_python_are_not_loaded(people):
    """An environment whose Python went from 3.(X-1) to 3.X: the packages installed for the old one stay where they
    were (lib/python3.(X-1)/site-packages) and the kernel does not load them; it says the module is missing."""
    kernel, alice = await people.session("alice")
    try:
        version = (await alice.execute("import sys; '%d.%d' % sys.version_info[:2]")).result.strip("'")
        major, minor = version.split(".")
        older = (
            people.shared / registered("alice").key / ".python" / "default" / "lib" / f"python{major}.{int(minor) - 1}" / "site-packages"
        )
        older.mkdir(parents=True, exist_ok=True)
        (older / "msbolderpython.py").write_text("raise SystemError('built for another Python')\n")
        assert "No module named 'msbolderpython'" in (await where(alice, "msbolderpython")).get("error", "")
    finally:
        await people.end("alice", kernel, alice)


async def test_a_user_install_without_a_volume_says_which_setting_enables_it(start_kernel, monkeypatch):
    """A kernel without a shared volume (here: a local one, as nbclient or papermill start it) has nowhere to keep a
    person's packages: pip's refusal does not reach the user, and the message names the setting."""
    monkeypatch.delenv("MSB_SHARED_VOLUME_PATH", raising=False)
    from tests.kernel_helpers import execute

    _, kc = await start_kernel()
    done = await execute(kc, "%pip install --user msbenvprobe")
    assert done.status == "ok" and done.error is None, done.messages
    said = done.stdout + done.stderr
    assert "MSB_SHARED_VOLUME_PATH" in said and "Without --user" in said, said
    assert "Traceback" not in said and "Can not" not in said, said
