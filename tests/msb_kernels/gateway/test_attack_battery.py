"""The attack battery: each class of hole a person found around the team gateway, tried through every way a kernel
starts or starts again (REST, /api/sessions, MCP start_session, a pool hand-out, a restart, an auto-restart after the
kernel's own death, an adoption after ``kill -9``, a hibernation wake), on namespace and gVisor.

A real gateway with a users file (alice, bob), the operator's single token (MSB_TOKEN, an admin) and canaries in the
gateway's own environment; real sandboxed kernels; real clients (REST, the kernel WebSocket in both framings, the MCP
SDK). What a kernel holds is read from inside it: its environment, every /proc/*/environ and cmdline it can read, and
every file of its io directory, home, /tmp, working directory and volume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from mcp_bridge import jupyter_ws
from msb_kernels.identity.people import login_name
from tests.conftest import TEST_BASE, VENV_BIN
from tests.msb_kernels.gateway.conftest import (
    Gateway,
    KernelSocket,
    add_user,
    canary_probe,
    launch_gateway,
    mcp_client,
    registered,
    wait_until,
)
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]

# What the gateway's own environment holds beside MSB_TOKEN: no kernel may ever see a byte of it.
CANARIES = {
    "SOME_DB_PASSWORD": "canary-db-" + uuid.uuid4().hex,
    "AWS_SECRET_ACCESS_KEY": "canary-aws-" + uuid.uuid4().hex,
    "GITHUB_TOKEN": "canary-gh-" + uuid.uuid4().hex,
}
BOBS_SECRET = "bob-private-" + uuid.uuid4().hex  # in bob's directory of the shared volume
# What a client sent to read the gateway's environment (the marker the provisioner once followed), and to pose as bob:
# KERNEL_* names only, as tried live (a name of the session's own would have had the gateway rewrite the marker).
ATTACK_ENV = {"KERNEL_ENV_NAMES": "MSB_TOKEN," + ",".join(CANARIES), "KERNEL_USERNAME": "bob"}


class Team:
    def __init__(self, gateway: Gateway, tokens: dict[str, str], admin_token: str, shared: Path, backend: str):
        self.gateway, self.tokens, self.admin_token, self.shared, self.backend = gateway, tokens, admin_token, shared, backend

    def token(self, who: str) -> str:
        return self.admin_token if who == "operator" else self.tokens[who]

    @property
    def canaries(self) -> list[str]:
        return [self.admin_token, *self.tokens.values(), *CANARIES.values()]

    async def rest(self, who: str, method: str, path: str, body: Any = None) -> Any:
        return await self.gateway.request(method, path, body, token=self.token(who))

    async def start(self, who: str, env: dict | None = None) -> str:
        started = await self.rest(who, "POST", "/api/kernels", {"name": "msb-python-small", **({"env": env} if env else {})})
        assert started.code == 201, (started.code, started.body)
        return started.json["id"]

    async def probe(self, who: str, kernel: str, *, scan_volume: bool = True) -> dict:
        """What the kernel holds, read from inside it over the kernel WebSocket with its person's token."""
        roots = ["/run/kernel", "/tmp", *(["/shared"] if scan_volume else [])]
        others = [BOBS_SECRET] if scan_volume and who != "bob" else []  # bob's own file holds his secret: not another's
        code = canary_probe(self.canaries + others, roots)
        deadline = asyncio.get_running_loop().time() + 120
        while True:  # a kernel restarting after its death answers once its new sandbox listens
            socket = await KernelSocket.open(self.gateway, kernel, token=self.token(who))
            try:
                reply = await socket.execute(code, timeout=90)
            except (asyncio.TimeoutError, ConnectionError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                continue
            finally:
                socket.close()
            if reply.reply["content"]["status"] == "ok" and reply.stdout.strip():
                return json.loads(reply.stdout.strip().splitlines()[-1])
            assert asyncio.get_running_loop().time() < deadline, (reply.reply, reply.messages)

    async def assert_clean(self, who: str, kernel: str, route: str) -> dict:
        """No canary anywhere in the kernel, and (a person's) only their own directory of the volume."""
        person = who != "operator"
        seen = await self.probe(who, kernel, scan_volume=person)
        assert seen["found"] == [], f"{route}: the gateway's secrets reached {who}'s kernel: {seen['found']}"
        assert not {"MSB_TOKEN", *CANARIES} & set(seen["env"]), (route, seen["env"])
        assert seen["sandbox"] == self.backend, (route, seen["sandbox"])
        if person:
            assert seen["shared"] == [f"{who}.txt"], f"{route}: {who}'s kernel shows {seen['shared']} at /shared, not only their own"
        # Still theirs alone: bob neither lists nor reaches it.
        if who == "alice":
            assert kernel not in {k["id"] for k in (await self.rest("bob", "GET", "/api/kernels")).json}, route
            assert (await self.rest("bob", "GET", f"/api/kernels/{kernel}")).code == 404, route
        return seen


def team_environment(backend: str, users_file: Path, shared: Path, admin_token: str, **more: str | None) -> dict:
    return {
        "MSB_BACKEND": backend,
        "MSB_USERS_FILE": str(users_file),
        "MSB_TOKEN": admin_token,
        "MSB_SHARED_VOLUME_PATH": str(shared),
        **CANARIES,
        **more,
    }


def make_team_files(name: str) -> tuple[Path, dict[str, str], Path]:
    users_file = TEST_BASE / f"{name}-users.json"
    tokens = {who: add_user(users_file, who) for who in ("alice", "bob")}
    shared = TEST_BASE / f"{name}-shared"
    for who in ("alice", "bob"):
        # Each person's directory as the gateway keeps it (under their key), with a file of theirs, left by an earlier
        # kernel of theirs; the volume itself is root's, with default modes, as an operator made it.
        own = shared / registered(who).key
        own.mkdir(parents=True)
        (own / f"{who}.txt").write_text(BOBS_SECRET if who == "bob" else "alice's own\n")
        for path in (own, own / f"{who}.txt"):
            os.chown(path, registered(who).own.uid, registered(who).own.gid)
    return users_file, tokens, shared


@pytest.fixture(scope="module", params=BACKENDS)
async def team(request) -> AsyncIterator[Team]:
    backend = request.param
    users_file, tokens, shared = make_team_files(f"battery-{backend}")
    admin_token = uuid.uuid4().hex
    gateway = await launch_gateway(team_environment(backend, users_file, shared, admin_token, MSB_POOL_SIZE="python-small=1"))
    yield Team(gateway, tokens, admin_token, shared, backend)
    gateway.stop()


async def test_no_start_request_reaches_the_gateways_environment_or_another_persons_volume(team: Team) -> None:
    """REST with the marker that once named the admin token, /api/sessions, MCP start_session, a restart, an
    auto-restart after the kernel's own death, and a pool hand-out: nothing of the gateway's in any kernel."""
    # REST, with the marker, a forged KERNEL_USERNAME and a notebook's path.
    rest = await team.start("alice", ATTACK_ENV)
    await team.assert_clean("alice", rest, "REST")

    # The session's own variables reach it; KERNEL_ENV_NAMES is one of them, its value only text.
    socket = await KernelSocket.open(team.gateway, rest, token=team.tokens["alice"])
    try:
        shown = (await socket.execute("import os; print(os.environ['KERNEL_ENV_NAMES'], os.environ['KERNEL_USERNAME'])")).stdout
    finally:
        socket.close()
    assert shown.split() == [ATTACK_ENV["KERNEL_ENV_NAMES"], "bob"]  # a name, never an owner (bob sees none of it)

    # A restart starts it again from its own start request.
    assert (await team.rest("alice", "POST", f"/api/kernels/{rest}/restart")).code == 200
    await team.assert_clean("alice", rest, "restart")

    # Its own death: jupyter_client restarts it, from the same request.
    socket = await KernelSocket.open(team.gateway, rest, token=team.tokens["alice"])
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
        socket.send("execute_request", jupyter_ws.execute_content("import os; os._exit(3)"))
        await asyncio.sleep(1)
    socket.close()

    async def restarted() -> bool:
        stats = (await team.rest("operator", "GET", "/api/msb/stats")).json
        return any(s["id"] == rest and s["status"] == "restarted" for s in stats["recently_stopped"])

    await wait_until(restarted, 90, "the kernel's death to be seen and the kernel restarted")
    await team.assert_clean("alice", rest, "auto-restart after its death")

    # /api/sessions: a session's kernel is started for its path, never with the gateway's environment.
    session = await team.rest(
        "alice", "POST", "/api/sessions", {"path": "work/a.ipynb", "type": "notebook", "kernel": {"name": "msb-python-small"}}
    )
    assert session.code == 201, session.body
    await team.assert_clean("alice", session.json["kernel"]["id"], "/api/sessions")

    # MCP: KERNEL_* is no session's to set there; a session's own variables are.
    async with mcp_client(team.gateway, team.tokens["alice"]) as alice:
        refused = await alice.call_tool("start_session", {"env": {"KERNEL_ENV_NAMES": "MSB_TOKEN"}})
        assert refused.is_error and "KERNEL_ENV_NAMES" in refused.structured_content["error"]["message"], refused.structured_content
        started = await alice.call_tool("start_session", {"env": {"PROJECT": "demo"}})
        assert not started.is_error, started.structured_content
        (mcp_kernel,) = [session["id"] for session in started.structured_content["sessions"]]
    await team.assert_clean("alice", mcp_kernel, "MCP start_session")

    # A pool hand-out to the operator (the single token's person: the whole volume), and its restart.
    async def pool_ready() -> bool:
        return (await team.rest("operator", "GET", "/api/msb/stats")).json["pool"]["waiting"]["msb-python-small"] == 1

    await wait_until(pool_ready, 120, "the pool to hold a kernel")
    handed = (await team.rest("operator", "GET", "/api/msb/stats")).json["pool"]["handed_out"]
    pooled = await team.start("operator")
    assert (await team.rest("operator", "GET", "/api/msb/stats")).json["pool"]["handed_out"] == handed + 1
    await team.assert_clean("operator", pooled, "pool hand-out")
    assert (await team.rest("alice", "GET", f"/api/kernels/{pooled}")).code == 404  # the operator's now
    assert (await team.rest("operator", "POST", f"/api/kernels/{pooled}/restart")).code == 200
    await team.assert_clean("operator", pooled, "restart after a pool hand-out")

    for kernel, who in ((rest, "alice"), (mcp_kernel, "alice"), (pooled, "operator")):
        await team.rest(who, "DELETE", f"/api/kernels/{kernel}")
    await team.rest("alice", "DELETE", f"/api/sessions/{session.json['id']}")


async def test_a_person_named_after_the_login_user_is_not_the_single_tokens_person(team: Team, tmp_path) -> None:
    """The single token's person is named after the gateway's login user (root, here): a users-file person of that
    name is another owner, and sees none of the single token's kernels."""
    name = login_name()
    users_file = Path(team.gateway.env["MSB_USERS_FILE"])
    namesake = add_user(users_file, name)
    try:
        operators = await team.start("operator")
        listed = await team.gateway.request("GET", "/api/kernels", token=namesake)
        assert operators not in {k["id"] for k in listed.json}, listed.json
        assert (await team.gateway.request("GET", f"/api/kernels/{operators}", token=namesake)).code == 404
        theirs = (await team.gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=namesake)).json["id"]
        stats = (await team.rest("operator", "GET", "/api/msb/stats")).json
        owners = {k["id"]: k["owner"] for k in stats["kernels"]}
        assert owners[operators] == owners[theirs] == name  # the same name, two owners
        await team.rest("operator", "DELETE", f"/api/kernels/{operators}")
        await team.gateway.request("DELETE", f"/api/kernels/{theirs}", token=namesake)
    finally:
        subprocess.run([str(VENV_BIN / "msb-kernels"), "users", "remove", name, "--file", str(users_file)], check=True, capture_output=True)


async def test_two_people_with_the_same_notebook_path_each_keep_one_kernel(team: Team) -> None:
    """jupyter_server finds a session by path with the first row that has it: here each person's lookups find their
    own, so bob's repeated starts for alice's path reuse his one kernel, and his lookups by path succeed."""
    body = {"path": "Untitled.ipynb", "type": "notebook", "kernel": {"name": "msb-python-small"}}
    first = {who: await team.rest(who, "POST", "/api/sessions", body) for who in ("alice", "bob")}
    assert all(r.code == 201 for r in first.values()), {who: r.body for who, r in first.items()}
    assert first["alice"].json["kernel"]["id"] != first["bob"].json["kernel"]["id"]
    for _ in range(3):
        for who in ("alice", "bob"):
            again = await team.rest(who, "POST", "/api/sessions", body)
            assert again.code == 201 and again.json["id"] == first[who].json["id"], (who, again.body)
            assert again.json["kernel"]["id"] == first[who].json["kernel"]["id"]
    for who, other in (("alice", "bob"), ("bob", "alice")):
        listed = (await team.rest(who, "GET", "/api/sessions")).json
        assert [s["id"] for s in listed if s["path"] == "Untitled.ipynb"] == [first[who].json["id"]], listed
        assert (await team.rest(who, "GET", f"/api/sessions/{first[other].json['id']}")).code == 404
    kernels = {who: [k["id"] for k in (await team.rest(who, "GET", "/api/kernels")).json] for who in ("alice", "bob")}
    assert kernels["bob"].count(first["bob"].json["kernel"]["id"]) == 1 and first["alice"].json["kernel"]["id"] not in kernels["bob"]
    # A rename moves the caller's own session; the other person's stays where it was.
    renamed = await team.rest("bob", "PATCH", f"/api/sessions/{first['bob'].json['id']}", {"path": "Renamed.ipynb"})
    assert renamed.code == 200 and renamed.json["path"] == "Renamed.ipynb", renamed.body
    assert (await team.rest("alice", "GET", f"/api/sessions/{first['alice'].json['id']}")).json["path"] == "Untitled.ipynb"
    for who in ("alice", "bob"):
        assert (await team.rest(who, "DELETE", f"/api/sessions/{first[who].json['id']}")).code == 204


# jupyter_server's routes that are not what the gateway is for: absent (a JSON 404, as any unknown path).
ABSENT = [
    ("GET", "/api/resolvePath?path=README.md"),
    ("GET", "/api/resolvePath?path=users.json"),
    ("GET", "/api/me"),
    ("GET", "/api/spec.yaml"),
    ("GET", "/files/README.md"),
    ("GET", "/static/nope"),
    ("GET", "/static/base/images/favicon.ico"),
    ("GET", "/robots.txt"),
    ("GET", "/favicon.ico"),
    ("GET", "/login"),
    ("GET", "/logout"),
    ("GET", "/api/contents"),
    ("GET", "/api/terminals"),
    ("GET", "/api/nbconvert"),
    ("GET", "/api/kernels/"),
    ("GET", "/tree"),
    ("GET", "/lab"),
]


async def test_only_what_the_gateway_is_for_is_served_and_no_page_carries_a_token(team: Team) -> None:
    """resolvePath and every other jupyter_server route beyond kernels, kernelspecs and sessions are absent; /api/status
    and /metrics are the admins'; every answer, error pages included, is JSON and carries no token."""
    root = await team.rest("alice", "GET", "/")  # JupyterHub's health check of its services: the health answer alone
    assert root.code == 200 and set(json.loads(root.body)) == {"status", "version"}, root.body
    for method, path in ABSENT:
        response = await team.rest("alice", method, path)
        assert response.code == 404, (path, response.code, response.body[:300])
        assert response.headers.get("Content-Type", "").startswith("application/json"), (path, response.headers)
    for path in ("/api/status", "/metrics"):
        assert (await team.rest("alice", "GET", path)).code == 403, path
        assert (await team.rest("operator", "GET", path)).code == 200, path
    # Every error a person can provoke, on every kind of handler: none is a page, none carries any token.
    errors = [
        ("GET", "/static/nope"),
        ("GET", "/metrics"),
        ("GET", "/api/status"),
        ("GET", "/kernelspecs/x/y"),
        ("GET", "/kernelspecs/msb-python-small/nope.png"),
        ("GET", "/api/kernelspecs/nope"),
        ("GET", "/api/kernels/00000000-0000-0000-0000-000000000000"),
        ("GET", "/api/kernels/00000000-0000-0000-0000-000000000000/channels"),
        ("POST", "/api/kernels/00000000-0000-0000-0000-000000000000/restart"),
        ("GET", "/api/sessions/00000000-0000-0000-0000-000000000000"),
        ("POST", "/api/sessions"),
        ("POST", "/api/kernels"),
        ("PATCH", "/api/kernels"),
    ]
    for method, path in errors:
        for who in ("alice", "operator"):
            response = await team.rest(who, method, path, "{not json" if method in ("POST", "PATCH") else None)
            text = response.body.decode(errors="replace") + json.dumps(response.headers)
            assert not [t for t in team.canaries if t in text], (who, method, path, response.code)
            assert "data-jupyter-api-token" not in text and "<html" not in text.lower(), (who, method, path, text[:300])
    logo = await team.rest("alice", "GET", "/kernelspecs/msb-python-small/logo-64x64.png")
    assert logo.code == 200 and logo.headers["Content-Type"] == "image/png"


async def test_the_audit_reads_what_runs_whatever_its_spelling(team: Team) -> None:
    """An execute_request whose msg_type is spelled with a JSON escape runs, on shell and on control, in either framing
    of the kernel WebSocket: each is an audit line."""
    kernel = await team.start("alice")
    lines_before = len(audit_lines(team.gateway))
    sent: list[str] = []
    # The JSON framing: the header's msg_type escaped, as JSON allows.
    socket = await KernelSocket.open(team.gateway, kernel, token=team.tokens["alice"])
    try:
        for channel, code in (("shell", "print('escaped-shell')"), ("control", "print('escaped-control')")):
            request = jupyter_ws.message(channel, "execute_request", jupyter_ws.execute_content(code), session=socket.session, username="a")
            raw = jupyter_ws.encode(request).replace('"execute_request"', '"execute\\u005frequest"')
            assert "execute_request" not in raw
            socket.connection.write_message(raw)
            sent.append(code)
            reply = await socket.wait_for(request["header"]["msg_id"], lambda m: m["msg_type"] == "execute_reply", 60)
            assert reply["content"]["status"] == "ok", reply  # it ran
    finally:
        socket.close()
    # The v1 binary framing, which jupyter_server passes on unparsed.
    from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1

    url = jupyter_ws.channels_url(team.gateway.url, kernel, uuid.uuid4().hex)
    headers = {"Authorization": f"token {team.tokens['alice']}"}
    v1 = await websocket_connect(HTTPRequest(url, headers=headers), subprotocols=["v1.kernel.websocket.jupyter.org"])
    try:
        code = "print('escaped-v1')"
        request = jupyter_ws.message("shell", "execute_request", jupyter_ws.execute_content(code), session=uuid.uuid4().hex, username="a")
        header = json.dumps(request["header"]).replace('"execute_request"', '"execute\\u005frequest"').encode()
        frames = [header, b"{}", b"{}", json.dumps(request["content"]).encode()]
        v1.write_message(serialize_msg_to_ws_v1(frames, "shell"), binary=True)
        sent.append(code)
        while True:
            message = await asyncio.wait_for(v1.read_message(), 60)
            assert message is not None, "the v1 WebSocket closed"
            if isinstance(message, bytes) and b"escaped-v1" in message:
                break  # its output: it ran
    finally:
        v1.close()
    executes = [line for line in audit_lines(team.gateway)[lines_before:] if line["event"] == "execute" and line["kernel"] == kernel]
    assert len(executes) == len(sent), executes
    assert all(line["person"] == "alice" and line["code_chars"] in {len(c) for c in sent} for line in executes), executes
    await team.rest("alice", "DELETE", f"/api/kernels/{kernel}")


def audit_lines(gateway: Gateway) -> list[dict]:
    return [json.loads(line.split(" audit ", 1)[1]) for line in gateway.log().splitlines() if " audit {" in line]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_adopted_kernels_restarts_mount_only_its_persons_volume(backend: str) -> None:
    """alice's kernel, adopted after the gateway was killed with -9, restarts (asked, and after its own death) from the
    start request it was first started with: her directory of the volume, nothing of the new gateway's environment."""
    users_file, tokens, shared = make_team_files(f"adopted-{backend}")
    admin_token = uuid.uuid4().hex
    environment = team_environment(backend, users_file, shared, admin_token, MSB_POOL_SIZE="python-small=0")
    first = await launch_gateway(environment)
    try:
        team = Team(first, tokens, admin_token, shared, backend)
        kernel = await team.start("alice", ATTACK_ENV)
        await team.assert_clean("alice", kernel, "before adoption")
    finally:
        first.stop(signal.SIGKILL)
    second = await launch_gateway(environment, runtime_dir=first.runtime_dir, port=first.port, token=admin_token)
    try:
        team = Team(second, tokens, admin_token, shared, backend)
        assert "adopted 1 kernel" in second.log(), second.log()[-2000:]
        await team.assert_clean("alice", kernel, "adopted")
        assert (await team.rest("alice", "POST", f"/api/kernels/{kernel}/restart")).code == 200
        await team.assert_clean("alice", kernel, "restart after adoption")
        socket = await KernelSocket.open(second, kernel, token=tokens["alice"])
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            socket.send("execute_request", jupyter_ws.execute_content("import os; os._exit(3)"))
            await asyncio.sleep(1)
        socket.close()
        await asyncio.sleep(2)
        await team.assert_clean("alice", kernel, "auto-restart after adoption")
    finally:
        second.stop()


@needs_runsc
async def test_a_hibernated_kernel_wakes_as_it_was_started_and_shares_count_sleeping_kernels() -> None:
    """gVisor's hibernation: a wake restores the kernel its start request made. alice's memory share counts her
    sleeping kernels: past it she is refused, naming the setting, and bob's start and wake cost her nothing of his."""
    users_file, tokens, shared = make_team_files("hibernated")
    admin_token = uuid.uuid4().hex
    environment = team_environment(
        "gvisor",
        users_file,
        shared,
        admin_token,
        MSB_POOL_SIZE="python-small=0",
        MSB_HIBERNATE_AFTER_SECONDS="3",
        MSB_USER_MEMORY_MIB="2048",
    )
    gateway = await launch_gateway(environment)
    try:
        team = Team(gateway, tokens, admin_token, shared, "gvisor")

        async def asleep(kernel: str) -> bool:
            kernels = (await team.rest("operator", "GET", "/api/msb/stats")).json["kernels"]
            return any(k["id"] == kernel and k["execution_state"] == "hibernated" for k in kernels)

        first = await team.start("alice", ATTACK_ENV)
        await wait_until(lambda: asleep(first), 60, "alice's kernel to hibernate")
        await team.assert_clean("alice", first, "hibernation wake")
        await wait_until(lambda: asleep(first), 60, "alice's kernel to hibernate again")
        second = await team.start("alice")  # 2 x 1024 MiB: her share, one of them asleep
        refused = await team.rest("alice", "POST", "/api/kernels", {"name": "msb-python-small"})
        assert refused.code == 429 and refused.json["limit"] == "user_memory", refused.body
        assert "MSB_USER_MEMORY_MIB=2048" in refused.json["message"] and "hibernated" in refused.json["message"]
        # bob is not touched by any of it: he starts, sleeps and wakes at once.
        bobs = await team.start("bob")
        await wait_until(lambda: asleep(bobs), 60, "bob's kernel to hibernate")
        await team.assert_clean("bob", bobs, "bob's wake")
        for kernel, who in ((first, "alice"), (second, "alice"), (bobs, "bob")):
            await team.rest(who, "DELETE", f"/api/kernels/{kernel}")
    finally:
        gateway.stop()


@needs_runsc
async def test_a_wake_past_a_persons_share_is_refused_by_name_and_costs_nobody_else_their_wake() -> None:
    """A share lowered under what a person already holds (the operator's next gateway, with MSB_USER_MEMORY_MIB
    halved, adopts alice's two kernels): her wake is refused, 429 naming the setting, over REST-started kernels' own
    WebSocket; no kernel of anyone else's is put to sleep for it, and bob's wake goes through."""
    users_file, tokens, shared = make_team_files("lowered")
    admin_token = uuid.uuid4().hex
    common = {"MSB_POOL_SIZE": "python-small=0", "MSB_HIBERNATE_AFTER_SECONDS": "3"}
    before = team_environment("gvisor", users_file, shared, admin_token, MSB_USER_MEMORY_MIB="2048", **common)
    first = await launch_gateway(before, args=["--keep-kernels"])
    try:
        team = Team(first, tokens, admin_token, shared, "gvisor")
        alices = [await team.start("alice"), await team.start("alice")]
        bobs = await team.start("bob")
    finally:
        first.stop()
    after = team_environment("gvisor", users_file, shared, admin_token, MSB_USER_MEMORY_MIB="1024", **common)
    second = await launch_gateway(after, runtime_dir=first.runtime_dir, port=first.port, token=admin_token)
    try:
        team = Team(second, tokens, admin_token, shared, "gvisor")
        assert "adopted 3 kernel" in second.log(), second.log()[-2000:]

        async def states() -> dict:
            return {k["id"]: k["execution_state"] for k in (await team.rest("operator", "GET", "/api/msb/stats")).json["kernels"]}

        await wait_until(lambda: all_asleep(states, [*alices, bobs]), 90, "every adopted kernel to hibernate")
        from tornado.httpclient import HTTPClientError

        with pytest.raises(HTTPClientError) as refused:
            await KernelSocket.open(second, alices[0], token=tokens["alice"])
        assert refused.value.code == 429, refused.value
        body = json.loads(refused.value.response.body)
        assert body["limit"] == "user_memory" and "MSB_USER_MEMORY_MIB=1024" in body["message"], body
        assert (await states())[bobs] == "hibernated"  # nothing was put to sleep or woken for her refused wake
        await team.assert_clean("bob", bobs, "bob's wake beside alice's refused one")
        # alice stops one of hers: her other one wakes, within her share again.
        assert (await team.rest("alice", "DELETE", f"/api/kernels/{alices[1]}")).code == 204
        await team.assert_clean("alice", alices[0], "a wake within the share")
    finally:
        second.stop()


async def all_asleep(states: Any, kernels: list[str]) -> bool:
    now = await states()
    return all(now.get(kernel) == "hibernated" for kernel in kernels)


@pytest.mark.parametrize("operator_list", [{"MSB_ALLOW_NETWORK": "true"}, {"MSB_NETWORK_ALLOW": "*"}, {"MSB_NETWORK_ALLOW": "*:*"}])
async def test_a_sessions_network_list_only_narrows(gateway_factory, operator_list: dict) -> None:
    """Under the public internet (MSB_ALLOW_NETWORK, or ``*``), a session's list that names the LAN is refused before any
    sandbox starts, through REST and MCP alike; a narrower public list is granted."""
    gateway = await gateway_factory(extra_env={**operator_list, "MSB_POOL_SIZE": "python-small=0"})
    for lan in ("10.0.0.0/8:*,172.16.0.0/12:*,192.168.0.0/16:*", "10.1.2.3:443", "[fd00::/8]:*"):
        refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_NETWORK_ALLOW": lan}})
        assert refused.code == 400 and "is not within the operator's list" in refused.json["message"], (lan, refused.body)
    async with mcp_client(gateway) as client:
        refused = await client.call_tool("start_session", {"network_allow": ["10.0.0.0/8:*"]})
        assert refused.is_error and "network_allow" in refused.structured_content["error"]["message"], refused.structured_content
    assert not gateway.sandboxes()
    granted = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_NETWORK_ALLOW": "pypi.org"}})
    assert granted.code == 201, granted.body
    await gateway.request("DELETE", f"/api/kernels/{granted.json['id']}")
