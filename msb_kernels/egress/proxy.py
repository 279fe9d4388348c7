"""One kernel's connections through the egress proxy, from the relay's header to the upstream's last byte.

Each connection on a kernel's socket starts with the relay's line (route.HEADER_MAGIC) naming what the sandboxed
client dialled: the HTTP proxy, an allowed name's address on one of its ports (transparent), or DNS. Every way out
comes to open_upstream, which holds the name and port to the kernel's policy and each address it resolves to to
policy.refusal_for_address, so no form of request reaches more than another. A refusal is fast and says what
was refused and by which setting: a 403 whose reason phrase tools print (pip: "Tunnel connection failed: 403
msb-kernels: ..."), NXDOMAIN for a name DNS must not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import h11

from msb_kernels.egress import dns
from msb_kernels.egress.policy import Policy, normalize_name, refusal_for_address
from msb_kernels.egress.reflection import Reflection
from msb_kernels.egress.route import HEADER_MAGIC
from msb_kernels.egress.secrets import Redaction, Secret, sendable, substitute_headers
from msb_kernels.egress.streams import Stream, TLSStream, splice
from msb_kernels.egress.tls import HELLO, NEED_MORE, CertificateAuthority, read_client_hello
from msb_kernels.observability import metrics

log = logging.getLogger("msb_kernels.egress")

CONNECT_TIMEOUT = 10.0
PEEK_TIMEOUT = 0.5  # a client that says nothing first (a server-speaks-first protocol) is spliced after this
MAX_CONNECTIONS = 128  # open at once per kernel: a kernel cannot spend the gateway's descriptors
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"te", b"upgrade"}
RECENT_REFUSALS = 20
WITHDRAW_AFTER = 3  # refused answers that held a piece of a secret, after which the kernel's requests no longer carry it
HOLD_BYTES = 1 << 20  # of an answer to a request that carried a secret, checked whole before its head goes (reflection.py)
_METHOD = re.compile(rb"^[A-Z]{3,10} ")


class EgressService(Protocol):
    """What a connection needs of the proxy that serves it (service.EgressService): lookups, the CA, upstream TLS."""

    ca: CertificateAuthority
    upstream_tls: ssl.SSLContext

    async def resolve(self, host: str) -> list[str]: ...


class Refused(Exception):
    """A connection the proxy will not make: the status for an HTTP client, and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class KernelEgress:
    """What the proxy holds for one kernel: its policy (and which setting gave it), its secrets, the loopback
    addresses DNS handed its names, and its counters."""

    kernel_id: str
    policy: Policy
    source: str  # the setting that gave the policy, for messages: MSB_NETWORK_ALLOW or the session's network_allow
    secrets: list[Secret] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # name -> the loopback address DNS answered
    by_address: dict[str, str] = field(default_factory=dict)
    open_connections: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"allowed": 0, "refused": 0, "dns_answered": 0, "dns_refused": 0})
    bytes: list[int] = field(default_factory=lambda: [0, 0])  # out, in
    refusals: deque = field(default_factory=lambda: deque(maxlen=RECENT_REFUSALS))
    # Secrets no longer put into this kernel's requests: an answer refused for holding a piece of one tells the kernel
    # that what it reflected was a piece (an oracle, one guessed byte a refusal), so after WITHDRAW_AFTER refusals the
    # kernel learns nothing more from it. Still checked for in every answer of their hosts.
    withdrawn: set = field(default_factory=set)
    reflections: dict = field(default_factory=dict)
    tasks: set = field(default_factory=set)  # the connections being served, cancelled when the kernel goes

    def address_for(self, name: str) -> str:
        """The loopback address this kernel's DNS gives name: stable for the name (a hash into 127.64.0.0/10), so a
        gateway that adopts the kernel hands out the same ones."""
        if name in self.names:
            return self.names[name]
        number = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
        while True:
            candidate = str(ipaddress.IPv4Address((127 << 24) | (64 << 16) | (number % (1 << 22))))
            if candidate not in self.by_address and not candidate.endswith((".0", ".255")):
                break
            number += 1
        self.names[name], self.by_address[candidate] = candidate, name
        return candidate

    def refuse(self, what: str, why: str) -> Refused:
        self.counts["refused"] += 1
        metrics.EGRESS_CONNECTIONS.labels("refused").inc()
        message = f"msb-kernels: {what} {why}"
        self.refusals.append({"at": time.time(), "what": what, "why": why})
        log.info("egress: kernel %s: refused %s %s", self.kernel_id, what, why)
        return Refused(403, message)

    def not_allowed(self, host: str, port: int) -> Refused:
        return self.refuse(f"{host}:{port}", f"is not allowed by {self.source} ({self.policy or 'nothing allowed'})")

    def snapshot(self) -> dict:
        """Its policy, secrets (names and hosts, never values), counters and last refusals, for stats and metrics."""
        return {
            "allow": str(self.policy),
            "source": self.source,
            "secrets": [secret.public() for secret in self.secrets],
            "connections_open": self.open_connections,
            "bytes_out": self.bytes[0],
            "bytes_in": self.bytes[1],
            **self.counts,
            "recent_refusals": list(self.refusals)[-5:],
        }

    def count_bytes(self, index: int, size: int) -> None:
        """size bytes went out (index 0, to a host) or in (1)."""
        self.bytes[index] += size
        metrics.EGRESS_BYTES.labels(("out", "in")[index]).inc(size)

    def reflected(self, name: str) -> None:
        """An answer was refused for holding a piece of the secret name: after WITHDRAW_AFTER, it is withdrawn."""
        self.reflections[name] = self.reflections.get(name, 0) + 1
        if self.reflections[name] >= WITHDRAW_AFTER and name not in self.withdrawn:
            self.withdrawn.add(name)
            self.refuse(f"the secret {name}", f"after {WITHDRAW_AFTER} answers that held a piece of it: it is no longer sent")

    def secrets_for(self, host: str, port: int) -> list[Secret]:
        return [secret for secret in self.secrets if secret.bound_for(host, port)]

    def secrets_of_host(self, host: str) -> list[Secret]:
        """The secrets that go to host on some port: every answer of it, on any port, is checked for them."""
        return [secret for secret in self.secrets if secret.held_by(host)]


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def open_upstream(egress: KernelEgress, service: EgressService, host: str, port: int) -> Stream:
    """A TCP connection to host:port, if the policy allows it and every check of its address passes; else Refused."""
    literal = _address(host)
    if literal is not None:
        if not egress.policy.allows_address(literal, port):
            raise egress.not_allowed(str(literal), port)
        candidates = [str(literal)]
    else:
        host = normalize_name(host)
        if not egress.policy.allows_name(host, port):
            raise egress.not_allowed(host, port)
        try:
            candidates = await service.resolve(host)
        except OSError as exc:
            raise Refused(502, f"msb-kernels: cannot resolve {host}: {exc}") from None
        if not candidates:
            raise Refused(502, f"msb-kernels: {host} has no address (NXDOMAIN)")
    usable, reasons = [], []
    for candidate in candidates:
        reason = refusal_for_address(egress.policy, ipaddress.ip_address(candidate))
        (reasons if reason else usable).append(f"{candidate}, {reason}" if reason else candidate)
    if not usable:
        raise egress.refuse(f"{host}:{port}", f"resolves only to {'; '.join(reasons)}")
    problems = []
    for candidate in usable:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(candidate, port), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            problems.append(f"{candidate}: {exc or 'timed out'}")
            continue
        egress.counts["allowed"] += 1
        metrics.EGRESS_CONNECTIONS.labels("allowed").inc()
        return Stream(reader, writer)
    raise Refused(502, f"msb-kernels: cannot connect to {host}:{port} ({'; '.join(problems)})")


async def serve(egress: KernelEgress, service: EgressService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection from the kernel's relay (or from the kernel itself on its socket)."""
    client = Stream(reader, writer)
    if egress.open_connections >= MAX_CONNECTIONS:
        egress.refuse("a new connection", f"(this kernel has {MAX_CONNECTIONS} open, the most one kernel may)")
        await client.close()
        return
    egress.open_connections += 1
    task = asyncio.current_task()
    egress.tasks.add(task)
    try:
        header = await asyncio.wait_for(reader.readline(), 10)
        parts = header.decode("ascii", errors="replace").split()
        if len(parts) != 5 or parts[0] != HEADER_MAGIC or parts[1] != "1":
            return
        kind, address, port = parts[2], parts[3], int(parts[4]) if parts[4].isdigit() else 0
        if kind == "proxy":
            await forward_proxy(egress, service, client)
        elif kind == "transparent":
            await transparent(egress, service, client, address, port)
        elif kind == "dns":
            await answer_dns(egress, client)
    except Refused:
        pass  # counted and logged where it was refused; a client past its CONNECT's 200 sees the connection close
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, h11.ProtocolError, ConnectionError) as exc:
        log.debug("egress: kernel %s: connection ended: %s", egress.kernel_id, exc)
    finally:
        egress.open_connections -= 1
        egress.tasks.discard(task)
        await client.close()


# -- DNS --------------------------------------------------------------------------------------------------------------


async def answer_dns(egress: KernelEgress, client: Stream) -> None:
    """DNS over the stream (two-byte lengths): allowed names get their loopback address, others NXDOMAIN."""
    buffer = b""
    while True:
        while len(buffer) < 2 or len(buffer) < 2 + int.from_bytes(buffer[:2], "big"):
            data = await client.recv()
            if not data:
                return
            buffer += data
        length = int.from_bytes(buffer[:2], "big")
        message, buffer = buffer[2 : 2 + length], buffer[2 + length :]
        await client.send(_framed(dns_reply(egress, message)))


def _framed(reply: bytes | None) -> bytes:
    return len(reply).to_bytes(2, "big") + reply if reply else b""


def dns_reply(egress: KernelEgress, message: bytes) -> bytes | None:
    try:
        question = dns.parse_query(message)
    except dns.DNSFormatError:
        return dns.error_answer(message, dns.RCODE_FORMERR)
    if question.qclass != dns.CLASS_IN or not egress.policy.allows_name(question.name):
        egress.counts["dns_refused"] += 1
        metrics.EGRESS_DNS.labels("refused").inc()
        if len(egress.refusals) == 0 or egress.refusals[-1].get("what") != question.name:
            egress.refusals.append({"at": time.time(), "what": question.name, "why": "DNS: not an allowed name"})
        return dns.answer(question, dns.RCODE_NXDOMAIN)
    egress.counts["dns_answered"] += 1
    metrics.EGRESS_DNS.labels("answered").inc()
    addresses = [egress.address_for(question.name)] if question.qtype == dns.TYPE_A else []
    return dns.answer(question, dns.RCODE_OK, addresses)  # AAAA and the rest: no data, so clients use IPv4


# -- HTTP -------------------------------------------------------------------------------------------------------------


async def _next_event(connection: h11.Connection, stream: Stream):
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await stream.recv())
            continue
        return event


async def _answer(client: Stream, server: h11.Connection, status: int, message: str) -> None:
    """A refusal or failure the client shows: the message in the reason phrase and the body."""
    body = (message + "\n").encode()
    reason = message.encode("ascii", errors="replace")[:400]
    with contextlib.suppress(h11.LocalProtocolError):
        await client.send(
            server.send(
                h11.Response(
                    status_code=status,
                    reason=reason,
                    headers=[(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")],
                )
            )
            + server.send(h11.Data(data=body))
            + server.send(h11.EndOfMessage())
        )


class Upstreams:
    """The upstream connection a run of requests reuses while host and port stay the same."""

    def __init__(self, opener: Callable[[str, int], Awaitable[Stream]]):
        self.opener = opener
        self.key: tuple[str, int] | None = None
        self.stream: Stream | None = None
        self.connection: h11.Connection | None = None

    async def get(self, host: str, port: int) -> tuple[Stream, h11.Connection]:
        if self.key != (host, port) or self.stream is None:
            await self.close()
            self.stream = await self.opener(host, port)
            self.key, self.connection = (host, port), h11.Connection(h11.CLIENT)
        return self.stream, self.connection

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        self.stream = self.connection = self.key = None


def _forwarded_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP and name.lower() not in (b"host", b"expect")]


async def exchange(
    egress: KernelEgress,
    client: Stream,
    upstreams: Upstreams,
    fixed: tuple[str, int] | None,
    server: h11.Connection | None = None,
    on_connect: Callable[[h11.Request], Awaitable[None]] | None = None,
    tls: bool = False,
) -> None:
    """HTTP/1.1 requests from client, each to its upstream: absolute-form targets (a forward proxy; CONNECT goes to
    on_connect), or origin-form ones for fixed (host, port), whose Host header must name that host. tls: the
    upstream connection is TLS (the proxy ended the kernel's TLS to put secrets in): only then do secrets go in, but
    for the operator's plain_http ones; never into the URL; and an answer never hands back a value that went in."""
    server = server or h11.Connection(h11.SERVER)
    try:
        while True:
            event = await _next_event(server, client)
            if not isinstance(event, h11.Request):
                return
            if event.method == b"CONNECT" and fixed is None and on_connect is not None:
                await on_connect(event)
                return
            try:
                host, port, target = _route(egress, event, fixed)
                stream, upstream = await upstreams.get(host, port)
            except Refused as refusal:
                await _answer(client, server, refusal.status, refusal.message)
                return
            going = [secret for secret in sendable(egress.secrets, host, port, tls) if secret.name not in egress.withdrawn]
            headers, sent = substitute_headers(_forwarded_headers(event.headers), going)
            redaction = Redaction(sent)
            # Every answer of a secret's host is checked, whether this request carried it or not: a host that keeps what
            # it got (a request bin, a "last request" page) hands it back to a later request, or queues it on the
            # connection for the next.
            bound = egress.secrets_of_host(host)  # on any port: the host holds the value, whichever port it answers on
            reflection = Reflection(sent + [(secret.name, secret.value.encode()) for secret in bound]) if sent or bound else None
            if reflection:  # an answer the proxy can read, to take the value out of it
                headers = [(name, value) for name, value in headers if name.lower() != b"accept-encoding"]
                headers.append((b"accept-encoding", b"identity"))
            authority = host if port in (80, 443) else f"{host}:{port}"
            if server.client_is_waiting_for_100_continue:
                await client.send(server.send(h11.InformationalResponse(status_code=100, headers=[])))
            await stream.send(
                upstream.send(h11.Request(method=event.method, target=target, headers=[(b"host", authority.encode()), *headers]))
            )
            if not await _copy_message(server, client, upstream, stream, egress.count_bytes, 0):
                return
            try:
                copied = await _copy_message(
                    upstream, stream, server, client, egress.count_bytes, 1, heads=True, redaction=redaction, reflection=reflection
                )
            except Reflected as reflected:
                held = ", ".join(reflected.names)
                refusal = egress.refuse(f"the answer of {host}:{port}", f"holds a piece of the secret {held}, {reflected.where}")
                for name in reflected.names:  # a piece two secrets share counts against each
                    egress.reflected(name)
                if server.our_state is h11.SEND_RESPONSE:
                    await _answer(client, server, 502, refusal.message)
                return  # its body had begun: the connection is cut, and the kernel's client sees an answer cut short
            except Refused as refusal:
                await _answer(client, server, refusal.status, refusal.message)
                return
            if not copied:
                await _answer(client, server, 502, f"msb-kernels: {host}:{port} closed the connection mid-response")
                return
            if upstream.our_state is h11.DONE and upstream.their_state is h11.DONE:
                upstream.start_next_cycle()
            else:
                await upstreams.close()
            if server.our_state is not h11.DONE or server.their_state is not h11.DONE:
                return
            server.start_next_cycle()
    finally:
        await upstreams.close()


class Reflected(Exception):
    """An answer holds a piece of a secret in a form Redaction does not mask (reflection.py): refused."""

    def __init__(self, names: tuple[str, ...], where: str):
        super().__init__(", ".join(names))
        self.names, self.where = names, where


async def _copy_message(
    source: h11.Connection,
    source_stream: Stream,
    target: h11.Connection,
    target_stream: Stream,
    count: Callable[[int, int], None],
    index: int,
    heads=False,
    redaction: Redaction | None = None,
    reflection: Reflection | None = None,
) -> bool:
    """Pass one message on from source to target: its response heads (with heads), its data, its end. False if the
    source ended first. redaction: what of a secret the request carried is masked on the way (Refused where the
    answer is encoded, which the proxy cannot read). reflection: Reflected where a piece of a secret is in the answer
    in another form; its head waits for the first HOLD_BYTES of its body, so that an answer of that size or less is
    checked whole before anything of it goes (a 502); a longer one is cut where the piece shows."""
    held: h11.Response | None = None  # a head that waits for the first HOLD_BYTES of its body to be checked
    waiting = b""

    async def release(last: bool = False) -> None:
        """Pass on the head that waits and the data after it, once the scan says they hold no piece of a secret
        (Reflected where they do). The scan is a few GB/s (reflection.py): on this thread, not worth a hand-off."""
        nonlocal held, waiting
        if (found := reflection.scan(waiting, last) if reflection else None) is not None:
            raise Reflected(found.names, "in its body")
        if held is not None:
            await target_stream.send(target.send(held))
            held = None
        if waiting:
            await target_stream.send(target.send(h11.Data(data=waiting)))
        waiting = b""

    while True:
        part = await _next_event(source, source_stream)
        if heads and isinstance(part, (h11.Response, h11.InformationalResponse)):
            forwarded = _forwarded_headers(part.headers)
            reason = part.reason
            if reflection:
                # Every Content-Encoding header and every coding in each: a client decodes them all, in turn.
                codings = [c.strip().lower() for k, v in forwarded if k.lower() == b"content-encoding" for c in v.split(b",")]
                if encoding := next((coding for coding in codings if coding not in (b"", b"identity")), None):
                    raise Refused(
                        502,
                        f"msb-kernels: an answer of a secret's host came {encoding.decode(errors='replace')}-encoded, "
                        "which the proxy cannot check for the secret",
                    )
                if redaction:
                    forwarded, reason = [(k, redaction.mask(v)) for k, v in forwarded], redaction.mask(reason)
                # Its status line's reason, and every header's name and value, of a final head and a 1xx alike: read
                # as the text they are on the wire, and the values alone as one text (a value split across headers),
                # which the body's scan goes on from (a value split between the last header and the body).
                head = b"\n".join([reason, *(name + b": " + value for name, value in forwarded)])
                values = b"\n".join(value for _, value in forwarded)
                if (found := reflection.check(head) or reflection.check(values)) is not None:
                    raise Reflected(found.names, "in its head")
                reflection.follows(values)
            head = type(part)(status_code=part.status_code, headers=forwarded, reason=reason)
            if reflection and isinstance(head, h11.Response):
                held = head
            else:
                await target_stream.send(target.send(head))
        elif isinstance(part, h11.Data):
            data = redaction.feed(part.data) if redaction else part.data
            if reflection:
                waiting += data
                if held is None or len(waiting) >= HOLD_BYTES:  # the first HOLD_BYTES go as one, checked whole
                    await release()
            elif data:
                await target_stream.send(target.send(h11.Data(data=data)))
            count(index, len(part.data))
        elif isinstance(part, h11.EndOfMessage):
            rest = redaction.flush() if redaction else b""
            if reflection:
                waiting += rest  # all of a short answer, its last bytes too, is checked before its head goes
                await release(last=True)
            elif rest:
                await target_stream.send(target.send(h11.Data(data=rest)))
            await target_stream.send(target.send(h11.EndOfMessage()))  # trailers are never passed on
            return True
        else:
            return False


def _route(egress: KernelEgress, request: h11.Request, fixed: tuple[str, int] | None) -> tuple[str, int, bytes]:
    """(host, port, origin-form target) of a request, checked against where the connection may go."""
    if fixed is not None:
        host_header = next((value for name, value in request.headers if name.lower() == b"host"), b"").decode("latin-1")
        named = host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header
        if named and normalize_name(named) != fixed[0]:
            raise egress.refuse(f"a request for {named}", f"on a connection to {fixed[0]} (the Host must name the host connected to)")
        target = request.target if request.target.startswith(b"/") else b"/" + request.target
        return fixed[0], fixed[1], target
    url = urlsplit(request.target.decode("latin-1"))
    if url.scheme != "http" or not url.hostname:
        raise Refused(400, "msb-kernels: the proxy takes http:// URLs and CONNECT host:port (HTTPS goes through CONNECT)")
    target = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return normalize_name(url.hostname), url.port or 80, target.encode("latin-1")


async def forward_proxy(egress: KernelEgress, service: EgressService, client: Stream) -> None:
    """The HTTP proxy on 127.0.0.1:3128 inside: plain http:// requests, and CONNECT tunnels."""
    server = h11.Connection(h11.SERVER)

    async def on_connect(request: h11.Request) -> None:
        authority = request.target.decode("latin-1")
        host, _, port_text = authority.rpartition(":")
        if not host or not port_text.isdigit():
            await _answer(client, server, 400, f"msb-kernels: CONNECT needs host:port, not {authority!r}")
            return
        host, port = host.strip("[]"), int(port_text)
        try:
            upstream = await open_upstream(egress, service, host, port)
        except Refused as refusal:
            await _answer(client, server, refusal.status, refusal.message)
            return
        await client.send(server.send(h11.Response(status_code=200, reason=b"Connection established", headers=[])))
        early, _ = server.trailing_data
        client.unread(early)
        literal = _address(host)
        await tunnel(egress, service, client, upstream, host if literal is None else None, port, host)

    await exchange(egress, client, Upstreams(lambda h, p: open_upstream(egress, service, h, p)), None, server, on_connect)


async def _peek(client: Stream, timeout: float | None) -> tuple[bytes, str, str | None]:
    """The client's first bytes, and what they are: (data, HELLO|not tls, server name)."""
    data = b""
    while True:
        state, name = read_client_hello(data)
        if state != NEED_MORE:
            return data, state, name
        try:
            more = await (asyncio.wait_for(client.recv(), timeout) if timeout and not data else client.recv())
        except asyncio.TimeoutError:
            return data, "silent", None
        if not more:
            return data, "closed", None
        data += more


async def tunnel(
    egress: KernelEgress, service: EgressService, client: Stream, upstream: Stream | None, name: str | None, port: int, host: str
) -> None:
    """Bytes both ways between client and host:port, once the TLS inside names what the tunnel was opened for.

    name: the host name the tunnel is for (None for an address). upstream: None to open it here."""
    data, state, sni = await _peek(client, PEEK_TIMEOUT)
    refusal = None
    if state == HELLO and sni is not None and sni != name and (name is not None or not egress.policy.allows_name(sni, port)):
        refusal = egress.refuse(f"TLS for {sni}", f"inside a tunnel to {host}:{port} (the SNI must name the host connected to)")
    if state == "closed" or refusal is not None:
        if upstream is not None:
            await upstream.close()
        return
    if name is not None and egress.secrets_of_host(name):
        # A secret's host: what it answers is read and checked, so the connection must be TLS the proxy ends, or HTTP.
        # Spliced unread, a host that keeps what it got would hand the value back (a client silent at first, or
        # plain HTTP inside a CONNECT).
        if state == HELLO:
            await intercept(egress, service, client, data, name, port, upstream)
        elif _METHOD.match(data):
            client.unread(data)
            first = upstream

            async def opener(host_: str, port_: int) -> Stream:
                nonlocal first
                stream, first = first or await open_upstream(egress, service, host_, port_), None
                return stream

            await exchange(egress, client, Upstreams(opener), (name, port))
        else:
            egress.refuse(
                f"{name}:{port}", "holds a secret: a connection to it must begin with TLS or an HTTP request, which the proxy reads"
            )
            if upstream is not None:
                await upstream.close()
        return
    upstream = upstream or await open_upstream(egress, service, host, port)
    await upstream.send(data)
    await splice(client, upstream, egress.count_bytes)


async def intercept(
    egress: KernelEgress, service: EgressService, client: Stream, hello: bytes, name: str, port: int, first: Stream | None
) -> None:
    """End the kernel's TLS with a certificate from the proxy's CA, to put secrets into its requests to name."""
    client.unread(hello)
    inner = TLSStream(client, service.ca.server_context(name), server_side=True)
    await inner.handshake()

    async def opener(host: str, port_: int) -> Stream:
        nonlocal first
        plain, first = first or await open_upstream(egress, service, host, port_), None
        secured = TLSStream(plain, service.upstream_tls, server_side=False, server_hostname=host)
        try:
            await secured.handshake()
        except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
            await plain.close()
            raise Refused(502, f"msb-kernels: TLS to {host}:{port_} failed: {exc}") from None
        return secured

    await exchange(egress, inner, Upstreams(opener), (name, port), tls=True)


async def transparent(egress: KernelEgress, service: EgressService, client: Stream, address: str, port: int) -> None:
    """A connection a tool made straight to an allowed name's loopback address (it ignores proxy variables)."""
    name = egress.by_address.get(address)
    if name is None:
        egress.refuse(f"{address}:{port}", "is no address this kernel's DNS gave out")
        return
    if not egress.policy.allows_name(name, port):
        egress.not_allowed(name, port)
        return
    data, state, _ = await _peek(client, PEEK_TIMEOUT)
    if state == "closed":
        return
    client.unread(data)
    if state == HELLO or not _METHOD.match(data):
        await tunnel(egress, service, client, None, name, port, name)
        return
    await exchange(egress, client, Upstreams(lambda h, p: open_upstream(egress, service, h, p)), (name, port))
