"""The standard kernel protocol, spoken to a real kernel in a real sandbox.

Execute with streamed output, display_data, interrupt and restart are in
backends/test_contract.py, which runs them for every backend.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid

import pytest

from msb_kernels.errors import ResourceLimitExceeded
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.provisioning import registry
from tests.kernel_helpers import execute

pytestmark = pytest.mark.asyncio


async def test_errors_come_with_tracebacks(shared_kernel):
    _, kc = shared_kernel
    result = await execute(kc, "def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    assert result.error["ename"] == "ZeroDivisionError"
    assert "return 1 / 0" in result.traceback


async def test_completion_inspection_history_and_is_complete(shared_kernel):
    _, kc = shared_kernel
    await execute(kc, "import os\nsandbox_marker_value = 7")
    reply = await kc.complete("sandbox_marker_v", 16, reply=True, timeout=30)
    assert "sandbox_marker_value" in reply["content"]["matches"]
    reply = await kc.inspect("len", 3, reply=True, timeout=30)
    assert reply["content"]["found"] and "len" in reply["content"]["data"]["text/plain"]
    reply = await kc.history(hist_access_type="tail", n=20, output=False, raw=True, reply=True, timeout=30)
    assert any("sandbox_marker_value = 7" in entry[2] for entry in reply["content"]["history"])
    reply = await kc.history(hist_access_type="search", pattern="*marker_value =*", output=False, raw=True, reply=True, timeout=30)
    assert [entry[2] for entry in reply["content"]["history"]] == ["import os\nsandbox_marker_value = 7"]
    searched = await execute(kc, "%history -g marker_value =")
    assert "sandbox_marker_value = 7" in searched.stdout
    reply = await kc.is_complete("for i in range(3):", reply=True, timeout=30)
    assert reply["content"]["status"] == "incomplete"
    reply = await kc.is_complete("x = 1", reply=True, timeout=30)
    assert reply["content"]["status"] == "complete"


async def test_ipython_keeps_its_history_in_memory_where_the_sandbox_home_would_lose_it(shared_kernel):
    _, kc = shared_kernel
    manager = "get_ipython().history_manager"
    kept = await execute(
        kc, f"({manager}.hist_file, {manager}.save_thread, __import__('os').listdir({manager}.shell.profile_dir.location))"
    )
    assert kept.value[0] == ":memory:" and kept.value[1] is None
    assert "history.sqlite" not in kept.value[2]


# Counts what sys.stdout and sys.stderr hand to ipykernel's IOPub thread: with nothing buffered, a flush hands
# nothing (ipykernel's own flush hands two callbacks per stream and waits); with text buffered, it sends it.
COUNT_FLUSH_HANDOFFS = """\
import sys
handed = []
pub_thread = sys.stdout.pub_thread
real_schedule = pub_thread.schedule
pub_thread.schedule = lambda callback: (handed.append(callback), real_schedule(callback))[1]
try:
    sys.stdout.flush(); sys.stderr.flush()
    when_empty = len(handed)
    sys.stdout.write("buffered "); sys.stdout.flush()
    when_written = len(handed) - when_empty
finally:
    del pub_thread.schedule
(getattr(type(sys.stdout).flush, "msb_quick_flush", False), when_empty, when_written)
"""


async def test_a_flush_with_nothing_to_send_costs_no_round_trip_and_output_keeps_its_cell(shared_kernel):
    _, kc = shared_kernel
    counted = await execute(kc, COUNT_FLUSH_HANDOFFS)
    installed, when_empty, when_written = counted.value
    assert installed and when_empty == 0 and when_written >= 2, counted.value
    assert counted.stdout == "buffered "
    # Every cell's output arrives before its idle status (execute collects until idle), from the cell and from
    # a thread it waits for, flushed by the kernel at the end of the request and not by the code.
    for i in range(40):
        cell = await execute(
            kc,
            f"import threading\nprint('cell {i}', end='')\nt = threading.Thread(target=print, args=(' thread {i}',)); t.start(); t.join()",
        )
        assert cell.stdout == f"cell {i} thread {i}\n", (i, cell.stdout)


async def test_comms_round_trip(shared_kernel):
    _, kc = shared_kernel
    await execute(
        kc,
        (
            "def _echo_target(comm, open_msg):\n"
            "    comm.on_msg(lambda msg: comm.send({'echo': msg['content']['data']['value'] * 2}))\n"
            "get_ipython().kernel.comm_manager.register_target('msb-echo', _echo_target)"
        ),
    )
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": "msb-echo", "data": {}}))
    info = await kc.comm_info(reply=True, timeout=30)
    assert comm_id in info["content"]["comms"]
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"value": 21}}))
    while True:
        message = await kc.get_iopub_msg(timeout=30)
        if message["msg_type"] == "comm_msg" and message["content"]["comm_id"] == comm_id:
            assert message["content"]["data"] == {"echo": 42}
            break
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))


async def test_input_is_answered_over_stdin(shared_kernel):
    _, kc = shared_kernel
    result = await execute(kc, "name = input('who? ')\nprint('hello', name)", stdin_answer="sandbox user")
    assert any(m["msg_type"] == "input_request" and m["content"]["prompt"] == "who? " for m in result.messages)
    assert "hello sandbox user" in result.stdout


async def test_shutdown_removes_the_sandbox(start_kernel, runtime_root):
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    state_dir = sandbox.state_dir
    cgroup_paths = list(sandbox.cgroup.paths.values()) if sandbox.cgroup else []
    await km.shutdown_kernel()
    assert not await km.is_alive()
    assert not os.path.exists(f"/proc/{sandbox.init_pid}") or open(f"/proc/{sandbox.init_pid}/stat").read().split()[2] == "Z"
    assert not state_dir.exists()
    assert not any(path.exists() for path in cgroup_paths)
    assert km.kernel_id not in registry.default().live_sandboxes


ALLOCATE = (
    "try:\n    block = bytearray({mib} * 2**20)\n    del block\n    print('allocated')\nexcept MemoryError:\n    print('MemoryError')"
)


@pytest.mark.parametrize("how", ["kernelspec", "KERNEL_FLAVOR"])
@pytest.mark.parametrize("flavor", ["medium", "large"])
async def test_a_larger_flavor_gets_its_own_limits(start_kernel, flavor, how):
    """Inside, memory up to the flavor's size can be had and more cannot; the cgroup holds its CPUs."""
    if how == "kernelspec":
        km, kc = await start_kernel(f"msb-python-{flavor}")
    else:
        km, kc = await start_kernel(env={"KERNEL_FLAVOR": flavor})
    size = FLAVORS[flavor]
    assert km.provisioner.flavor_spec is size
    assert (await execute(kc, "import os; os.environ['MSB_FLAVOR'], os.environ['OMP_NUM_THREADS']")).value == (flavor, str(size.cpus))
    assert (await execute(kc, ALLOCATE.format(mib=size.memory_mib - 400))).stdout.strip() == "allocated"
    assert (await execute(kc, ALLOCATE.format(mib=size.memory_mib + 256))).stdout.strip() == "MemoryError"
    cgroup = km.provisioner.sandbox.cgroup
    if cgroup is not None and cgroup.hierarchy.version == 1:
        assert int((cgroup.paths["memory"] / "memory.limit_in_bytes").read_text()) == size.memory_bytes
        quota = int((cgroup.paths["cpu"] / "cpu.cfs_quota_us").read_text())
        assert quota == size.cpus * int((cgroup.paths["cpu"] / "cpu.cfs_period_us").read_text())


async def test_unknown_flavor_is_refused_with_the_accepted_values(start_kernel):
    with pytest.raises(Exception, match="KERNEL_FLAVOR='huge' is not a flavor; use one of small, medium, large"):
        await start_kernel(env={"KERNEL_FLAVOR": "huge"})


async def test_max_sessions_refuses_one_more(start_kernel, monkeypatch):
    await start_kernel()
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(registry.default().session_kernel_ids)))
    with pytest.raises(ResourceLimitExceeded, match="MSB_MAX_SESSIONS"):
        await start_kernel()


async def test_a_burst_of_starts_takes_turns(start_kernel, monkeypatch):
    """MSB_CONCURRENT_STARTS=1: each sandbox is created only once the one before it has bound its shell socket."""
    monkeypatch.setenv("MSB_CONCURRENT_STARTS", "1")
    kernels = await asyncio.gather(*(start_kernel() for _ in range(3)))
    starts = []
    for km, _ in kernels:
        description = km.provisioner.describe()
        shell = km.provisioner.io_dir / f"kernel-{km.shell_port}"
        starts.append((description.created, shell.stat().st_mtime))
    starts.sort()
    for (_, bound), (created, _) in itertools.pairwise(starts):
        assert created >= bound, f"a sandbox was created before the one ahead of it was listening: {starts}"


async def test_host_environment_does_not_leak_into_the_kernel(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_TEST_HOST_SECRET", "do-not-leak")
    km, kc = await start_kernel(env={"KERNEL_USERNAME": "alice"})
    result = await execute(kc, "import os; sorted(os.environ)")
    assert "MSB_TEST_HOST_SECRET" not in result.result
    assert "JPY_PARENT_PID" not in result.result
    assert (await execute(kc, "os.environ['KERNEL_USERNAME']")).result == "'alice'"


async def test_describe_names_the_chosen_template_and_flavor_and_the_live_sandbox(start_kernel):
    """What mcp_bridge reads: the flavor the start request chose (not the kernelspec's name), and a new sandbox after a restart."""
    km, kc = await start_kernel(env={"KERNEL_FLAVOR": "medium"})
    before = km.provisioner.describe()
    assert (before.template.name, before.flavor.name) == ("python", "medium")
    assert before.sandbox is km.provisioner.sandbox and before.created == before.sandbox.created
    await km.restart_kernel(now=True)
    after = km.provisioner.describe()
    assert after.sandbox is not None and after.sandbox is not before.sandbox
    assert after.created >= before.created


@pytest.mark.parametrize("template", sorted(TEMPLATES))
async def test_the_newest_client_of_a_zmq_identity_gets_the_replies(start_kernel, template: str) -> None:
    """jupyter_server gives a client's shell socket its session id as ZMQ identity, and a client that
    reconnects keeps its session id: the kernel must answer the new socket (ZMQ_ROUTER_HANDOVER),
    as ipykernel does on its own and tslab does with the provisioner's NODE_OPTIONS preload."""
    if reason := TEMPLATES[template].unavailable_reason():
        pytest.skip(f"{template} kernels unavailable: {reason}")
    km, kc = await start_kernel(f"msb-{template}-small")
    sockets = []
    try:
        for attempt in ("first", "second"):
            shell = km.connect_shell(identity=b"one-session")
            sockets.append(shell)
            request = kc.session.send(shell, "kernel_info_request", {})
            try:
                _, reply = kc.session.feed_identities(await asyncio.wait_for(shell.recv_multipart(), 30))
            except asyncio.TimeoutError:
                raise AssertionError(f"the {attempt} socket with the identity got no reply") from None
            assert kc.session.deserialize(reply)["parent_header"]["msg_id"] == request["header"]["msg_id"]
    finally:
        for shell in sockets:
            shell.close(linger=0)


async def test_a_start_cancelled_while_waiting_for_its_turn_gives_back_its_session_and_directory(monkeypatch, runtime_root):
    """A caller's timeout (MCP's start timeout, a client gone) cancels a start that waits for its turn: it held a session
    claim and a directory with the kernel's key, which nothing would ever give back, so MSB_MAX_SESSIONS refused later starts."""
    from jupyter_client.manager import AsyncKernelManager

    from msb_kernels.provisioning.provisioner import start_turn
    from msb_kernels.settings.config import load_settings

    monkeypatch.setenv("MSB_CONCURRENT_STARTS", "1")
    kernel_id = str(uuid.uuid4())
    km = AsyncKernelManager(kernel_name="msb-python-small")
    async with start_turn(load_settings()):  # every turn is taken: the start waits at it
        start = asyncio.ensure_future(km.start_kernel(kernel_id=kernel_id, env=dict(os.environ)))
        for _ in range(500):
            if kernel_id in registry.default().session_kernel_ids and (runtime_root / kernel_id).exists():
                break
            await asyncio.sleep(0.01)
        assert kernel_id in registry.default().session_kernel_ids, "the start never claimed its session"
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
    assert kernel_id not in registry.default().session_kernel_ids, "a cancelled start kept its session"
    assert not (runtime_root / kernel_id).exists(), "a cancelled start left its directory (and the kernel's key) behind"
    assert kernel_id not in registry.default().live_sandboxes
