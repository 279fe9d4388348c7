"""A kernel's own directory is hostile ground: the battery of a kernel whose code replaces everything in its io
directory (/run/kernel) with links to host files and to another person's sockets through /proc, FIFOs, directories
and a huge file, and tries the read-only directory of what the host wrote (/run/msb). Then it dies, is restarted, is
adopted after the gateway's kill -9, hibernates and wakes (gVisor), and is deleted; after each:

- no host file outside the sandbox changed (canaries: their bytes, mode and owner);
- no other kernel's output reached anyone (bob's kernel prints a secret all along; alice's WebSocket never sees it);
- /api/msb/health answered within HEALTH_LIMIT throughout (a poller beside every step);
- the kernel runs as its owner's, or was refused cleanly.

Namespace and gVisor, through a real gateway with a users file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mcp_bridge import jupyter_ws
from tests.conftest import TEST_BASE
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, add_user, init_pids, launch_gateway, wait_until
from tests.parallel import ALONE
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), ALONE]  # HEALTH_LIMIT is a latency: no other test's load
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
# Seconds /api/msb/health answers within, whatever a kernel does to its directory: a check that the gateway is never
# blocked by what a kernel left it (a FIFO it would wait on for ever), not a timing. On a 2-vCPU host running two
# gVisor kernels, any process waits for a CPU for up to 180 ms now and then (a plain sleeper beside this test, 5 ms
# ticks), and the gateway's answer did too (109 to 150 ms): the limit stands clear of that.
HEALTH_LIMIT = 0.5
BOBS_SECRET = "bobs-output-" + uuid.uuid4().hex

# bob's kernel: a thread that prints his secret on iopub every 50 ms, all along.
BOB_TALKS = f"""
import threading, time, sys
def talk():
    while True:
        print({BOBS_SECRET!r}, flush=True)
        time.sleep(0.05)
threading.Thread(target=talk, daemon=True).start()
"""

# alice's kernel, hostile: everything in its io dir replaced; what the host wrote for it tried too. Prints what held.
HOSTILE = r"""
import json, os, socket
victims, bob, ports = {victims!r}, {bob!r}, {ports!r}
done = {{}}
def swap(name, make):
    path = "/run/kernel/" + name
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)
        make(path)
        done[name] = "replaced"
    except OSError as exc:
        done[name] = type(exc).__name__
links = {{"connection.json": victims[0], "exit_status": victims[1]}}
for index, port in enumerate(ports):
    name = f"kernel-{{port}}"
    if bob is not None and index == 1:  # its iopub: bob's socket, as the host would reach it
        links[name] = bob
    else:
        links[name] = victims[index % len(victims)]
for name, target in links.items():
    swap(name, lambda path, target=target: os.symlink(target, path))
swap("fifo", os.mkfifo)
swap("subdir", os.mkdir)
try:
    fd = os.open("/run/kernel/huge", os.O_WRONLY | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 3 << 30)
    done["huge"] = "3 GiB written"
except OSError as exc:
    done["huge"] = type(exc).__name__
for name in os.listdir("/run/msb") if os.path.isdir("/run/msb") else []:
    try:
        os.unlink("/run/msb/" + name)
        done["/run/msb/" + name] = "removed"
    except OSError as exc:
        done["/run/msb/" + name] = type(exc).__name__
print(json.dumps(done))
"""


# Then its own death, with exit_status a FIFO that a background process reads: the host once blocked on it, and
# every person's requests with it.
FIFO_AND_DIE = """
import os, subprocess
if os.path.lexists("/run/kernel/exit_status"):
    os.unlink("/run/kernel/exit_status")
os.mkfifo("/run/kernel/exit_status")
subprocess.Popen(["cat", "/run/kernel/exit_status"])
os._exit(1)
"""


class Canaries:
    """Host files outside every sandbox, as a root-only secret would be: none may change."""

    def __init__(self, base: Path):
        self.paths = []
        for index in range(3):
            path = base / f"victim-{index}-{uuid.uuid4().hex[:6]}"
            path.write_text(f"host canary {index}\n")
            path.chmod(0o600)
            self.paths.append(path)
        self.before = self.read()

    def read(self) -> list[tuple[bytes, int, int]]:
        return [(p.read_bytes(), p.stat().st_mode, p.stat().st_uid) for p in self.paths]

    def assert_unchanged(self, step: str) -> None:
        assert self.read() == self.before, f"{step}: a host file outside every sandbox changed"


class HealthWatch:
    """/api/msb/health every 20 ms while a step runs; the slowest answer is what the step is judged by."""

    def __init__(self, gateway: Gateway):
        self.gateway, self.slowest, self.failures, self.answers = gateway, 0.0, [], 0
        self.task: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            started = time.monotonic()
            try:
                response = await self.gateway.request("GET", "/api/msb/health", token=None, timeout=5)
                if response.code != 200:
                    self.failures.append(response.code)
            except Exception as exc:  # a gateway that does not answer at all
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.answers += 1
            await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def during(self, step: str) -> AsyncIterator[None]:
        self.slowest, self.failures, self.answers = 0.0, [], 0
        self.task = asyncio.ensure_future(self._poll())
        try:
            yield
        finally:
            for _ in range(250):  # a quick step is still judged by a few answers (5 s at most)
                if self.answers >= 3 or self.task.done():
                    break
                await asyncio.sleep(0.02)
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        print(f"{step}: slowest /api/msb/health {self.slowest * 1000:.1f} ms of {self.answers}")
        assert self.answers >= 3 or self.failures, f"{step}: /api/msb/health was not answered three times"
        assert not self.failures, f"{step}: /api/msb/health failed: {self.failures[:3]}"
        assert self.slowest < HEALTH_LIMIT, f"{step}: /api/msb/health took {self.slowest * 1000:.0f} ms"


class Pair:
    """alice's hostile kernel, bob's talking one, on one gateway."""

    def __init__(self, gateway: Gateway, tokens: dict[str, str], backend: str, base: Path):
        self.gateway, self.tokens, self.backend, self.base = gateway, tokens, backend, base
        self.canaries = Canaries(base)
        self.health = HealthWatch(gateway)

    async def start(self, who: str) -> str:
        started = await self.gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=self.tokens[who])
        assert started.code == 201, started.body
        return started.json["id"]

    async def socket(self, who: str, kernel: str) -> KernelSocket:
        return await KernelSocket.open(self.gateway, kernel, token=self.tokens[who])

    def ports(self, kernel: str) -> list[int]:
        """The kernel's five channel ports, from the gateway's own connection file of it (the host's, root-only)."""
        info = json.loads((Path(os.environ["JUPYTER_RUNTIME_DIR"]) / f"kernel-{kernel}.json").read_text())
        return [info[name] for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")]

    async def run_hostile(self, alices: str, bobs: str | None) -> dict:
        bob = None
        if bobs is not None:  # bob's iopub: through /proc and his sandbox's init (namespace), or its host path (gVisor)
            bob_iopub = f"kernel-{self.ports(bobs)[1]}"
            if self.backend == "namespace":
                bob = f"/proc/{init_pids(self.gateway)[bobs]}/root/run/kernel/{bob_iopub}"
            else:
                bob = str(self.gateway.runtime_dir / bobs / "io" / bob_iopub)
        code = HOSTILE.format(victims=[str(p) for p in self.canaries.paths], bob=bob, ports=self.ports(alices))
        socket = await self.socket("alice", alices)
        try:
            reply = await socket.execute(code, timeout=120)
        finally:
            socket.close()
        assert reply.reply["content"]["status"] == "ok", reply.reply
        return json.loads(reply.stdout.strip().splitlines()[-1])

    async def alice_hears_only_herself(self, kernel: str, step: str) -> None:
        """alice's kernel runs her next cell as hers; bob's output never reaches her WebSocket."""
        deadline = time.monotonic() + 90
        while True:
            try:
                socket = await self.socket("alice", kernel)
                break
            except Exception:
                assert time.monotonic() < deadline, f"{step}: alice's kernel is not reachable"
                await asyncio.sleep(0.5)
        try:
            heard: list[str] = []
            reply = None
            while time.monotonic() < deadline:
                try:
                    reply = await socket.execute("print('alice here')", timeout=30)
                    break
                except (asyncio.TimeoutError, ConnectionError):
                    continue
            assert reply is not None and reply.stdout == "alice here\n", f"{step}: {reply and reply.messages}"
            end = time.monotonic() + 1.0  # bob prints every 50 ms: a second of alice's channel
            with contextlib.suppress(asyncio.TimeoutError):
                while time.monotonic() < end:
                    message = await socket.receive(max(0.05, end - time.monotonic()))
                    heard.append(json.dumps(message))
            assert not [m for m in heard + [json.dumps(m) for m in reply.messages] if BOBS_SECRET in m], (
                f"{step}: bob's output reached alice"
            )
        finally:
            socket.close()
        owners = {k["id"]: k["owner"] for k in (await self.gateway.stats())["kernels"]}
        assert owners.get(kernel) == "alice", f"{step}: {owners}"


def team_files(name: str) -> tuple[Path, dict[str, str]]:
    users_file = TEST_BASE / f"{name}-users.json"
    tokens = {who: add_user(users_file, who, admin=who == "ops") for who in ("alice", "bob", "ops")}
    return users_file, tokens


def environment(backend: str, users_file: Path, **more: str) -> dict[str, str | None]:
    return {"MSB_BACKEND": backend, "MSB_USERS_FILE": str(users_file), "MSB_TOKEN": None, "MSB_POOL_SIZE": "python-small=0", **more}


def assert_held(done: dict, step: str) -> None:
    """What the hostile cell managed: its own directory is its own (it may put anything there), the host's is not."""
    assert done.get("huge") == "OSError", f"{step}: the io dir took {done.get('huge')} (it is {done})"
    written = [name for name, outcome in done.items() if name.startswith("/run/msb/") and outcome == "removed"]
    assert not written, f"{step}: the kernel removed what the host wrote for it: {written}"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_kernel_that_turns_its_directory_against_the_host_harms_nothing_and_no_one(backend: str) -> None:
    users_file, tokens = team_files(f"hostile-{backend}")
    base = TEST_BASE / f"hostile-{backend}"
    base.mkdir()
    gateway = await launch_gateway(environment(backend, users_file))
    gateway.token = tokens["ops"]
    pair = Pair(gateway, tokens, backend, base)
    bobs = await pair.start("bob")
    bob_socket = await pair.socket("bob", bobs)
    try:
        assert (await bob_socket.execute(BOB_TALKS)).reply["content"]["status"] == "ok"
        alices = await pair.start("alice")

        # Its own death, with everything replaced and a FIFO read by a background process at exit_status.
        async with pair.health.during("death"):
            done = await pair.run_hostile(alices, bobs)
            assert_held(done, "death")
            socket = await pair.socket("alice", alices)
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                socket.send("execute_request", jupyter_ws.execute_content(FIFO_AND_DIE))
                await asyncio.sleep(1)
            socket.close()

            async def restarted() -> bool:
                stopped = (await gateway.stats())["recently_stopped"]
                return any(s["id"] == alices and s["status"] == "restarted" for s in stopped)

            await wait_until(restarted, 90, "alice's kernel to die and be restarted")
            await pair.alice_hears_only_herself(alices, "after its death")
        pair.canaries.assert_unchanged("death")

        # A restart asked for, after the same.
        async with pair.health.during("restart"):
            assert_held(await pair.run_hostile(alices, bobs), "restart")
            assert (await gateway.request("POST", f"/api/kernels/{alices}/restart", token=tokens["alice"])).code == 200
            await pair.alice_hears_only_herself(alices, "after a restart")
        pair.canaries.assert_unchanged("restart")

        # A delete, after the same: gone, and its directory with it.
        async with pair.health.during("delete"):
            doomed = await pair.start("alice")
            assert_held(await pair.run_hostile(doomed, bobs), "delete")
            assert (await gateway.request("DELETE", f"/api/kernels/{doomed}", token=tokens["alice"])).code == 204
        pair.canaries.assert_unchanged("delete")
        assert not (gateway.runtime_dir / backend / doomed).exists()
        bob_socket.close()

        # Adopted after the gateway's kill -9, with the same done to it first: adopted as hers, or refused cleanly.
        assert_held(await pair.run_hostile(alices, bobs), "adoption")
    finally:
        bob_socket.close()
        gateway.stop(signal.SIGKILL)
    second = await launch_gateway(environment(backend, users_file), runtime_dir=gateway.runtime_dir, port=gateway.port)
    second.token = tokens["ops"]
    pair.gateway, pair.health.gateway = second, second
    try:
        async with pair.health.during("adoption"):
            listed = {k["id"] for k in (await second.request("GET", "/api/kernels")).json}
            if alices in listed:
                await pair.alice_hears_only_herself(alices, "after adoption")
            else:  # refused: swept, and said so
                said = [
                    line
                    for line in second.log().splitlines()
                    if alices in line and ("adopt" in line or "swept" in line or "removed" in line)
                ]
                assert said, second.log()[-3000:]
                assert alices not in {r.sandbox_id for r in second.sandboxes()}
                print("\n".join(said))
            assert bobs in listed, "bob's kernel, which did nothing, is adopted"
        pair.canaries.assert_unchanged("adoption")
    finally:
        second.stop()


@needs_runsc
async def test_a_kernel_that_turned_its_directory_is_refused_hibernation_and_a_clean_one_wakes_as_its_owners() -> None:
    """gVisor's hibernation (tcp: no socket in the io dir; its init holds exit_status open). A checkpoint saves the
    files of the sandbox's host mounts, and cannot carry a FIFO, a link or a file its init holds that the kernel
    removed: such a kernel is refused hibernation, said why, and runs on as alice's. Restarted (its io dir cleared),
    it hibernates and wakes as hers."""
    users_file, tokens = team_files("hostile-hibernated")
    base = TEST_BASE / "hostile-hibernated"
    base.mkdir()
    gateway = await launch_gateway(environment("gvisor", users_file, MSB_HIBERNATE_AFTER_SECONDS="3"))
    gateway.token = tokens["ops"]
    pair = Pair(gateway, tokens, "gvisor", base)

    async def state(kernel: str) -> str | None:
        return next((k["execution_state"] for k in (await gateway.stats())["kernels"] if k["id"] == kernel), None)

    try:
        alices = await pair.start("alice")
        async with pair.health.during("hibernation refused"):
            assert_held(await pair.run_hostile(alices, None), "hibernation")

            async def refused() -> list:
                refusals = (await gateway.stats())["hibernation"]["recent_refusals"]
                return [r for r in refusals if r["id"] == alices and "io directory" in r["reason"]]

            (refusal,) = (await wait_until(refused, 60, "alice's kernel's hibernation to be refused"))[:1]
            assert "exit_status" in refusal["reason"] or "fifo" in refusal["reason"], refusal
            await pair.alice_hears_only_herself(alices, "after a refused hibernation")
        pair.canaries.assert_unchanged("hibernation refused")
        async with pair.health.during("hibernation"):
            assert (await gateway.request("POST", f"/api/kernels/{alices}/restart", token=tokens["alice"])).code == 200

            async def asleep() -> bool:
                return await state(alices) == "hibernated"

            await wait_until(asleep, 60, "alice's restarted kernel to hibernate")
            await pair.alice_hears_only_herself(alices, "after a wake")
        pair.canaries.assert_unchanged("hibernation")
    finally:
        gateway.stop()


def test_nothing_here_is_a_stand_in(tmp_path: Any) -> None:
    """The canaries can fail: a changed mode is a change."""
    canaries = Canaries(tmp_path)
    canaries.paths[0].chmod(0o644)
    with pytest.raises(AssertionError):
        canaries.assert_unchanged("a chmod")
    assert stat.S_IMODE(canaries.paths[0].stat().st_mode) == 0o644
