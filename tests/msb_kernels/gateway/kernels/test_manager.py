"""The gateway's kernel manager in this process, as its callers reach it: identity fails closed. A path that forgets to
say who acts (nobody) sees no kernel and starts none; the system, said explicitly, sees every one; a person, their own.
The MCP bridge over it answers a call that came without its request as nobody's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from mcp import Client
from tornado import web

from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.server import build_server
from msb_kernels.errors import NobodyActing
from msb_kernels.gateway.kernels.manager import MsbKernelManager
from msb_kernels.gateway.sandboxed_kernelspecs import MsbKernelSpecManager
from msb_kernels.identity.people import SYSTEM, Person, acting_as
from msb_kernels.identity.person_registry import person_key
from msb_kernels.provisioning.start_request import START_REQUEST, StartRequest
from msb_kernels.settings.config import load_settings
from tests.mcp_bridge.conftest import TEST_OPTIONS

ALICE = Person("alice", source="users-file")
BOB = Person("bob", source="users-file")


@pytest.fixture
async def manager(tmp_path, monkeypatch) -> AsyncIterator[MsbKernelManager]:
    monkeypatch.setenv("MSB_POOL_SIZE", "python-small=0")
    km = MsbKernelManager(kernel_spec_manager=MsbKernelSpecManager(), connection_dir=str(tmp_path))
    yield km
    with acting_as(SYSTEM):
        await km.shutdown_all(now=True)


async def test_nobody_sees_and_starts_nothing_the_system_sees_all_a_person_their_own(manager: MsbKernelManager) -> None:
    with acting_as(None), pytest.raises(NobodyActing):
        await manager.start_kernel(kernel_name="msb-python-small")
    assert not manager.records
    with acting_as(ALICE):
        # What the request says of its owner and volume is not what the kernel gets: the caller's are.
        forged = StartRequest(env={"PROJECT": "demo"}).for_caller(BOB.owner, "bob")
        kernel = await manager.start_kernel(kernel_name="msb-python-small", **{START_REQUEST: forged})
        assert kernel in manager and manager.list_kernel_ids() == [kernel]
    record = manager.record(kernel)
    assert (record.owner, record.request.volume, dict(record.request.env)) == (ALICE.owner, person_key(ALICE.owner), {"PROJECT": "demo"})
    assert record.request.flavor == "small"  # what the gateway chose, kept for every later start

    for caller in (None, BOB, Person("alice", source="hub"), Person("alice", source="token")):
        with acting_as(caller):
            assert kernel not in manager and manager.list_kernel_ids() == [] and manager.list_kernels() == [], caller
            for action in (manager.shutdown_kernel, manager.restart_kernel, manager.interrupt_kernel):
                with pytest.raises(web.HTTPError) as refused:
                    await action(kernel)
                assert refused.value.status_code == 404, (caller, action)
    with acting_as(SYSTEM):
        assert manager.list_kernel_ids() == [kernel]
    with acting_as(ALICE):
        await manager.restart_kernel(kernel, now=True)
        assert manager.record(kernel).request is record.request  # the restart used the same start request
        await manager.shutdown_kernel(kernel, now=True)
    assert not manager.records


async def test_an_mcp_call_without_its_request_acts_for_nobody(manager: MsbKernelManager) -> None:
    """The gateway's /mcp serves HTTP only (local_caller None): a tool call whose request is missing is nobody's, who
    sees no session and may start none; never the system, never an admin."""
    with acting_as(ALICE):
        kernel = await manager.start_kernel(kernel_name="msb-python-small")
    server = build_server(ManagedKernelSessions(manager), load_settings(), TEST_OPTIONS, local_caller=None)
    async with Client(server) as client:  # in process: no HTTP request under any call
        listed = await client.call_tool("get_sessions", {})
        assert not listed.is_error and kernel not in str(listed.structured_content), listed.structured_content
        refused = await client.call_tool("execute_code", {"code": "1 + 1"})
        assert refused.is_error and "nobody acting" in refused.structured_content["error"]["message"], refused.structured_content
        reached = await client.call_tool("execute_code", {"code": "1 + 1", "session_id": kernel})
        assert reached.is_error and reached.structured_content["error"]["type"] == "SessionNotFound", reached.structured_content
    assert manager.list_kernel_ids() == [] and list(manager.records) == [kernel]
