"""The swarm backend live, on a two-node Docker Swarm of private engines (conftest.py, tests/engines.py).

Kernels are reached at their tasks' addresses on the kernels' overlay network, so the provisioner-level suites (the
contract every backend keeps, and the escapes that apply inside a container: on_the_swarm.py) run in a process
on that network: pytest inside the network namespace of a container attached to it, as the gateway's own
container is. The rest is the product as the README deploys it: deploy/swarm/stack.yml with `docker stack deploy`,
the gateway as a service behind its API proxy, JupyterLab in Chromium and the MCP Inspector against it, its
kill -9, and a node's loss (last; the worker is revived after it for the session's later modules).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ
from tests.conftest import REPO, TEST_BASE, VENV_BIN
from tests.mcp_bridge.test_inspector import FETCH_PRELOAD, Inspector, inspector_env, inspector_missing

# JupyterLab's own browser test of interrupt and restart, run again below against the gateway service (this module's `lab`).
from tests.msb_kernels.gateway import test_jupyterlab_browser as lab_tests
from tests.msb_kernels.gateway.browser import PYTHON, STDOUT, LabPage, browser, page  # noqa: F401 (fixtures)
from tests.msb_kernels.gateway.conftest import HttpServer, KernelSocket, free_port, launch_jupyter_server, wait_until
from tests.skips import needs_runsc
from tests.swarm import KERNEL_IMAGE, NETWORK, SwarmSite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STACK = REPO / "deploy" / "swarm" / "stack.yml"
UPSTREAM = "msbt-upstream"
CULL_AFTER_SECONDS = 45  # longer than any test here leaves its own kernels idle, shorter than the tests before culling's
LOGS_TIMEOUT = 20  # seconds `docker service logs` gets: it may never end once a node died (ServiceGateway.log)
INNER_SUITES = ["tests/msb_kernels/backends/test_contract.py", "tests/msb_kernels/backends/cluster/on_the_swarm.py"]


def test_the_contract_and_the_container_escapes_hold_on_the_swarms_network(swarm_site: SwarmSite) -> None:
    """pytest, run where a gateway runs: in the network namespace of a container on the kernels' overlay."""
    with swarm_site.on_network("msbt-anchor") as there:
        command = [*there, str(VENV_BIN / "python"), "-m", "pytest", *INNER_SUITES]
        command += ["-k", "swarm or not contract", "-p", "no:cacheprovider", "-q", "-rs", "--timeout=300"]
        env = swarm_site.env(MSBT_ON_SWARM="1", MSBT_SWARM_WORKER=swarm_site.swarm.worker_addr)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=840)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"\non the swarm's network: {summary}")
    assert result.returncode == 0, f"the suites on the swarm's network failed:\n{result.stdout[-12000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary and "skipped" not in summary, summary


async def test_a_process_off_the_kernels_network_is_told_where_to_run(swarm_site: SwarmSite, start_kernel, monkeypatch) -> None:
    """This pytest runs on the host, not on the overlay: a swarm kernel could never be reached from here. On a
    manager whose kernels' network exists, the backend is unavailable to this process (MSB_BACKEND=auto passes it over,
    as doctor and the bench do; bench/run.py's cold start picked it and crashed), and a start says so at once, with
    what to do, instead of waiting out the kernel's start."""
    from msb_kernels.backends import choose_backend
    from msb_kernels.backends.cluster.backend import SwarmBackend
    from msb_kernels.errors import BackendUnavailable

    swarm_site.client().networks.get(NETWORK)  # the kernels' network exists: the case that crashed the bench
    monkeypatch.setenv("MSB_BACKEND", "swarm")
    monkeypatch.setenv("DOCKER_HOST", swarm_site.docker_host)
    monkeypatch.setattr(SwarmBackend, "_availability", None)
    availability = SwarmBackend.availability()
    assert not availability.ok, availability
    assert "not on the kernels' network msb-kernels" in availability.reason and "docker stack deploy" in availability.reason
    assert choose_backend("auto")[0] != "swarm"
    began = time.monotonic()
    with pytest.raises(BackendUnavailable) as refused:
        await start_kernel()
    assert time.monotonic() - began < 10
    assert "not on the kernels' network msb-kernels" in refused.value.message
    assert "docker stack deploy" in refused.value.message + " ".join(refused.value.suggestions)
    assert not swarm_site.client().services.list(filters={"label": "msb-kernels=1"}), "a service was left"


# -- the gateway as a service: deploy/swarm/stack.yml ---------------------------------------------------------------


class ServiceGateway(HttpServer):
    """The stack's gateway, at the port it publishes on the manager (mode host)."""

    def __init__(self, site: SwarmSite, port: int, token: str):
        super().__init__(port, token, process=None, log_path=TEST_BASE / "stack-gateway.log")  # type: ignore[arg-type]
        self.site = site

    @property
    def url(self) -> str:
        return f"http://{self.site.swarm.manager_addr}:{self.port}"

    def running(self) -> bool:
        return True

    def log(self) -> str:
        """The gateway service's output, every task's: stdout (the banner) and stderr (the log) together."""
        try:
            shown = self.site.docker("service", "logs", "--raw", "msb_gateway", timeout=LOGS_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            # After a node died and came back, `docker service logs` can wait on a task of the dead node for good (a
            # fresh clone's run: 120 s, then the stack's teardown never ran). What came by then is the log there is.
            # What run() caught before the timeout is bytes, text=True or not (subprocess.TimeoutExpired).
            got = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")
            return got[-20000:] + f"\n(no end of the log in {LOGS_TIMEOUT} s)"
        return (shown.stdout + shown.stderr)[-20000:]

    def stop(self, *args, **kwargs) -> int:
        return 0

    def containers(self) -> list:
        return self.site.client().containers.list(filters={"label": "com.docker.swarm.service.name=msb_gateway"})

    async def kernel(self, kernel_id: str) -> dict:
        return (await self.request("GET", f"/api/kernels/{kernel_id}")).json

    async def start_kernel(self, name: str = "msb-python-small", env: dict | None = None) -> str:
        """A kernel; while the kernels a test just deleted still hold their node's reservation (their tasks stop within
        seconds), the scheduler's "no suitable node" is waited out for up to 30 s."""
        deadline = time.monotonic() + 30
        while True:
            response = await self.request("POST", "/api/kernels", {"name": name, **({"env": env} if env else {})})
            if response.code != 429 or b"no suitable node" not in response.body or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert response.code == 201, (response.code, response.body[:500])
        return response.json["id"]


async def _healthy(gateway: ServiceGateway) -> bool:
    try:
        return (await gateway.request("GET", "/api/msb/health", token=None, timeout=5)).code == 200
    except (ConnectionError, OSError):
        return False


@pytest.fixture(scope="module")
async def stack(swarm_site: SwarmSite) -> AsyncIterator[ServiceGateway]:
    """The stack as the README deploys it: a token secret, `docker stack deploy --resolve-image never`."""
    token, port = secrets.token_hex(16), free_port()
    created = subprocess.run(
        ["/usr/bin/docker", "-H", swarm_site.docker_host, "secret", "create", "msb-token", "-"],
        input=token,
        capture_output=True,
        text=True,
        env=swarm_site.env(),
    )
    assert created.returncode == 0, created.stderr
    deployed = swarm_site.docker(
        "stack",
        "deploy",
        "--resolve-image",
        "never",
        "-c",
        str(STACK),
        "msb",
        MSB_PORT=str(port),
        MSB_POOL_SIZE="python-small=1",
        MSB_SESSION_TIMEOUT_SECONDS=str(CULL_AFTER_SECONDS),
        MSB_CULL_INTERVAL_SECONDS="5",
        MSB_NETWORK_ALLOW=f"{UPSTREAM}:8080",
        DOCKER_SOCKET=str(swarm_site.swarm.manager.socket),
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    # A web host on the gateway's front network, which no kernel is on: the egress test's allowed host.
    from docker.types import EndpointSpec, RestartPolicy

    swarm_site.client().services.create(
        KERNEL_IMAGE,
        ["python3", "-m", "http.server", "8080"],
        name=UPSTREAM,
        networks=["msb_front"],
        endpoint_spec=EndpointSpec(mode="dnsrr"),
        restart_policy=RestartPolicy(condition="none"),
    )
    gateway = ServiceGateway(swarm_site, port, token)
    try:
        await wait_until(lambda: _healthy(gateway), 120, "the stack's gateway to answer")
    except AssertionError as exc:
        tasks = swarm_site.docker("stack", "ps", "--no-trunc", "msb").stdout
        raise AssertionError(
            f"{exc}\n{tasks}\n{gateway.log()}\n{swarm_site.docker('service', 'logs', '--raw', 'msb_docker-api').stdout[-3000:]}"
        ) from None
    gateway.idle_kernel = await gateway.start_kernel()  # used once, then left alone: the culling test finds it gone
    socket = await KernelSocket.open(gateway, gateway.idle_kernel)
    try:
        await socket.execute("used = True")
    finally:
        socket.close()
    gateway.idle_since = time.monotonic()
    yield gateway
    gateway.log_path.write_text(gateway.log())
    swarm_site.docker("service", "rm", UPSTREAM)
    swarm_site.docker("stack", "rm", "msb")
    # The kernels the stack's gateway kept (it adopts them across a restart), and those of the node that died: the
    # session's later modules share the swarm and count its kernel services. Once the gateway's task is gone, so that
    # its pool starts none after.
    client = swarm_site.client()
    gone = time.monotonic() + 60
    while time.monotonic() < gone and client.containers.list(filters={"label": "com.docker.stack.namespace=msb"}):
        time.sleep(0.5)
    for service in client.services.list(filters={"label": "msb-kernels=1"}):
        service.remove()


async def test_kernels_spread_over_both_nodes_and_one_no_node_fits_is_refused_fast(stack: ServiceGateway) -> None:
    """Two 2-CPU nodes hold four small kernels (1 CPU reserved each): the pool's, the idle one the fixture started and
    two more fill both nodes. A large one (4 CPUs) fits on none and is refused at once with the scheduler's reason,
    never left pending."""
    kernels = [await stack.start_kernel() for _ in range(2)]
    try:
        assert {_node_of(stack, kernel) for kernel in [stack.idle_kernel, *kernels]} == {"manager", "worker"}
        began = time.monotonic()
        refused = await stack.request("POST", "/api/kernels", {"name": "msb-python-large"})
        took = time.monotonic() - began
        assert refused.code == 429, (refused.code, refused.body[:500])
        assert refused.json["reason"] == "ResourceLimitExceeded", refused.json
        assert "no suitable node (insufficient resources on 2 nodes)" in refused.json["message"], refused.json
        assert took < 10, f"refused after {took:.1f} s"
        print(f"a large kernel refused in {took * 1000:.0f} ms: {refused.json['message']}")
    finally:
        for kernel in kernels:
            await stack.request("DELETE", f"/api/kernels/{kernel}")


def _node_of(stack: ServiceGateway, kernel_id: str) -> str:
    """Which node (manager, worker) runs the kernel's service, as the swarm says."""
    client = stack.site.client()
    ids = stack.site.swarm.node_ids()
    role = {node_id: name for name, node_id in ids.items()}
    for service in client.services.list(filters={"label": f"msb-kernels.kernel-id={kernel_id}"}):
        for task in service.tasks():
            if task["Status"]["State"] == "running":
                return role[task["NodeID"]]
    raise AssertionError(f"kernel {kernel_id} runs nowhere")


async def test_the_pool_hands_out_a_service_that_runs_already(stack: ServiceGateway) -> None:
    await wait_until(lambda: _pool_ready(stack), 120, "the pool's kernel")
    began = time.monotonic()
    kernel = await stack.start_kernel()
    handed_out = time.monotonic() - began
    stats = (await stack.request("GET", "/api/msb/stats")).json
    assert stats["pool"]["handed_out"] >= 1, stats["pool"]
    socket = await KernelSocket.open(stack, kernel)
    try:
        assert (await socket.execute("import os; os.environ['MSB_SANDBOX']")).result == "'swarm'"
    finally:
        socket.close()
    print(f"pool hand-out through the gateway service: {handed_out * 1000:.0f} ms")
    assert (await stack.request("DELETE", f"/api/kernels/{kernel}")).code == 204


async def _pool_ready(stack: ServiceGateway) -> bool:
    pool = (await stack.request("GET", "/api/msb/stats")).json["pool"]
    return sum(pool["waiting"].values()) >= 1


async def test_kill_9_of_the_gateway_service_and_the_next_one_adopts_its_kernel(stack: ServiceGateway) -> None:
    kernel = await stack.start_kernel()
    socket = await KernelSocket.open(stack, kernel)
    try:
        await socket.execute("kept = 'through a kill -9'")
    finally:
        socket.close()
    (old,) = stack.containers()
    old.kill(signal="SIGKILL")  # the gateway's main process, as the OOM killer or a crash would end it
    await wait_until(lambda: _replaced(stack, old.id), 120, "swarm to start the gateway's next task")
    await wait_until(lambda: _healthy(stack), 120, "the next gateway to answer")
    assert any(k["id"] == kernel for k in (await stack.request("GET", "/api/kernels")).json)
    socket = await KernelSocket.open(stack, kernel)
    try:
        assert (await socket.execute("kept")).result == "'through a kill -9'"
    finally:
        socket.close()
    assert "adopted 1 kernel" in stack.log() or "adopted" in stack.log()
    assert (await stack.request("DELETE", f"/api/kernels/{kernel}")).code == 204


async def _replaced(stack: ServiceGateway, old_id: str) -> bool:
    return any(c.id != old_id for c in stack.containers())


@pytest.fixture(scope="module")
async def lab(stack: ServiceGateway) -> AsyncIterator[HttpServer]:
    """`jupyter lab --gateway-url` at the gateway service, as the stack file's header says."""
    server = await launch_jupyter_server(stack, app="lab")
    yield server
    server.stop()


def test_jupyterlab_interrupts_and_restarts_a_swarm_kernel_from_the_toolbar(page: LabPage) -> None:
    """Lab's own test, on the gateway service: the restart's kernel is a new task at a new address, and the next cell
    reaches it."""
    lab_tests.test_interrupt_and_restart_from_the_toolbar(page)


@pytest.mark.skipif(inspector_missing() is not None, reason=str(inspector_missing()))
async def test_the_mcp_inspector_runs_code_on_the_swarm_through_the_gateway_service(stack: ServiceGateway, tmp_path: Path) -> None:
    log = tmp_path / "fetch.jsonl"
    env = inspector_env(NODE_OPTIONS=f"--import={FETCH_PRELOAD.as_uri()}", MSB_TEST_BEARER_TOKEN=stack.token, MSB_TEST_FETCH_LOG=str(log))
    inspector = Inspector([stack.url + "/mcp"], env, fetch_log=log)
    first = (await inspector.call("execute_code", code="import os; value = 7; print(os.environ['MSB_SANDBOX'])")).structured
    assert first.get("stdout") == "swarm\n" and first.get("status") == "ok", first
    again = (await inspector.call("execute_code", code="print(value * 6)", session_id=first["session_id"])).structured
    assert again["stdout"] == "42\n", again
    sessions = (await inspector.call("get_sessions")).structured["sessions"]
    assert any(s["id"] == first["session_id"] and s["flavor"] == "small" for s in sessions), sessions
    await inspector.call("stop_session", session_id=first["session_id"])


async def result_in_a_new_kernel(stack: ServiceGateway, code: str) -> str:
    """code's result in a kernel of its own, deleted after."""
    kernel = await stack.start_kernel()
    socket = await KernelSocket.open(stack, kernel)
    try:
        return (await socket.execute(code)).result
    finally:
        socket.close()
        await stack.request("DELETE", f"/api/kernels/{kernel}")


async def test_a_kernel_cannot_call_its_gateway(stack: ServiceGateway) -> None:
    """The gateway's container is on the kernels' overlay (it reaches them there): its server closes any connection
    from that network unread, so the token is not all that stands between a kernel and the gateway's API."""
    code = """
import socket
try:
    with socket.create_connection(("msb_gateway", 8765), timeout=10) as s:  # Docker's DNS: the task's overlay address
        s.sendall(b"GET /api/msb/health HTTP/1.0\\r\\n\\r\\n")
        answer = s.recv(200)
except OSError as exc:
    answer = type(exc).__name__
answer
"""
    answer = await result_in_a_new_kernel(stack, code)
    assert answer in ("b''", "'ConnectionResetError'"), answer
    assert "refused a connection from" in stack.log()


async def test_a_kernel_is_its_nodes_first_choice_for_the_oom_killer_and_cannot_make_itself_immune(stack: ServiceGateway) -> None:
    """As on the other backends (tests/msb_kernels/backends/core/test_processes.py): a node out of memory ends a kernel
    before its dockerd or the gateway's task."""
    code = """
def immune():
    try:
        with open("/proc/self/oom_score_adj", "w") as score:
            score.write("-1000")
    except OSError as exc:
        return type(exc).__name__
(open("/proc/self/oom_score_adj").read().strip(), immune())
"""
    answer = await result_in_a_new_kernel(stack, code)
    assert answer == f"('{SANDBOX_OOM_SCORE_ADJ}', 'PermissionError')", answer


async def test_kernels_reach_their_allow_list_through_the_gateway_and_nothing_else(stack: ServiceGateway) -> None:
    """MSB_NETWORK_ALLOW on a swarm: each kernel's relay (127.0.0.1:3128) reaches the gateway's proxy on the kernels'
    network, which knows the kernel by its task's address and reaches the allowed host on its front network."""
    upstream = stack.site.client().services.get(UPSTREAM)
    await wait_until(lambda: _task_address(upstream), 60, "the upstream web host's task")
    kernel = await stack.start_kernel()
    code = f"""
import os, socket, urllib.request
def fetch(url):
    try:
        return urllib.request.urlopen(url, timeout=20).status
    except Exception as exc:
        return str(exc)
def direct(address):
    try:
        socket.create_connection((address, 8080), timeout=5).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
print(os.environ["MSB_NETWORK_ALLOW"])
print(fetch("http://{UPSTREAM}:8080/"))
print(fetch("http://msb_docker-api:2375/version"))
print(direct({_task_address(upstream)!r}))
import subprocess  # the image's curl, as a `!curl` line runs it: through the proxy its environment names
print(subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{{http_code}}", "http://{UPSTREAM}:8080/"], capture_output=True, text=True).stdout)
"""
    socket = await KernelSocket.open(stack, kernel)
    try:
        reply = await socket.execute(code)
    finally:
        socket.close()
        await stack.request("DELETE", f"/api/kernels/{kernel}")
    lines = reply.stdout.splitlines()
    assert lines[:2] == [f"{UPSTREAM}:8080", "200"], (lines, reply.error, stack.log()[-3000:])
    assert "msb_docker-api:2375 is not allowed by MSB_NETWORK_ALLOW" in lines[2], lines
    assert lines[3] != "connected", "the upstream is on no network of the kernel's: only the proxy reaches it"
    assert lines[4] == "200", lines


def _task_address(service) -> str | None:
    for task in service.tasks():
        if task["Status"]["State"] == "running":
            for attachment in task.get("NetworksAttachments") or ():
                if attachment["Network"]["Spec"]["Name"] == "msb_front":
                    return attachment["Addresses"][0].split("/")[0]
    return None


async def test_an_idle_kernel_is_culled_and_its_service_removed(stack: ServiceGateway) -> None:
    """The kernel the stack fixture started and used once: past MSB_SESSION_TIMEOUT_SECONDS idle the gateway culls it,
    as on one host, and its service and secrets go."""
    kernel = stack.idle_kernel
    await asyncio.sleep(max(0.0, CULL_AFTER_SECONDS - (time.monotonic() - stack.idle_since)))  # then a look every 5 s

    async def culled() -> bool:
        return all(k["id"] != kernel for k in (await stack.request("GET", "/api/kernels")).json)

    try:
        await wait_until(culled, 30, "the idle kernel to be culled")
    except AssertionError as exc:
        listed = (await stack.request("GET", "/api/kernels")).json
        raise AssertionError(f"{exc}: {listed}\n{stack.log()[-4000:]}") from None
    assert not stack.site.client().services.list(filters={"label": f"msb-kernels.kernel-id={kernel}"})
    assert not stack.site.client().secrets.list(filters={"label": "msb-kernels=1"}) or all(
        not s.name.startswith(f"msb-{kernel}") for s in stack.site.client().secrets.list(filters={"label": "msb-kernels=1"})
    )


@needs_runsc
async def test_a_node_whose_default_runtime_is_runsc_runs_its_kernels_in_gvisor(stack: ServiceGateway) -> None:
    """Swarm has no runtime per service: the node's daemon decides. With runsc its default (Debian's, ptrace, and
    --network=host, which hands gVisor the task's own network namespace), the kernels placed there run on gVisor's
    kernel; the manager's stay on runc. Nothing in msb-kernels changes."""
    stack.site.swarm.worker.use_default_runtime("runsc", shutil.which("runsc") or "/usr/bin/runsc", ["--platform=ptrace", "--network=host"])
    kernels, releases = [], {}
    try:
        while "worker" not in releases and len(kernels) < 3:
            # A variable of its own: the pool's waiting service was started before the switch, on runc.
            kernels.append(await stack.start_kernel(env={"KERNEL_STARTED_AFTER_THE_SWITCH": "1"}))
            socket = await KernelSocket.open(stack, kernels[-1])
            try:
                releases[_node_of(stack, kernels[-1])] = (
                    await socket.execute("import os, platform; (platform.release(), os.getuid())")
                ).result
            finally:
                socket.close()
        assert releases.get("worker") == "('4.4.0', 1000)", releases  # gVisor's Linux, as the gvisor backend's kernels see it
        assert all(release != "('4.4.0', 1000)" for node, release in releases.items() if node == "manager"), releases
    finally:
        for kernel in kernels:
            await stack.request("DELETE", f"/api/kernels/{kernel}")


async def test_a_kernel_whose_node_dies_is_reported_dead_with_the_reason(stack: ServiceGateway) -> None:
    """Last in this module. The worker's kernel is said to be dead because its node went down, within seconds, never
    left hanging; the manager's kernel lives on. The worker is revived after: the session shares the swarm, and the
    environments' tests load their image on both nodes (a dead worker refused it: CI, the first time)."""
    try:
        await _a_node_dies(stack)
    finally:
        stack.site.swarm.revive_worker()


async def _a_node_dies(stack: ServiceGateway) -> None:
    # Placement spreads, but the pool's kernel counts too: start until each node holds one of ours.
    kernels = [await stack.start_kernel() for _ in range(2)]
    while len(kernels) < 5 and len({_node_of(stack, k) for k in kernels}) < 2:
        kernels.append(await stack.start_kernel())
    on_worker = [k for k in kernels if _node_of(stack, k) == "worker"]
    assert on_worker, "no kernel on the worker"
    assert len(on_worker) < len(kernels), "no kernel on the manager"
    victim = on_worker[0]
    stack.site.swarm.kill_worker(unplug=True)
    began = time.monotonic()

    async def reported() -> str | None:
        stopped = (await stack.request("GET", "/api/msb/stats")).json.get("recently_stopped") or []
        for record in stopped:
            if record.get("id") == victim and "node" in (record.get("reason") or ""):
                return record["reason"]
        return None

    reason = await wait_until(reported, 60, "the gateway to report the kernel on the dead node")
    print(f"reported {time.monotonic() - began:.1f} s after the worker died: {reason}")
    assert "is down" in reason and "heartbeat failure" in reason, reason
    survivor = next(k for k in kernels if k not in on_worker)
    socket = await KernelSocket.open(stack, survivor)
    try:
        assert (await socket.execute("1 + 1")).result == "2"
    finally:
        socket.close()
