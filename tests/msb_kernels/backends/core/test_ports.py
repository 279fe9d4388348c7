"""The port manager, against ports this test really holds open on the host."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading

import pytest

from msb_kernels.backends.core.ports import PORTS_PER_KERNEL, PortManager, port_is_free
from msb_kernels.errors import ConfigError, ResourceLimitExceeded
from msb_kernels.settings.config import MsbSettings
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def free_block(size: int) -> int:
    """The first port of `size` consecutive ports that nothing on this host holds right now."""
    for first in range(20000, 60000, size + 7):
        if all(port_is_free(port) for port in range(first, first + size)):
            return first
    raise RuntimeError("no free block of ports on this host")


@contextlib.contextmanager
def held(*ports: int, address: str = "127.0.0.1"):
    sockets = []
    try:
        for port in ports:
            sock = socket.socket()
            sock.bind((address, port))
            sock.listen()
            sockets.append(sock)
        yield
    finally:
        for sock in sockets:
            sock.close()


def test_five_distinct_ports_per_kernel_within_the_range():
    first = free_block(20)
    manager = PortManager(first, first + 19)
    a, b = manager.allocate("a"), manager.allocate("b")
    assert len(a) == len(b) == PORTS_PER_KERNEL == 5
    assert len(set(a) | set(b)) == 10
    assert all(first <= port <= first + 19 for port in a + b)
    assert manager.allocate("a") == a, "the same kernel (a restart) keeps its ports"
    assert manager.stats()["allocated"] == 10 and manager.stats()["available"] == 10


def test_ports_bound_on_the_host_are_skipped():
    first = free_block(12)
    with held(first, first + 2), held(first + 4, address="0.0.0.0"):
        assert not port_is_free(first) and not port_is_free(first + 4)
        ports = PortManager(first, first + 11, start=first).allocate("k")
    assert not {first, first + 2, first + 4} & set(ports)
    assert ports == [first + 1, first + 3, first + 5, first + 6, first + 7]


def test_exhaustion_is_a_clear_resource_limit_error_and_release_frees_ports():
    first = free_block(12)
    manager = PortManager(first, first + 11, start=first)
    with held(first + 10):
        manager.allocate("a")
        manager.allocate("b")  # 10 of the 12; one of the last two is held open by this test
        with pytest.raises(ResourceLimitExceeded) as caught:
            manager.allocate("c")
    message = str(caught.value)
    assert f"MSB_PORT_RANGE={first}-{first + 11}" in message and "needs 5" in message
    assert caught.value.to_dict()["type"] == "ResourceLimitExceeded"
    assert manager.stats() == {"allocated": 10, "available": 2, "kernels": 2, "range_first": first, "range_last": first + 11}
    released = manager.release("a")
    assert len(released) == 5 and manager.release("a") == []  # a second release (crash, then cleanup) is harmless
    c = manager.allocate("c")
    assert not set(c) & set(manager.owned("b")) and set(c) <= set(released) | {first + 10, first + 11}
    assert manager.stats()["allocated"] == 10


def test_concurrent_allocations_never_share_a_port():
    first = free_block(100)
    manager = PortManager(first, first + 99)
    results: dict[str, list[int]] = {}

    def grab(owner: str) -> None:
        results[owner] = manager.allocate(owner)

    threads = [threading.Thread(target=grab, args=(f"k{n}",)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [port for ports in results.values() for port in ports]
    assert len(every) == 100 and len(set(every)) == 100


@pytest.mark.parametrize("value", ["9000-8000", "80-90", "8000", "8000-8003", "a-b", "8000-70000"])
def test_bad_port_range_is_refused_at_start(monkeypatch, value):
    monkeypatch.setenv("MSB_PORT_RANGE", value)
    with pytest.raises(ConfigError) as caught:
        MsbSettings()
    assert "MSB_PORT_RANGE" in str(caught.value) and "8000-9000" in str(caught.value)


def test_default_port_range_and_network_setting(monkeypatch):
    settings = MsbSettings()
    assert settings.ports == (8000, 9000) and settings.allow_network is False
    monkeypatch.setenv("MSB_PORT_RANGE", "10000-10009")
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    settings = MsbSettings()
    assert settings.ports == (10000, 10009) and settings.allow_network is True


def test_processes_sharing_a_lock_dir_never_share_a_port(tmp_path):
    first = free_block(10)
    one = PortManager(first, first + 9, lock_dir=tmp_path, start=first)
    other = PortManager(first, first + 9, lock_dir=tmp_path, start=first)  # as another msb-kernels process would
    mine = one.allocate("a")
    theirs = other.allocate("b")
    assert not set(mine) & set(theirs)
    with pytest.raises(ResourceLimitExceeded):
        other.allocate("c")
    one.release("a")
    assert set(other.allocate("c")) == set(mine)


# -- through a kernel start ------------------------------------------------------------------------------


@pytest.fixture
def microsandbox_start(monkeypatch, tmp_path):
    """MSB_BACKEND=microsandbox taken as bootable, so a start goes as far as reserving ports and asking
    microsandbox for a VM, which then fails for real (here: the image is not built). Returns the
    backend's port stats as a function."""
    from msb_kernels.backends import get_backend
    from msb_kernels.backends.core.base import Availability
    from msb_kernels.backends.microsandbox.backend import MicrosandboxBackend
    from msb_kernels.settings.config import load_settings

    monkeypatch.setattr(MicrosandboxBackend, "_availability", Availability(True, "taken as bootable by this test"))
    monkeypatch.setenv("MSB_BACKEND", "microsandbox")
    monkeypatch.setenv("MSB_PYTHON_IMAGE", "msb-kernels/not-built-for-this-test:1")
    # A runtime dir of its own: one backend (and port manager) per runtime dir and process.
    monkeypatch.setenv("MSB_RUNTIME_DIR", tempfile.mkdtemp(prefix="msbp-", dir="/tmp"))
    return lambda: get_backend(load_settings()).ports.stats()


async def test_a_failed_kernel_start_gives_its_ports_back(start_kernel, microsandbox_start, monkeypatch):
    first = free_block(10)
    monkeypatch.setenv("MSB_PORT_RANGE", f"{first}-{first + 9}")
    for _ in range(3):  # more starts than the range holds kernels: nothing leaks between them
        with pytest.raises(Exception) as caught:
            await start_kernel()
        assert "microVM" in str(caught.value), caught.value
        assert microsandbox_start()["allocated"] == 0


async def test_port_exhaustion_refuses_the_kernel_start(start_kernel, microsandbox_start, monkeypatch):
    first = free_block(6)
    monkeypatch.setenv("MSB_PORT_RANGE", f"{first}-{first + 5}")
    with held(first, first + 1):  # 4 of the 6 ports are free: fewer than one kernel needs
        with pytest.raises(ResourceLimitExceeded) as caught:
            await start_kernel()
    assert f"MSB_PORT_RANGE={first}-{first + 5}" in str(caught.value)
    assert microsandbox_start()["allocated"] == 0
