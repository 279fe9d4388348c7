"""Real processes for the gateway tests: `msb-kernels serve`, and `jupyter server --gateway-url` in front of it.

Each `msb-kernels serve` gets its own MSB_RUNTIME_DIR, so what a test finds there
(``get_backend(...).list_sandboxes()``) is exactly what that server left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from mcp_bridge import jupyter_ws
from msb_kernels.backends.core.keeping import KEEPERS_SOCKET
from msb_kernels.gateway.app import JUPYTERLAB_ALLOWED_ENVS
from tests.conftest import TEST_BASE, VENV_BIN, venv_environment

START_TIMEOUT = 60.0  # kernel and server starts: the test machine is small and shared
_counter = itertools.count(1)
_launched: list[Gateway] = []  # this run's gateways whose kernels may outlive them: see end_kernels_left_behind
# A test that drives a browser puts here what saves a screenshot; a failure calls it while the page still shows why.
SCREENSHOT_ON_FAILURE = pytest.StashKey[Callable[[], str]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    save = item.stash.get(SCREENSHOT_ON_FAILURE, None)
    if report.failed and save is not None:
        try:
            report.sections.append(("browser screenshot", f"saved to {save()}"))
        except Exception as exc:  # the browser itself may be what failed
            report.sections.append(("browser screenshot", f"could not be saved: {exc}"))
    return report


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sandbox_records(runtime_dir: Path) -> list:
    """Every namespace and gVisor sandbox under runtime_dir, as the backends see them (live or orphaned)."""
    from msb_kernels.backends.core.state import read_states

    return read_states(runtime_dir, "namespace") + read_states(runtime_dir, "gvisor")


def init_pids(gateway: Gateway) -> dict[str, int]:
    """Kernel id -> host pid of its sandbox's init, from the gateway's sandbox records."""
    return {r.sandbox_id: r.details["init_pid"] for r in gateway.sandboxes() if r.details.get("init_pid")}


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def alive_after(pids: set[int], timeout: float) -> set[int]:
    """Those of pids still alive once they are all gone or timeout seconds have passed (a blocking wait)."""
    deadline = time.monotonic() + timeout
    while (alive := {pid for pid in pids if pid_alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


async def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Response:
    code: int
    body: bytes
    headers: dict

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class HttpServer:
    """A server process reached over HTTP with a token."""

    def __init__(self, port: int, token: str, process: subprocess.Popen, log_path: Path):
        self.port = port
        self.token = token
        self.process = process
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        token: str | None = "default",
        headers: dict | None = None,
        timeout: float = START_TIMEOUT,
    ) -> Response:
        all_headers = dict(headers or {})
        token = self.token if token == "default" else token
        if token is not None:
            all_headers["Authorization"] = f"token {token}"
        data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        if data is None and method in ("POST", "PUT", "PATCH"):
            data = ""
        request = HTTPRequest(self.url + path, method=method, body=data, headers=all_headers, request_timeout=timeout, connect_timeout=10)
        response = await AsyncHTTPClient().fetch(request, raise_error=False)
        if response.code == 599:
            raise ConnectionError(f"{method} {path}: {response.error}")
        return Response(response.code, response.body or b"", dict(response.headers))

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 45) -> int:
        if self.running():
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"server did not stop within {timeout} s after signal {signum}:\n{self.log()[-3000:]}") from None


class Gateway(HttpServer):
    """A running `msb-kernels serve`."""

    def __init__(self, *args: Any, runtime_dir: Path, env: dict):
        super().__init__(*args)
        self.runtime_dir = runtime_dir
        self.env = env

    async def start_kernel(self, name: str = "msb-python-small", env: dict | None = None) -> str:
        response = await self.request("POST", "/api/kernels", {"name": name, **({"env": env} if env else {})})
        assert response.code == 201, (response.code, response.body)
        return response.json["id"]

    async def stats(self) -> dict:
        response = await self.request("GET", "/api/msb/stats")
        assert response.code == 200, response.body
        return response.json

    def sandboxes(self) -> list:
        return sandbox_records(self.runtime_dir)


class JupyterServer(HttpServer):
    """`jupyter server|lab`, which may never exit once a collaboration room was open; then it is killed.

    With jupyter-collaboration 5.0.4 and anyio 4.16, a Lab that served a room stops its loop on SIGTERM
    but its main thread then waits in threading._shutdown for AnyIO worker threads that never end (seen
    with py-spy). That is Lab's to fix, not what these tests are about.
    """

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 15) -> int:
        with contextlib.suppress(AssertionError):
            return super().stop(signum, timeout)
        return self.process.returncode


def _start_process(argv: list[str], env: dict, log_path: Path, umask: int = -1) -> subprocess.Popen:
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(TEST_BASE), umask=umask
        )
    finally:
        log.close()


async def _wait_for_http(server: HttpServer, path: str, token: str | None) -> None:
    async def up() -> bool:
        if not server.running():
            raise AssertionError(f"{server.process.args[:3]} exited with {server.process.returncode}:\n{server.log()[-3000:]}")
        try:
            return (await server.request("GET", path, token=token, timeout=5)).code == 200
        except (ConnectionError, OSError):
            return False

    await wait_until(up, START_TIMEOUT, f"{server.url}{path}", interval=0.25)


async def launch_gateway(
    extra_env: dict | None = None,
    runtime_dir: Path | None = None,
    args: list[str] | None = None,
    port: int | None = None,
    token: str | None = None,
    venv: Path | None = None,
    umask: int = -1,
) -> Gateway:
    """port and token: a gateway that takes over from another, where its clients expect it. venv: one a user made
    elsewhere, with msb-kernels and its kernelspecs installed into it; the gateway runs from it, as its user's would,
    seeing nothing of the suite's (JUPYTER_PATH, PYTHONPATH, PATH). umask: the operator's (-1: this process's)."""
    number = next(_counter)
    runtime_dir = runtime_dir or TEST_BASE / f"g{number}"  # short: ipc socket paths must fit in 107 bytes
    token = token or secrets.token_hex(16)
    port = port or free_port()
    base = venv_environment(venv) if venv is not None else os.environ
    env = {**base, "MSB_RUNTIME_DIR": str(runtime_dir), "MSB_TOKEN": token, **(extra_env or {})}
    env = {name: value for name, value in env.items() if value is not None}  # None in extra_env: leave it unset
    log_path = TEST_BASE / f"serve-{number}-{port}.log"
    # A copied venv's scripts name the original's interpreter: its own python runs the copy.
    program = [str(venv / "bin" / "python"), "-m", "msb_kernels.cli"] if venv is not None else [str(VENV_BIN / "msb-kernels")]
    process = _start_process([*program, "serve", "--port", str(port), *(args or [])], env, log_path, umask)
    gateway = Gateway(port, token, process, log_path, runtime_dir=runtime_dir, env=env)
    _launched.append(gateway)
    await _wait_for_http(gateway, "/api/msb/health", token=None)
    return gateway


def end_kernels_left_behind() -> None:
    """After each test: stop what ended gateways left running for adoption (a kill -9, or a test that failed before
    its next gateway adopted), as an operator's `msb-kernels sweep --include-adoptable` does. Left alone, each runs on
    for MSB_ADOPT_GRACE_SECONDS (300 s): a fresh clone's CI run held a dozen such gVisor sandboxes at once, and a
    plain process on the 2-vCPU host then waited up to 180 ms for a CPU, which later tests' timings paid for."""
    live = {gateway.runtime_dir for gateway in _launched if gateway.running()}
    for gateway in [gateway for gateway in _launched if not gateway.running()]:
        _launched.remove(gateway)
        if gateway.runtime_dir not in live and _has_keepers(gateway.runtime_dir):
            sweep = [str(VENV_BIN / "msb-kernels"), "sweep", "--include-adoptable"]
            subprocess.run(sweep, env=gateway.env, capture_output=True, timeout=120, check=False)


def _has_keepers(runtime_dir: Path) -> bool:
    serving = f"{runtime_dir}/{KEEPERS_SOCKET}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if serving in cmdline.read_bytes():
                return True
    return False


@contextlib.asynccontextmanager
async def mcp_client(server: HttpServer, token: str | None = None) -> AsyncIterator[Any]:
    """The official MCP client on the gateway's /mcp over streamable HTTP, with its token (or another)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token or server.token}"}, timeout=120) as http:
        async with Client(streamable_http_client(server.url + "/mcp", http_client=http)) as client:
            yield client


def registered(name: str, source: str = "users-file") -> Any:
    """The person as the gateway's registry holds them (the suite's MSB_STATE_DIR): their key and own host ids."""
    from msb_kernels.identity.people import Owner
    from msb_kernels.identity.person_registry import PersonRegistry

    return PersonRegistry(Path(os.environ["MSB_STATE_DIR"])).get(Owner(source, name))


def add_user(users_file: Path, name: str, admin: bool = False) -> str:
    """`msb-kernels users add`, as an operator runs it; returns the token it prints once."""
    out = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "users", "add", name, "--file", str(users_file), *(["--admin"] if admin else [])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()[0].rsplit(": ", 1)[1]


@pytest.fixture
async def gateway_factory() -> AsyncIterator[Callable]:
    """Start `msb-kernels serve` processes; each is stopped (SIGKILL if it hangs) at the end of the test."""
    started: list[Gateway] = []

    async def factory(**kwargs: Any) -> Gateway:
        gateway = await launch_gateway(**kwargs)
        started.append(gateway)
        return gateway

    yield factory
    for gateway in started:
        with contextlib.suppress(AssertionError):
            gateway.stop()


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    """One `msb-kernels serve` for the tests of a module that only add and remove their own kernels."""
    server = await launch_gateway()
    yield server
    server.stop()


async def launch_jupyter_server(
    gateway: Gateway, app: str = "server", port: int | None = None, token: str | None = None, our_settings: bool = True
) -> HttpServer:
    """`jupyter server|lab --gateway-url=...`: jupyter_server's GatewayClient, as the README tells users to run it.

    port and token: where a gateway started before it (MSB_LAB_URL, MSB_LAB_TOKEN) expects it. our_settings=False: a
    Lab from another environment, without the settings `msb-kernels install` puts beside a Lab of its own prefix.
    """
    port = port or free_port()
    token = token or secrets.token_hex(16)
    root = TEST_BASE / f"js-root-{port}"
    (root / "work").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSB_", "JUPYTER_GATEWAY"))}
    log_path = TEST_BASE / f"jupyter-{app}-{port}.log"
    argv = [
        str(VENV_BIN / "jupyter"),
        app,
        "--no-browser",
        "--allow-root",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={token}",
        f"--gateway-url={gateway.url}",
        f"--GatewayClient.auth_token={gateway.token}",
        "--GatewayClient.request_timeout=90",
        "--GatewayClient.connect_timeout=60",
        f"--GatewayClient.allowed_envs={','.join(JUPYTERLAB_ALLOWED_ENVS)}",
    ]  # as the banner says
    if app == "lab":  # the settings `msb-kernels install` put in the suite's own prefix, as in a user's Lab's app dir
        settings = TEST_BASE / "prefix" / "share" / "jupyter" / "lab" / "settings" if our_settings else root / "no-settings"
        settings.mkdir(parents=True, exist_ok=True)
        argv.append(f"--LabApp.app_settings_dir={settings}")
    server = JupyterServer(port, token, _start_process(argv, env, log_path), log_path)
    await _wait_for_http(server, "/api/status", token=token)
    return server


@pytest.fixture(scope="module")
async def jupyter_server(gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(gateway)
    yield server
    server.stop()


# -- what a kernel holds, read from inside it -------------------------------------------------------------------

# Where any canary is (its variables, every /proc/*/environ, cmdline and io directory it can read, every file under
# the roots, its working directory and home), what its volume shows, its variables' names and its sandbox.
CANARY_PROBE = r"""
import glob, json, os, sys
canaries = {canaries!r}
# The interpreter and venv the kernel runs from: the operator's install, bound in read-only at its host path, the same
# in every kernel; no start request writes there. Under /tmp (a checkout in /tmp) it would be walked file by file.
interpreter = {{os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}}

def holds(path):
    try:
        data = open(path, "rb").read(1 << 20)
    except OSError:
        return False
    return any(c.encode() in data for c in canaries)

found = [["env", k] for k, v in os.environ.items() if any(c in k + "=" + v for c in canaries)]
readable = glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/root/run/kernel/*")
found += [["proc", path] for path in readable if holds(path)]
for root in {roots!r} + [os.getcwd(), os.path.expanduser("~")]:
    for dirpath, folders, files in os.walk(root):
        folders[:] = [f for f in folders if os.path.realpath(os.path.join(dirpath, f)) not in interpreter]
        found += [["file", os.path.join(dirpath, name)] for name in files if holds(os.path.join(dirpath, name))]
shared = sorted(os.listdir("/shared")) if os.path.isdir("/shared") else None
print(json.dumps({{"found": found, "shared": shared, "env": sorted(os.environ), "sandbox": os.environ.get("MSB_SANDBOX")}}))
"""


def canary_probe(canaries: list[str], roots: list[str]) -> str:
    """Code that prints, as JSON, where in the kernel any of ``canaries`` is (CANARY_PROBE)."""
    return CANARY_PROBE.format(canaries=list(canaries), roots=list(roots))


# -- the Jupyter kernel WebSocket protocol (JSON messages, as jupyter_server relays them) --------


@dataclass
class Reply:
    messages: list[dict] = field(default_factory=list)
    reply: dict | None = None

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def error(self) -> dict | None:
        errors = [m["content"] for m in self.messages if m["msg_type"] == "error"]
        return errors[0] if errors else None

    @property
    def result(self) -> str | None:
        results = [m["content"]["data"]["text/plain"] for m in self.messages if m["msg_type"] == "execute_result"]
        return results[0] if results else None


class KernelSocket:
    """A kernel's /api/kernels/{id}/channels WebSocket."""

    def __init__(self, connection: Any):
        self.connection = connection
        self.session = uuid.uuid4().hex

    @classmethod
    async def open(cls, server: HttpServer, kernel_id: str, session_id: str | None = None, token: str | None = "default") -> KernelSocket:
        """Connect with the server's token, another ``token``, or none (``token=None``).

        session_id: the client's session; Lab reuses one when it reconnects (random if not given).
        """
        url = jupyter_ws.channels_url(server.url, kernel_id, session_id or uuid.uuid4().hex)
        return cls(await jupyter_ws.connect(url, server.token if token == "default" else token, START_TIMEOUT))

    def send(self, msg_type: str, content: dict, channel: str = "shell") -> str:
        request = jupyter_ws.message(channel, msg_type, content, session=self.session, username="test")
        self.connection.write_message(jupyter_ws.encode(request))
        return request["header"]["msg_id"]

    async def receive(self, timeout: float) -> dict:
        """The next message (binary frames skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            raw = await asyncio.wait_for(self.connection.read_message(), max(0.01, deadline - time.monotonic()))
            if raw is None:
                raise ConnectionError("the kernel WebSocket closed")
            message = jupyter_ws.parse(raw)
            if message is not None:
                return message

    async def wait_for(self, msg_id: str, predicate: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            message = await self.receive(max(0.1, deadline - time.monotonic()))
            if jupyter_ws.parent_id(message) == msg_id and predicate(message):
                return message

    async def execute(self, code: str, timeout: float = START_TIMEOUT) -> Reply:
        msg_id = self.send("execute_request", jupyter_ws.execute_content(code))
        reply = Reply()
        deadline = time.monotonic() + timeout
        idle = False
        while not (idle and reply.reply is not None):
            message = await self.receive(max(0.1, deadline - time.monotonic()))
            if jupyter_ws.parent_id(message) != msg_id:
                continue
            if message["msg_type"] == "status":
                idle = message["content"]["execution_state"] == "idle"
            elif message["msg_type"] == "execute_reply":
                reply.reply = message
            else:
                reply.messages.append(message)
        return reply

    async def execute_after_error(self, code: str, timeout: float = START_TIMEOUT) -> Reply:
        """Execute, sending again while the kernel aborts it: after an error, ipykernel aborts
        requests that arrive before it has finished recovering (stop_on_error)."""
        deadline = time.monotonic() + timeout
        while True:
            reply = await self.execute(code, timeout=max(1.0, deadline - time.monotonic()))
            if reply.reply["content"]["status"] != "aborted" or time.monotonic() > deadline:
                return reply
            await asyncio.sleep(0.1)

    def close(self) -> None:
        self.connection.close()
