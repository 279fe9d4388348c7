"""A real JupyterHub in front of the gateway, for tests: deploy/jupyterhub/jupyterhub_config.py as shipped.

The Hub runs from a temp dir on free loopback ports, with configurable-http-proxy from npm (``scripts/test``
installs it into ``.venv/share/msb-kernels/chp``), JupyterHub's ``SharedPasswordAuthenticator`` (one password), and
``SimpleLocalProcessSpawner`` (``--allow-root`` where the suite runs as root); the Hub starts and stops
``msb-kernels serve`` as its managed service ``msb-kernels``. Everything test-only is in an overlay config that
loads the deploy config first: the proxy's path, and an admin service whose token drives the Hub's REST API.

API::

    launch_hub(users=..., admins=(), env=None, extra_config="") -> Hub
    launch_hub_as_documented(command, install) -> Hub    docs/teams.md's command, word for word, from an install
    Hub .url .token (admin) .gateway_url .runtime_dir (the gateway's) .log() (the gateway's too)
        .api(method, path, body=None, token=...)         the Hub's REST API, /hub/api/<path>
        .gateway(method, path, token, ...)               the gateway through the Hub's proxy, /services/msb-kernels/<path>
        .mcp(token) -> MCP SDK client                    the gateway's /mcp through the proxy, as token's person
        .token_for(user, scopes=None) -> token          a user's Hub API token, made by the admin (kept in .issued)
        .token_by_login(user) -> token                   one made as /hub/token makes it, after logging in as user
        .secrets() -> dict                               every token this Hub run issued that the harness can find, by origin
        .revoke(user, token)  .delete_user(user)
        .start_server(user) -> UserServer                POST .../server, then wait until it is ready
        .login(driver, user)                             /hub/login in Chromium, as that user (cookies cleared first)
        .stop()                                          servers, gateway, proxy, Hub, and every process they left
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import shlex
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

from bench.kernels import descendants
from tests.conftest import REPO, TEST_BASE, VENV_BIN
from tests.msb_kernels.gateway.conftest import START_TIMEOUT, HttpServer, Response, alive_after, free_port, wait_until
from tests.skips import CHP

DEPLOY_CONFIG = REPO / "deploy" / "jupyterhub" / "jupyterhub_config.py"
SERVICE = "msb-kernels"
PASSWORD = "msb-tests-shared-password"  # SharedPasswordAuthenticator's one password, for every user
SERVER_TIMEOUT = 120.0  # a single-user server's start: JupyterLab and its extensions, on a loaded 2-core machine
ADMIN_SERVICE = "msb-tests"
SUITES_OWN = ("MSB_", "JUPYTER_", "IPYTHONDIR")  # what tests/conftest.py sets for every process the suite starts
# What the Hub puts in its processes' environments that lets one act as someone: servers', services' and the proxy's.
HUB_SECRETS = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN", "JUPYTER_GATEWAY_AUTH_TOKEN", "CONFIGPROXY_AUTH_TOKEN", "MSB_TOKEN")


class Command(NamedTuple):
    """How a Hub is started, and started again after a stop."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    terminal: bool = False  # on a terminal: a pty for its stdin, in a process group of its own


class UserServer(HttpServer):
    """A person's single-user server, reached through the Hub's proxy at /user/<name> with a token of theirs."""

    def __init__(self, hub: Hub, user: str, token: str):
        super().__init__(hub.port, token, hub.process, hub.log_path)
        self.user = user

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/user/{self.user}"


class Hub(HttpServer):
    """A running JupyterHub; ``token`` is its admin service's."""

    def __init__(self, *args: Any, state_dir: Path, gateway_port: int, runtime_dir: Path):
        super().__init__(*args)
        self.state_dir = state_dir
        self.runtime_dir = runtime_dir  # the gateway's MSB_RUNTIME_DIR
        self.gateway_port = gateway_port
        self.tokens: dict[str, str] = {}  # user -> a token of theirs the harness made (admin-made, all their scopes)
        self.issued: set[str] = set()  # every token token_for made
        self.console: int | None = None  # the terminal's side of its pty, for a Hub launched on one
        self.command = Command([], {}, state_dir)

    async def start(self) -> None:
        """Start the Hub (again, after a stop: the same state dir, ports and tokens) and wait until it answers."""
        argv, env, cwd, terminal = self.command
        console, stdin = os.openpty() if terminal else (None, subprocess.DEVNULL)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=stdin, cwd=cwd, start_new_session=terminal
            )
        if console is not None:
            os.close(stdin)  # the Hub holds it; the harness keeps the console's side open, as a terminal window does
        self.console = console
        try:
            await _wait_until_up(self)
        except BaseException:
            self.stop()
            raise

    def interrupt(self) -> None:
        """Ctrl-C on the Hub's terminal: SIGINT to its whole process group (what did not start a session of its own)."""
        assert self.console is not None, "launch_hub(terminal=True): Ctrl-C needs a terminal"
        os.killpg(self.process.pid, signal.SIGINT)

    @property
    def gateway_url(self) -> str:
        return f"{self.url}/services/{SERVICE}"

    async def api(self, method: str, path: str, body: Any = None, token: str | None = "default", **kwargs: Any) -> Response:
        return await self.request(method, f"/hub/api/{path.lstrip('/')}", body, token=token, **kwargs)

    async def gateway(self, method: str, path: str, token: str | None, body: Any = None, **kwargs: Any) -> Response:
        return await self.request(method, f"/services/{SERVICE}/{path.lstrip('/')}", body, token=token, **kwargs)

    @contextlib.asynccontextmanager
    async def mcp(self, token: str | None, direct: bool = False, headers: dict | None = None) -> AsyncIterator[Any]:
        """An MCP SDK client on the gateway's /mcp through the Hub's proxy (direct: at the gateway's own port, as a
        process on this host reaches it), sending ``token`` as its person's, and ``headers`` beside it."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        sent = {**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})}
        base = f"http://127.0.0.1:{self.gateway_port}/services/{SERVICE}" if direct else self.gateway_url
        async with httpx2.AsyncClient(headers=sent, timeout=SERVER_TIMEOUT) as http:
            async with Client(streamable_http_client(f"{base}/mcp", http_client=http)) as client:
                yield client

    async def token_for(self, user: str, scopes: list[str] | None = None, note: str = "msb-tests") -> str:
        """A new Hub API token of user's: all their scopes, or only ``scopes`` (a subset of theirs)."""
        body: dict[str, Any] = {"note": note, **({"scopes": scopes} if scopes is not None else {})}
        response = await self.api("POST", f"users/{quote(user)}/tokens", body)
        assert response.code == 201, (response.code, response.body)
        self.issued.add(response.json["token"])
        return response.json["token"]

    async def token_by_login(self, user: str, note: str = "msb-tests") -> str:
        """A new token of user's as /hub/token makes one: log in with their password, then ask with the session's
        cookies (all their scopes). For a Hub that has no admin service, as one started as the docs say has none."""
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=SERVER_TIMEOUT) as http:

            def xsrf() -> str:  # the latest: JupyterHub binds it to the session, which logging in starts
                return [cookie.value for cookie in http.cookies.jar if cookie.name == "_xsrf"][-1]

            await http.get("/hub/login")
            login = await http.post("/hub/login", data={"username": user, "password": PASSWORD, "_xsrf": xsrf()})
            assert login.status_code == 302, (login.status_code, login.text[-2000:])
            await http.get("/hub/token")
            made = await http.post(f"/hub/api/users/{quote(user)}/tokens", json={"note": note}, headers={"X-XSRFToken": xsrf()})
            assert made.status_code == 201, (made.status_code, made.text[-2000:])
        self.issued.add(made.json()["token"])
        return made.json()["token"]

    def secrets(self) -> dict[str, str]:
        """Every token of this run the harness can find, each with where it came from: those it made, its admin
        service's, and those the Hub gave its processes (each server's and the gateway's own API token, the proxy's
        auth token), read from their environments now."""
        found = {self.token: "the admin service's token", **{token: "a user's API token" for token in self.issued}}
        for pid in descendants(self.process.pid) | {self.process.pid}:
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
                for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    name, _, value = entry.decode(errors="replace").partition("=")
                    if name in HUB_SECRETS and len(value) >= 16:
                        found.setdefault(value, f"{name} of {b' '.join(command).decode(errors='replace')}")
        return found

    async def revoke(self, user: str, token: str) -> None:
        """Delete the token through the Hub's API: its id is found by asking the Hub who holds it."""
        found = await self.api("GET", "user", token=token)
        assert found.code == 200, (found.code, found.body)
        token_id = found.json["token_id"]
        response = await self.api("DELETE", f"users/{quote(user)}/tokens/{token_id}")
        assert response.code == 204, (response.code, response.body)

    async def delete_user(self, user: str) -> None:
        response = await self.api("DELETE", f"users/{quote(user)}", timeout=SERVER_TIMEOUT)
        assert response.code == 204, (response.code, response.body)
        self.tokens.pop(user, None)

    async def start_server(self, user: str) -> UserServer:
        response = await self.api("POST", f"users/{quote(user)}/server", timeout=SERVER_TIMEOUT)
        running = response.code == 400 and b"already running" in response.body  # an earlier test of the module started it
        assert response.code in (201, 202) or running, (response.code, response.body)

        async def ready() -> bool:
            if not self.running():
                raise AssertionError(f"the Hub exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            model = (await self.api("GET", f"users/{quote(user)}")).json
            server = (model.get("servers") or {}).get("")
            if server is None and not model.get("pending"):
                raise AssertionError(f"{user}'s server did not start:\n{self.log()[-3000:]}")
            return bool(server and server.get("ready"))

        await wait_until(ready, SERVER_TIMEOUT, f"{user}'s single-user server", interval=0.25)
        if user not in self.tokens:
            self.tokens[user] = await self.token_for(user)
        return UserServer(self, user, self.tokens[user])

    def login(self, driver: Any, user: str, timeout: float = SERVER_TIMEOUT) -> None:
        """Log in at /hub/login as a person does; land on /hub/home. Cookies of whoever was logged in go first."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        # Every cookie, not only those the current page sees (delete_all_cookies): the Hub's own are on /hub/.
        driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
        driver.get(f"{self.url}/hub/login")
        WebDriverWait(driver, timeout).until(lambda d: d.find_elements(By.ID, "username_input"))
        driver.find_element(By.ID, "username_input").send_keys(user)
        driver.find_element(By.ID, "password_input").send_keys(PASSWORD)
        driver.find_element(By.ID, "login_submit").click()
        WebDriverWait(driver, timeout).until(lambda d: "/hub/login" not in d.current_url)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """The Hub stops its servers, its managed gateway (which stops its kernels) and its proxy. Each of those starts
        a session of its own, so no process group holds them: whatever of the Hub's tree is left after it is killed."""
        tree = descendants(self.process.pid) - {self.process.pid}
        try:
            return super().stop(signum, timeout)
        finally:
            if self.console is not None:
                os.close(self.console)
                self.console = None
            for pid in alive_after(tree, 10):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


_OVERLAY = """\
# Written by tests/hub.py: the shipped config, then only what a test needs beside it.
c = get_config()  # noqa: F821
load_subconfig({deploy!r})  # noqa: F821
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.JupyterHub.services.append({{"name": {admin!r}, "api_token": {token!r}, "display": False}})
c.JupyterHub.load_roles.append(
    {{"name": "msb-tests-admin", "scopes": ["admin:users", "admin:servers", "tokens", "list:users"], "services": [{admin!r}]}}
)
{extra}
"""


async def launch_hub(
    users: tuple[str, ...] = ("alice", "bob"),
    admins: tuple[str, ...] = (),
    env: dict | None = None,
    extra_config: str = "",
    terminal: bool = False,
) -> Hub:
    """Start a Hub with the deploy config and wait until it, its proxy and its gateway answer.

    env: more variables for the Hub (MSB_* ones reach the gateway); extra_config: more config lines after the
    deploy config's (``c`` is the config); terminal: as an operator starts it, on a terminal (a pty for its stdin,
    which its servers inherit) in a process group of its own, which Ctrl-C signals whole (``Hub.interrupt``)."""
    token = secrets.token_hex(24)
    hub, place = _placed_hub(token)
    overlay = hub.state_dir / "jupyterhub_config.py"
    overlay.write_text(_OVERLAY.format(deploy=str(DEPLOY_CONFIG), chp=str(CHP), admin=ADMIN_SERVICE, token=token, extra=extra_config))
    env = {
        **os.environ,
        **place,
        "MSB_HUB_AUTHENTICATOR": "dummy",
        "MSB_HUB_PASSWORD": PASSWORD,
        "MSB_HUB_ALLOWED_USERS": ",".join(users),
        "MSB_HUB_ADMIN_USERS": ",".join(admins),
        "MSB_HUB_SPAWNER": "simple",
        "MSB_HUB_ALLOW_ROOT": "1" if os.geteuid() == 0 else "",
        **(env or {}),
    }
    hub.command = Command([str(VENV_BIN / "jupyterhub"), "-f", str(overlay)], env, hub.state_dir, terminal)
    await hub.start()
    return hub


async def launch_hub_as_documented(command: str, install: Path, env: dict | None = None) -> Hub:
    """Run ``command`` (a shell line as docs/teams.md writes it: variables, then the Hub's argv) in ``install``, as an
    operator does, and wait until the Hub, its proxy and its gateway answer. Only where it runs is the harness's: its
    state dir, free loopback ports, and the suite's configurable-http-proxy on PATH (which ``npm install -g`` puts
    there); ``env`` is what else the operator's environment holds. The Hub has no admin service: ``Hub.token`` is
    unset until a test gives it one (``token_by_login``)."""
    words = shlex.split(command)
    assignments = list(itertools.takewhile(lambda word: re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word), words))
    hub, place = _placed_hub("")
    # An operator's environment: none of the suite's own (its kernelspecs on JUPYTER_PATH name the suite's venv), but
    # where the suite keeps every gateway's state and scratch.
    operators = {name: value for name, value in os.environ.items() if not name.startswith(SUITES_OWN)}
    path = [entry for entry in os.environ.get("PATH", os.defpath).split(os.pathsep) if entry != str(VENV_BIN)]
    env = {
        **operators,
        **{name: os.environ[name] for name in ("MSB_STATE_DIR", "MSB_SCRATCH_DIR")},
        **place,
        "PATH": os.pathsep.join([str(CHP.parent), *path]),
        **(env or {}),
        **dict(word.split("=", 1) for word in assignments),
    }
    hub.command = Command(words[len(assignments) :], env, install)
    await hub.start()
    return hub


def _placed_hub(token: str) -> tuple[Hub, dict[str, str]]:
    """A Hub not yet started, with its own state dir and free loopback ports, and the knobs that place it there (for
    its command's environment)."""
    state_dir = Path(TEST_BASE) / f"hub-{secrets.token_hex(3)}"
    state_dir.mkdir(parents=True)
    port, gateway_port = free_port(), free_port()
    runtime_dir = Path(TEST_BASE) / f"h{port}"  # short: ipc socket paths must fit in 107 bytes
    hub = Hub(port, token, None, state_dir / "jupyterhub.log", state_dir=state_dir, gateway_port=gateway_port, runtime_dir=runtime_dir)
    place = {
        "MSB_HUB_IP": "127.0.0.1",
        "MSB_HUB_PORT": str(port),
        "MSB_HUB_API_PORT": str(free_port()),
        "MSB_HUB_PROXY_API_PORT": str(free_port()),
        "MSB_HUB_GATEWAY_PORT": str(gateway_port),
        "MSB_HUB_STATE_DIR": str(state_dir),
        "MSB_RUNTIME_DIR": str(runtime_dir),
    }
    return hub, place


async def _wait_until_up(hub: Hub) -> None:
    async def answers(path: str, direct: bool = False) -> bool:
        if not hub.running():
            raise AssertionError(f"the Hub exited with {hub.process.returncode}:\n{hub.log()[-3000:]}")
        with contextlib.suppress(ConnectionError, OSError):
            if direct:  # the gateway on its own port: its route in the proxy comes a moment after the Hub is up
                server = HttpServer(hub.gateway_port, hub.token, hub.process, hub.log_path)
                return (await server.request("GET", path, token=None, timeout=5)).code == 200
            return (await hub.request("GET", path, token=None, timeout=5)).code == 200
        return False

    await wait_until(lambda: answers("/hub/health"), START_TIMEOUT, "the Hub's /hub/health through its proxy", interval=0.25)
    await wait_until(lambda: answers(f"/services/{SERVICE}/api/msb/health"), START_TIMEOUT, "the gateway through the Hub's proxy", 0.25)
