"""The egress proxy of this process: its own thread and event loop, and one listener per kernel.

Why a thread: the proxy copies a kernel's downloads byte by byte, and the gateway's event loop carries every
notebook's messages; a ``pip install`` must not add latency to someone's cell. Why a listener per kernel (a Unix
socket in the kernel's io dir): which kernel a connection comes from is then a fact of the file system, not
something the kernel could claim.

The process that starts a kernel runs its proxy (the gateway, ``msb-mcp``, papermill): kernels live no longer
than it, except a gateway's kept ones, whose next gateway listens on their sockets again when it adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import socket
import ssl
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from msb_kernels.egress import dns
from msb_kernels.egress.proxy import KernelEgress, serve
from msb_kernels.egress.tls import CertificateAuthority, upstream_context

log = logging.getLogger("msb_kernels.egress")

START_TIMEOUT = 10.0


class EgressService:
    """The proxy thread: ``open`` a kernel's listener, ``close`` it; ``resolve`` names as the proxy does."""

    def __init__(self, runtime_root: Path, dns_servers: list[tuple[str, int]], ca_file: str | None):
        self.runtime_root = runtime_root
        self.dns_servers = dns_servers
        self.ca = CertificateAuthority(runtime_root)
        self.upstream_tls: ssl.SSLContext = upstream_context(ca_file)
        self.kernels: dict[str, KernelEgress] = {}
        self._servers: dict[str, asyncio.AbstractServer] = {}
        self._paths: dict[str, Path] = {}
        self.by_address: dict[str, KernelEgress] = {}  # a cluster's kernels, by their address on the kernels' network
        self._tcp: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="msb-egress", daemon=True)
        self._started = threading.Event()
        _raise_descriptor_limit()
        self._thread.start()
        self._started.wait(START_TIMEOUT)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    async def _call(self, coroutine: Coroutine) -> Any:
        """Run coroutine on the proxy's loop and wait for it from the caller's (or block where there is none)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return future.result(START_TIMEOUT)
        return await asyncio.wrap_future(future)

    async def open(self, egress: KernelEgress, socket_path: Path) -> None:
        """Listen for egress.kernel_id's connections at socket_path (replacing one left by an earlier process)."""
        await self._call(self._open(egress, socket_path))

    async def _open(self, egress: KernelEgress, socket_path: Path) -> None:
        old = self._servers.pop(egress.kernel_id, None)
        if old is not None and self._paths.get(egress.kernel_id) == socket_path:
            self._servers[egress.kernel_id] = old  # a restart in the same io dir: keep listening, take the new policy
            self.kernels[egress.kernel_id] = egress
            return
        if old is not None:
            old.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()
        server = await asyncio.start_unix_server(functools.partial(serve, egress, self), path=str(socket_path), backlog=64)
        os.chmod(socket_path, 0o666)  # the sandbox's user (uid 1000, or its own host uid) connects; its io dir holds it in
        self._servers[egress.kernel_id] = server
        self._paths[egress.kernel_id] = socket_path
        self.kernels[egress.kernel_id] = egress

    async def listen_tcp(self, address: str, port: int) -> None:
        """Listen on address:port (on a cluster's kernels' network) for kernels known by their address (bind_address);
        a connection from any other address is closed unread."""
        await self._call(self._listen_tcp(address, port))

    async def _listen_tcp(self, address: str, port: int) -> None:
        if (address, port) not in self._tcp:
            self._tcp[(address, port)] = await asyncio.start_server(self._serve_by_address, address, port, backlog=128)
            log.info("egress proxy for cluster kernels at %s:%d", address, port)

    async def _serve_by_address(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        egress = self.by_address.get(peer[0]) if peer else None
        if egress is None:
            writer.close()
            return
        await serve(egress, self, reader, writer)

    async def bind_address(self, egress: KernelEgress, address: str) -> None:
        """The kernel egress.kernel_id is at address now (its task's): connections from there are its."""
        await self._call(self._bind_address(egress, address))

    async def _bind_address(self, egress: KernelEgress, address: str) -> None:
        for known, other in list(self.by_address.items()):
            if other.kernel_id == egress.kernel_id:
                del self.by_address[known]
        self.by_address[address] = egress
        self.kernels[egress.kernel_id] = egress

    async def close(self, kernel_id: str) -> None:
        """Stop listening for kernel_id; its open connections end with it."""
        await self._call(self._close(kernel_id))

    async def _close(self, kernel_id: str) -> None:
        server = self._servers.pop(kernel_id, None)
        path = self._paths.pop(kernel_id, None)
        egress = self.kernels.pop(kernel_id, None)
        for address, other in list(self.by_address.items()):
            if other.kernel_id == kernel_id:
                del self.by_address[address]
        if server is not None:
            server.close()
        if egress is not None:  # connections in flight belong to a kernel that is gone
            for task in list(egress.tasks):
                task.cancel()
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    async def resolve(self, host: str) -> list[str]:
        """host's addresses, as the proxy connects: MSB_NETWORK_DNS's servers, else the host's resolver."""
        if self.dns_servers:
            return await dns.lookup(host, self.dns_servers)
        try:
            infos = await self.loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return []
            raise OSError(str(exc)) from None
        return list(dict.fromkeys(info[4][0] for info in infos))

    def snapshot(self) -> dict[str, dict]:
        """Every kernel's KernelEgress.snapshot, for metrics."""
        return {kernel_id: egress.snapshot() for kernel_id, egress in list(self.kernels.items())}


def _raise_descriptor_limit() -> None:
    """Each proxied connection holds two descriptors in this process: take the hard limit, as servers do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


_services: dict[tuple, EgressService] = {}
_lock = threading.Lock()


def egress_service(runtime_root: Path, dns_servers: list[tuple[str, int]], ca_file: str | None) -> EgressService:
    """The process's proxy for this runtime dir and these settings, started on first use."""
    key = (str(runtime_root), tuple(dns_servers), ca_file)
    with _lock:
        if key not in _services:
            _services[key] = EgressService(runtime_root, dns_servers, ca_file)
        return _services[key]


def running_services() -> list[EgressService]:
    return list(_services.values())
