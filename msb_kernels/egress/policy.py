"""What a kernel may reach through the egress proxy: MSB_NETWORK_ALLOW's rules, a session's narrower list, and the
addresses that no rule opens.

A rule is a host name (``pypi.org``), a wildcard (``*.pythonhosted.org``: any name below it, not the name itself),
``*`` (any name), or a network (``198.51.100.0/24``, ``2001:db8::/32``), with ports after a colon (``:443``,
``:8000-8100``, ``:*``; none = 80 and 443). Rules are separated by commas or whitespace.

Why addresses are checked after every lookup: a name is what the rule allows, but the connection goes to whatever
the name resolves to, and a name someone else's DNS answers (``*``, or a wildcard over a zone they control) can
point at the host itself or the LAN. So a connection never goes to loopback, link-local (cloud metadata), multicast
or the host's own addresses, and goes into a private range (the LAN) only where a network rule names that range.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
import time
from dataclasses import dataclass

from msb_kernels.egress.netlink import host_ipv4_addresses

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_PORTS = frozenset({80, 443})
ANY_PORT: frozenset[int] = frozenset()  # ":*" (an empty set stands for every port)
# Private ranges: reachable only where a network rule names them (and through MSB_ALLOW_NETWORK's slirp never).
LAN_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16")
LAN_NETWORKS_V6 = ("fc00::/7",)
RULE_FORMS = (
    "host names (pypi.org), wildcards (*.pythonhosted.org), * for any name, or networks (198.51.100.0/24), "
    "each with :PORT, :FIRST-LAST or :* (no port = 80 and 443), separated by commas"
)
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_HOST_ADDRESSES_TTL = 5.0


class PolicyError(ValueError):
    """A rule that cannot be read, or a list that asks for more than it may; the message names the rule."""


@dataclass(frozen=True)
class Rule:
    """One allowed destination: a host pattern or a network, and its ports."""

    host: str | None = None  # "pypi.org", "*.pythonhosted.org" or "*"
    network: IPNetwork | None = None
    ports: frozenset[int] = DEFAULT_PORTS  # ANY_PORT: every port

    def __str__(self) -> str:
        where = self.host if self.host is not None else str(self.network)
        if self.network is not None and self.network.version == 6:
            where = f"[{where}]"
        return where + _ports_text(self.ports)

    def allows_port(self, port: int) -> bool:
        return not self.ports or port in self.ports

    def matches_name(self, name: str) -> bool:
        if self.host is None:
            return False
        if self.host == "*":
            return True
        if self.host.startswith("*."):
            return name.endswith(self.host[1:])
        return name == self.host

    def covers(self, other: Rule) -> bool:
        """Whether every destination other allows, this rule allows too (a session's rule against the operator's).

        ``*`` is any name and any public address: it covers every name rule, and a network rule only where the network
        holds no private address. A private range opens only where a network rule names it (refusal_for_address), so a
        session's network rule within ``*`` would widen the operator's list to the LAN it names."""
        if self.ports and (not other.ports or not other.ports <= self.ports):
            return False
        if self.host == "*":
            return other.network is None or not overlaps_private(other.network)
        if other.network is not None:
            return self.network is not None and self.network.version == other.network.version and other.network.subnet_of(self.network)
        if self.host is None or other.host is None or other.host == "*":
            return False
        if other.host.startswith("*."):
            return self.host.startswith("*.") and (other.host == self.host or other.host.endswith(self.host[1:]))
        return self.matches_name(other.host)


def _ports_text(ports: frozenset[int]) -> str:
    if ports == DEFAULT_PORTS:
        return ""
    if not ports:
        return ":*"
    low, high = min(ports), max(ports)  # a parsed rule's ports are one port or one range
    return f":{low}" if low == high else f":{low}-{high}"


def normalize_name(name: str) -> str:
    """A host name as rules compare it: lower case, no trailing dot, IDNA for non-ASCII names."""
    name = name.strip().rstrip(".").lower()
    if name and not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:
            raise PolicyError(f"{name!r} is not a valid host name") from None
    return name


def _parse_ports(text: str, rule: str) -> frozenset[int]:
    if text == "*":
        return ANY_PORT
    first, dash, last = text.partition("-")
    try:
        low, high = int(first), int(last if dash else first)
    except ValueError:
        raise PolicyError(f"{rule!r}: {text!r} is not a port, a range FIRST-LAST or *") from None
    if not 1 <= low <= high <= 65535:
        raise PolicyError(f"{rule!r}: ports must lie in 1-65535, FIRST <= LAST")
    if high - low >= 4096:
        raise PolicyError(f"{rule!r}: a range of more than 4096 ports; use :* for every port")
    return frozenset(range(low, high + 1))


def parse_rule(text: str) -> Rule:
    """One rule of RULE_FORMS; PolicyError names it and says why it cannot be read."""
    raw = text.strip()
    if not raw:
        raise PolicyError("an empty rule")
    where, ports_text = raw, None
    if raw.count(":") > 1 and not raw.startswith("[") and "/" in raw:
        with contextlib.suppress(ValueError):  # an IPv6 network without brackets, and so without ports
            ipaddress.ip_network(raw, strict=False)
            where = f"[{raw}]"
    if where.startswith("["):  # [2001:db8::/32]:443
        end = where.find("]")
        if end < 0:
            raise PolicyError(f"{raw!r}: an IPv6 network in [ ] has no closing ]")
        where, rest = where[1:end], where[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise PolicyError(f"{raw!r}: only :PORT may follow ]")
            ports_text = rest[1:]
    elif raw.count(":") == 1:
        where, _, ports_text = raw.partition(":")
    elif raw.count(":") > 1:
        raise PolicyError(f"{raw!r}: write an IPv6 network in brackets, as [2001:db8::/32]:443")
    ports = _parse_ports(ports_text, raw) if ports_text is not None else DEFAULT_PORTS
    if "/" in where or _is_address(where):
        try:
            network = ipaddress.ip_network(where, strict=False)
        except ValueError:
            raise PolicyError(f"{raw!r} is not a network such as 198.51.100.0/24") from None
        reason = never_reason(network.network_address) or never_reason(network.broadcast_address)
        if reason or network.is_loopback or network.is_link_local:
            raise PolicyError(f"{raw!r} names {reason or 'loopback or link-local addresses'}, which kernels never reach")
        return Rule(network=network, ports=ports)
    name = normalize_name(where)
    if name == "*":
        return Rule(host="*", ports=ports)
    bare = name[2:] if name.startswith("*.") else name
    if "*" in bare or not bare or not all(_LABEL.match(label) for label in bare.split(".")):
        raise PolicyError(f"{raw!r} is not a host name, a wildcard such as *.example.com, * or a network")
    return Rule(host=name, ports=ports)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Policy:
    """The rules one kernel's connections are held to, in order."""

    rules: tuple[Rule, ...]

    @classmethod
    def parse(cls, text: str | list[str] | None) -> Policy:
        parts = text if isinstance(text, list) else re.split(r"[\s,]+", text or "")
        return cls(tuple(dict.fromkeys(parse_rule(part) for part in parts if part and part.strip())))

    @classmethod
    def everything(cls) -> Policy:
        """MSB_ALLOW_NETWORK=true as an operator's list: any public name or address, on any port."""
        return cls((Rule(host="*", ports=ANY_PORT),))

    def __str__(self) -> str:
        return ",".join(map(str, self.rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def allows_name(self, name: str, port: int | None = None) -> bool:
        """Whether a connection to name (on port; any rule's port when None) is allowed: the DNS answer's test too."""
        name = normalize_name(name)
        return any(rule.matches_name(name) and (port is None or rule.allows_port(port)) for rule in self.rules)

    def allows_address(self, address: IPAddress, port: int) -> bool:
        """Whether a connection straight to an address (a CONNECT to an IP) is allowed by a network rule or *."""
        return any(
            rule.allows_port(port) and (rule.host == "*" or (rule.network is not None and address in rule.network)) for rule in self.rules
        )

    def opens_private(self, address: IPAddress) -> bool:
        """Whether a network rule names the private range address is in (names alone never open the LAN)."""
        return any(rule.network is not None and address in rule.network for rule in self.rules)

    def narrowed_to(self, requested: Policy) -> Policy:
        """requested, when each of its rules lies within one of these; else PolicyError naming the first that does not."""
        for rule in requested.rules:
            if not any(own.covers(rule) for own in self.rules):
                raise PolicyError(f"{rule} is not within the operator's list ({self or 'nothing'})")
        return requested

    def transparent_ports(self, limit: int = 16) -> list[int]:
        """The ports where tools that ignore proxy variables reach allowed names (by DNS answer): each name rule's
        ports, 80 and 443 for :* rules, at most limit of them."""
        ports: set[int] = set()
        for rule in self.rules:
            if rule.host is not None:
                ports |= set(rule.ports) if rule.ports else DEFAULT_PORTS
        return sorted(ports)[:limit]


def never_reason(address: IPAddress) -> str | None:
    """Why no rule ever opens address, or None: loopback, link-local, multicast, unspecified, reserved."""
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata lives there)"
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return "a multicast, unspecified or reserved address"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return never_reason(address.ipv4_mapped)
    return None


@functools.cache
def _lan_networks() -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(n) for n in (*LAN_NETWORKS, *LAN_NETWORKS_V6))


def is_private(address: IPAddress) -> bool:
    return any(address.version == n.version and address in n for n in _lan_networks())


def overlaps_private(network: IPNetwork) -> bool:
    """Whether a network holds any private (LAN) address."""
    return any(network.version == n.version and network.overlaps(n) for n in _lan_networks())


_host_addresses: tuple[float, frozenset[str]] = (0.0, frozenset())


def host_addresses() -> frozenset[str]:
    """This host's own addresses, every interface (read every few seconds: links come and go)."""
    global _host_addresses
    read_at, found = _host_addresses
    if time.monotonic() - read_at < _HOST_ADDRESSES_TTL:
        return found
    addresses = set()
    try:
        addresses.update(host_ipv4_addresses())
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                raw = line.split()[0]
                addresses.add(str(ipaddress.ip_address(bytes.fromhex(raw))))
    except OSError:
        pass
    _host_addresses = (time.monotonic(), frozenset(addresses))
    return _host_addresses[1]


def refusal_for_address(policy: Policy, address: IPAddress) -> str | None:
    """Why a connection to address is refused whatever the name, or None: the never-ranges, the host, the LAN."""
    reason = never_reason(address)
    if reason:
        return reason
    if str(address) in host_addresses():
        return "an address of the gateway's host"
    if is_private(address) and not policy.opens_private(address):
        return "a private (LAN) address, which only a network rule such as 10.1.0.0/16 opens"
    return None
