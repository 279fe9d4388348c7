"""rtnetlink with the standard library: this network namespace's IPv4 addresses, and one request's replies.

The egress policy reads the host's addresses with it (a sandbox never reaches them), the namespace backend fences them
off with routes, and the namespace init, a script with no import path of the package's, reads this file by path
(backends/namespace/init_program.py): so the standard library only.
"""

from __future__ import annotations

import os
import socket
import struct

NETLINK_ROUTE = 0
RTM_NEWADDR, RTM_GETADDR = 20, 22
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
IFA_ADDRESS, IFA_LOCAL = 1, 2


def request(message_type: int, flags: int, body: bytes) -> list[tuple[int, bytes]]:
    """One rtnetlink request: the payloads of its replies; a kernel error is raised as OSError."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(struct.pack("=IHHII", 16 + len(body), message_type, flags | NLM_F_REQUEST, 1, 0) + body)
        replies = []
        while True:
            data = sock.recv(65536)
            offset = 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                payload = data[offset + 16 : offset + length]
                if kind == NLMSG_DONE:
                    return replies
                if kind == NLMSG_ERROR:
                    error = -struct.unpack_from("=i", payload)[0]
                    if error:
                        raise OSError(error, os.strerror(error))
                    return replies
                replies.append((kind, payload))
                offset += (length + 3) & ~3


def _attributes(payload: bytes, offset: int) -> dict[int, bytes]:
    found = {}
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            break
        found[kind] = payload[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return found


def host_ipv4_addresses() -> list[str]:
    """Every IPv4 address of this network namespace's interfaces (loopback included)."""
    addresses = []
    for kind, payload in request(RTM_GETADDR, NLM_F_DUMP, struct.pack("=BBBBI", socket.AF_INET, 0, 0, 0, 0)):
        if kind == RTM_NEWADDR:
            attributes = _attributes(payload, 8)
            raw = attributes.get(IFA_LOCAL) or attributes.get(IFA_ADDRESS)
            if raw and len(raw) == 4:
                addresses.append(socket.inet_ntoa(raw))
    return sorted(set(addresses))
