"""Kernels outlive `msb-kernels serve`: kill -9, a clean stop with --keep-kernels, the grace period, a busy kernel.

Each test runs real gateways on one runtime dir, one after the other on the same port and token, with
what users run in front: `jupyter server --gateway-url` (JupyterLab's server) and the MCP Inspector CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from datetime import datetime

import pytest

from msb_kernels.backends import backend_classes
from msb_kernels.backends.core.keeping import ADOPTION_RECORD, KEEPER_SOCKET, trusted_json
from msb_kernels.errors import InvalidRequest
from msb_kernels.gateway.kernels.records import KernelRecord
from msb_kernels.identity.people import Owner
from msb_kernels.kernelspecs.flavors import get_flavor
from msb_kernels.provisioning.start_request import StartRequest
from tests.conftest import TEST_BASE, VENV_BIN
from tests.msb_kernels.gateway.conftest import (
    Gateway,
    KernelSocket,
    launch_gateway,
    launch_jupyter_server,
    pid_alive,
    wait_until,
)
from tests.parallel import ALONE

NO_POOL = {"MSB_POOL_SIZE": "python-small=0"}


async def take_over(gateway: Gateway, extra_env: dict | None = None, args: list[str] | None = None) -> Gateway:
    """The next `msb-kernels serve` on the same runtime dir, port and token, as a restart by an operator would be."""
    return await launch_gateway(
        {**NO_POOL, **(extra_env or {})}, runtime_dir=gateway.runtime_dir, args=args, port=gateway.port, token=gateway.token
    )


def keeper_pids(gateway: Gateway) -> list[int]:
    return [record.details["keeper_pid"] for record in gateway.sandboxes() if record.details.get("keeper_pid")]


def msb_list(gateway: Gateway) -> str:
    return subprocess.run([str(VENV_BIN / "msb-kernels"), "list"], env=gateway.env, capture_output=True, text=True, timeout=60).stdout


async def until_reconnected(notebook: KernelSocket, code: str, timeout: float = 90) -> str:
    """jupyter_server's GatewayClient reconnects its upstream WebSocket by itself, with back-off; until it has,
    a request is dropped, so the client (as JupyterLab's would) asks again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return (await notebook.execute(code, timeout=5)).stdout
        except asyncio.TimeoutError:
            if time.monotonic() > deadline:
                raise


def running_ids(gateway: Gateway) -> list[str]:
    """The sandboxes `msb-kernels list` shows running under the gateway's runtime dir (every backend: microVMs too)."""
    return [line.split()[0] for line in msb_list(gateway).splitlines() if line.split()[3:4] == ["running"]]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["namespace", "gvisor", "microsandbox"])
async def test_a_kernel_survives_kill_9_of_the_gateway_for_jupyterlab_and_the_mcp_inspector(backend, tmp_path, upstream):
    """kill -9 of the gateway: the sandbox lives on, held by its keeper; the next gateway adopts it with its id,
    variables, flavor, notebook, creation time and last activity; jupyter server's open WebSocket (JupyterLab's
    server) reconnects by itself and the MCP Inspector CLI uses the old id as its session. The kernel's way out
    through the egress proxy, which died with the first gateway, is the second's."""
    from tests.mcp_bridge.test_inspector import gateway_inspector, inspector_missing

    if backend != "namespace" and not (availability := backend_classes()[backend].availability()).ok:
        pytest.skip(f"{backend} backend cannot run on this host: {availability.reason}")
    if missing := inspector_missing():
        pytest.skip(missing)
    network = {"MSB_NETWORK_ALLOW": "api.msb.test", "MSB_NETWORK_DNS": upstream.dns}
    env = {"MSB_BACKEND": backend, "MSB_POOL_SIZE": "python-small=1", **network}  # a pooled kernel too: never a session
    first = await launch_gateway(env, runtime_dir=TEST_BASE / f"adopt-{backend[:2]}")
    second = None
    lab = await launch_jupyter_server(first)
    try:
        created = await lab.request(
            "POST",
            "/api/sessions",
            {"path": "work/kept.ipynb", "type": "notebook", "name": "kept.ipynb", "kernel": {"name": "msb-python-medium"}},
        )
        assert created.code == 201, created.body
        kernel_id = created.json["kernel"]["id"]
        notebook = await KernelSocket.open(lab, kernel_id)
        assert (await notebook.execute("kept = 'set before the crash'")).reply["content"]["status"] == "ok"
        (before,) = [k for k in (await first.stats())["kernels"] if k["id"] == kernel_id]

        first.process.kill()
        first.process.wait(10)
        await asyncio.sleep(1)
        listing = msb_list(first)
        assert f"{kernel_id}  {backend}  medium  running  adoptable" in listing, listing
        swept = subprocess.run([str(VENV_BIN / "msb-kernels"), "sweep"], env=first.env, capture_output=True, text=True, timeout=120)
        assert f"left 1 adoptable sandbox(es) running for the next msb-kernels serve: {kernel_id}" in swept.stdout, swept

        second = await take_over(first, {"MSB_BACKEND": backend, **network})
        assert "adopted 1 running kernel(s)" in second.log(), second.log()[-3000:]
        assert await until_reconnected(notebook, "print(kept)") == "set before the crash\n"
        fetched = await notebook.execute("import urllib.request; print(urllib.request.urlopen('http://api.msb.test/echo').status)")
        assert fetched.stdout == "200\n", fetched.messages

        inspector = gateway_inspector(second, tmp_path)
        result = (await inspector.call("execute_code", code="print(kept)", session_id=kernel_id)).structured
        assert result.get("stdout") == "set before the crash\n", result

        stats = await second.stats()
        (after,) = [k for k in stats["kernels"] if k["id"] == kernel_id]
        for key in ("kernel_name", "flavor", "template", "backend", "created", "notebook_path", "cull_idle_timeout"):
            assert after[key] == before[key], (key, before, after)
        assert after["notebook_path"].endswith("work/kept.ipynb") and after["flavor"] == "medium"
        assert after["last_activity"] >= before["last_activity"]
        assert stats["active_sessions"] == 1 and stats["total_memory_mb"] == 2048  # its place in the limits
        assert running_ids(second) == [kernel_id]  # the old pool's kernel was swept
        metrics = (await second.request("GET", "/metrics")).body.decode()
        assert 'msb_kernel_adoptions_total{outcome="adopted"} 1.0' in metrics.splitlines(), "adoptions are counted in /metrics"
    finally:
        lab.stop()
        if second is not None:
            second.stop()
        first.stop()
    assert not running_ids(second), "a clean stop without --keep-kernels stops every sandbox"


@pytest.mark.slow
async def test_a_clean_stop_keeps_kernels_only_with_keep_kernels():
    """SIGTERM with --keep-kernels leaves the kernel for the next gateway, which adopts it and hands its own new
    kernel to the same keeper; that one's plain SIGTERM stops everything, the keeper included, as before."""
    first = await launch_gateway(NO_POOL, args=["--keep-kernels"])
    second = None
    try:
        kernel_id = await first.start_kernel(env={"KERNEL_FLAVOR": "small"})
        notebook = await KernelSocket.open(first, kernel_id)
        await notebook.execute("counter = 41")
        notebook.close()
        assert "kernels keep running for 300 s" in first.log()
        assert first.stop(signal.SIGTERM) == 0
        (kept,) = first.sandboxes()
        assert kept.adoptable and kept.running, kept
        record = first.runtime_dir / kernel_id / ADOPTION_RECORD
        assert oct(record.stat().st_mode & 0o777) == "0o600"

        second = await take_over(first)
        notebook = await KernelSocket.open(second, kernel_id)
        assert (await notebook.execute("counter += 1; print(counter)")).stdout == "42\n"
        notebook.close()
        await second.start_kernel(env={"KERNEL_FLAVOR": "small"})
        keepers = keeper_pids(second)  # the adopted kernel's keeper holds the new gateway's kernels too: one per runtime dir
        assert len(keepers) == 2 and len(set(keepers)) == 1 and pid_alive(keepers[0]), keepers
        assert (await second.stats())["keepers"] == [{"pid": keepers[0], "kernels": 2}]  # what an operator must not kill
        assert second.stop(signal.SIGTERM) == 0
        assert not second.sandboxes()
        await wait_until(lambda: not any(pid_alive(pid) for pid in keepers), 10, "the keepers to exit")
    finally:
        for gateway in (first, second):
            if gateway is not None:
                gateway.stop(signal.SIGKILL)


@pytest.mark.slow
@ALONE  # a cull due within a window of seconds
async def test_the_culling_clock_goes_on_from_the_last_activity_before_the_crash():
    """An idle kernel adopted 5 s into a 12 s idle timeout is culled some 7 s later, not 12 s after its adoption."""
    culling = {**NO_POOL, "MSB_SESSION_TIMEOUT_SECONDS": "12", "MSB_CULL_INTERVAL_SECONDS": "1"}
    first = await launch_gateway(culling)
    second = None
    try:
        kernel_id = await first.start_kernel()
        notebook = await KernelSocket.open(first, kernel_id)
        await notebook.execute("1")
        notebook.close()
        (kernel,) = (await first.stats())["kernels"]
        last_activity = kernel["last_activity"]
        await asyncio.sleep(5)
        first.process.kill()
        first.process.wait(10)
        second = await take_over(first, culling)
        adopted = time.monotonic()
        (kernel,) = (await second.stats())["kernels"]
        moved = datetime.fromisoformat(kernel["last_activity"]) - datetime.fromisoformat(last_activity)
        assert abs(moved.total_seconds()) < 1 and kernel["cull_idle_timeout"] == 12, (kernel, last_activity)

        async def culled() -> bool:
            return not (await second.stats())["kernels"]

        await wait_until(culled, 30, "the adopted kernel to be culled")
        after = time.monotonic() - adopted
        print(f"culled {after:.1f} s after its adoption (idle timeout 12 s, idle for 5 s before the crash)")
        assert after < 10.5, f"culled {after:.1f} s after adoption: its clock started again"
        (stopped,) = (await second.stats())["recently_stopped"]
        assert stopped["reason"].startswith("culled"), stopped
    finally:
        for gateway in (first, second):
            if gateway is not None:
                gateway.stop()


@pytest.mark.slow
async def test_a_sandbox_whose_gateway_never_returns_is_gone_after_the_grace_period():
    gateway = await launch_gateway({**NO_POOL, "MSB_ADOPT_GRACE_SECONDS": "3"})
    try:
        kernel_id = await gateway.start_kernel()
        (record,) = gateway.sandboxes()
        init_pid, keeper_pid = record.details["init_pid"], record.details["keeper_pid"]
    finally:
        gateway.stop(signal.SIGKILL)
    assert pid_alive(init_pid), "the sandbox must wait for the grace period"
    started = time.monotonic()
    await wait_until(lambda: not pid_alive(init_pid), 20, "the grace period to end the sandbox")
    print(f"stopped {time.monotonic() - started:.1f} s after the kill (grace 3 s)")
    await wait_until(lambda: not (gateway.runtime_dir / kernel_id).exists(), 30, "the keeper's sweep to remove the sandbox's state")
    await wait_until(lambda: not pid_alive(keeper_pid), 30, "the keeper (its sweep, by then) to exit")


@pytest.mark.slow
async def test_a_busy_kernel_is_adopted_and_its_lost_ending_is_reported():
    """The gateway dies while a cell runs. Its output and its end are delivered, or the notebook is told they
    were lost (what it printed while no gateway listened), and the cell ends (an error reply) instead of
    waiting for ever; the kernel's state is kept either way."""
    first = await launch_gateway(NO_POOL)
    second = None
    lab = await launch_jupyter_server(first)
    try:
        kernel_id = (await lab.request("POST", "/api/kernels", {"name": "python3"})).json["id"]  # as Lab's launcher
        notebook = await KernelSocket.open(lab, kernel_id)
        await notebook.execute("state = 'kept'")
        msg_id = notebook.send(
            "execute_request",
            {
                "code": "import time\nprint('before', flush=True)\ntime.sleep(2)\n"
                "print('during the restart', flush=True)\ntime.sleep(7)\nprint('after')",
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        )
        await notebook.wait_for(msg_id, lambda m: m["msg_type"] == "stream" and "before" in m["content"]["text"], 60)
        first.process.kill()
        first.process.wait(10)
        await asyncio.sleep(3)  # 'during the restart' is printed with no gateway to hear it
        second = await take_over(first)
        texts, reply = [], None
        deadline = time.monotonic() + 90
        while reply is None and time.monotonic() < deadline:
            message = await notebook.receive(max(0.1, deadline - time.monotonic()))
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                texts.append(message["content"]["text"])
            elif message["msg_type"] == "execute_reply":
                reply = message
        assert reply is not None, f"the cell never ended: {texts}"
        said = "".join(texts)
        delivered = "during the restart" in said and "after" in said
        assert delivered or "the gateway restarted while this ran" in said, said  # never silently dropped
        if not delivered:
            assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "GatewayRestarted", reply
        assert await until_reconnected(notebook, "print(state)") == "kept\n"
        # Still reported by the name it was started by, which Lab lists and saves (not msb-python-small, unlisted).
        assert (await second.request("GET", f"/api/kernels/{kernel_id}")).json["name"] == "python3"
    finally:
        lab.stop()
        for gateway in (first, second):
            if gateway is not None:
                gateway.stop()


async def test_adoption_trusts_only_records_no_sandbox_could_have_written():
    """The keys live in a 0600 file in a root-only state dir the kernel cannot see; a record that is a link,
    open to others, or owned by another user is not adopted, and its sandbox is swept, not served."""
    first = await launch_gateway(NO_POOL)
    try:
        kernel_ids = [await first.start_kernel() for _ in range(3)]
        notebook = await KernelSocket.open(first, kernel_ids[0])
        state_dir = first.runtime_dir / kernel_ids[0]
        seen = await notebook.execute(
            f"import os\nprint(os.path.exists({str(first.runtime_dir)!r}), os.path.exists({str(state_dir)!r}),"
            " sorted(os.listdir('/run/kernel')))"
        )
        notebook.close()
        assert seen.stdout.startswith("False False ["), seen.stdout  # the state dirs are not in the sandbox at all
        assert ADOPTION_RECORD not in seen.stdout and KEEPER_SOCKET not in seen.stdout
    finally:
        first.stop(signal.SIGKILL)
    state = first.runtime_dir
    opened, foreign, trusted = (state / kernel_id / ADOPTION_RECORD for kernel_id in kernel_ids)
    os.chmod(opened, 0o644)
    os.chown(foreign, 1000, 1000)
    second = await take_over(first)
    try:
        assert [r.sandbox_id for r in second.sandboxes()] == [kernel_ids[2]], second.log()[-3000:]
        log = second.log()
        assert "is open to other users" in log and "is not a regular file of uid 0" in log, log[-3000:]
        assert trusted.exists()
    finally:
        second.stop()


def test_a_kernel_record_round_trips_through_its_adoption_record_field_by_field():
    """What a kernel's record writes for adoption restores the same record, every field of its start request included
    (what its restarts mount and run); a record from before start requests were typed is not adopted."""
    request = StartRequest(
        flavor="medium",
        environment="science",
        env={"KERNEL_X": "1", "PROJECT": "demo"},
        network_allow="pypi.org",
        secrets=json.dumps({"TOKEN": {"value": "s3cret", "hosts": ["pypi.org"]}}),
        argument_names=("network_allow", "secrets"),
        owner=Owner("users-file", "alice"),
        volume="alice",
        working_dir="/srv/lab/project",
        notebook_path="project/a.ipynb",
    )
    record = KernelRecord("k1", "msb-science-python-medium", "python", request, created=1.5)
    written = json.loads(json.dumps({**record.to_adoption(), "connection": {}, "last_activity": None}))  # as on disk
    restored = KernelRecord.from_adoption(written)
    for name in ("kernel_id", "kernel_name", "template", "created"):
        assert getattr(restored, name) == getattr(record, name), name
    for name in ("flavor", "environment", "env", "network_allow", "secrets", "argument_names", "owner", "volume", "working_dir"):
        assert getattr(restored.request, name) == getattr(request, name), name
    assert restored.request.notebook_path == request.notebook_path
    assert (restored.flavor, restored.owner, restored.notebook_path) == (
        get_flavor("medium"),
        Owner("users-file", "alice"),
        "project/a.ipynb",
    )
    assert restored.to_adoption() == record.to_adoption()
    # An owner is its source and its name: the same name from another source is another owner.
    assert restored.owner != Owner("token", "alice")
    older = {key: value for key, value in record.to_adoption().items() if key != "request"} | {"flavor": "medium", "owner": "alice"}
    with pytest.raises(InvalidRequest, match="no start request"):
        KernelRecord.from_adoption(older)
    forged = json.loads(json.dumps(written))
    forged["request"]["env"]["LD_PRELOAD"] = "/tmp/x.so"  # a record is checked again wherever it is read
    with pytest.raises(InvalidRequest, match="LD_PRELOAD"):
        KernelRecord.from_adoption(forged)
    forged["request"]["env"].pop("LD_PRELOAD")
    forged["request"]["volume"] = "../bob"
    with pytest.raises(InvalidRequest, match="one directory name"):
        KernelRecord.from_adoption(forged)


async def test_an_adopted_kernel_keeps_its_owner(tmp_path):
    """The adoption record carries each kernel's owner; the next gateway restores it into the kernel's record (and
    writes it back from there), so after a crash and an adoption each person still sees only their own kernel."""
    from tests.msb_kernels.gateway.conftest import add_user

    users = tmp_path / "users.json"
    tokens = {name: add_user(users, name) for name in ("alice", "bob")}
    people = {**NO_POOL, "MSB_USERS_FILE": str(users), "MSB_TOKEN": None}
    first = await launch_gateway(people)
    first.token = tokens["alice"]
    try:
        alices = await first.start_kernel()
        bobs = (await first.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens["bob"])).json["id"]
        notebook = await KernelSocket.open(first, alices)
        await notebook.execute("kept = 'alice'")
        notebook.close()
    finally:
        first.stop(signal.SIGKILL)
    paths = {kernel_id: first.runtime_dir / kernel_id / ADOPTION_RECORD for kernel_id in (alices, bobs)}
    written = {kernel_id: trusted_json(path, private=True)[0] for kernel_id, path in paths.items()}
    owners = {kernel_id: record["request"]["owner"] for kernel_id, record in written.items()}
    assert owners[alices] == {"source": "users-file", "name": "alice"} and owners[bobs]["name"] == "bob", written
    before = paths[alices].stat().st_ino
    second = await take_over(first, people)
    try:
        assert [k["id"] for k in (await second.request("GET", "/api/kernels")).json] == [alices], second.log()[-3000:]
        assert [k["id"] for k in (await second.request("GET", "/api/kernels", token=tokens["bob"])).json] == [bobs]
        assert (await second.request("GET", f"/api/kernels/{alices}", token=tokens["bob"])).code == 404
        assert paths[alices].stat().st_ino != before  # recorded again by the adopting gateway, from its own record
        assert trusted_json(paths[alices], private=True)[0]["request"]["owner"] == {"source": "users-file", "name": "alice"}
        notebook = await KernelSocket.open(second, alices)
        assert (await notebook.execute("print(kept)")).stdout == "alice\n"
        notebook.close()
    finally:
        second.stop()
