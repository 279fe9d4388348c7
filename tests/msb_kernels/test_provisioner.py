"""The standard kernel protocol, spoken to a real kernel in a real sandbox.

Execute with streamed output, display_data, interrupt and restart are in
backends/test_contract.py, which runs them for every backend.
"""

from __future__ import annotations

import os
import uuid

import pytest

from msb_kernels.errors import ResourceLimitExceeded
from msb_kernels.provisioner import live_sandboxes
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
    reply = await kc.is_complete("for i in range(3):", reply=True, timeout=30)
    assert reply["content"]["status"] == "incomplete"
    reply = await kc.is_complete("x = 1", reply=True, timeout=30)
    assert reply["content"]["status"] == "complete"


async def test_comms_round_trip(shared_kernel):
    _, kc = shared_kernel
    await execute(kc, (
        "def _echo_target(comm, open_msg):\n"
        "    comm.on_msg(lambda msg: comm.send({'echo': msg['content']['data']['value'] * 2}))\n"
        "get_ipython().kernel.comm_manager.register_target('msb-echo', _echo_target)"
    ))
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
    assert km.kernel_id not in live_sandboxes


async def test_flavor_from_kernel_flavor_env(start_kernel):
    km, kc = await start_kernel(env={"KERNEL_FLAVOR": "medium"})
    assert km.provisioner.flavor_spec.name == "medium"
    assert (await execute(kc, "import os; os.environ['MSB_FLAVOR']")).result == "'medium'"


async def test_unknown_flavor_is_refused_with_the_accepted_values(start_kernel):
    with pytest.raises(Exception, match="KERNEL_FLAVOR='huge' is not a flavor; use one of small, medium, large"):
        await start_kernel(env={"KERNEL_FLAVOR": "huge"})


async def test_max_sessions_refuses_one_more(start_kernel, monkeypatch):
    await start_kernel()
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(live_sandboxes)))
    with pytest.raises(ResourceLimitExceeded, match="MSB_MAX_SESSIONS"):
        await start_kernel()


async def test_host_environment_does_not_leak_into_the_kernel(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_TEST_HOST_SECRET", "do-not-leak")
    km, kc = await start_kernel(env={"KERNEL_USERNAME": "alice"})
    result = await execute(kc, "import os; sorted(os.environ)")
    assert "MSB_TEST_HOST_SECRET" not in result.result
    assert "JPY_PARENT_PID" not in result.result
    assert (await execute(kc, "os.environ['KERNEL_USERNAME']")).result == "'alice'"
