"""A person's own files (docs/teams.md, "Your files"): their notebook's folder and their volume, as themselves.

A real gateway with a users file, on namespace and gVisor: each person's Lab root is MSB_LAB_ROOT_PATH's
``<labs>/{username}`` (as JupyterHub's notebook_dir is each person's), their volume ``<shared>/<name>``. Both were made
by root with default modes, and nothing is opened up with chmod. What "alice's Lab" does here is what her single-user
server does as her host user: it writes her files as her.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from msb_kernels.backends.core import handout, iodir
from tests.conftest import TEST_BASE
from tests.msb_kernels.gateway.conftest import (
    Gateway,
    KernelSocket,
    add_user,
    init_pids,
    launch_gateway,
    mcp_client,
    registered,
    wait_until,
)
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a person's own host ids need a root gateway")]
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
# alice's own host ids, which the gateway's registry gives her and the operator runs her Lab as.
ALICE_UID = registered("alice").own.uid


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


async def launch_team(name: str, env: dict[str, str]) -> Team:
    """alice and bob of a users file, each with a Lab root under MSB_LAB_ROOT_PATH's ``<labs>/{username}`` and a
    volume under ``<shared>``, made by root with default modes. alice's root and its project/ are hers (0700), as the
    Hub's spawner makes them; bob's is made at his first start."""
    users_file = TEST_BASE / f"{name}-users.json"
    tokens = {who: add_user(users_file, who) for who in ("alice", "bob")}
    labs, shared = TEST_BASE / f"{name}-labs", TEST_BASE / f"{name}-shared"
    for directory in (labs, shared):
        directory.mkdir(mode=0o755)
    (labs / "alice" / "project").mkdir(parents=True)
    for directory in (labs / "alice", labs / "alice" / "project"):
        os.chown(directory, ALICE_UID, ALICE_UID)
    os.chmod(labs / "alice", 0o700)
    gateway = await launch_gateway(
        extra_env={
            "MSB_USERS_FILE": str(users_file),
            "MSB_TOKEN": None,
            "MSB_SHARED_VOLUME_PATH": str(shared),
            "MSB_LAB_ROOT_PATH": str(labs / "{username}"),
            **env,
        }
    )
    return Team(gateway, tokens, labs, shared)


@pytest.fixture(scope="module", params=BACKENDS)
async def team(request) -> AsyncIterator[Team]:
    made = await launch_team(f"own-files-{request.param}", {"MSB_BACKEND": request.param})
    yield made
    made.gateway.stop()


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
    own = team.shared / registered("alice").key
    assert (own / "notes" / "from-assistant.txt").read_text() == "from the assistant\n"
    assert {p.stat().st_uid for p in (own, own / "notes", own / "notes" / "from-assistant.txt")} == {own.stat().st_uid}
    assert own.stat().st_uid != 0 and own.stat().st_mode & 0o777 == 0o700 and team.shared.stat().st_mode & 0o777 == 0o755


# -- the warm pool, for people ---------------------------------------------------------------------------------------

POOLED_PROBE = """
import json, os, sys
import handed_mod  # her own package, in her volume's user site
open("pooled-out.csv", "w").write("p\\n")
open("/shared/from-pooled.txt", "w").write("p\\n")
print(json.dumps({"cwd": os.getcwd(), "data": open("data.csv").read(), "shared": sorted(os.listdir("/shared")),
                  "slots": os.path.exists("/run/msb-slots"), "mod": handed_mod.WHO}))
"""


HIBERNATE_AFTER = 3  # seconds idle


POOLED = ["namespace", pytest.param("gvisor, ipc", marks=needs_runsc), pytest.param("gvisor, tcp, hibernating", marks=needs_runsc)]


@pytest.fixture(scope="module", params=POOLED)
async def pooled_team(request) -> AsyncIterator[Team]:
    """alice and bob with a warm pool of one, whose kernels are started with nothing of anyone's: on namespace, and on
    gVisor over ipc and over tcp (gVisor's own network stack, in a network namespace of the sandbox's) with kernels
    that hibernate."""
    backend, *how = request.param.split(", ")
    env = {"MSB_BACKEND": backend, "MSB_POOL_SIZE": "python-small=1"}
    env.update({"MSB_HIBERNATE_AFTER_SECONDS": str(HIBERNATE_AFTER)} if "hibernating" in how else {"MSB_TRANSPORT": "ipc"})
    made = await launch_team("pooled-" + "-".join([backend, *how[:1]]), env)
    yield made
    made.gateway.stop()


async def pooled_kernel_waiting(team: Team, as_who: str) -> int:
    """How many kernels the pool has handed out, once it holds one waiting (the gateway's stats)."""

    async def waiting() -> dict | None:
        pool = (await team.gateway.request("GET", "/api/msb/stats", token=team.tokens[as_who])).json["pool"]
        return pool if pool["waiting"].get("msb-python-small") == 1 else None

    return (await wait_until(waiting, 180, "the pool to hold a kernel"))["handed_out"]


def waiting_kernel(team: Team) -> tuple[str, int]:
    """The pool's waiting kernel (the gateway's one sandbox while no session runs) and its sandbox's init pid; checked
    to hold nothing of anyone's: no directory mounted under its slots (gVisor), its placeholders empty (namespace)."""
    (record,) = team.gateway.sandboxes()
    if record.backend == "gvisor":
        slots = team.gateway.runtime_dir / record.sandbox_id / handout.SLOTS_DIR
        assert iodir.mounts_under(slots) == [slots]
    else:
        root = Path(f"/proc/{record.details['init_pid']}/root")
        assert os.listdir(root / "shared") == [] and os.listdir(root / str(team.labs).lstrip("/")) == []
    return record.sandbox_id, record.details["init_pid"]


async def test_a_pooled_kernel_is_handed_to_a_person_with_their_folder_and_volume_and_nothing_of_anyone_elses(pooled_team) -> None:
    team = pooled_team
    project = team.labs / "alice" / "project"
    as_alices_lab(project / "data.csv", "a,b\n")
    handed = await pooled_kernel_waiting(team, "alice")
    pooled, init_pid = waiting_kernel(team)
    # Her own package, as `%pip install --user` left it in her volume by an earlier kernel.
    volume = team.shared / registered("alice").key
    volume.mkdir(mode=0o700, exist_ok=True)
    os.chown(volume, ALICE_UID, ALICE_UID)
    site_dir = Path(sysconfig.get_path("purelib", "posix_user", vars={"userbase": str(volume / ".python" / "default")}))
    site_dir.mkdir(parents=True)
    (site_dir / "handed_mod.py").write_text("WHO = 'hers'\n")
    for path in [volume / ".python", *(volume / ".python").rglob("*")]:
        os.chown(path, volume.stat().st_uid, volume.stat().st_gid)

    kernel, alice = await team.kernel("alice", project)
    try:
        # The pool's kernel, in the sandbox that waited: not a fresh one under its id (what a failed hand-out starts).
        assert kernel == pooled and init_pids(team.gateway)[kernel] == init_pid
        stats = (await team.gateway.request("GET", "/api/msb/stats", token=team.tokens["alice"])).json
        assert stats["pool"]["handed_out"] == handed + 1 and stats["pool"]["hand_outs_failed"] == 0, stats["pool"]
        reply = await alice.execute(POOLED_PROBE)
        assert reply.error is None, reply.messages
        assert json.loads(reply.stdout) == {
            "cwd": str(project),
            "data": "a,b\n",
            "shared": [".python", "from-pooled.txt"],
            "slots": False,
            "mod": "hers",
        }
    finally:
        await team.end("alice", kernel, alice)
    assert (project / "pooled-out.csv").stat().st_uid == ALICE_UID
    assert (volume / "from-pooled.txt").stat().st_uid == volume.stat().st_uid != 0

    # The next one goes to bob: his own volume and home, nothing of hers.
    await pooled_kernel_waiting(team, "bob")
    kernel, bob = await team.kernel("bob", project)
    try:
        code = f"import os; print(os.getcwd(), os.path.exists({str(team.labs / 'alice')!r}), sorted(os.listdir('/shared')))"
        assert (await bob.execute(code)).stdout.split(" ", 2) == ["/home/sandbox", "False", "[]\n"]
    finally:
        await team.end("bob", kernel, bob)


@needs_runsc
@pytest.mark.parametrize("pooled_team", ["gvisor, tcp, hibernating"], indirect=True)
async def test_a_kernel_handed_out_by_the_pool_hibernates_and_wakes_with_its_persons_files(pooled_team) -> None:
    team = pooled_team
    project = team.labs / "alice" / "project"
    as_alices_lab(project / "before.txt", "before\n")
    await pooled_kernel_waiting(team, "alice")
    pooled, init_pid = waiting_kernel(team)
    kernel, alice = await team.kernel("alice", project)
    try:
        assert kernel == pooled and init_pids(team.gateway)[kernel] == init_pid
        assert (await alice.execute("kept = open('before.txt').read()")).error is None
        alice.close()

        async def hibernated() -> bool:
            model = await team.gateway.request("GET", f"/api/kernels/{kernel}", token=team.tokens["alice"])
            return model.json["execution_state"] == "hibernated"

        await wait_until(hibernated, 120, "her handed-out kernel to hibernate")
        alice = await KernelSocket.open(team.gateway, kernel, token=team.tokens["alice"])  # wakes it
        code = (
            "import os; open('/shared/after-wake.txt', 'w').write('w'); print(kept.strip(), os.getcwd(), open('before.txt').read().strip())"
        )
        assert (await alice.execute(code)).stdout.split() == ["before", str(project), "before"]
    finally:
        await team.end("alice", kernel, alice)
    volume = team.shared / registered("alice").key
    assert (volume / "after-wake.txt").stat().st_uid == volume.stat().st_uid != 0
