"""Outbound network for namespace sandboxes (MSB_ALLOW_NETWORK): user-mode NAT by slirp4netns.

slirp4netns, not pasta: the passt of Debian 12 has no way to tie its lifetime to a pipe
(slirp4netns has --exit-fd), and it copies the host's addresses and routes into the
namespace. slirp4netns gives the sandbox 10.0.2.100 behind its own NAT; its connections
leave from the host as ordinary sockets of an unprivileged helper, so the host must be
fenced off explicitly:

- ``--disable-host-loopback``: the gateway (10.0.2.2) never maps to the host's 127.0.0.1;
- ``--disable-dns``: nor does 10.0.2.3 (slirp's DNS alias forwards any port to the host's
  resolver, which may sit on the host's loopback);
- prohibit routes inside the sandbox for the host's own addresses and the LAN (the same
  "public internet only" rule as the microVM backend), which sandboxed code cannot remove:
  it has no CAP_NET_ADMIN over its network namespace.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path

from msb_kernels.egress.netlink import host_ipv4_addresses
from msb_kernels.errors import SandboxError

HELPER = "slirp4netns"
INSTALL_HINT = "install slirp4netns (Debian/Ubuntu: apt-get install slirp4netns; Fedora: dnf install slirp4netns)"
SLIRP_NETWORK = "10.0.2.0/24"  # slirp4netns's default: the sandbox's own link
GATEWAY = "10.0.2.2"
DNS_ALIAS = "10.0.2.3"
INTERFACE = "tap0"
HELPER_OPTIONS = ("--configure", "--mtu=65520", "--disable-host-loopback", "--disable-dns", "--enable-sandbox", "--enable-seccomp")
# Never reachable with MSB_ALLOW_NETWORK: private, carrier-grade NAT and link-local (cloud metadata) ranges.
LAN_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16")
RESOLV_CONFS = ("/etc/resolv.conf", "/run/systemd/resolve/resolv.conf")  # the second when the first names only a local stub


def helper_path() -> str | None:
    return shutil.which(HELPER, path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")


TUN_DEVICE = "/dev/net/tun"


def tun_unusable_reason(rootful: bool) -> str | None:
    """Why slirp4netns, run as this user, cannot open the tun device it needs; None when it can."""
    if rootful:
        return None
    try:
        mode = os.stat(TUN_DEVICE).st_mode
    except OSError:
        return f"{TUN_DEVICE} does not exist (load the tun module: modprobe tun)"
    if mode & 0o006 != 0o006:
        return (
            f"{TUN_DEVICE} is mode {mode & 0o777:04o}, so only root opens it "
            f"(as root: chmod 0666 {TUN_DEVICE}, the usual mode; or run msb-kernels as root)"
        )
    return None


def describe(allowed: bool) -> str:
    """What gives namespace kernels their network, for `msb-kernels doctor`."""
    path = helper_path()
    if not allowed:
        provider = f"{HELPER} ({path})" if path else f"nothing: {HELPER} is missing ({INSTALL_HINT})"
        return f"none (MSB_ALLOW_NETWORK=false: kernels have only loopback); with MSB_ALLOW_NETWORK=true it would be {provider}"
    if path is None:
        return f"none: MSB_ALLOW_NETWORK=true, but {HELPER} is missing, so namespace kernels cannot start; {INSTALL_HINT}"
    return (
        f"{HELPER} ({path}), MSB_ALLOW_NETWORK=true: the public internet only; the host's addresses, its loopback "
        f"and the LAN stay unreachable; DNS: {', '.join(host_nameservers()) or 'none (the host has no usable resolver)'}"
    )


def host_nameservers() -> list[str]:
    """The host's IPv4 DNS servers that a sandbox may use: not loopback (the host's stub resolver) and not the host itself."""
    own = set(host_ipv4_addresses())
    for resolv_conf in RESOLV_CONFS:
        try:
            lines = Path(resolv_conf).read_text().splitlines()
        except OSError:
            continue
        servers = []
        for line in lines:
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "nameserver":
                try:
                    address = ipaddress.ip_address(fields[1])
                except ValueError:
                    continue
                # One inside slirp's network (a host that is itself a QEMU guest) would be slirp's alias here.
                if (
                    address.version == 4
                    and not address.is_loopback
                    and str(address) not in own
                    and address not in ipaddress.ip_network(SLIRP_NETWORK)
                ):
                    servers.append(str(address))
        if servers:
            return list(dict.fromkeys(servers))
    return []


def prohibited_destinations() -> list[str]:
    """The LAN, every non-loopback address of the host (loopback is the sandbox's own lo inside), and
    slirp's aliases for the host: fenced twice, by slirp's flags and by these routes."""
    own = [f"{a}/32" for a in host_ipv4_addresses() if not ipaddress.ip_address(a).is_loopback]
    return list(dict.fromkeys([*LAN_NETWORKS, *sorted(own), f"{GATEWAY}/32", f"{DNS_ALIAS}/32"]))


def network_plan(state_dir: Path, rootful: bool) -> dict:
    """The launch plan's "network" entry; raises SandboxError when no helper is installed."""
    path = helper_path()
    if path is None:
        raise SandboxError(
            f"MSB_ALLOW_NETWORK=true, but {HELPER}, which gives namespace sandboxes their network, is not installed; "
            f"{INSTALL_HINT}, or unset MSB_ALLOW_NETWORK",
            [INSTALL_HINT, "or unset MSB_ALLOW_NETWORK to run kernels without network"],
        )
    tun = tun_unusable_reason(rootful)
    if tun:
        raise SandboxError(
            f"MSB_ALLOW_NETWORK=true, but {HELPER} cannot give this user's sandboxes a network: {tun}",
            [f"as root: chmod 0666 {TUN_DEVICE}", "or unset MSB_ALLOW_NETWORK to run kernels without network"],
        )
    return {
        "helper": [path, *HELPER_OPTIONS],
        "interface": INTERFACE,
        "gateway": GATEWAY,
        "join_user_namespace": not rootful,
        "log": str(state_dir / "network.log"),
        "nameservers": host_nameservers(),
        "prohibited": prohibited_destinations(),
    }
