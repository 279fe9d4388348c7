"""Hibernation through `msb-kernels serve` (MSB_HIBERNATE_AFTER_SECONDS), with the clients users have: JupyterLab in
headless Chromium, the MCP Inspector CLI, and plain REST. The checkpoint itself is tested in
tests/msb_kernels/backends/gvisor/test_hibernation.py."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator

import pytest

from msb_kernels.backends.gvisor import netstack
from tests.conftest import TEST_BASE
from tests.msb_kernels.gateway.conftest import Gateway, HttpServer, KernelSocket, launch_gateway, launch_jupyter_server, wait_until
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, needs_runsc, pytest.mark.timeout(600)]

AFTER = 3  # seconds idle before a kernel hibernates: past an Inspector call's reply and the stats read after it
ASLEEP_WITHIN = 30.0  # the look runs every AFTER / 2 s (at least 1 s); a checkpoint takes a second or two
FREED = 4 * 2**20  # what a hibernated kernel's cgroup may still hold: no process, and its page cache given back


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    """A gateway whose gVisor kernels hibernate after AFTER idle seconds (this module's `gateway`, for `page` too)."""
    server = await launch_gateway({"MSB_BACKEND": "gvisor", "MSB_HIBERNATE_AFTER_SECONDS": str(AFTER)})
    yield server
    server.stop()


async def kernel_entry(gateway: Gateway, kernel_id: str) -> dict:
    (entry,) = [k for k in (await gateway.stats())["kernels"] if k["id"] == kernel_id]
    return entry


async def until_hibernated(gateway: Gateway, kernel_id: str) -> dict:
    async def asleep() -> dict | None:
        entry = await kernel_entry(gateway, kernel_id)
        return entry if entry["execution_state"] == "hibernated" else None

    return await wait_until(asleep, ASLEEP_WITHIN, f"kernel {kernel_id} to hibernate")


async def test_the_mcp_inspector_reads_back_what_it_set_before_the_kernel_hibernated(gateway: Gateway, tmp_path) -> None:
    """execute_code sets state; the kernel hibernates (get_sessions says so, its memory is freed); execute_code with the
    same session reads the state back. Then REST: an interrupt leaves it asleep, a restart gives a fresh kernel, and a
    shutdown deletes its image and network."""
    from tests.mcp_bridge.test_inspector import gateway_inspector, inspector_missing

    if missing := inspector_missing():
        pytest.skip(missing)
    inspector = gateway_inspector(gateway, tmp_path)
    started = await inspector.call("execute_code", code="import numpy; kept = numpy.arange(10**6); print('set')")
    assert started.structured["stdout"] == "set\n", started.result
    session = started.structured["session_id"]
    awake = (await kernel_entry(gateway, session))["memory_bytes"]

    asleep = await until_hibernated(gateway, session)
    print(f"memory {awake / 2**20:.0f} MiB awake, {(asleep['memory_bytes'] or 0) / 2**20:.0f} MiB hibernated")
    assert (asleep["memory_bytes"] or 0) < FREED, asleep
    listed = (await inspector.call("get_sessions")).structured["sessions"]
    assert [s["status"] for s in listed if s["id"] == session] == ["hibernated"], listed
    model = (await gateway.request("GET", f"/api/kernels/{session}")).json
    assert model["execution_state"] == "hibernated", model
    images = TEST_BASE / "scratch" / "hibernate" / session
    assert images.is_dir()

    read = await inspector.call("execute_code", code="print(kept.sum())", session_id=session)
    assert read.structured["stdout"] == "499999500000\n", read.result
    stats = (await gateway.stats())["hibernation"]
    assert stats["hibernated"] >= 1 and stats["restored"] >= 1, stats
    assert not images.exists()
    metrics = (await gateway.request("GET", "/metrics")).body.decode()
    assert 'msb_hibernations_total{outcome="restored"}' in metrics and "msb_restore_seconds_count" in metrics

    await until_hibernated(gateway, session)
    assert (await gateway.request("POST", f"/api/kernels/{session}/interrupt")).code == 204
    assert (await kernel_entry(gateway, session))["execution_state"] == "hibernated"
    assert (await gateway.request("POST", f"/api/kernels/{session}/restart")).code == 200
    assert not images.exists()
    socket = await KernelSocket.open(gateway, session)
    try:
        assert (await socket.execute("print('kept' in globals())")).stdout == "False\n"
    finally:
        socket.close()

    await until_hibernated(gateway, session)
    assert images.is_dir()
    assert (await gateway.request("DELETE", f"/api/kernels/{session}")).code == 204
    assert not images.exists()
    assert not any(name in netstack_names() for name in netstack.names(session))


def netstack_names() -> str:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


async def test_a_message_on_an_open_websocket_wakes_the_kernel_and_is_answered(gateway: Gateway) -> None:
    """The WebSocket stays open while the kernel sleeps; what it sends then waits in ZMQ's queue until the restore."""
    kernel_id = await gateway.start_kernel()
    socket = await KernelSocket.open(gateway, kernel_id)
    try:
        assert (await socket.execute("n = 1")).reply["content"]["status"] == "ok"
        await until_hibernated(gateway, kernel_id)
        assert (await socket.execute("print(n)", timeout=60)).stdout == "1\n", gateway.log()[-3000:]
    finally:
        socket.close()
        await gateway.request("DELETE", f"/api/kernels/{kernel_id}")


async def test_a_kernel_no_client_has_reached_yet_hibernates_and_wakes_on_the_first_one(gateway: Gateway) -> None:
    """Started over REST and never asked anything, jupyter_server calls it "starting" until its first request: it is
    at rest all the same, and sleeps like an idle one (a host full of such kernels refused starts it had room for)."""
    kernel_id = await gateway.start_kernel()
    try:
        assert (await kernel_entry(gateway, kernel_id))["execution_state"] == "starting"
        await until_hibernated(gateway, kernel_id)
        socket = await KernelSocket.open(gateway, kernel_id)
        try:
            assert (await socket.execute("1+1", timeout=60)).result == "2", gateway.log()[-3000:]
        finally:
            socket.close()
    finally:
        await gateway.request("DELETE", f"/api/kernels/{kernel_id}")


async def test_a_kernel_that_cannot_hibernate_runs_on_and_the_stats_say_why(gateway: Gateway) -> None:
    kernel_id = await gateway.start_kernel()
    socket = await KernelSocket.open(gateway, kernel_id)
    try:
        code = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen(); kept = 'awake'"
        assert (await socket.execute(code)).reply["content"]["status"] == "ok"

        async def refused() -> list:
            return [r for r in (await gateway.stats())["hibernation"]["recent_refusals"] if r["id"] == kernel_id]

        (refusal,) = await wait_until(refused, ASLEEP_WITHIN, "the gateway to try, and refuse")
        assert "tcp listening on 127.0.0.1:8765" in refusal["reason"], refusal
        assert f"kernel {kernel_id} stays awake: it cannot hibernate" in gateway.log()
        assert (await kernel_entry(gateway, kernel_id))["execution_state"] == "idle"
        assert (await socket.execute("print(kept)")).stdout == "awake\n"
    finally:
        socket.close()
        await gateway.request("DELETE", f"/api/kernels/{kernel_id}")


async def test_an_image_that_cannot_be_restored_stops_the_kernel_and_says_why(gateway: Gateway) -> None:
    """A hibernated kernel whose image was damaged on disk (here: replaced) does not come back: the request that woke
    it is refused with the reason, the kernel is stopped and its stop record says why. Nothing hangs."""
    kernel_id = await gateway.start_kernel()
    socket = await KernelSocket.open(gateway, kernel_id)
    assert (await socket.execute("x = 1")).reply["content"]["status"] == "ok"
    socket.close()
    await until_hibernated(gateway, kernel_id)
    (image,) = (TEST_BASE / "scratch" / "hibernate" / kernel_id).iterdir()
    image.write_bytes(b"not a checkpoint")
    with contextlib.suppress(Exception):  # a new WebSocket wakes it, and is refused when the kernel cannot come back
        (await KernelSocket.open(gateway, kernel_id)).close()

    async def stopped() -> dict | None:
        return next((r for r in (await gateway.stats())["recently_stopped"] if r["id"] == kernel_id), None)

    record = await wait_until(stopped, 30, "the kernel's stop record")
    assert record["reason"].startswith("restore from hibernation failed: runsc could not restore the kernel"), record
    assert (await gateway.request("GET", f"/api/kernels/{kernel_id}")).code == 404
    assert "restore from hibernation failed" in gateway.log()


KEEPING = {"MSB_BACKEND": "gvisor", "MSB_HIBERNATE_AFTER_SECONDS": str(AFTER), "MSB_KEEP_KERNELS": "1"}


async def kernel_holding(gateway: Gateway, value: str) -> str:
    """A new kernel of the gateway's, holding ``kept = value``, with no client left on it."""
    kernel_id = await gateway.start_kernel()
    socket = await KernelSocket.open(gateway, kernel_id)
    assert (await socket.execute(f"kept = {value!r}")).reply["content"]["status"] == "ok"
    socket.close()
    return kernel_id


async def assert_woken_and_adopted(first: Gateway, env: dict, kernel_id: str, value: str) -> None:
    """first, stopped keeping its kernels, woke the hibernated one; the next gateway adopts it holding ``value``."""
    from tests.msb_kernels.gateway.kernels.test_adoption import take_over

    assert "waking 1 hibernated kernel(s), for the next msb-kernels serve to adopt" in first.log(), first.log()[-3000:]
    second = await take_over(first, env)
    try:
        assert "adopted 1 running kernel(s)" in second.log(), second.log()[-3000:]
        socket = await KernelSocket.open(second, kernel_id)
        assert (await socket.execute("print(kept)")).stdout == f"{value}\n"
        socket.close()
    finally:
        await second.request("DELETE", f"/api/kernels/{kernel_id}")  # or this stop would keep it too
        second.stop()


async def test_a_stop_that_keeps_kernels_wakes_a_hibernated_one_for_the_next_gateway(gateway_factory) -> None:
    """A hibernated kernel has no process for a keeper to hold: `serve --keep-kernels` wakes it at the stop, and the
    next gateway adopts it, over tcp, with its state."""
    first = await gateway_factory(extra_env=KEEPING, runtime_dir=TEST_BASE / "hib-keep")
    kernel_id = await kernel_holding(first, "through a restart")
    await until_hibernated(first, kernel_id)
    first.stop()
    await assert_woken_and_adopted(first, KEEPING, kernel_id, "through a restart")


async def test_a_stop_that_keeps_kernels_during_a_checkpoint_keeps_that_kernel_too(gateway_factory) -> None:
    """The stop comes while a kernel is being checkpointed: it finishes, the kernel is woken, and the next gateway adopts
    it with its state and leaves no image behind. A fresh clone's run under load kept 2 of 3 kernels: the third,
    mid-checkpoint, was neither running for its keeper nor marked asleep to be woken, and its disk was left."""
    import os
    from pathlib import Path

    env = {**KEEPING, "MSB_HIBERNATE_AFTER_SECONDS": "1"}
    first = await gateway_factory(extra_env=env, runtime_dir=TEST_BASE / "hib-keep-mid")
    kernel_id = await kernel_holding(first, "through a checkpoint")
    image = Path(os.environ["MSB_SCRATCH_DIR"]) / "hibernate" / kernel_id  # made empty as its checkpoint begins

    async def checkpoint_begun() -> bool:
        return image.is_dir()

    await wait_until(checkpoint_begun, ASLEEP_WITHIN, "the kernel's checkpoint to begin", interval=0.01)
    first.stop()
    await assert_woken_and_adopted(first, env, kernel_id, "through a checkpoint")
    assert not image.exists(), sorted(image.iterdir())


async def test_a_host_holds_more_sessions_than_its_memory_and_a_wake_makes_room(gateway_factory, tmp_path) -> None:
    """Capacity for one small kernel awake: bob's session starts once alice's sleeps, and her wake puts his, idle but
    not yet asleep, to sleep to make room (another person's kernel, put to sleep by the system). Both keep their
    state and their owner, and neither person ever sees the other's."""
    from tests.msb_kernels.gateway.conftest import add_user

    users = tmp_path / "users.json"
    tokens = {name: add_user(users, name, admin=name == "ops") for name in ("alice", "bob", "ops")}
    after = 4  # long enough that the second kernel is still awake when the first is woken
    env = {
        "MSB_BACKEND": "gvisor",
        "MSB_HIBERNATE_AFTER_SECONDS": str(after),
        "MSB_CAPACITY_MEMORY_MIB": "1024",
        "MSB_POOL_SIZE": "0",
        "MSB_USERS_FILE": str(users),
        "MSB_TOKEN": None,
    }
    gateway = await gateway_factory(extra_env=env, runtime_dir=TEST_BASE / "hib-room")
    gateway.token = tokens["ops"]  # stats, as the admin, see both
    first = (await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens["alice"])).json["id"]
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens["bob"])
    assert refused.code == 429 and "host capacity reached" in refused.body.decode(), refused.body
    one = await KernelSocket.open(gateway, first, token=tokens["alice"])
    assert (await one.execute("mine = 'first'")).reply["content"]["status"] == "ok"
    await until_hibernated(gateway, first)
    second = (await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, token=tokens["bob"])).json["id"]
    two = await KernelSocket.open(gateway, second, token=tokens["bob"])
    try:
        assert (await two.execute("mine = 'second'")).reply["content"]["status"] == "ok"
        assert (await one.execute("print(mine)", timeout=60)).stdout == "first\n"  # its wake hibernates the second
        assert (await kernel_entry(gateway, second))["execution_state"] == "hibernated"
        assert (await two.execute("print(mine)", timeout=60)).stdout == "second\n"  # and back: the first sleeps
        assert (await kernel_entry(gateway, first))["execution_state"] == "hibernated"
        assert {(await kernel_entry(gateway, k))["owner"] for k in (first, second)} == {"alice", "bob"}
        for who, theirs, other in (("alice", first, second), ("bob", second, first)):
            seen = {k["id"] for k in (await gateway.request("GET", "/api/kernels", token=tokens[who])).json}
            assert theirs in seen and other not in seen
    finally:
        one.close()
        two.close()


# -- JupyterLab in Chromium ---------------------------------------------------------------------------------------

try:
    from tests.msb_kernels.gateway.browser import (  # noqa: F401 (browser and page are fixtures)
        PYTHON,
        STDOUT,
        LabPage,
        browser,
        page,
    )
except pytest.skip.Exception:  # selenium missing: the browser test below skips with the reason the import gave
    LabPage = None  # type: ignore[assignment,misc]


@pytest.fixture(scope="module")
async def lab(gateway: Gateway) -> AsyncIterator[HttpServer]:
    server = await launch_jupyter_server(gateway, app="lab")
    yield server
    server.stop(signal.SIGKILL)  # its kernel is deleted by the test; a Lab that served a room hangs 15 s at SIGTERM


@pytest.mark.skipif(LabPage is None, reason="selenium is a test extra: pip install -e '.[test]'")
async def test_jupyterlab_runs_a_cell_on_a_hibernated_kernel_without_a_reload(page, gateway: Gateway) -> None:
    """Set a variable, wait past the timeout, see the kernel's memory freed, run a cell that reads it: the answer comes,
    in the same page, on the same WebSocket."""
    before = {k["id"] for k in (await gateway.stats())["kernels"]}  # the module's gateway may hold others' kernels
    page.new_notebook(PYTHON)
    page.wait_for_text(page.run("secret = 6 * 7; print('set')"), STDOUT, "set")
    (kernel_id,) = {k["id"] for k in (await gateway.stats())["kernels"]} - before
    asleep = await until_hibernated(gateway, kernel_id)
    assert (asleep["memory_bytes"] or 0) < FREED, asleep
    cell = page.run("print(secret)")
    try:
        shown = page.wait_for_text(cell, STDOUT, "42", 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{gateway.log()[-4000:]}") from None
    assert shown.strip() == "42"
    assert (await kernel_entry(gateway, kernel_id))["execution_state"] in ("idle", "busy")
    assert (await gateway.request("DELETE", f"/api/kernels/{kernel_id}")).code == 204  # Lab's stop need not wait for it
