"""The keeper on its own (keeper.py): ownership, the grace period, one process for every sandbox of a runtime dir,
and a sandbox with no host process (a microVM).

The gateway-level behaviour (kill -9, adoption, a busy cell) is in tests/msb_kernels/gateway/kernels/test_adoption.py.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from msb_kernels.backends.core.keeping import (
    ADOPTION_RECORD,
    KEEPER_SOCKET,
    KEEPERS_SOCKET,
    KeeperLink,
    disconnect_keepers,
    start_keeper,
    write_private_json,
)
from msb_kernels.errors import SandboxError
from tests.msb_kernels.gateway.conftest import pid_alive, wait_until


@pytest.fixture
def runtime_root() -> Path:
    path = Path("/tmp") / f"msbk-{os.getpid()}-{time.monotonic_ns()}"  # short: unix socket paths
    path.mkdir(mode=0o700)
    yield path
    disconnect_keepers()
    subprocess.run(["rm", "-rf", str(path)], check=False)


def sandbox_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    write_private_json(path / ADOPTION_RECORD, {"kernel_id": name})
    return path


async def test_one_owner_at_a_time_and_a_released_microvm_is_let_go(runtime_root):
    state_dir = sandbox_dir(runtime_root, "vm")
    keeper_pid, sandbox_pid = await start_keeper(state_dir, 60)
    assert sandbox_pid is None and pid_alive(keeper_pid)
    owner = KeeperLink.own(state_dir, keeper_pid)
    with pytest.raises(SandboxError, match="another process owns this sandbox"):
        KeeperLink.own(state_dir, keeper_pid)
    with pytest.raises(SandboxError, match="not its keeper"):
        KeeperLink.own(state_dir, keeper_pid + 100000)
    owner.close()  # a gateway gone: the next one may own it
    second = KeeperLink.own(state_dir, keeper_pid)
    assert second.unowned_seconds >= 0
    second.release()  # the VM was removed: nothing left to keep
    await wait_until(lambda: not (state_dir / KEEPER_SOCKET).exists(), 10, "the keeper to let the sandbox go")
    assert pid_alive(keeper_pid), "the keeper left while this process (its gateway) may still hand it sandboxes"
    disconnect_keepers()
    await wait_until(lambda: not pid_alive(keeper_pid), 10, "the keeper, holding nothing and with no gateway, to exit")
    assert not (runtime_root / KEEPERS_SOCKET).exists()


async def test_past_the_grace_period_the_keeper_drops_the_record_and_sweeps(runtime_root):
    """With no owner for the grace period, the sandbox is no longer adoptable (its record goes, before the sweep,
    which sees the keeper alive), and the keeper runs `msb-kernels sweep`."""
    state_dir = sandbox_dir(runtime_root, "vm")
    keeper_pid, _ = await start_keeper(state_dir, 1, sweep_env={"MSB_RUNTIME_DIR": str(runtime_root / "rt")})
    KeeperLink.own(state_dir, keeper_pid).close()
    await wait_until(
        lambda: not (state_dir / ADOPTION_RECORD).exists() and not (state_dir / KEEPER_SOCKET).exists(),
        30,
        "the keeper to drop the sandbox's record and socket",
    )
    log = state_dir / "keeper.log"  # the sweep's output, for an operator looking into a sandbox left behind
    await wait_until(lambda: log.exists() and "orphaned sandbox" in log.read_text(), 60, "the sweep to report")
    assert "Traceback" not in (state_dir / "keeper.log").read_text()
    disconnect_keepers()
    await wait_until(lambda: not pid_alive(keeper_pid), 30, "the keeper to exit")


async def test_one_keeper_holds_every_sandbox_and_each_ends_on_its_own(runtime_root):
    """Sandboxes of one runtime dir share one keeper process. One sandbox's grace period ending leaves the others
    held; a kill of the keeper closes every lifeline it holds (their sandboxes end, as with a gateway that keeps
    nothing); the next sandbox gets a fresh keeper."""
    held = subprocess.Popen(["sleep", "600"])  # stands in for a namespace sandbox's init
    lifeline_read, lifeline_write = os.pipe()
    stderr_read, stderr_write = os.pipe()
    try:
        ns_dir, vm_dir = sandbox_dir(runtime_root, "ns"), sandbox_dir(runtime_root, "vm")
        keeper_pid, sandbox_pid = await start_keeper(ns_dir, 60, sandbox_pid=held.pid, lifeline_fd=lifeline_write, stderr_fd=stderr_read)
        os.close(lifeline_write)
        os.close(stderr_read)  # the keeper holds its own copies
        assert sandbox_pid == held.pid
        vm_keeper, _ = await start_keeper(vm_dir, 1, sweep_env={"MSB_RUNTIME_DIR": str(runtime_root / "rt")})
        assert vm_keeper == keeper_pid, "a second keeper process for the same runtime dir"
        KeeperLink.own(vm_dir, keeper_pid).close()
        await wait_until(lambda: not (vm_dir / KEEPER_SOCKET).exists(), 30, "the first sandbox's grace period to end")

        os.write(stderr_write, b"unowned output\n" * 1000)  # drained while no one owns it: never blocks the sandbox
        owner = KeeperLink.own(ns_dir, keeper_pid)
        assert owner.sandbox_pid == held.pid and owner.stderr_fd is not None
        os.close(owner.stderr_fd)
        owner.close()
        assert held.poll() is None and pid_alive(keeper_pid)

        os.kill(keeper_pid, signal.SIGKILL)
        os.set_blocking(lifeline_read, True)
        assert os.read(lifeline_read, 1) == b"", "the lifeline stayed open after the keeper was killed"
        await wait_until(lambda: not pid_alive(keeper_pid), 10, "the killed keeper to go")

        fresh_pid, _ = await start_keeper(sandbox_dir(runtime_root, "next"), 60)
        assert fresh_pid != keeper_pid and pid_alive(fresh_pid)
    finally:
        held.kill()
        held.wait()
        os.close(lifeline_read)
        os.close(stderr_write)


async def test_a_sandbox_the_keeper_cannot_hold_is_refused_and_its_descriptors_closed(runtime_root):
    """A hand-over that fails (here: the sandbox's socket cannot be bound) is answered with the reason; the keeper
    closes the descriptors it was given, once, and goes on holding the others."""
    held = sandbox_dir(runtime_root, "held")
    keeper_pid, _ = await start_keeper(held, 60)
    lifeline_read, lifeline_write = os.pipe()
    try:
        with pytest.raises(SandboxError, match="the keeper cannot hold the sandbox"):
            await start_keeper(runtime_root / "missing", 60, sandbox_pid=os.getpid(), lifeline_fd=lifeline_write)
        os.close(lifeline_write)
        assert select.select([lifeline_read], [], [], 10)[0] and os.read(lifeline_read, 1) == b"", (
            "the keeper kept the refused sandbox's lifeline open"
        )
    finally:
        os.close(lifeline_read)
    assert pid_alive(keeper_pid)
    KeeperLink.own(held, keeper_pid).close()  # the sandbox it holds is still its
    assert (await start_keeper(sandbox_dir(runtime_root, "next"), 60))[0] == keeper_pid
