"""Hibernation of gVisor kernels, live: runsc checkpoint and restore of real kernels (backends/gvisor/checkpoint_images.py).

Each test gets a runtime dir of its own, so its backend has its own settings (key, disk budget). The gateway's side
(when, and the clients that wake a kernel) is tests/msb_kernels/gateway/kernels/test_hibernation.py.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
import subprocess

import pytest

from msb_kernels.backends.gvisor import checkpoint_images, netstack
from msb_kernels.errors import HibernationRefused, SandboxError
from msb_kernels.gateway.kernels.hibernation import reconnect_of
from tests.kernel_helpers import HostListener, connect_outcomes, execute
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, needs_runsc]


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


async def test_a_hibernated_kernel_frees_its_memory_and_wakes_with_every_variable(hibernating, start_kernel):
    """The same client, never reconnected by hand, reads a variable and a 80 MB array after the restore. While asleep no
    process of the sandbox runs (its cgroup is empty), and its image on disk is sealed: private, and no plain copy."""
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    assert km.transport == "tcp" and sandbox.info()["transport"] == "tcp"
    setup = await execute(kc, "import numpy, threading; x = 41; a = numpy.ones(10**7); lock = threading.Lock()")
    assert setup.status == "ok", setup.error
    awake = sandbox.memory_bytes()

    size = await sandbox.hibernate(reconnect_of(km))
    assert sandbox.hibernated and await km.is_alive()  # alive to jupyter_client: its restarter leaves it be
    assert sandbox.cgroup is None or sandbox.cgroup.pids() == set()
    asleep = sandbox.memory_bytes() or 0
    print(f"memory {awake / 2**20:.0f} MiB awake, {asleep / 2**20:.0f} MiB asleep; image {size / 2**20:.1f} MiB")
    assert asleep < min(awake / 10, 4 * 2**20)  # no process, and the page cache it left given back
    image_dir = hibernating / sandbox.sandbox_id
    assert stat.S_IMODE(hibernating.stat().st_mode) == 0o700 and stat.S_IMODE(image_dir.stat().st_mode) == 0o700
    assert sorted(os.listdir(image_dir)) == [checkpoint_images.SEALED]
    sealed = image_dir / checkpoint_images.SEALED
    assert stat.S_IMODE(sealed.stat().st_mode) == 0o600 and sealed.stat().st_size == size
    assert sealed.read_bytes().startswith(checkpoint_images.MAGIC)

    await sandbox.wake(reconnect_of(km))
    assert not sandbox.hibernated and not image_dir.exists()
    result = await execute(kc, "print(x + 1, a.sum(), lock.acquire())", timeout=60)
    assert result.stdout == "42 10000000.0 True\n", result.messages
    assert (await execute(kc, "x = 'twice'; x")).result == "'twice'"  # and again: a second sleep
    await sandbox.hibernate(reconnect_of(km))
    await sandbox.wake(reconnect_of(km))
    assert (await execute(kc, "x")).result == "'twice'"


async def test_a_kernel_that_holds_a_socket_runsc_cannot_save_stays_awake_with_its_state(hibernating, start_kernel):
    """A listening socket of the user's (and a connection) would end the sandbox in runsc's save: refused first."""
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    code = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen(); kept = 'here'"
    assert (await execute(kc, code)).status == "ok"
    with pytest.raises(HibernationRefused, match=r"sockets that runsc cannot save: tcp listening on 127\.0\.0\.1:8765"):
        await sandbox.hibernate(reconnect_of(km))
    assert not sandbox.hibernated and not (hibernating / sandbox.sandbox_id).exists()
    assert (await execute(kc, "kept")).result == "'here'"
    await execute(kc, "s.close()")
    await sandbox.hibernate(reconnect_of(km))  # closed: nothing stops it now
    await sandbox.wake(reconnect_of(km))
    assert (await execute(kc, "kept")).result == "'here'"


async def test_a_checkpoint_that_ends_the_sandbox_is_an_error_that_says_why(hibernating, start_kernel, monkeypatch, tmp_path):
    """runsc's failed save destroys the sandbox: hibernate raises SandboxError with runsc's reason, no image is left,
    and the kernel is dead, not asleep, so the gateway stops it with that reason instead of waking a kernel that is
    gone. The save fails as a disk that fills mid-save fails it: the images' directory is a 1 MiB tmpfs. (runsc 2022's
    save also failed on a listener that epoll watched; Debian 13's saves it.)"""
    full = tmp_path / "images"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "msb-test-full", str(full)], check=True)
    try:
        monkeypatch.setenv("MSB_HIBERNATE_DIR", str(full))
        monkeypatch.setenv("MSB_RUNTIME_DIR", os.environ["MSB_RUNTIME_DIR"] + "f")  # a backend with these settings
        km, kc = await start_kernel()
        sandbox = km.provisioner.sandbox
        assert (await execute(kc, "x = 1")).status == "ok"

        async def nothing_blocks(wait: float = 2.0) -> list[str]:
            return []  # past the socket check, which on a loaded host can still see a closing connection: the save is tried

        monkeypatch.setattr(sandbox, "_settled_sockets", nothing_blocks)
        with pytest.raises((SandboxError, HibernationRefused)) as failed:
            await sandbox.hibernate(reconnect_of(km))
        print(failed.value)
        assert not sandbox.hibernated and not (full / sandbox.sandbox_id).exists()
        if isinstance(failed.value, HibernationRefused):
            # runsc failed before it stopped the kernel: it runs on, as it was
            assert re.search(r"runsc could not checkpoint it: .*no space left", str(failed.value)), failed.value
            assert await km.is_alive() and (await execute(kc, "x", timeout=60)).result == "1"
        else:
            assert re.search(r"runsc could not checkpoint the kernel, which ended it: .*no space left", str(failed.value)), failed.value
            assert not await km.is_alive()
        names = netstack.names(sandbox.sandbox_id)
        await km.shutdown_kernel(now=True)
        assert not any(name in netns_names() for name in names)
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)


async def test_past_the_disk_budget_a_kernel_stays_awake_and_the_error_names_the_setting(hibernating, start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_HIBERNATE_DISK_MIB", "1")
    monkeypatch.setenv("MSB_RUNTIME_DIR", os.environ["MSB_RUNTIME_DIR"] + "b")  # a backend with these settings
    km, kc = await start_kernel()
    await execute(kc, "kept = 1")
    with pytest.raises(HibernationRefused, match="no room to hibernate: MSB_HIBERNATE_DISK_MIB=1"):
        await km.provisioner.sandbox.hibernate(reconnect_of(km))
    assert (await execute(kc, "kept")).result == "1"


async def test_shutdown_and_restart_of_a_hibernated_kernel_delete_its_image_and_network(hibernating, start_kernel):
    km, kc = await start_kernel()
    first = km.provisioner.sandbox
    await execute(kc, "x = 1")
    await first.hibernate(reconnect_of(km))
    await km.restart_kernel(now=True)
    assert not (hibernating / first.sandbox_id).exists()
    assert (await execute(kc, "x", timeout=60)).error["ename"] == "NameError"
    second = km.provisioner.sandbox
    assert second is not first
    await second.hibernate(reconnect_of(km))
    names = netstack.names(second.sandbox_id)
    assert names[0] in netns_names()
    await km.shutdown_kernel(now=True)
    assert not (hibernating / second.sandbox_id).exists()
    assert not any(name in netns_names() for name in names)
    with pytest.raises(SandboxError, match="stopped while it was hibernated"):
        await second.wake(reconnect_of(km))


async def test_over_its_network_stack_the_kernel_reaches_nothing_of_the_hosts(hibernating, start_kernel):
    """The veth's far end (10.0.0.1) is a namespace where nothing listens; the kernel's own host ports (and so every
    other kernel's, and the gateway's) are on the host's loopback, which the sandbox has no route to."""
    km, kc = await start_kernel()
    with HostListener() as listener:
        targets = [(netstack.LINK_ADDRESS, port) for port in [*km.ports, 22, 80]]
        targets += [("127.0.0.1", port) for port in [*km.ports, listener.port]]
        targets += [(socket.gethostbyname(socket.gethostname()), listener.port)]
        outcomes = await connect_outcomes(kc, targets, timeout=1)
        assert all(outcome != "connected" for outcome in outcomes), list(zip(targets, outcomes, strict=True))
        assert listener.accepted == []
    assert (await execute(kc, "1 + 1")).result == "2"


def test_a_sealed_image_opens_only_with_its_key_and_unchanged(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(os.urandom(checkpoint_images.CHUNK * 2 + 17))  # three chunks, the last one short
    key = secrets.token_bytes(32)
    checkpoint_images.seal_file(key, plain, tmp_path / "sealed")
    checkpoint_images.open_file(key, tmp_path / "sealed", tmp_path / "opened")
    assert (tmp_path / "opened").read_bytes() == plain.read_bytes()
    with pytest.raises(ValueError, match="does not open with MSB_HIBERNATE_KEY_FILE's key"):
        checkpoint_images.open_file(secrets.token_bytes(32), tmp_path / "sealed", tmp_path / "other")
    sealed = (tmp_path / "sealed").read_bytes()
    cut = sealed[: len(sealed) - 100]  # the last chunk dropped, or cut short
    (tmp_path / "cut").write_bytes(cut)
    with pytest.raises(ValueError):
        checkpoint_images.open_file(key, tmp_path / "cut", tmp_path / "other")


def test_what_stops_a_checkpoint_is_read_from_the_sandboxs_socket_tables():
    tcp = (
        "  sl  local_address rem_address   st\n"
        "   0: 0200000A:2166 00000000:0000 0A 0\n"  # a relay's listener, 10.0.0.2:8550: saveable
        "   1: 0200000A:2166 0100000A:EB12 01 0\n"  # a connection accepted on it: not
        "   2: 0100007F:223D 00000000:0000 0A 0\n"  # the user's listener on 127.0.0.1:8765
        "   3: 0100007F:223E 0100007F:223D 07 0\n"  # closed: nothing left of it
    )
    found = checkpoint_images.blocking_sockets({"tcp": tcp, "udp": ""}, {("tcp", "10.0.0.2", 8550)})
    assert found == ["tcp connected 10.0.0.2:8550 to 10.0.0.1:60178", "tcp listening on 127.0.0.1:8765"]
