"""The flavor's disk is disk on gVisor: /tmp and home are an ext4 image of the flavor's size that the host mounts and
runsc's gofer serves (core/scratch.py), not a tmpfs taken out of the kernel's memory."""

from __future__ import annotations

import json
import os

import pytest

from msb_kernels.backends.core import scratch
from msb_kernels.backends.core.scratch import DISK_DIR
from msb_kernels.gateway.kernels.hibernation import reconnect_of
from msb_kernels.kernelspecs.flavors import FLAVORS
from tests.kernel_helpers import execute
from tests.skips import needs_runsc


@pytest.fixture(autouse=True)
def gvisor(monkeypatch):
    monkeypatch.setenv("MSB_BACKEND", "gvisor")


pytestmark = [
    pytest.mark.slow,
    needs_runsc,
    pytest.mark.skipif(scratch.unavailable_reason() is not None, reason=f"{scratch.unavailable_reason()}"),
]

FILL = """
import os, errno
os.environ["MSB_PROBE"] = "kept"
state = list(range(1000))
written, error = 0, None
block = b"\\0" * (64 << 20)
try:
    with open("/tmp/fill", "wb") as f:
        while True:
            written += f.write(block)
            f.flush()
            os.fsync(f.fileno())
except OSError as exc:
    error = errno.errorcode.get(exc.errno, str(exc.errno))
print(written, error)
"""


async def sizes(kc) -> dict[str, int]:
    code = "import os, json; print(json.dumps({p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in ('/tmp', os.path.expanduser('~'))}))"
    result = await execute(kc, code)
    assert result.status == "ok", result.error
    return json.loads(result.stdout)


async def test_a_small_kernels_disk_fills_at_its_flavors_size_and_costs_it_no_memory(start_kernel):
    km, kc = await start_kernel()
    assert km.provisioner.backend.name == "gvisor"
    flavor = FLAVORS["small"]
    disk = await sizes(kc)
    assert disk["/tmp"] == disk[os.path.expanduser("/home/sandbox")], disk  # one disk for both
    assert 0.95 * flavor.disk_bytes < disk["/tmp"] <= flavor.disk_bytes, disk
    state_dir = km.provisioner.io_dir.parent
    assert os.path.ismount(state_dir / DISK_DIR)  # on the host: a mount of its own, not the host's /tmp or /run

    filled = await execute(kc, FILL, timeout=300)
    assert filled.status == "ok", filled.error
    written, error = filled.stdout.split()
    print(f"wrote {int(written) >> 20} MiB before {error}; memory of the sandbox {km.provisioner.sandbox.memory_bytes() >> 20} MiB")
    assert error == "ENOSPC" and 0.9 * flavor.disk_bytes < int(written) <= flavor.disk_bytes, filled.stdout
    # the kernel is alive with its state, and its memory is still its own: 700 MiB of a 1 GiB flavor fit after a full disk
    after = await execute(kc, "big = bytearray(700 << 20); big[-1] = 1; print(len(state), os.environ['MSB_PROBE'], big[-1])", timeout=120)
    assert after.status == "ok" and after.stdout == "1000 kept 1\n", (after.error, after.stdout)
    assert (await execute(kc, "os.remove('/tmp/fill'); open('/tmp/again', 'w').write('room'); 1")).status == "ok"


@pytest.mark.parametrize("flavor", ["medium", "large"])
async def test_each_flavor_gets_its_own_disk_size(start_kernel, flavor):
    _, kc = await start_kernel(kernel_name=f"msb-python-{flavor}")
    disk = await sizes(kc)
    assert 0.95 * FLAVORS[flavor].disk_bytes < disk["/tmp"] <= FLAVORS[flavor].disk_bytes, disk


async def test_the_disk_keeps_its_files_through_hibernation_and_is_gone_with_the_kernel(hibernating, start_kernel):
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    wrote = await execute(
        kc,
        "import os; os.urandom(0); data = os.urandom(1 << 20); open('/tmp/kept', 'wb').write(data); open(os.path.expanduser('~/notes.txt'), 'w').write('mine'); 1",
    )
    assert wrote.status == "ok", wrote.error
    await sandbox.hibernate(reconnect_of(km))
    await sandbox.wake(reconnect_of(km))
    read = await execute(kc, "print(open('/tmp/kept', 'rb').read() == data, open(os.path.expanduser('~/notes.txt')).read())", timeout=60)
    assert read.stdout == "True mine\n", (read.error, read.stdout)
    state_dir = km.provisioner.io_dir.parent
    image = scratch.image_path(km.provisioner.backend.settings.scratch_root(), sandbox.sandbox_id)
    assert image.exists() and os.path.ismount(state_dir / DISK_DIR)
    await km.shutdown_kernel(now=True)
    assert not image.exists() and not os.path.ismount(state_dir / DISK_DIR)
