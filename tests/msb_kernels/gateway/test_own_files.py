"""A person's own files (docs/teams.md, "Your files"): their notebook's folder and their volume, as themselves.

A real gateway with a users file, on namespace and gVisor: each person's Lab root is MSB_LAB_ROOT_PATH's
``<labs>/{username}`` (as JupyterHub's notebook_dir is each person's), their volume ``<shared>/<name>``. Both were made
by root with default modes, and nothing is opened up with chmod. What "alice's Lab" does here is what her single-user
server does as her host user: it writes her files as her.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TEST_BASE
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, add_user, launch_gateway, mcp_client
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a person's own host ids need a root gateway")]
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
ALICE_UID = 1_000_888_001  # alice's host user, who runs her Lab (LocalProcessSpawner's)


@dataclass
class Team:
    gateway: Gateway
    tokens: dict[str, str]
    labs: Path
    shared: Path

    async def kernel(self, who: str, working_dir: Path | None = None) -> tuple[str, KernelSocket]:
        env = {"KERNEL_WORKING_DIR": str(working_dir)} if working_dir else {}
        started = await self.gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": env}, token=self.tokens[who])
        assert started.code == 201, started.body
        return started.json["id"], await KernelSocket.open(self.gateway, started.json["id"], token=self.tokens[who])

    async def end(self, who: str, kernel: str, socket: KernelSocket) -> None:
        socket.close()
        assert (await self.gateway.request("DELETE", f"/api/kernels/{kernel}", token=self.tokens[who])).code == 204


def as_alices_lab(path: Path, text: str) -> None:
    """A file saved by alice's Lab: hers."""
    path.write_text(text)
    os.chown(path, ALICE_UID, ALICE_UID)


@pytest.fixture(scope="module", params=BACKENDS)
async def team(request) -> AsyncIterator[Team]:
    backend = request.param
    users_file = TEST_BASE / f"own-files-{backend}-users.json"
    tokens = {name: add_user(users_file, name) for name in ("alice", "bob")}
    labs, shared = TEST_BASE / f"own-files-{backend}-labs", TEST_BASE / f"own-files-{backend}-shared"
    for directory in (labs, shared):
        directory.mkdir(mode=0o755)
    (labs / "alice" / "project").mkdir(parents=True)  # her server's root, as the Hub's spawner made it: hers, 0700
    for directory in (labs / "alice", labs / "alice" / "project"):
        os.chown(directory, ALICE_UID, ALICE_UID)
    os.chmod(labs / "alice", 0o700)
    gateway = await launch_gateway(
        extra_env={
            "MSB_BACKEND": backend,
            "MSB_USERS_FILE": str(users_file),
            "MSB_TOKEN": None,
            "MSB_SHARED_VOLUME_PATH": str(shared),
            "MSB_LAB_ROOT_PATH": str(labs / "{username}"),
        }
    )
    yield Team(gateway, tokens, labs, shared)
    gateway.stop()


PROBE = """
import json, os
seen = {"cwd": os.getcwd(), "data": open("data.csv").read()}
open("out.csv", "w").write("x,y\\n3,4\\n")
print(json.dumps(seen))
"""


async def test_a_persons_kernels_work_in_their_notebooks_folder_as_them_and_nobody_elses_see_it(team: Team) -> None:
    project = team.labs / "alice" / "project"
    as_alices_lab(project / "data.csv", "a,b\n1,2\n")  # uploaded in her Lab's file browser
    kernel, alice = await team.kernel("alice", project)  # her notebook in project/ starts its kernel there
    try:
        reply = await alice.execute(PROBE)
        assert reply.error is None, reply.messages
        assert json.loads(reply.stdout) == {"cwd": str(project), "data": "a,b\n1,2\n"}
    finally:
        await team.end("alice", kernel, alice)
    # What her kernel wrote is hers on the host: her Lab lists, opens and saves it.
    written = project / "out.csv"
    assert (written.stat().st_uid, written.stat().st_gid) == (ALICE_UID, ALICE_UID) and written.read_text() == "x,y\n3,4\n"
    as_alices_lab(written, "x,y\n5,6\n")  # an edit saved in her Lab
    kernel, alice = await team.kernel("alice", project)
    try:
        assert (await alice.execute("open('out.csv').read()")).result == repr("x,y\n5,6\n")
    finally:
        await team.end("alice", kernel, alice)

    # bob asks for her folder by its path: his kernel starts in his home, and none of her files exist for it.
    kernel, bob = await team.kernel("bob", project)
    try:
        code = f"import os; print(os.getcwd(), os.path.exists({str(team.labs / 'alice')!r}), sorted(os.listdir({str(team.labs)!r})))"
        cwd, exists, listing = (await bob.execute(code)).stdout.split(" ", 2)
        assert (cwd, exists, listing.strip()) == ("/home/sandbox", "False", "['bob']")
    finally:
        await team.end("bob", kernel, bob)
    assert (team.labs / "bob").stat().st_uid not in (0, ALICE_UID) and (team.labs / "bob").stat().st_mode & 0o777 == 0o700


async def test_an_assistants_file_tools_see_the_persons_lab_and_volume_as_theirs(team: Team) -> None:
    project = team.labs / "alice" / "project"
    as_alices_lab(project / "saved.txt", "saved in Lab\n")
    async with mcp_client(team.gateway, team.tokens["alice"]) as client:
        started = await client.call_tool("start_session", {})
        assert not started.is_error, started.content[0].text
        session = started.structured_content["sessions"][0]["id"]
        try:
            for path in (str(project / "from-assistant.txt"), "/shared/notes/from-assistant.txt"):
                wrote = await client.call_tool("upload_file", {"session_id": session, "path": path, "content": "from the assistant\n"})
                assert not wrote.is_error, wrote.content[0].text
                back = await client.call_tool("download_file", {"session_id": session, "path": path})
                assert back.structured_content["content"] == "from the assistant\n"
            read = await client.call_tool("download_file", {"session_id": session, "path": str(project / "saved.txt")})
            assert not read.is_error and read.structured_content["content"] == "saved in Lab\n", read.content[0].text
        finally:
            await client.call_tool("stop_session", {"session_id": session})
    assert (project / "from-assistant.txt").stat().st_uid == ALICE_UID  # her Lab shows it, as hers
    own = team.shared / "alice"
    assert (own / "notes" / "from-assistant.txt").read_text() == "from the assistant\n"
    assert {p.stat().st_uid for p in (own, own / "notes", own / "notes" / "from-assistant.txt")} == {own.stat().st_uid}
    assert own.stat().st_uid != 0 and own.stat().st_mode & 0o777 == 0o700 and team.shared.stat().st_mode & 0o777 == 0o755
