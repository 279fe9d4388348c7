"""A gateway a team shares through a users file: each person sees and touches only their own kernels.

Real gateway, real kernels, real clients: REST, the kernel WebSocket, the MCP SDK's client over /mcp. Every refusal of
another person's kernel answers as if it did not exist, and no answer names the other person or their kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from mcp import Client
from tornado.httpclient import HTTPClientError

from tests.conftest import TEST_BASE, VENV_BIN
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, add_user, launch_gateway, mcp_client, registered, wait_until

pytestmark = pytest.mark.slow


class Team:
    def __init__(self, gateway: Gateway, tokens: dict[str, str], users_file: Path):
        self.gateway, self.tokens, self.users_file = gateway, tokens, users_file

    async def rest(self, who: str, method: str, path: str, body=None):
        return await self.gateway.request(method, path, body, token=self.tokens[who])


@pytest.fixture(scope="module")
async def team() -> AsyncIterator[Team]:
    users_file = TEST_BASE / "team-users.json"
    tokens = {name: add_user(users_file, name, admin=name == "ops") for name in ("alice", "bob", "ops")}
    # No MSB_TOKEN: with a users file, every token is a person's.
    shared = TEST_BASE / "team-shared"
    shared.mkdir(mode=0o755)  # as an operator makes it: each person's directory in it is made theirs
    gateway = await launch_gateway(
        extra_env={
            "MSB_USERS_FILE": str(users_file),
            "MSB_TOKEN": None,
            "MSB_MAX_SESSIONS_PER_USER": "2",
            "MSB_USER_MEMORY_MIB": "2048",
            "MSB_SHARED_VOLUME_PATH": str(shared),
        }
    )
    gateway.token = tokens["alice"]
    yield Team(gateway, tokens, users_file)
    gateway.stop()


@contextlib.asynccontextmanager
async def mcp_as(team: Team, who: str | None, token: str | None = None) -> AsyncIterator[Client]:
    async with mcp_client(team.gateway, token or team.tokens[who]) as client:
        yield client


def leaks(text: str, *secrets: str) -> list[str]:
    return [s for s in secrets if s in text]


async def test_another_persons_kernel_does_not_exist_for_them_on_any_route(team):
    gw = team.gateway
    started = await team.rest("alice", "POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_USERNAME": "bob"}})
    assert started.code == 201, started.body
    kernel = started.json["id"]
    own = await KernelSocket.open(gw, kernel, token=team.tokens["alice"])
    try:
        assert (await own.execute("secret = 41; secret + 1")).result == "42"
    finally:
        own.close()

    listed = await team.rest("bob", "GET", "/api/kernels")
    assert listed.code == 200 and kernel not in {k["id"] for k in listed.json}
    stats = await team.rest("bob", "GET", "/api/msb/stats")
    assert kernel not in stats.body.decode() and "alice" not in stats.body.decode()
    refusals = [
        await team.rest("bob", "GET", f"/api/kernels/{kernel}"),
        await team.rest("bob", "POST", f"/api/kernels/{kernel}/interrupt"),
        await team.rest("bob", "POST", f"/api/kernels/{kernel}/restart"),
        await team.rest("bob", "DELETE", f"/api/kernels/{kernel}"),
    ]
    guessed = await team.rest("bob", "GET", "/api/kernels/00000000-0000-0000-0000-000000000000")
    for refusal in refusals:
        assert refusal.code == guessed.code == 404, refusal.body
        assert not leaks(refusal.body.decode(), "alice")
    with pytest.raises(HTTPClientError) as refused:
        await KernelSocket.open(gw, kernel, token=team.tokens["bob"])
    assert refused.value.code == 404
    # A kernel id chosen by the client could tell a taken id from a free one: a person cannot choose one.
    chosen = await team.rest("bob", "POST", "/api/kernels", {"name": "msb-python-small", "kernel_id": kernel})
    assert chosen.code == 400 and not leaks(chosen.body.decode(), "alice"), chosen.body

    # The forged KERNEL_USERNAME did not make it bob's, and after all of that alice's kernel kept its state.
    assert kernel in {k["id"] for k in (await team.rest("alice", "GET", "/api/kernels")).json}
    again = await KernelSocket.open(gw, kernel, token=team.tokens["alice"])
    try:
        assert (await again.execute("secret")).result == "41"
    finally:
        again.close()
    owners = {k["id"]: k["owner"] for k in (await team.rest("ops", "GET", "/api/msb/stats")).json["kernels"]}
    assert owners[kernel] == "alice"  # the admin sees every kernel, and whose it is
    assert (await team.rest("alice", "DELETE", f"/api/kernels/{kernel}")).code == 204


async def test_sessions_of_another_person_are_skipped_not_deleted(team):
    created = await team.rest(
        "alice", "POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "kernel": {"name": "msb-python-small"}}
    )
    assert created.code == 201, created.body
    session = created.json["id"]
    try:
        bobs = await team.rest("bob", "GET", "/api/sessions")
        assert bobs.code == 200 and session not in bobs.body.decode()
        assert (await team.rest("bob", "GET", f"/api/sessions/{session}")).code == 404
        assert (await team.rest("bob", "DELETE", f"/api/sessions/{session}")).code == 404
        assert session in {s["id"] for s in (await team.rest("alice", "GET", "/api/sessions")).json}
    finally:
        await team.rest("alice", "DELETE", f"/api/sessions/{session}")


async def test_tokens_nobody_issued_are_refused_and_metrics_are_for_admins(team):
    for token in (None, "made-up", team.tokens["alice"][:-1]):
        response = await team.gateway.request("GET", "/api/kernels", token=token)
        assert response.code in (401, 403), (token, response.code)
    assert (await team.rest("alice", "GET", "/metrics")).code == 403
    metrics = await team.rest("ops", "GET", "/metrics")
    assert metrics.code == 200
    assert "msb_sessions_per_person" in metrics.body.decode()
    # A person removed from the file is refused at once (the gateway rereads the file).
    carol = add_user(team.users_file, "carol")
    assert (await team.gateway.request("GET", "/api/kernels", token=carol)).code == 200
    subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "users", "remove", "carol", "--file", str(team.users_file)], check=True, capture_output=True
    )
    assert (await team.gateway.request("GET", "/api/kernels", token=carol)).code == 403


async def test_an_assistant_sees_and_touches_only_its_persons_sessions(team):
    async with mcp_as(team, "alice") as alice:
        started = await alice.call_tool("execute_code", {"code": "mine = 'alice-data'; 6 * 7"})
        assert not started.is_error, started.content[0].text
        session = started.structured_content["session_id"]
        execution = started.structured_content.get("execution_id")
    try:
        async with mcp_as(team, "bob") as bob:
            listed = await bob.call_tool("get_sessions", {})
            assert session not in json.dumps(listed.structured_content)
            for tool, arguments in (
                ("execute_code", {"code": "mine", "session_id": session}),
                ("execute_command", {"command": "id", "session_id": session}),
                ("get_sessions", {"session_id": session}),
                ("interrupt_session", {"session_id": session}),
                ("restart_session", {"session_id": session}),
                ("stop_session", {"session_id": session}),
                ("get_execution_output", {"session_id": session, "execution_id": execution or "x"}),
                ("download_file", {"session_id": session, "path": "/etc/hostname"}),
                ("upload_file", {"session_id": session, "path": "/tmp/from-bob.txt", "content": "bob was here"}),
            ):
                refused = await bob.call_tool(tool, arguments)
                assert refused.is_error, (tool, refused.content[0].text)
                assert refused.structured_content["error"]["type"] == "SessionNotFound", (tool, refused.structured_content)
                assert not leaks(json.dumps(refused.structured_content), "alice", "alice-data"), tool
        async with mcp_as(team, "ops") as ops:  # an admin's assistant sees every person's sessions
            assert session in json.dumps((await ops.call_tool("get_sessions", {})).structured_content)
        async with mcp_as(team, "alice") as alice:
            again = await alice.call_tool("execute_code", {"code": "mine", "session_id": session})
            assert again.structured_content["results"][0]["data"]["text/plain"] == "'alice-data'"
    finally:
        await team.rest("alice", "DELETE", f"/api/kernels/{session}")


async def test_an_mcp_session_is_bound_to_the_person_who_opened_it(team):
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    async with httpx2.AsyncClient(timeout=30) as http:
        opened = await http.post(
            team.gateway.url + "/mcp", json=initialize, headers={**headers, "Authorization": f"Bearer {team.tokens['alice']}"}
        )
        assert opened.status_code == 200, opened.text
        mcp_session = opened.headers["mcp-session-id"]
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        hijack = await http.post(
            team.gateway.url + "/mcp",
            json=listing,
            headers={
                **headers,
                "Authorization": f"Bearer {team.tokens['bob']}",
                "mcp-session-id": mcp_session,
                "mcp-protocol-version": "2025-06-18",
            },
        )
        assert hijack.status_code == 404, hijack.text
        anonymous = await http.post(team.gateway.url + "/mcp", json=initialize, headers=headers)
        assert anonymous.status_code == 401
        challenge = anonymous.headers["www-authenticate"]
        assert challenge.startswith("Bearer ") and "resource_metadata=" in challenge
        metadata_url = challenge.split('resource_metadata="', 1)[1].split('"', 1)[0]
        metadata = (await http.get(metadata_url)).json()
        assert metadata["resource"] == team.gateway.url + "/mcp" and metadata["bearer_methods_supported"] == ["header"]


async def test_a_persons_memory_share_refuses_a_flavor_past_it_and_names_their_use(team):
    refused = await team.rest("bob", "POST", "/api/kernels", {"name": "msb-python-large"})
    assert refused.code == 429 and refused.json["limit"] == "user_memory", refused.body
    assert (
        "bob's kernels hold 0 MiB of MSB_USER_MEMORY_MIB=2048 (hibernated ones included); a large kernel (4096 MiB) does not fit"
        in refused.json["message"]
    )
    assert any("small" in suggestion for suggestion in refused.json["suggestions"]), refused.json
    fits = await team.rest("bob", "POST", "/api/kernels", {"name": "msb-python-medium"})  # 2048 MiB: his whole share
    assert fits.code == 201, fits.body
    await team.rest("bob", "DELETE", f"/api/kernels/{fits.json['id']}")


async def test_one_person_at_their_share_costs_the_others_nothing(team):
    bobs = [(await team.rest("bob", "POST", "/api/kernels", {"name": "msb-python-small"})).json["id"] for _ in range(2)]
    try:
        refused = await team.rest("bob", "POST", "/api/kernels", {"name": "msb-python-small"})
        assert refused.code == 429, refused.body
        assert refused.json["limit"] == "max_sessions_per_user"
        assert "bob runs 2 of MSB_MAX_SESSIONS_PER_USER=2" in refused.json["message"], refused.json
        began = time.monotonic()
        alices = await team.rest("alice", "POST", "/api/kernels", {"name": "msb-python-small"})
        assert alices.code == 201, alices.body
        assert time.monotonic() - began < 15  # started at once, as when bob had no kernel
        await team.rest("alice", "DELETE", f"/api/kernels/{alices.json['id']}")
    finally:
        for kernel in bobs:
            await team.rest("bob", "DELETE", f"/api/kernels/{kernel}")


def audit_lines(gateway: Gateway) -> list[dict]:
    return [json.loads(line.split(" audit ", 1)[1]) for line in gateway.log().splitlines() if " audit {" in line]


async def test_the_audit_trail_has_a_line_per_start_execution_call_stop_and_refusal(team):
    gw = team.gateway
    kernel = (await team.rest("alice", "POST", "/api/kernels", {"name": "msb-python-small"})).json["id"]
    socket = await KernelSocket.open(gw, kernel, token=team.tokens["alice"])
    try:
        assert (await socket.execute("password = 'hunter2'; len(password)")).result == "7"
    finally:
        socket.close()
    assert (await team.rest("bob", "GET", f"/api/kernels/{kernel}")).code == 404
    assert (await team.rest("bob", "POST", f"/api/kernels/{kernel}/interrupt")).code == 404
    await gw.request("GET", "/api/kernels", token="not-a-token")
    async with mcp_as(team, "alice") as alice:
        await alice.call_tool("execute_code", {"code": "1 + 1", "session_id": kernel})
    await team.rest("alice", "DELETE", f"/api/kernels/{kernel}")
    lines = audit_lines(gw)
    mine = [line for line in lines if line.get("kernel") == kernel]
    events = {(line["event"], line["person"], line["outcome"]) for line in mine}
    assert ("start", "alice", "ok") in events, mine
    assert ("execute", "alice", "sent") in events, mine
    assert ("refusal", "bob", "not the caller's kernel") in events, mine
    refusals = [line for line in mine if line["event"] == "refusal" and line["person"] == "bob"]
    assert [line["client"].split(":")[0] for line in refusals] == ["rest", "rest"], refusals  # the GET and the interrupt
    assert ("mcp_call", "alice", "ok") in events, mine
    assert ("stop", "alice", "shutdown") in events, mine
    executed = next(line for line in mine if line["event"] == "execute")
    assert executed["code_chars"] == len("password = 'hunter2'; len(password)") and len(executed["code_sha256"]) == 64
    assert "hunter2" not in gw.log()  # the code is known by its digest only
    assert any(line["event"] == "refusal" and line["outcome"] == "unknown token" for line in lines)
    assert next(line for line in mine if line["event"] == "mcp_call")["client"].startswith("mcp: ")
    assert all(set(line) >= {"ts", "event", "person", "kernel", "client", "outcome"} for line in lines)


def test_a_users_file_others_can_read_is_refused_with_the_chmod_that_fixes_it(tmp_path):
    users_file = tmp_path / "users.json"
    add_user(users_file, "alice")
    users_file.chmod(0o644)
    result = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "serve", "--port", "1"],
        env={**os.environ, "MSB_USERS_FILE": str(users_file), "MSB_RUNTIME_DIR": str(tmp_path / "rt")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"chmod 600 {users_file}" in result.stderr and "0644" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def test_each_person_has_their_own_directory_of_the_shared_volume(team):
    shared = TEST_BASE / "team-shared"
    async with mcp_as(team, "alice") as alice:
        wrote = await alice.call_tool(
            "execute_code", {"code": "open('/shared/notes.txt', 'w').write('alice-only'); import os; os.listdir('/shared')"}
        )
        assert not wrote.is_error, wrote.content[0].text
        alice_session = wrote.structured_content["session_id"]
        volume = await alice.call_tool("get_volume_path", {})
        assert str(shared / registered("alice").key) in volume.structured_content["description"]
    async with mcp_as(team, "bob") as bob:
        looked = await bob.call_tool(
            "execute_code",
            {"code": "import os; sorted(os.listdir('/shared')), os.path.exists('/shared/../alice'), os.path.exists('/shared/notes.txt')"},
        )
        assert looked.structured_content["results"][0]["data"]["text/plain"] == "([], False, False)", looked.content[0].text
        bob_session = looked.structured_content["session_id"]
        assert str(shared / registered("bob").key) in (await bob.call_tool("get_volume_path", {})).structured_content["description"]
    assert (shared / registered("alice").key / "notes.txt").read_text() == "alice-only"
    assert not (shared / registered("bob").key / "notes.txt").exists()
    for who, session in (("alice", alice_session), ("bob", bob_session)):
        await team.rest(who, "DELETE", f"/api/kernels/{session}")


def test_sessions_per_person_keep_a_bounded_label_set():
    from types import SimpleNamespace

    from msb_kernels.gateway.scrape import PEOPLE_LABELS, sessions_per_person
    from msb_kernels.identity.people import Owner

    records = [SimpleNamespace(owner=Owner("users-file", f"person{i}")) for i in range(300)]
    records += [SimpleNamespace(owner=Owner("hub", "busy"))] * 5
    records.append(SimpleNamespace(owner=None))
    samples = {sample.labels["person"]: sample.value for sample in sessions_per_person(records).samples}
    assert len(samples) == PEOPLE_LABELS + 1 and samples["busy"] == 5 and sum(samples.values()) == 306
    assert samples["(others)"] == 306 - sum(v for k, v in samples.items() if k != "(others)")


async def test_a_pooled_kernel_is_nobodys_until_handed_out_then_only_its_owners(gateway_factory, tmp_path):
    users_file = tmp_path / "users.json"
    tokens = {name: add_user(users_file, name) for name in ("alice", "bob")}
    gateway = await gateway_factory(extra_env={"MSB_USERS_FILE": str(users_file), "MSB_TOKEN": None, "MSB_POOL_SIZE": "python-small=1"})
    gateway.token = tokens["alice"]

    async def pooled() -> list:
        stats = await gateway.stats()
        return gateway.sandboxes() if stats["pool"]["waiting"]["msb-python-small"] == 1 else []

    (waiting,) = await wait_until(pooled, 60, "the pool to hold a started kernel")
    for who in ("alice", "bob"):  # a waiting kernel is no one's: no person lists it
        assert (await gateway.request("GET", "/api/kernels", token=tokens[who])).json == []
        assert (await gateway.request("GET", f"/api/kernels/{waiting.sandbox_id}", token=tokens[who])).code == 404
    kernel = await gateway.start_kernel()
    assert kernel == waiting.sandbox_id, "alice did not get the pooled kernel"
    assert [k["id"] for k in (await gateway.request("GET", "/api/kernels")).json] == [kernel]
    assert (await gateway.request("GET", "/api/kernels", token=tokens["bob"])).json == []
    assert (await gateway.request("GET", f"/api/kernels/{kernel}", token=tokens["bob"])).code == 404


async def test_the_culler_culls_every_persons_idle_kernel(gateway_factory, tmp_path):
    """The culler is the system's: started before any request, it sees every person's kernels, not those of whoever
    started a kernel first."""
    users_file = tmp_path / "users.json"
    tokens = {name: add_user(users_file, name) for name in ("alice", "bob")}
    env = {"MSB_USERS_FILE": str(users_file), "MSB_TOKEN": None, "MSB_SESSION_TIMEOUT_SECONDS": "3", "MSB_CULL_INTERVAL_SECONDS": "1"}
    gateway = await gateway_factory(extra_env=env)
    kernels = {
        who: (await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens[who])).json["id"]
        for who in ("alice", "bob")
    }

    async def all_culled() -> bool:
        codes = [(await gateway.request("GET", f"/api/kernels/{kernels[who]}", token=tokens[who])).code for who in kernels]
        return codes == [404, 404]

    await wait_until(all_culled, 60, "both people's idle kernels to be culled")
    culled = [line for line in audit_lines(gateway) if line["event"] == "stop" and line["outcome"] == "culled"]
    assert {line["owner"] for line in culled} == {"alice", "bob"} and {line["person"] for line in culled} == {"system"}, culled


async def test_a_stop_amid_a_persons_request_stops_every_persons_kernel(gateway_factory, tmp_path):
    """A stop signal schedules the cleanup in the context it interrupted (tornado's add_callback_from_signal). With
    bob's kernel flooding his WebSocket, that is nearly always his; the stop is the system's all the same: alice's
    kernel and sandbox go too (they were left for the next start's sweep, a gVisor one's network namespaces with them)."""
    users_file = tmp_path / "users.json"
    tokens = {name: add_user(users_file, name) for name in ("alice", "bob")}
    gateway = await gateway_factory(extra_env={"MSB_USERS_FILE": str(users_file), "MSB_TOKEN": None, "MSB_POOL_SIZE": "0"})
    for who in ("alice", "bob"):
        started = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens[who])
        assert started.code == 201, started.body
    flood = await KernelSocket.open(gateway, started.json["id"], token=tokens["bob"])
    flood.send("execute_request", {"code": "while True: print('x' * 200, flush=True)", "silent": False})
    for _ in range(200):  # under way
        await flood.receive(30)
    assert len(gateway.sandboxes()) == 2
    gateway.stop()
    assert "Shutting down 2 kernels" in gateway.log(), gateway.log()[-3000:]
    assert gateway.sandboxes() == [], gateway.sandboxes()
