"""The sandbox's side of the egress route: where the relay listens inside, what it tells the proxy, and the variables
that point a kernel's tools at it. One definition for the backends (which start the relay), the provisioner (which
sets the variables) and the proxy (which reads the relay's header).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

SOCKET_NAME = "egress.sock"  # in the kernel's io dir: the proxy listens there for this kernel alone
CA_BUNDLE_NAME = "egress-ca.pem"  # in the io dir, where the kernel has secrets: the host's CAs and the proxy's
PROXY_PORT = 3128  # 127.0.0.1:3128 inside: an HTTP proxy (CONNECT and plain HTTP)
DNS_PORT = 53  # 127.0.0.1:53 inside, UDP and TCP: allowed names only
HEADER_MAGIC = "MSB-EGRESS"  # the relay's first line on each connection: MSB-EGRESS 1 <kind> <address> <port>
KINDS = ("proxy", "transparent", "dns")
NO_PROXY = "localhost,127.0.0.1,::1"


def listeners(transparent_ports: list[int], dns: bool = True) -> list[list]:
    """What the sandbox's init binds for the relay, as [kind, address, port, "tcp"|"udp"]: transparent listeners on
    every loopback address (allowed names resolve to addresses of their own in 127.64.0.0/10). dns False: the proxy's
    port alone (a cluster's kernel, which cannot bind port 53, and whose DNS is its engine's)."""
    bound = [["proxy", "127.0.0.1", PROXY_PORT, "tcp"]]
    if dns:
        bound += [["dns", "127.0.0.1", DNS_PORT, "tcp"], ["dns", "127.0.0.1", DNS_PORT, "udp"]]
        bound += [["transparent", "0.0.0.0", port, "tcp"] for port in transparent_ports if port not in (PROXY_PORT, DNS_PORT)]
    return bound


# A cluster's kernel has no init of ours: its command starts the relay beside it, then becomes the kernel.
# argv: the relay's spec (JSON, its source in "source"), then the kernel's command.
RELAY_LAUNCHER = r"""
import json, os, sys
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", json.loads(sys.argv[1])["source"], sys.argv[1]])
os.execvp(sys.argv[2], sys.argv[2:])
"""


@functools.cache
def relay_source() -> str:
    """relay_program.py's text: the sandbox runs it with -c, since no import path of ours exists in there."""
    return (Path(__file__).with_name("relay_program.py")).read_text()


def proxy_env(guest_dir: str, with_ca: bool) -> dict[str, str]:
    """The variables that send a kernel's HTTP tools through the proxy (and, with secrets, trust its CA at guest_dir)."""
    proxy = f"http://127.0.0.1:{PROXY_PORT}"
    env = {name: proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy", "npm_config_https_proxy")}
    env.update(NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
    if with_ca:
        bundle = f"{guest_dir}/{CA_BUNDLE_NAME}"
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "npm_config_cafile"):
            env[name] = bundle
    return env


@dataclass(frozen=True)
class EgressRoute:
    """A sandbox whose only way out is the egress proxy: a relay inside, which the sandbox's init starts on these
    listeners (listeners() above), to the proxy's socket at this path inside. Egress owns it; the backends'
    SandboxSpec carries it."""

    listeners: list[list]
    socket: str  # the proxy's socket, as the guest sees it (in its io dir)

    def plan(self, with_source: bool) -> dict:
        """What the sandbox's init needs to start the relay: its listeners, the socket, and the relay's source for an
        init that runs it with -c (the namespace init reads the file by path)."""
        return {"listeners": self.listeners, "socket": self.socket, **({"source": relay_source()} if with_source else {})}
