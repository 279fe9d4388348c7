"""DNS messages, as much as the egress proxy needs: a kernel's queries answered from its policy, and the proxy's own
lookups when MSB_NETWORK_DNS names the servers to ask.

Why not forward a kernel's queries: a query is itself a message out (``<data>.attacker.example`` reaches the
attacker's name server through any resolver). So no query of a kernel's ever leaves the host: an allowed name is
answered with an address on the sandbox's own loopback, where the relay takes the connection to the proxy, which
looks the name up itself; every other name gets NXDOMAIN.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import struct
from dataclasses import dataclass

TYPE_A, TYPE_AAAA, TYPE_CNAME = 1, 28, 5
CLASS_IN = 1
RCODE_OK, RCODE_FORMERR, RCODE_SERVFAIL, RCODE_NXDOMAIN, RCODE_NOTIMP = 0, 1, 2, 3, 4
FLAG_QR, FLAG_AA, FLAG_TC, FLAG_RD, FLAG_RA = 0x8000, 0x0400, 0x0200, 0x0100, 0x0080
HEADER = struct.Struct("!HHHHHH")
ANSWER_TTL = 30
LOOKUP_TIMEOUT = 3.0


class DNSFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    id: int
    flags: int
    name: str  # lower case, no trailing dot
    qtype: int
    qclass: int
    raw_question: bytes  # the question section as sent, echoed in the answer


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """A (possibly compressed) name at offset, and the offset after it in the message."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # a loop of pointers is a malformed message, not a hang
        if offset >= len(message):
            raise DNSFormatError("truncated name")
        length = message[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(message):
                raise DNSFormatError("truncated pointer")
            end = end if end is not None else offset + 2
            offset = ((length & 0x3F) << 8) | message[offset + 1]
            continue
        if length & 0xC0:
            raise DNSFormatError("unknown label type")
        offset += 1
        if length == 0:
            return ".".join(labels).lower(), end if end is not None else offset
        labels.append(message[offset : offset + length].decode("ascii", errors="replace"))
        offset += length
    raise DNSFormatError("too many labels or pointers")


def parse_query(message: bytes) -> Question:
    if len(message) < HEADER.size:
        raise DNSFormatError("shorter than a DNS header")
    ident, flags, qdcount, _, _, _ = HEADER.unpack_from(message)
    if flags & FLAG_QR or qdcount != 1:
        raise DNSFormatError("not a query with one question")
    name, offset = _read_name(message, HEADER.size)
    if offset + 4 > len(message):
        raise DNSFormatError("truncated question")
    qtype, qclass = struct.unpack_from("!HH", message, offset)
    return Question(ident, flags, name, qtype, qclass, message[HEADER.size : offset + 4])


def answer(question: Question, rcode: int = RCODE_OK, addresses: list[str] = ()) -> bytes:
    """The reply to question: rcode, and an A or AAAA record per address (pointing at the question's name)."""
    flags = FLAG_QR | FLAG_AA | FLAG_RA | (question.flags & (FLAG_RD | 0x7800)) | rcode
    records = b""
    for address in addresses:
        packed = ipaddress.ip_address(address).packed
        rtype = TYPE_A if len(packed) == 4 else TYPE_AAAA
        records += struct.pack("!HHHIH", 0xC00C, rtype, CLASS_IN, ANSWER_TTL, len(packed)) + packed
    return HEADER.pack(question.id, flags, 1, len(addresses), 0, 0) + question.raw_question + records


def error_answer(message: bytes, rcode: int) -> bytes | None:
    """A bare reply with rcode for a message that could not be parsed as a query; None if it has no header."""
    if len(message) < HEADER.size:
        return None
    ident, flags = struct.unpack_from("!HH", message)
    return HEADER.pack(ident, FLAG_QR | (flags & 0x7800) | rcode, 0, 0, 0, 0)


# -- lookups for the proxy (MSB_NETWORK_DNS) -----------------------------------------------------------------------


def encode_query(name: str, qtype: int, ident: int) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode("ascii") for part in name.split(".") if part)
    return HEADER.pack(ident, FLAG_RD, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, CLASS_IN)


def decode_addresses(message: bytes, ident: int) -> tuple[int, list[str], bool]:
    """(rcode, the A/AAAA addresses in the answer section, truncated?) of a reply to the query ident."""
    if len(message) < HEADER.size:
        raise DNSFormatError("shorter than a DNS header")
    got, flags, qdcount, ancount, _, _ = HEADER.unpack_from(message)
    if got != ident or not flags & FLAG_QR:
        raise DNSFormatError("not the reply to this query")
    offset = HEADER.size
    for _ in range(qdcount):
        _, offset = _read_name(message, offset)
        offset += 4
    found = []
    for _ in range(ancount):
        _, offset = _read_name(message, offset)
        rtype, _, _, length = struct.unpack_from("!HHIH", message, offset)
        offset += 10
        data = message[offset : offset + length]
        offset += length
        if rtype in (TYPE_A, TYPE_AAAA) and len(data) in (4, 16):
            found.append(str(ipaddress.ip_address(data)))
    return flags & 0xF, found, bool(flags & FLAG_TC)


class _OneReply(asyncio.DatagramProtocol):
    def __init__(self, done: asyncio.Future):
        self.done = done

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if not self.done.done():
            self.done.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def _ask(server: tuple[str, int], query: bytes, ident: int) -> tuple[int, list[str]]:
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    transport, _ = await loop.create_datagram_endpoint(lambda: _OneReply(done), remote_addr=server)
    try:
        transport.sendto(query)
        reply = await asyncio.wait_for(done, LOOKUP_TIMEOUT)
    finally:
        transport.close()
    rcode, found, truncated = decode_addresses(reply, ident)
    if truncated:  # the whole answer over TCP
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*server), LOOKUP_TIMEOUT)
        try:
            writer.write(struct.pack("!H", len(query)) + query)
            length = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), LOOKUP_TIMEOUT))[0]
            rcode, found, _ = decode_addresses(await asyncio.wait_for(reader.readexactly(length), LOOKUP_TIMEOUT), ident)
        finally:
            writer.close()
    return rcode, found


async def lookup(name: str, servers: list[tuple[str, int]]) -> list[str]:
    """name's IPv4 and IPv6 addresses from the first of servers that answers; OSError when none does."""
    problems = []
    for server in servers:
        try:
            addresses: list[str] = []
            for qtype in (TYPE_A, TYPE_AAAA):
                ident = random.randrange(1 << 16)
                rcode, found = await _ask(server, encode_query(name, qtype, ident), ident)
                if rcode == RCODE_NXDOMAIN:
                    return []
                addresses += found
            return addresses
        except (OSError, asyncio.TimeoutError, DNSFormatError, struct.error) as exc:
            problems.append(f"{server[0]}:{server[1]}: {exc or type(exc).__name__}")
    raise OSError(f"no DNS server answered for {name} ({'; '.join(problems)})")


def parse_dns_servers(text: str | None) -> list[tuple[str, int]]:
    """MSB_NETWORK_DNS as (address, port) pairs; ValueError names a bad entry."""
    servers = []
    for entry in (text or "").replace(",", " ").split():
        host, port = entry, 53
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else 53
        elif entry.count(":") == 1:
            host, _, port_text = entry.partition(":")
            if not port_text.isdigit():
                raise ValueError(f"{entry!r} has a port that is not a number")
            port = int(port_text)
        ipaddress.ip_address(host)  # ValueError for a name: the resolver must be an address
        servers.append((host, port))
    return servers
