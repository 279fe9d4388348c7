"""Files never kill the kernel: /tmp and home are a disk of the flavor's size, /dev/shm is small.

Each test fills a real sandbox's disk or /dev/shm and checks the kernel, with its state, lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from msb_kernels.backends.core import scratch
from msb_kernels.errors import SandboxError
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.settings.config import load_settings
from tests.kernel_helpers import execute
from tests.parallel import ALONE

SMALL = FLAVORS["small"]
needs_disk = pytest.mark.skipif(
    scratch.unavailable_reason() is not None, reason=f"disk-backed scratch is unavailable here: {scratch.unavailable_reason()}"
)

FILL = (
    "import errno, os\n"
    "def fill(path, block=64 << 20):\n"
    "    data, written = b'x' * block, 0\n"
    "    try:\n"
    "        with open(path, 'wb') as f:\n"
    "            while True:\n"
    "                written += f.write(data)\n"
    "    except OSError as exc:\n"
    "        return written >> 20, errno.errorcode[exc.errno]\n"
    "    return written >> 20, None\n"
)


def size_mib(path: str) -> str:
    return f"(lambda s: s.f_blocks * s.f_frsize >> 20)(os.statvfs({path!r}))"


@needs_disk
@pytest.mark.slow
async def test_a_write_past_the_flavors_disk_fails_and_the_kernel_keeps_its_state(start_kernel):
    km, kc = await start_kernel()
    await execute(kc, FILL + "before = 'kept'")
    # More than the flavor's memory: on RAM-backed /tmp this killed the kernel.
    written, error = (await execute(kc, "fill('/tmp/download.bin')", timeout=240)).value
    print(f"namespace, small: wrote {written} MiB to /tmp before {error}")  # docs/backends/README.md's figure
    assert error == "ENOSPC" and written > SMALL.disk_mib * 0.9, (written, error)
    size = (await execute(kc, size_mib("/tmp"))).value
    assert SMALL.disk_mib * 0.95 < size <= SMALL.disk_mib
    home = await execute(kc, "fill(os.path.expanduser('~/more.bin'))")  # home shares the same disk
    assert home.value[1] == "ENOSPC" and home.value[0] < 64
    assert await km.is_alive()
    assert (await execute(kc, "before")).result == "'kept'"
    again = await execute(kc, "os.remove('/tmp/download.bin'); open('/tmp/small.txt', 'w').write('room again')")
    assert again.result == "10"


async def test_a_write_past_dev_shm_fails_and_the_kernel_lives(start_kernel):
    km, kc = await start_kernel()
    await execute(kc, FILL + "before = 'kept'")
    assert (await execute(kc, size_mib("/dev/shm"))).value == SMALL.shm_mib
    written, error = (await execute(kc, "fill('/dev/shm/big', 1 << 20)")).value
    assert error == "ENOSPC" and written <= SMALL.shm_mib, (written, error)
    assert await km.is_alive()
    assert (await execute(kc, "before")).result == "'kept'"


@needs_disk
async def test_the_disk_is_released_when_the_kernel_stops(start_kernel):
    km, kc = await start_kernel()
    image = scratch.image_path(load_settings().scratch_root(), km.provisioner.sandbox.sandbox_id)
    assert image.stat().st_blocks * 512 >= SMALL.disk_bytes, "the flavor's disk is reserved on the host up front"
    assert str(image) in scratch.attached_images()
    await execute(kc, "open('/tmp/f', 'wb').write(b'x' * 2**20)")
    kc.stop_channels()
    await km.shutdown_kernel()
    assert not image.exists()
    deadline = time.monotonic() + 10
    while str(image) in scratch.attached_images():  # the loop device lets go with the sandbox's mount namespace
        assert time.monotonic() < deadline, "the loop device still holds the deleted disk"
        await asyncio.sleep(0.1)


@needs_disk
@ALONE  # its crash's disk is for its own sweep to find: any other start on the host sweeps it too
async def test_a_disk_left_by_a_crash_is_swept_and_a_live_one_is_not(start_kernel):
    from msb_kernels.backends import get_backend

    km, _ = await start_kernel()
    root = load_settings().scratch_root()
    live = scratch.image_path(root, km.provisioner.sandbox.sandbox_id)
    stale = scratch.image_path(root, "left-by-a-crash")
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    starting = scratch.image_path(root, "still-starting")
    starting.write_bytes(b"")
    await get_backend(load_settings()).sweep_orphans()
    assert not stale.exists() and starting.exists() and live.exists()
    starting.unlink()


@contextlib.contextmanager
def own_scratch_dir(monkeypatch, size: str | None = None):
    """A scratch dir (a tmpfs of ``size``, or plain) and a runtime dir of this test's alone, so the backend
    made for them has these settings (short: the runtime dir holds ipc sockets)."""
    base = Path(tempfile.mkdtemp(prefix="msbs-", dir="/tmp"))
    scratch_dir = base / "scratch"
    scratch_dir.mkdir()
    if size:
        # mode: a tmpfs is 1777 unless told, and a scratch dir others may write is refused
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(scratch_dir)], check=True)
    try:
        monkeypatch.setenv("MSB_SCRATCH_DIR", str(scratch_dir))
        monkeypatch.setenv("MSB_RUNTIME_DIR", str(base / "rt"))
        yield scratch_dir
    finally:
        if size:
            subprocess.run(["umount", "-l", str(scratch_dir)], check=True)
        shutil.rmtree(base, ignore_errors=True)


@needs_disk
@pytest.mark.parametrize("reserve", ["true", "false"])
async def test_no_room_on_the_host_for_the_disk_is_a_clear_error(start_kernel, monkeypatch, reserve):
    monkeypatch.setenv("MSB_DISK_RESERVE", reserve)
    with own_scratch_dir(monkeypatch, size="64m") as tiny:
        with pytest.raises(Exception) as failure:
            await start_kernel()
        assert "cannot reserve the 2048 MiB disk of flavor small" in str(failure.value)
        assert "MiB free, and the host keeps 1024 MiB of it for itself" in str(failure.value)
        assert os.listdir(tiny) == []


def test_a_start_leaves_the_host_its_headroom(tmp_path):
    """The last 5% of the host's filesystem (at least 1 GiB) is never reserved for a sandbox."""
    usage = shutil.disk_usage(tmp_path)
    assert scratch.host_headroom_bytes(usage.total) == max(1 << 30, usage.total // 20)
    assert scratch.host_headroom_bytes(8 << 30) == 1 << 30 and scratch.host_headroom_bytes(100 << 30) == 5 << 30


@needs_disk
async def test_unreserved_disks_are_sparse_and_still_the_flavors_size(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_DISK_RESERVE", "false")
    with own_scratch_dir(monkeypatch) as scratch_dir:
        km, kc = await start_kernel()
        image = scratch.image_path(scratch_dir, km.kernel_id)
        assert image.stat().st_size == SMALL.disk_bytes
        assert image.stat().st_blocks * 512 < SMALL.disk_bytes // 8, "the disk was reserved although MSB_DISK_RESERVE=false"
        assert SMALL.disk_mib * 0.95 < (await execute(kc, "import os\n" + size_mib("/tmp"))).value <= SMALL.disk_mib
        await km.shutdown_kernel(now=True)
        assert not image.exists()


async def test_an_unusable_scratch_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SandboxError) as failure:
        scratch.reserve_image(scratch.image_path(blocker / "scratch", "x"), SMALL)
    assert f"cannot create the sandbox's disk in MSB_SCRATCH_DIR={blocker / 'scratch'}" in failure.value.message


def test_doctor_reports_the_flavors_disks():
    result = subprocess.run([str(Path(sys.executable).parent / "msb-kernels"), "doctor"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"flavor small: 1 CPU, 1024 MiB memory, {SMALL.disk_mib} MiB disk, {SMALL.shm_mib} MiB /dev/shm" in result.stdout
    reason = scratch.unavailable_reason()
    expected = scratch.memory_scratch_note(reason) if reason else "/tmp and /home/sandbox share an ext4 disk of the flavor's size"
    assert f"disk (namespace and gvisor backends): {expected}" in result.stdout
