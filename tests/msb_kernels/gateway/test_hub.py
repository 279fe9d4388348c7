"""The gateway under JupyterHub, as a team runs it: deploy/jupyterhub/jupyterhub_config.py, two people, one gateway.

JupyterHub 6 from PyPI with configurable-http-proxy from npm (tests/hub.py), SharedPasswordAuthenticator with one
password, SimpleLocalProcessSpawner (``--allow-root`` as root), and the gateway as the Hub's managed service. Each
person's JupyterLab sends the gateway its own server token. Chromium logs in and runs a cell as a person does; bob's
tries at alice's kernel are refused as if it did not exist, and name neither her nor it.

The tests run in order and share one Hub: alice's kernel, made by the first, is what the others try to reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from bench.kernels import descendants
from mcp_bridge import jupyter_ws
from tests.hub import Hub, UserServer, launch_hub
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, LabPage, browser, driver  # noqa: F401 (fixtures)
from tests.msb_kernels.gateway.conftest import (
    START_TIMEOUT,
    KernelSocket,
    Response,
    alive_after,
    free_port,
    sandbox_records,
    wait_until,
)
from tests.skips import needs_hub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), needs_hub]

CACHE_SECONDS = 2  # the gateway's Hub-token cache (MSB_HUB_AUTH_CACHE_SECONDS): short, so a revocation shows soon
USERS = ("alice", "bob", "carol", "ada")  # carol is deleted by a test; ada is a Hub admin


@pytest.fixture(scope="module")
async def hub() -> AsyncIterator[Hub]:
    server = await launch_hub(users=USERS, admins=("ada",), env={"MSB_HUB_AUTH_CACHE_SECONDS": str(CACHE_SECONDS)})
    yield server
    server.stop()
    # The Hub stopped its managed gateway cleanly: every sandbox went with it.
    assert not sandbox_records(server.runtime_dir), sandbox_records(server.runtime_dir)


@pytest.fixture(scope="module")
async def alice_server(hub: Hub) -> UserServer:
    return await hub.start_server("alice")


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    """What the first test leaves for the others: alice's kernel id."""
    return {}


def alices_kernel(shared: dict[str, Any]) -> str:
    if "kernel" not in shared:
        pytest.skip("alice's kernel was not made: the first test of this module did not pass")
    return shared["kernel"]


def assert_names_nothing(response: Response, *secrets: str) -> None:
    text = response.body.decode(errors="replace") + " ".join(f"{k}: {v}" for k, v in response.headers.items())
    for secret in secrets:
        assert secret not in text, f"the answer ({response.code}) names {secret!r}: {text[:500]}"


def assert_as_if_absent(response: Response, guessed: Response, kernel: str, guess: str) -> None:
    """The answer about alice's kernel is the answer about a made-up id: a 404 that echoes only the id asked for
    (jupyter_server's "Kernel does not exist: <id>"), so it tells bob nothing he did not send."""
    assert response.code == guessed.code == 404, (response.code, response.body, guessed.code)
    assert response.body.replace(kernel.encode(), b"<id>") == guessed.body.replace(guess.encode(), b"<id>"), (response.body, guessed.body)
    assert_names_nothing(response, "alice")


async def channels_refusal(hub: Hub, kernel_id: str, token: str | None) -> Response:
    """The kernel WebSocket's answer: a client's connect must fail, and the plain answer to its upgrade request is
    what it would have been told."""
    url = jupyter_ws.channels_url(hub.gateway_url, kernel_id, uuid.uuid4().hex)
    with pytest.raises(HTTPClientError) as refused:
        connection = await jupyter_ws.connect(url, token, START_TIMEOUT)
        connection.close()
    upgrade = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    response = await hub.gateway("GET", f"api/kernels/{kernel_id}/channels", token=token, headers=upgrade)
    assert response.code == refused.value.code, (response.code, refused.value.code)
    return response


async def test_alice_logs_in_and_runs_a_cell_in_her_lab(hub: Hub, alice_server: UserServer, driver: Any, shared: dict) -> None:
    hub.login(driver, "alice")
    page = LabPage(driver, alice_server)
    page.open_lab()
    page.new_notebook(PYTHON)
    assert page.wait_for_text(page.run("x = 41; x + 1"), "text/plain", "42").strip() == "42"
    # The kernel is the gateway's, in a sandbox, and alice's token reaches it there.
    kernels = (await alice_server.request("GET", "/api/kernels")).json
    assert len(kernels) == 1, kernels
    shared["kernel"] = kernels[0]["id"]
    on_gateway = await hub.gateway("GET", f"api/kernels/{shared['kernel']}", token=hub.tokens["alice"])
    assert on_gateway.code == 200, (on_gateway.code, on_gateway.body)
    shown = page.wait_for_text(page.run("import os; print('sandbox:', os.environ['MSB_SANDBOX'])"), STDOUT, "sandbox:")
    assert shown.split()[1] in ("namespace", "gvisor", "microsandbox"), shown
    page.wait(lambda: [item for item in page.running_items() if "(sandbox" in item], "her kernel in Lab's running panel")
    # Lab asks its server to resolve a path a kernel names (opening a file from an output): the server's scope
    # answers; the kernel's resolves nothing (its files are the sandbox's), where jupyter_server's asserted (a 500).
    made = await alice_server.request("PUT", "/api/contents/data.csv", {"type": "file", "format": "text", "content": "a,b\n"})
    assert made.code in (200, 201), (made.code, made.body)
    resolved = await alice_server.request("GET", f"/api/resolvePath?path=data.csv&kernel={shared['kernel']}")
    assert resolved.code == 200, (resolved.code, resolved.body)
    assert [entry["scope"] for entry in resolved.json["resolved"]] == ["server"], resolved.json
    # Her notebook's kernel works in her server's root, her home: it reads the file her Lab saved, and what it writes
    # shows in her Lab's file browser (docs/teams.md, "Your files").
    cell = page.run("import os; open('from-her-kernel.txt', 'w').write('hers'); print(os.getcwd(), open('data.csv').read().strip())")
    shown = page.wait_for_text(cell, STDOUT, "a,b")
    assert shown.split() == [str(hub.state_dir / "home" / "alice"), "a,b"], shown
    page.wait(lambda: "from-her-kernel.txt" in page.file_browser_names(refresh=True), "her kernel's file in Lab's file browser")


async def test_bobs_lab_shows_none_of_alices_kernels(hub: Hub, driver: Any, shared: dict) -> None:
    kernel = alices_kernel(shared)
    bob_server = await hub.start_server("bob")
    listed = await bob_server.request("GET", "/api/kernels")
    assert listed.code == 200 and listed.json == [], (listed.code, listed.body)
    assert_names_nothing(listed, kernel, "alice")
    sessions = await bob_server.request("GET", "/api/sessions")
    assert sessions.code == 200 and sessions.json == [], (sessions.code, sessions.body)

    hub.login(driver, "bob")
    page = LabPage(driver, bob_server)
    page.open_lab()
    page.new_notebook(PYTHON)  # so the panel has a kernel to show: his own, and only his
    (own,) = [k["id"] for k in (await bob_server.request("GET", "/api/kernels")).json]
    assert own != kernel
    page.wait(lambda: [item for item in page.running_items() if "(sandbox" in item], "his kernel in Lab's running panel")
    assert len([item for item in page.running_items() if "(sandbox" in item]) == 1, page.running_items()
    await bob_server.request("DELETE", f"/api/kernels/{own}")


async def lab_kernel(server: UserServer, hub: Hub, path: str) -> tuple[str, KernelSocket]:
    """A notebook's kernel as Lab starts it (POST /api/sessions: its gateway client sends the notebook's folder), and
    a socket to it on the gateway as the server's person."""
    created = await server.request("POST", "/api/sessions", {"path": path, "type": "notebook", "kernel": {"name": "msb-python-small"}})
    assert created.code == 201, (created.code, created.body)
    kernel = created.json["kernel"]["id"]
    url = jupyter_ws.channels_url(hub.gateway_url, kernel, uuid.uuid4().hex)
    return created.json["id"], KernelSocket(await jupyter_ws.connect(url, hub.tokens[server.user], 60))


async def test_alices_kernels_work_in_her_labs_files_as_her_and_bobs_see_none_of_them(hub: Hub, alice_server: UserServer) -> None:
    """Her server's root is her home; the gateway shows it to her kernels only, at the same path, written as her. (Under
    the test's SimpleLocalProcessSpawner every server runs as the Hub's user, root, so what her Lab itself makes is
    root's, which her kernels read but do not write; LocalProcessSpawner's servers run as their person.)"""
    home = hub.state_dir / "home" / "alice"
    folder = home / "project"
    folder.mkdir(exist_ok=True)  # a folder of hers, as LocalProcessSpawner's Lab would make it
    os.chown(folder, home.stat().st_uid, home.stat().st_gid)
    # Lab's file browser uploads with this PUT.
    uploaded = await alice_server.request(
        "PUT", "/api/contents/project/data.csv", {"type": "file", "format": "text", "content": "a,b\n1,2\n"}
    )
    assert uploaded.code in (200, 201), (uploaded.code, uploaded.body)
    session, alice = await lab_kernel(alice_server, hub, "project/analysis.ipynb")
    try:
        ran = await alice.execute(
            "import os; open('out.csv', 'w').write('x,y\\n3,4\\n'); print(os.getcwd(), open('data.csv').read().split())"
        )
        assert ran.error is None and ran.stdout.split() == [str(home / "project"), "['a,b',", "'1,2']"], ran.messages
    finally:
        alice.close()
        await alice_server.request("DELETE", f"/api/sessions/{session}")
    # Lab lists it and opens it; on the host it is hers, as a file she saved would be.
    listed = await alice_server.request("GET", "/api/contents/project")
    assert "out.csv" in {entry["name"] for entry in listed.json["content"]}, listed.json
    opened = await alice_server.request("GET", "/api/contents/project/out.csv?type=file&format=text")
    assert opened.json["content"] == "x,y\n3,4\n", opened.json
    assert (home / "project" / "out.csv").stat().st_uid == home.stat().st_uid != 0
    saved = await alice_server.request("PUT", "/api/contents/project/out.csv", {"type": "file", "format": "text", "content": "x,y\n5,6\n"})
    assert saved.code == 200, (saved.code, saved.body)
    session, alice = await lab_kernel(alice_server, hub, "project/analysis.ipynb")  # her next kernel reads her edit
    try:
        assert (await alice.execute("open('out.csv').read()")).result == repr("x,y\n5,6\n")
    finally:
        alice.close()
        await alice_server.request("DELETE", f"/api/sessions/{session}")

    # bob's kernel, even asked to start in her folder, starts in his home and finds nothing of hers.
    bob_server = await hub.start_server("bob")
    assert "project" not in {entry["name"] for entry in (await bob_server.request("GET", "/api/contents")).json["content"]}
    started = await hub.gateway(
        "POST", "api/kernels", hub.tokens["bob"], {"name": "msb-python-small", "env": {"KERNEL_WORKING_DIR": str(home / "project")}}
    )
    assert started.code == 201, (started.code, started.body)
    bob = KernelSocket(
        await jupyter_ws.connect(jupyter_ws.channels_url(hub.gateway_url, started.json["id"], uuid.uuid4().hex), hub.tokens["bob"], 60)
    )
    try:
        seen = await bob.execute(f"import os; print(os.getcwd(), os.path.exists({str(home)!r}))")
        assert seen.stdout.split() == ["/home/sandbox", "False"], seen.messages
    finally:
        bob.close()
        assert (await hub.gateway("DELETE", f"api/kernels/{started.json['id']}", token=hub.tokens["bob"])).code == 204


async def test_under_the_shipped_config_a_user_install_lands_in_the_persons_own_volume(hub: Hub, alice_server: UserServer) -> None:
    """Run as shipped, with no MSB_SHARED_VOLUME_PATH: `%pip install --user` in alice's notebook kernel keeps the
    package in her own directory of the volume under the Hub's state dir (before: refused, naming the setting; issue
    55, point 3)."""
    import base64

    from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, PROBE_VALUE, probe_wheel

    wheel = probe_wheel(hub.state_dir)
    session, socket = await lab_kernel(alice_server, hub, "packages.ipynb")
    try:
        put = await socket.execute(
            f"open('/tmp/{wheel.name}', 'wb').write(__import__('base64').b64decode({base64.b64encode(wheel.read_bytes()).decode()!r}))"
        )
        assert put.error is None, put.error
        installed = await socket.execute(f"%pip install --user --no-index /tmp/{wheel.name}", timeout=180)
        said = "".join(m["content"].get("text", "") for m in installed.messages)
        assert "Successfully installed" in said, said
        assert (await socket.execute(f"import {PROBE_PACKAGE}; {PROBE_PACKAGE}.VALUE")).result == repr(PROBE_VALUE)
    finally:
        socket.close()
        await alice_server.request("DELETE", f"/api/sessions/{session}")
    kept = list((hub.state_dir / "volume").glob(f"*/.python/*/lib/python3.*/site-packages/{PROBE_PACKAGE}"))
    assert len(kept) == 1, list((hub.state_dir / "volume").rglob("*"))[:20]


async def test_bobs_token_reaches_none_of_alices_kernel_and_hers_still_runs(hub: Hub, shared: dict) -> None:
    kernel = alices_kernel(shared)
    bob = hub.tokens.get("bob") or await hub.token_for("bob")
    listed = await hub.gateway("GET", "api/kernels", token=bob)
    assert listed.code == 200 and kernel not in {k["id"] for k in listed.json}, (listed.code, listed.body)
    assert_names_nothing(listed, kernel, "alice")
    guess = str(uuid.uuid4())
    for method, path in (
        ("GET", "api/kernels/{}"),
        ("POST", "api/kernels/{}/interrupt"),
        ("POST", "api/kernels/{}/restart"),
        ("DELETE", "api/kernels/{}"),
    ):
        response = await hub.gateway(method, path.format(kernel), token=bob)
        assert_as_if_absent(response, await hub.gateway(method, path.format(guess), token=bob), kernel, guess)
    socket = await channels_refusal(hub, kernel, bob)
    assert_as_if_absent(socket, await channels_refusal(hub, guess, bob), kernel, guess)

    # A start that names alice (as Lab names its own user) is still bob's: she does not see it, he does.
    forged = await hub.gateway("POST", "api/kernels", bob, {"name": "msb-python-small", "env": {"KERNEL_USERNAME": "alice"}})
    assert forged.code == 201, (forged.code, forged.body)
    try:
        assert forged.json["id"] not in {k["id"] for k in (await hub.gateway("GET", "api/kernels", token=hub.tokens["alice"])).json}
        assert forged.json["id"] in {k["id"] for k in (await hub.gateway("GET", "api/kernels", token=bob)).json}
    finally:
        assert (await hub.gateway("DELETE", f"api/kernels/{forged.json['id']}", token=bob)).code == 204

    # Nothing bob tried touched it: her kernel runs her next cell with her variables.
    alice = KernelSocket(
        await jupyter_ws.connect(jupyter_ws.channels_url(hub.gateway_url, kernel, uuid.uuid4().hex), hub.tokens["alice"], 60)
    )
    try:
        assert (await alice.execute("x")).result == "41"
    finally:
        alice.close()


async def test_bobs_assistant_cannot_reach_alices_kernel_and_hers_shares_it(hub: Hub, shared: dict) -> None:
    """MCP through the Hub's proxy with each person's Hub token: a session id is a kernel id, so alice's assistant
    runs in the kernel behind her notebook, and bob's cannot list or touch it."""
    kernel = alices_kernel(shared)
    async with hub.mcp(hub.tokens.get("bob") or await hub.token_for("bob")) as bob:
        listed = await bob.call_tool("get_sessions", {})
        assert kernel not in json.dumps(listed.structured_content)
        for tool, arguments in (("execute_code", {"code": "x", "session_id": kernel}), ("interrupt_session", {"session_id": kernel})):
            refused = await bob.call_tool(tool, arguments)
            assert refused.is_error and refused.structured_content["error"]["type"] == "SessionNotFound", (tool, refused.content)
            assert "alice" not in json.dumps(refused.structured_content), tool
    async with hub.mcp(hub.tokens["alice"]) as alice:
        ran = await alice.call_tool("execute_code", {"code": "x", "session_id": kernel})
        assert ran.structured_content["results"][0]["data"]["text/plain"] == "41", ran.content


async def test_a_hub_admin_sees_every_persons_kernel(hub: Hub, shared: dict) -> None:
    kernel = alices_kernel(shared)
    ada = await hub.token_for("ada")
    listed = await hub.gateway("GET", "api/kernels", token=ada)
    assert listed.code == 200 and kernel in {k["id"] for k in listed.json}, (listed.code, listed.body)
    assert (await hub.gateway("GET", f"api/kernels/{kernel}", token=ada)).code == 200


async def assert_refused(hub: Hub, token: str | None, kernel: str, *names: str) -> None:
    for method, path in (("GET", "api/kernels"), ("GET", f"api/kernels/{kernel}"), ("GET", "api/sessions")):
        response = await hub.gateway(method, path, token=token)
        assert response.code in (401, 403), (method, path, response.code, response.body)
        assert_names_nothing(response, kernel, *names)
    socket = await channels_refusal(hub, kernel, token)
    assert socket.code in (401, 403, 404), (socket.code, socket.body)
    assert_names_nothing(socket, kernel, *names)


async def test_no_token_a_made_up_one_and_one_without_the_services_scope_are_refused(hub: Hub, shared: dict) -> None:
    kernel = alices_kernel(shared)
    unscoped = await hub.token_for("alice", scopes=["users:activity!user=alice"])
    for token in (None, uuid.uuid4().hex, unscoped):
        await assert_refused(hub, token, kernel, "alice")


async def test_a_revoked_token_is_refused_once_the_cache_has_passed(hub: Hub, shared: dict) -> None:
    kernel = alices_kernel(shared)
    token = await hub.token_for("alice")
    assert (await hub.gateway("GET", f"api/kernels/{kernel}", token=token)).code == 200
    await hub.revoke("alice", token)
    revoked_at = time.monotonic()

    async def refused() -> bool:
        return (await hub.gateway("GET", "api/kernels", token=token)).code in (401, 403)

    # The cache may keep it for its lifetime; the room past that is for a loaded machine's request.
    await wait_until(refused, CACHE_SECONDS + 10, "the revoked token to be refused")
    assert time.monotonic() - revoked_at < CACHE_SECONDS + 10
    await assert_refused(hub, token, kernel, "alice")


async def test_a_deleted_users_token_is_refused(hub: Hub, shared: dict) -> None:
    kernel = alices_kernel(shared)
    token = await hub.token_for("carol")
    assert (await hub.gateway("GET", "api/kernels", token=token)).code == 200
    await hub.delete_user("carol")

    async def refused() -> bool:
        return (await hub.gateway("GET", "api/kernels", token=token)).code in (401, 403)

    await wait_until(refused, CACHE_SECONDS + 10, "the deleted user's token to be refused")
    await assert_refused(hub, token, kernel, "alice", "carol")


async def test_no_token_of_any_person_service_or_server_is_in_any_log(hub: Hub, driver: Any, shared: dict) -> None:
    """A whole Hub run with the shipped config: both people's Labs started kernels on the gateway (alice's in Chromium
    above, bob's now), through REST, the WebSocket and MCP. The log of every process (the Hub, its proxy, the gateway,
    each single-user server, all at INFO) holds none of the tokens issued: each person's, each server's, the gateway's
    service token, the proxy's, the admin's, nor the browser's session cookies."""
    alices_kernel(shared)
    bob_server = await hub.start_server("bob")
    started = await bob_server.request("POST", "/api/sessions", {"path": "bob.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
    assert started.code == 201, (started.code, started.body)
    socket = KernelSocket(
        await jupyter_ws.connect(
            jupyter_ws.channels_url(bob_server.url, started.json["kernel"]["id"], uuid.uuid4().hex), bob_server.token, 60
        )
    )
    try:
        assert (await socket.execute("6 * 7")).result == "42"
    finally:
        socket.close()
    assert (await bob_server.request("DELETE", f"/api/sessions/{started.json['id']}")).code == 204
    secrets = hub.secrets()
    # The browser's credentials: the Hub's login cookie and each server's (every path's, not the page's alone). Not
    # its session id or xsrf cookie, which authenticate nothing, and which JupyterHub itself logs at INFO.
    cookies = driver.execute_cdp_cmd("Network.getAllCookies", {})["cookies"]
    logins = {
        c["value"]: f"the browser's cookie {c['name']}"
        for c in cookies
        if c["name"].startswith(("jupyterhub-hub-login", "jupyterhub-user-"))
    }
    assert logins, [c["name"] for c in cookies]
    secrets.update(logins)
    servers = {s for s in secrets if s not in hub.issued and s != hub.token}
    assert len(servers) >= 4, "the servers', the gateway's and the proxy's tokens were not found to look for"
    log = hub.log()
    assert "GatewayKernelManager started kernel" in log, "no Lab started a kernel: the line that carried their tokens"
    leaked = {
        origin: [line.replace(secret, "<token>")[:300] for line in log.splitlines() if secret in line][:2]
        for secret, origin in secrets.items()
        if secret in log
    }
    assert not leaked, f"tokens in the Hub run's log: {leaked}"
    # Nor tornado's warning about jupyter_server's ping units, which every kernel connect in a Lab printed
    assert "websocket_ping_timeout" not in log, [line for line in log.splitlines() if "websocket_ping_timeout" in line][:2]


def test_the_deploy_config_passes_the_gateway_its_settings_and_keeps_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Read as JupyterHub reads it, with no Hub: the gateway gets its MSB_* settings (its MSB_HUB_AUTH_CACHE_SECONDS
    included) and none of the config's own knobs (the shared password above all); each server gets its own token."""
    from traitlets.config.loader import PyFileConfigLoader

    from msb_kernels.gateway.app import JUPYTERLAB_ALLOWED_ENVS
    from tests.conftest import VENV_BIN
    from tests.hub import DEPLOY_CONFIG

    knobs = {
        "MSB_HUB_STATE_DIR": str(tmp_path),
        "MSB_HUB_PASSWORD": "a shared password",
        "MSB_HUB_ADMIN_PASSWORD": "an admin's own password, 32 characters long",
        "MSB_HUB_AUTHENTICATOR": "dummy",
        "MSB_HUB_AUTH_CACHE_SECONDS": "7",
        "MSB_HUB_PUBLIC_URL": "https://hub.example",
    }
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    config = PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent)).load_config()
    (service,) = config.JupyterHub.services
    assert service["command"] == [str(VENV_BIN / "msb-kernels"), "serve"] and service["url"] == "http://127.0.0.1:8765"
    assert service["environment"]["MSB_HUB_AUTH_CACHE_SECONDS"] == "7"
    assert config.JupyterHub.public_url == service["environment"]["MSB_HUB_PUBLIC_URL"] == "https://hub.example"  # both read it
    assert not [name for name in service["environment"] if name in ("MSB_HUB_PASSWORD", "MSB_HUB_ADMIN_PASSWORD", "MSB_HUB_STATE_DIR")]
    # The shared password is JupyterHub 5.3+'s SharedPasswordAuthenticator's (DummyAuthenticator.password is deprecated).
    assert config.JupyterHub.authenticator_class.__name__ == "SharedPasswordAuthenticator"
    assert config.SharedPasswordAuthenticator.user_password == "a shared password"
    assert config.SharedPasswordAuthenticator.admin_password == knobs["MSB_HUB_ADMIN_PASSWORD"]
    # A volume of each person's own, for `%pip install --user` (issue 55, point 3), unless the operator names another.
    assert service["environment"]["MSB_SHARED_VOLUME_PATH"] == str(tmp_path / "volume")
    assert (tmp_path / "volume").stat().st_mode & 0o777 == 0o755
    # Each person's kernels see their own server's root (LocalProcessSpawner's homes), unless the operator says otherwise.
    assert service["environment"]["MSB_LAB_ROOT_PATH"] == "/home/{username}"
    monkeypatch.setenv("MSB_LAB_ROOT_PATH", "/srv/labs/{username}")
    again = PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent)).load_config()
    assert again.JupyterHub.services[0]["environment"]["MSB_LAB_ROOT_PATH"] == "/srv/labs/{username}"
    monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", "")
    assert (
        PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent))
        .load_config()
        .JupyterHub.services[0]["environment"]["MSB_SHARED_VOLUME_PATH"]
        == ""
    )
    assert "access:services!service=msb-kernels" in config.Spawner.server_token_scopes
    environment = config.Spawner.environment
    assert environment["JUPYTER_GATEWAY_URL"] == "http://127.0.0.1:8765/services/msb-kernels/"
    assert environment["JUPYTER_GATEWAY_ALLOWED_ENVS"] == ",".join(JUPYTERLAB_ALLOWED_ENVS)

    class Spawner:
        api_token = "the server's own"

    assert environment["JUPYTER_GATEWAY_AUTH_TOKEN"](Spawner()) == "the server's own"
    # Each person's Lab starts a notebook's kernel with the notebook's path alone, never its environment (its token).
    assert "--ServerApp.session_manager_class=msb_kernels.jupyterlab.GatewaySessions" in config.Spawner.args
    # With a public_url, JupyterHub tells the gateway where its proxy is; without one, the config does.
    assert "MSB_HUB_PROXY_URL" not in service["environment"]
    monkeypatch.delenv("MSB_HUB_PUBLIC_URL")
    monkeypatch.setenv("MSB_HUB_PORT", "8123")
    config = PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent)).load_config()
    assert config.JupyterHub.services[0]["environment"]["MSB_HUB_PROXY_URL"] == "http://127.0.0.1:8123"


@pytest.mark.parametrize(
    ("knobs", "said"),
    [
        ({}, "MSB_HUB_ALLOWED_USERS is not set, so no one could log in"),
        ({"MSB_HUB_ALLOWED_USERS": "root", "MSB_HUB_ADMIN_USERS": "ops-nobody-here"}, "MSB_HUB_ADMIN_USERS names 'ops-nobody-here'"),
        ({"MSB_HUB_ALLOWED_USERS": "root,ann-nobody-here"}, "MSB_HUB_ALLOWED_USERS names 'ann-nobody-here'"),
    ],
)
def test_under_pam_the_config_refuses_at_start_what_would_let_no_one_in_or_log_errors(knobs: dict, said: str, tmp_path: Path) -> None:
    """The docs' Hub under PAM (its default): with no allow rule JupyterHub 6 let no one log in ("User 'ann' not
    allowed"), and an admin who is no host user logged a KeyError at every start (issue 55, point 2). The real
    jupyterhub command stops at once, saying which variable and what to do; nothing else starts."""
    from tests.conftest import VENV_BIN
    from tests.hub import DEPLOY_CONFIG

    env = {k: v for k, v in os.environ.items() if not k.startswith("MSB_HUB_")}
    env.update(MSB_HUB_STATE_DIR=str(tmp_path), MSB_HUB_PORT=str(free_port()), **knobs)
    ran = subprocess.run(
        [str(VENV_BIN / "jupyterhub"), "-f", str(DEPLOY_CONFIG)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode != 0 and said in ran.stderr, (ran.returncode, ran.stderr[-2000:])
    assert "Traceback" not in ran.stderr and "- " in ran.stderr.split(said, 1)[1]
    assert not (tmp_path / "jupyterhub.sqlite").exists()


def test_under_pam_a_star_lets_every_host_user_in_and_named_host_users_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from traitlets.config.loader import PyFileConfigLoader

    from tests.hub import DEPLOY_CONFIG

    monkeypatch.setenv("MSB_HUB_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("MSB_HUB_AUTHENTICATOR", raising=False)
    monkeypatch.setenv("MSB_HUB_ALLOWED_USERS", "*")
    assert PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent)).load_config().Authenticator.allow_all is True
    monkeypatch.setenv("MSB_HUB_ALLOWED_USERS", "root")
    monkeypatch.setenv("MSB_HUB_ADMIN_USERS", "root")
    config = PyFileConfigLoader(DEPLOY_CONFIG.name, path=str(DEPLOY_CONFIG.parent)).load_config()
    assert config.Authenticator.allowed_users == {"root"} and config.Authenticator.admin_users == {"root"}


async def test_ctrl_c_with_a_persons_lab_open_in_a_browser_stops_everything_within_seconds(driver: Any) -> None:
    """Ctrl-C on the terminal the Hub runs on, with JupyterHub's own timeouts (SIGINT, 10 s, SIGTERM, 5 s) and alice's
    Lab open in Chromium on a notebook whose kernel ran a cell (a collaboration room served). Every process of the
    Hub's is gone within 10 s, and no traceback is logged. With a Lab open it took 66 to 73 s in issue 55, 15.4 s
    here: each Lab, on the Hub's terminal, asked whether to shut down instead of stopping; without a terminal SIGINT
    ended its loop with no cleanup; and once it had served a notebook it waited on AnyIO's worker threads until
    SIGKILL. Its kernels' shutdown on the gateway the Hub had stopped first was logged as a traceback."""
    hub = await launch_hub(users=("alice",), terminal=True)
    try:
        alice = await hub.start_server("alice")
        hub.login(driver, "alice")
        page = LabPage(driver, alice)
        page.open_lab()
        page.new_notebook(PYTHON)
        assert page.wait_for_text(page.run("print('open')"), STDOUT, "open").strip() == "open"
        tree = descendants(hub.process.pid)
        assert len(tree) >= 4, tree  # the Hub, its proxy, the gateway and alice's Lab at least
        began = time.monotonic()
        hub.interrupt()
        alive = alive_after(tree, 60)
        took = time.monotonic() - began
    finally:
        hub.stop()
    print(f"every process of the Hub's was gone {took:.1f} s after Ctrl-C")
    assert not alive and took < 10, f"{took:.1f} s after Ctrl-C, {sorted(alive)} still ran:\n{hub.log()[-3000:]}"
    assert not sandbox_records(hub.runtime_dir), sandbox_records(hub.runtime_dir)
    after = hub.log().split("Received signal SIGINT", 1)[1]
    assert "Traceback" not in after, after[-3000:]
