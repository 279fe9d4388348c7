"""A name an attacker chooses (issue 53): a person is an id, not a name.

A real gateway with a users file, Lab roots at MSB_LAB_ROOT_PATH=<labs>/{username} and a shared volume, on namespace
and gVisor. Beside the people's own, the Lab roots' parent holds a host login's real home (made with useradd, with an
``authorized_keys``) and a directory of root's with a token file in it: a person named like either is shown nothing of
it, and their start says which setting to change. Each person's files are one host id of their own in every place,
nobody else's, and never a login's.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mcp_bridge import jupyter_ws
from msb_kernels.identity.person_registry import PERSON_IDS
from tests.conftest import TEST_BASE
from tests.host_users import host_user
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, add_user, launch_gateway, mcp_client, registered, wait_until
from tests.parallel import HOST_USERS
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, HOST_USERS, pytest.mark.skipif(os.geteuid() != 0, reason="host logins and people's own host ids need root")]
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
LOGIN = "msbtvictim"  # a host login whose name a person of the users file takes
CANARY_KEY = "ssh-ed25519 AAAA-the-victims-own-key victim@host\n"
CANARY_TOKEN = "another-gateways-token-0123456789abcdef\n"


@dataclass
class Site:
    gateway: Gateway
    tokens: dict[str, str]
    labs: Path
    shared: Path
    login: pwd.struct_passwd

    async def start(self, who: str):
        return await self.gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=self.tokens[who])


@pytest.fixture(scope="module", params=BACKENDS)
async def site(request) -> AsyncIterator[Site]:
    name = f"names-{request.param}"
    labs, shared = TEST_BASE / f"{name}-labs", TEST_BASE / f"{name}-shared"
    for directory in (labs, shared):
        directory.mkdir(mode=0o755)
    with host_user(LOGIN) as login:
        home = labs / LOGIN  # the login's real home, where its name puts a person's Lab root
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "authorized_keys").write_text(CANARY_KEY)
        for path in (home, home / ".ssh", home / ".ssh" / "authorized_keys"):
            os.chown(path, login.pw_uid, login.pw_gid)
        os.chmod(home, 0o700)
        (labs / "rootdir").mkdir()  # root's: another gateway's state, say
        (labs / "rootdir" / "token").write_text(CANARY_TOKEN)
        users_file = TEST_BASE / f"{name}-users.json"
        tokens = {who: add_user(users_file, who) for who in ("alice", "bob", LOGIN, "rootdir")}
        gateway = await launch_gateway(
            extra_env={
                "MSB_USERS_FILE": str(users_file),
                "MSB_TOKEN": None,
                "MSB_BACKEND": request.param,
                "MSB_SHARED_VOLUME_PATH": str(shared),
                "MSB_LAB_ROOT_PATH": str(labs / "{username}"),
            }
        )
        try:
            yield Site(gateway, tokens, labs, shared, login)
        finally:
            gateway.stop()


def owners_under(path: Path) -> set[tuple[int, int]]:
    found = {(path.lstat().st_uid, path.lstat().st_gid)}
    for directory, names, files in os.walk(path):
        for entry in (*names, *files):
            st = os.lstat(os.path.join(directory, entry))
            found.add((st.st_uid, st.st_gid))
    return found


async def test_a_person_named_like_a_login_or_roots_directory_is_shown_none_of_it_and_told_why(site: Site) -> None:
    home = site.labs / LOGIN
    before = {"login": owners_under(home), "root": owners_under(site.labs / "rootdir")}
    for who in (LOGIN, "rootdir"):
        refused = await site.start(who)
        assert refused.code != 201, (who, refused.body)
        message = refused.body.decode()
        assert "MSB_LAB_ROOT_PATH" in message and "MSB_HOST_ACCOUNTS" in message and "not theirs" in message, message
        assert "Traceback" not in message
        # An assistant of theirs is told the same, over MCP.
        async with mcp_client(site.gateway, site.tokens[who]) as assistant:
            result = await assistant.call_tool("start_session", {})
            assert result.is_error and "MSB_LAB_ROOT_PATH" in result.structured_content["error"]["message"], result.structured_content
    # Nothing there changed hands, and the key file is as it was.
    assert (home / ".ssh" / "authorized_keys").read_text() == CANARY_KEY
    assert {"login": owners_under(home), "root": owners_under(site.labs / "rootdir")} == before
    assert before["login"] == {(site.login.pw_uid, site.login.pw_gid)}
    # Their volume directory, made before the refusal, is of their own ids: never the login's.
    victim = registered(LOGIN)
    made = site.shared / victim.key
    assert not made.exists() or (made.stat().st_uid == victim.own.uid != site.login.pw_uid)


WRITE_MINE = """
import os
open("/shared/mine.txt", "w").write("{who}")
open(os.path.join({root!r}, "mine.txt"), "w").write("{who}")
print(sorted(os.listdir({labs!r})), sorted(os.listdir("/shared")))
"""


async def test_each_persons_files_are_one_id_of_their_own_in_every_place_and_nobody_elses(site: Site) -> None:
    seen: dict[str, str] = {}
    for who in ("alice", "bob"):
        started = await site.start(who)
        assert started.code == 201, started.body
        socket = await KernelSocket.open(site.gateway, started.json["id"], token=site.tokens[who])
        try:
            reply = await socket.execute(WRITE_MINE.format(who=who, root=str(site.labs / who), labs=str(site.labs)))
            assert reply.error is None, reply.messages
            seen[who] = reply.stdout
        finally:
            socket.close()
            await site.gateway.request("DELETE", f"/api/kernels/{started.json['id']}", token=site.tokens[who])
    ids = {}
    for who in ("alice", "bob"):
        person = registered(who)
        volume, root = site.shared / person.key, site.labs / who
        assert (volume / "mine.txt").read_text() == (root / "mine.txt").read_text() == who
        # One id for the person, in the volume and in their Lab root, their own: no login's, no group's.
        assert owners_under(volume) == owners_under(root) == {(person.own.uid, person.own.gid)}
        assert person.own.uid in PERSON_IDS
        with pytest.raises(KeyError):
            pwd.getpwuid(person.own.uid)
        with pytest.raises(KeyError):
            grp.getgrgid(person.own.gid)
        ids[who] = person.own.uid
        # Each kernel saw only its own person's root in the Lab roots' parent, and only its own volume.
        assert seen[who].split("] [")[0].strip("[]'\n").split("', '") == [who] and "mine.txt" in seen[who]
    assert ids["alice"] != ids["bob"]


# What the kernel leaves at its reaper's exit_status before it dies (gVisor's init made the file already).
FIFO_AT_EXIT_STATUS = """
import contextlib, os
with contextlib.suppress(FileNotFoundError):
    os.unlink("/run/kernel/exit_status")
os.mkfifo("/run/kernel/exit_status")
os._exit(1)
"""
LINK_AT_EXIT_STATUS = FIFO_AT_EXIT_STATUS.replace(
    'os.mkfifo("/run/kernel/exit_status")', 'os.symlink("/etc/passwd", "/run/kernel/exit_status")'
)


@pytest.mark.parametrize("left", [FIFO_AT_EXIT_STATUS, LINK_AT_EXIT_STATUS], ids=["fifo", "link"])
async def test_a_kernel_that_leaves_a_fifo_or_a_link_at_its_exit_status_is_back_fresh_within_seconds(site: Site, left: str) -> None:
    started = await site.start("alice")
    assert started.code == 201, started.body
    kernel = started.json["id"]
    socket = await KernelSocket.open(site.gateway, kernel, token=site.tokens["alice"])
    try:
        assert (await socket.execute("before = 1")).error is None
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            socket.send("execute_request", jupyter_ws.execute_content(left))
            await asyncio.sleep(0.5)
    finally:
        socket.close()

    async def restarted() -> bool:
        stopped = (await site.gateway.request("GET", "/api/msb/stats", token=site.tokens["alice"])).json["recently_stopped"]
        return any(s["id"] == kernel and s["status"] == "restarted" for s in stopped)

    await wait_until(restarted, 20, "the kernel's death to be seen and the kernel restarted")
    socket = await KernelSocket.open(site.gateway, kernel, token=site.tokens["alice"])
    try:
        reply = await socket.execute_after_error("print('before' in globals())")
        assert reply.stdout.strip() == "False", reply.messages  # a fresh kernel
    finally:
        socket.close()
        await site.gateway.request("DELETE", f"/api/kernels/{kernel}", token=site.tokens["alice"])
