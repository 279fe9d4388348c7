"""Nothing left behind (issue 58): a dead owner's sandboxes take their disks, mounts, io dirs and state with them,
however the owner died, with no later start to sweep them.

The owner is what users run: a script that starts kernels with jupyter_client's KernelManager, as nbclient and
papermill do, in a process of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from msb_kernels.backends.core import scratch
from tests.msb_kernels.gateway.conftest import wait_until
from tests.skips import needs_runsc

BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]

OWNER = """
import asyncio, sys
from jupyter_client.manager import AsyncKernelManager

async def main():
    managers = []
    for _ in range(2):
        manager = AsyncKernelManager(kernel_name="msb-python-small")
        await manager.start_kernel()
        managers.append(manager)
    print(" ".join(manager.kernel_id for manager in managers), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed before it shut its kernels down")
    await asyncio.sleep(600)

asyncio.run(main())
"""


def leftovers(kernel_ids: list[str]) -> list[str]:
    """What of these kernels' sandboxes is still on the host: state or io dirs, disk images, mounts, loop devices."""
    runtime, scratch_root = Path(os.environ["MSB_RUNTIME_DIR"]), Path(os.environ["MSB_SCRATCH_DIR"])
    found = []
    for kernel_id in kernel_ids:
        found += [f"directory {path}" for path in runtime.rglob(f"*{kernel_id}*")]
        found += [f"image {path}" for path in scratch_root.glob(f"{kernel_id}*")]
        found += [f"loop device backed by {image}" for image in scratch.attached_images() if kernel_id in image]
        with open("/proc/self/mountinfo") as mountinfo:
            found += [f"mount {line.split()[4]}" for line in mountinfo if kernel_id in line.split()[4]]
    return found


@pytest.mark.parametrize("death", ["kill -9", "raise"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_dead_scripts_kernels_leave_no_disk_mount_or_state(backend: str, death: str) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, "raise" if death == "raise" else "wait"],
        env={**os.environ, "MSB_BACKEND": backend},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 120)
        kernel_ids = line.split()
        assert len(kernel_ids) == 2, owner.stderr.read() if owner.poll() is not None else line
        if death == "kill -9":
            held = leftovers(kernel_ids)  # what the owner's death must take with it
            assert held and (scratch.unavailable_reason() is not None or any(item.startswith("image") for item in held)), held
            os.kill(owner.pid, signal.SIGKILL)
        await asyncio.to_thread(owner.wait, 60)
        # Within seconds, and with no new start: the keeper ends each sandbox and sweeps what it left.
        await wait_until(lambda: not leftovers(kernel_ids), 60, f"the dead owner's sandboxes to be swept ({backend}, {death})")
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
