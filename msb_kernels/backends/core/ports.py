"""Host TCP ports for kernels reached over tcp.

A microVM kernel is only reachable through ports published on the host, five per
kernel (shell, iopub, stdin, control, hb); so is a namespace sandbox's kernel under
MSB_TRANSPORT=tcp. The PortManager hands them out from
MSB_PORT_RANGE: never one that is already bound on the host, never one twice, and
it takes them all back when the kernel goes, whichever way it goes (shutdown,
crash, cull, a failed start). Running out is a ResourceLimitExceeded error.

With a lock_dir, every port it hands out is also held by an flock on
``<lock_dir>/<port>.lock``, so other msb-kernels processes sharing that dir skip
it too; the kernel drops the locks when a process dies, so a crash frees them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from msb_kernels.errors import ResourceLimitExceeded, SandboxError

if TYPE_CHECKING:
    from msb_kernels.settings.config import MsbSettings

PORTS_PER_KERNEL = 5


def port_is_free(port: int) -> bool:
    """Whether nothing on this host listens on (or holds) TCP port, on loopback or any address.

    Connections closing on the port (TIME_WAIT, after a kernel's) do not count: what binds there sets SO_REUSEADDR."""
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
        probe = socket.socket(family, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
        finally:
            probe.close()
    return True


class PortManager:
    """Allocates PORTS_PER_KERNEL host ports per owner (a kernel id) from [first, last]."""

    def __init__(self, first: int, last: int, per_owner: int = PORTS_PER_KERNEL, lock_dir: Path | None = None, start: int | None = None):
        if not 0 < first <= last <= 65535:
            raise ValueError(f"bad port range {first}-{last}")
        self.first, self.last, self.per_owner = first, last, per_owner
        self.lock_dir = lock_dir
        self._owners: dict[str, list[int]] = {}
        self._locks: dict[int, int] = {}  # port -> fd holding its flock
        self._lock = threading.Lock()
        # Round-robin from a random start: a port just released is not reused at once, and processes
        # sharing a range rarely race for the same ports.
        self._next = start if start is not None else random.randint(first, last)

    def _claim(self, port: int) -> bool:
        """Hold port against other processes (its lock file), when there is a lock_dir."""
        if self.lock_dir is None:
            return True
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_dir / f"{port}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._locks[port] = fd
        return True

    def _unclaim(self, port: int) -> None:
        fd = self._locks.pop(port, None)
        if fd is not None:
            os.close(fd)

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def allocate(self, owner: str) -> list[int]:
        """The owner's ports; the same ones again while it holds them (a restart keeps its ports)."""
        with self._lock:
            if owner in self._owners:
                return list(self._owners[owner])
            taken = {port for ports in self._owners.values() for port in ports}
            chosen: list[int] = []
            for offset in range(self.size):
                port = self.first + (self._next - self.first + offset) % self.size
                if port in taken or not port_is_free(port) or not self._claim(port):
                    continue
                chosen.append(port)
                if len(chosen) == self.per_owner:
                    break
            if len(chosen) < self.per_owner:
                for port in chosen:
                    self._unclaim(port)
                raise ResourceLimitExceeded(
                    f"no free host ports for another kernel: MSB_PORT_RANGE={self.first}-{self.last} has "
                    f"{len(chosen)} unbound port(s) left and a kernel needs {self.per_owner} "
                    f"({len(self._owners)} kernel(s) hold {len(taken)})",
                    [
                        "stop a session you no longer need",
                        "widen MSB_PORT_RANGE (for example 8000-9000)",
                        "free ports that other programs hold in that range",
                    ],
                )
            self._next = self.first + (chosen[-1] + 1 - self.first) % self.size
            self._owners[owner] = chosen
            return list(chosen)

    def claim(self, owner: str, ports: list[int]) -> None:
        """Count ports the owner's sandbox still holds bound (an adopted kernel's), and keep other processes off them."""
        with self._lock:
            for port in ports:
                if port not in self._locks:
                    self._claim(port)
            self._owners[owner] = list(ports)

    def release(self, owner: str) -> list[int]:
        """Give the owner's ports back; releasing twice, or an owner with none, does nothing."""
        with self._lock:
            ports = self._owners.pop(owner, [])
            for port in ports:
                self._unclaim(port)
            return ports

    def owned(self, owner: str) -> list[int]:
        with self._lock:
            return list(self._owners.get(owner, []))

    def stats(self) -> dict[str, int]:
        """allocated: ports held by kernels; available: ports of the range no kernel holds."""
        with self._lock:
            allocated = sum(len(ports) for ports in self._owners.values())
        return {
            "allocated": allocated,
            "available": self.size - allocated,
            "kernels": len(self._owners),
            "range_first": self.first,
            "range_last": self.last,
        }


def host_ports(settings: MsbSettings) -> PortManager:
    """MSB_PORT_RANGE, shared (by the lock files) with every msb-kernels process on the same runtime dir."""
    return PortManager(*settings.ports, lock_dir=settings.runtime_root() / "ports")


class HostListeners:
    """tcp: each sandbox's host ports from a PortManager, bound and listening on host_ip by this process until released.

    The relay that joins them to the kernel gets them by inheritance (the namespace sandbox's inside, gVisor's in the
    sandbox's link namespace); this process keeps its own copies, so a port stays the kernel's across a restart, or
    while gVisor's relay is stopped (a hibernated kernel)."""

    def __init__(self, ports: PortManager, host_ip: str):
        self.ports = ports
        self.host_ip = host_ip
        self._bound: dict[str, list[socket.socket]] = {}

    def reserve(self, sandbox_id: str) -> list[int]:
        return self.ports.allocate(sandbox_id)

    def bound(self, sandbox_id: str, ports: list[int] | None = None) -> list[socket.socket]:
        """The sandbox's listeners; a restart reuses them. ports: an adopted kernel's, which the last gateway held."""
        if sandbox_id not in self._bound:
            if ports is not None:
                self.ports.claim(sandbox_id, ports)
            listeners = []
            try:
                for port in ports if ports is not None else self.reserve(sandbox_id):
                    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    listeners.append(listener)
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last kernel's TIME_WAITs
                    listener.bind((self.host_ip, port))
                    listener.listen(64)
            except OSError as exc:
                for listener in listeners:
                    listener.close()
                raise SandboxError(
                    f"cannot bind the kernel's host port on {self.host_ip}: {exc}",
                    ["start the kernel again (another program took that port)", "or move MSB_PORT_RANGE to ports nothing else uses"],
                ) from None
            self._bound[sandbox_id] = listeners
        return self._bound[sandbox_id]

    def release(self, sandbox_id: str) -> None:
        """Close the sandbox's listeners and give its ports back; harmless twice."""
        for listener in self._bound.pop(sandbox_id, []):
            listener.close()
        self.ports.release(sandbox_id)
