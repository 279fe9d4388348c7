"""The warm pool, with real sandboxed kernels behind a real AsyncMultiKernelManager."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from msb_kernels.provisioning import registry
from msb_kernels.provisioning.pool import KernelPool, PooledMultiKernelManager
from tests.kernel_helpers import execute


async def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
async def pooled_manager():
    manager = PooledMultiKernelManager()
    manager.pool = KernelPool(manager, {"msb-python-small": 1})
    manager.pool.fill()
    yield manager
    await manager.shutdown_all(now=True)


async def test_a_new_session_gets_a_running_pooled_kernel_with_no_past(pooled_manager, monkeypatch):
    pool = pooled_manager.pool
    await wait_for(lambda: pool.waiting() == 1)
    (pooled_id,) = pool.kernel_ids()
    # Room for exactly one more session: the waiting kernel is nobody's, so it does not count. Sessions an earlier
    # test of this process still holds are counted in (and named, for whoever hunts the leak: it happened once in
    # three full runs, and a watch over every test could not catch it again).
    held = set(registry.default().session_kernel_ids)
    if held:
        print(f"sessions already claimed in this process: {sorted(held)}")
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(held) + 1))

    kernel_id = await pooled_manager.start_kernel(kernel_name="msb-python-small")
    assert kernel_id == pooled_id and kernel_id in pooled_manager.list_kernel_ids()
    kc = pooled_manager.get_kernel(kernel_id).client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=30)
    fresh = await execute(
        kc,
        "[len(In), len(Out), sorted(k for k in globals() if not k.startswith('_') and k not in ('In', 'Out', 'get_ipython', 'exit', 'quit', 'open')),"
        " 'formatters' in get_ipython().display_formatter._trait_values]",
    )  # read before this cell's result is shown
    # The pool's silent warm-up cell left no trace, and built what a first result needs.
    assert fresh.value == [2, 0, [], True] and fresh.reply["content"]["execution_count"] == 1
    await execute(kc, "secret = 'session one'")
    kc.stop_channels()

    await wait_for(lambda: pool.waiting() == 1)  # refilled in the background, at MSB_MAX_SESSIONS
    (refill_id,) = pool.kernel_ids()
    assert refill_id != kernel_id
    monkeypatch.setenv("MSB_MAX_SESSIONS", str(len(held) + 2))
    second = await pooled_manager.start_kernel(kernel_name="msb-python-small")
    assert second == refill_id != kernel_id
    kc2 = pooled_manager.get_kernel(second).client()
    kc2.start_channels()
    await kc2.wait_for_ready(timeout=30)
    assert (await execute(kc2, "'secret' in globals()")).result == "False"
    kc2.stop_channels()


async def test_requests_the_pool_cannot_serve_start_their_own_kernel(pooled_manager):
    pool = pooled_manager.pool
    await wait_for(lambda: pool.waiting() == 1)
    (pooled_id,) = pool.kernel_ids()
    medium = await pooled_manager.start_kernel(kernel_name="msb-python-small", env={**os.environ, "KERNEL_FLAVOR": "medium"})
    assert medium != pooled_id
    assert pooled_manager.get_kernel(medium).provisioner.flavor_spec.name == "medium"
    custom = await pooled_manager.start_kernel(kernel_name="msb-python-small", env={**os.environ, "KERNEL_GREETING": "hello"})
    assert custom != pooled_id, "a variable the kernel must see was given a kernel started without it"
    assert pool.kernel_ids() == {pooled_id}


async def test_jupyterlabs_start_variables_take_a_pooled_kernel_and_reach_it_on_restart(pooled_manager):
    pool = pooled_manager.pool
    await wait_for(lambda: pool.waiting() == 1)
    (pooled_id,) = pool.kernel_ids()
    lab_env = {
        "KERNEL_LAUNCH_TIMEOUT": "40",
        "KERNEL_WORKING_DIR": "/home/alice/work",
        "KERNEL_USERNAME": "alice",
        "JPY_SESSION_NAME": "/home/alice/work/report.ipynb",
    }
    kernel_id = await pooled_manager.start_kernel(kernel_name="msb-python-small", env={**os.environ, **lab_env})
    assert kernel_id == pooled_id
    km = pooled_manager.get_kernel(kernel_id)
    await km.restart_kernel(now=True)
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        seen = await execute(kc, "import os\n[os.environ.get('JPY_SESSION_NAME'), os.environ.get('KERNEL_USERNAME')]")
        assert seen.value == ["/home/alice/work/report.ipynb", "alice"]
    finally:
        kc.stop_channels()


async def test_shutdown_stops_pooled_kernels_too():
    manager = PooledMultiKernelManager()
    manager.pool = KernelPool(manager, {"msb-python-small": 1})
    manager.pool.fill()
    await wait_for(lambda: manager.pool.waiting() == 1)
    (pooled,) = manager.pool.ready["msb-python-small"]
    sandbox = pooled.provisioner.sandbox
    await manager.shutdown_all(now=True)
    assert await sandbox.poll() is not None
    assert not sandbox.state_dir.exists()
    assert pooled.kernel_id not in registry.default().live_sandboxes and pooled.kernel_id not in registry.default().pooled_kernel_ids


async def test_a_manager_that_owns_a_registry_counts_its_kernels_there_alone():
    """The registry is the manager's, handed down: its pool marks its waiting kernel there, its provisioner holds the
    sandbox there (reached through the kernel manager's parent) and claims the session there, never in default()."""
    from msb_kernels.provisioning.registry import SandboxRegistry

    manager = PooledMultiKernelManager()
    manager.sandbox_registry = own = SandboxRegistry()
    manager.pool = KernelPool(manager, {"msb-python-small": 1})
    manager.pool.fill()
    try:
        await wait_for(lambda: manager.pool.waiting() == 1)
        (pooled_id,) = manager.pool.kernel_ids()
        assert pooled_id in own.pooled_kernel_ids and pooled_id in own.live_sandboxes and not own.session_kernel_ids
        assert pooled_id not in registry.default().pooled_kernel_ids and pooled_id not in registry.default().live_sandboxes
        assert registry.runs_in_this_process(pooled_id)  # what a backend's sweep asks, whichever registry holds it
        kernel_id = await manager.start_kernel(kernel_name="msb-python-small")
        assert kernel_id == pooled_id and own.session_kernel_ids == {kernel_id} and kernel_id not in own.pooled_kernel_ids
        assert kernel_id not in registry.default().session_kernel_ids
    finally:
        await manager.shutdown_all(now=True)
    assert not own.live_sandboxes and not own.session_kernel_ids and not own.pooled_kernel_ids
