"""The keeper on its own (keeper.py): ownership, the grace period, and a sandbox with no host process (a microVM).

The gateway-level behaviour (kill -9, adoption, a busy cell) is in tests/msb_kernels/gateway/test_adoption.py.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from msb_kernels.backends.adoption import ADOPTION_RECORD, KEEPER_SOCKET, KeeperLink, start_keeper, write_private_json
from msb_kernels.errors import SandboxError
from tests.msb_kernels.gateway.conftest import pid_alive, wait_until


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = Path("/tmp") / f"msbk-{os.getpid()}-{time.monotonic_ns()}"  # short: a unix socket path
    path.mkdir(mode=0o700)
    write_private_json(path / ADOPTION_RECORD, {"kernel_id": "test"})
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


async def test_one_owner_at_a_time_and_a_released_microvm_keeper_exits(state_dir):
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
    await wait_until(lambda: not pid_alive(keeper_pid), 10, "the keeper to exit")
    assert not (state_dir / KEEPER_SOCKET).exists()


async def test_past_the_grace_period_the_keeper_drops_the_record_and_sweeps(state_dir):
    """With no owner for the grace period, the sandbox is no longer adoptable (its record goes), and the keeper
    becomes `msb-kernels sweep` (under the same pid, so the record must go first)."""
    keeper_pid, _ = await start_keeper(state_dir, 1, sweep_env={"MSB_RUNTIME_DIR": str(state_dir / "rt")})
    KeeperLink.own(state_dir, keeper_pid).close()
    await wait_until(lambda: not pid_alive(keeper_pid), 30, "the keeper's sweep to finish")
    assert not (state_dir / ADOPTION_RECORD).exists() and not (state_dir / KEEPER_SOCKET).exists()
    assert "Traceback" not in (state_dir / "keeper.log").read_text()
