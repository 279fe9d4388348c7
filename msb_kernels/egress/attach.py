"""One kernel's way out through the egress proxy, from the provisioner's side: opened before its sandbox starts,
told where the kernel runs (a cluster's kernel is known by its address), and closed when the kernel ends.

Imported by the provisioner only for a kernel with an allow-list: the proxy (h11, its thread) loads then.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from msb_kernels.egress import route
from msb_kernels.egress.dns import parse_dns_servers
from msb_kernels.egress.grant import KernelNetwork
from msb_kernels.egress.proxy import KernelEgress
from msb_kernels.egress.service import EgressService, egress_service
from msb_kernels.egress.tls import system_bundle


def service_for(settings: Any) -> EgressService:
    """The process's proxy for these settings' runtime dir, DNS servers and CAs."""
    return egress_service(settings.runtime_root(), parse_dns_servers(settings.network_dns), settings.network_ca_file)


class KernelRoute:
    """What the provisioner holds for a proxied kernel: its KernelEgress, and how its sandbox reaches the proxy."""

    def __init__(
        self,
        settings: Any,
        backend: Any,
        kernel_id: str,
        network: KernelNetwork,
        host_dir: Path,
        write_host_file: Callable[[str, bytes, int], object],
    ):
        """host_dir: the sandbox's directory of what the host writes for it (read-only inside, at the backend's
        guest_host_dir); write_host_file(name, data, mode) writes there without following what is in it (the
        provisioner's: egress knows no backend's directories)."""
        self.settings, self.backend = settings, backend
        self.host_dir, self.write_host_file = host_dir, write_host_file
        self.egress = KernelEgress(kernel_id, network.policy, network.source, network.secrets)
        self.service = service_for(settings)

    async def open(self, env: dict[str, str]) -> route.EgressRoute:
        """Have the proxy listen for the kernel, and point its tools at it (env: the kernel's, completed here)."""
        network = self.egress
        if self.backend.egress_routes == "tcp":  # known to the proxy by its address on the kernels' network, once it runs
            address, port, dial = self.backend.egress_endpoint()
            await self.service.listen_tcp(address, port)
            opened = route.EgressRoute(route.listeners([], dns=False), f"tcp:{dial}:{port}")
        else:  # in the directory of what the host wrote: the sandbox sees it read-only and cannot swap it for a link
            await self.service.open(network, self.host_dir / route.SOCKET_NAME)
            opened = route.EgressRoute(
                route.listeners(network.policy.transparent_ports()), f"{self.backend.guest_host_dir}/{route.SOCKET_NAME}"
            )
        if network.secrets:
            self.write_host_file(route.CA_BUNDLE_NAME, system_bundle() + b"\n" + self.service.ca.load(), 0o644)
        env.update(route.proxy_env(self.backend.guest_host_dir, with_ca=bool(network.secrets)))
        env.update({secret.name: secret.placeholder for secret in network.secrets})
        env["MSB_NETWORK_ALLOW"] = str(network.policy)
        return opened

    async def at(self, address: str | None) -> None:
        """The kernel runs at address now: a cluster's kernel is known to the proxy by it (egress_routes "tcp")."""
        if address and self.backend.egress_routes == "tcp":
            await self.service.bind_address(self.egress, address)

    async def close(self) -> None:
        await self.service.close(self.egress.kernel_id)
