"""The byte relay: the egress route's, and the tcp transports' (the namespace backend's, and gVisor's on both sides of
its network stack).

Egress (run as ``python -I -S -c <this file> <spec>``, or called in a fork by the namespace init): the sandbox has
loopback and nothing else. The listeners (route.listeners: the HTTP proxy's port, DNS on 53, the allowed names'
ports) are bound while low ports may still be bound, by the namespace init or by this program before it becomes
the sandbox's user (gVisor). Each connection, and each DNS datagram, becomes a connection to the kernel's Unix
socket in the io dir, where the host's proxy decides; the first line says what the client dialled. Nothing here
decides anything: a kernel that talks to the socket itself, or kills this relay, gets no more than the proxy allows.

Standard library only: no import path of ours exists in a sandbox. The namespace init reads this file by path.

argv[1]: JSON {"bind": [[kind, address, port, "tcp"|"udp"], ...] or "fds": [fd, ...] (TCP listeners inherited, bound by
the host), "user": uid or null, and where each connection goes:
- "socket": the proxy's Unix socket path or "tcp:HOST:PORT" (a cluster's kernel reaches its gateway's proxy over the
  kernels' network, which tells kernels apart by address), the header sent first;
- "unix": a path prefix: a connection to port P joins the Unix socket PREFIX + P (gVisor's kernel, inside);
- "dial": an address: a connection to port P joins ADDRESS:P (the sandbox's loopback, or gVisor's network stack).
"""

import json
import os
import select
import socket
import sys
import time

CHUNK = 256 * 1024
BUFFER_LIMIT = 4 * 1024 * 1024  # per direction: past it, the relay stops reading the sender
DNS_TIMEOUT = 5.0
LINGER_RESET = (1).to_bytes(4, sys.byteorder) + (0).to_bytes(4, sys.byteorder)  # struct linger {on, 0 s}: close resets
PR_CAPBSET_DROP = 24


def bind_listeners(entries):
    """Bind [kind, address, port, proto] each; [fd, kind, proto] each, the sockets detached."""
    bound = []
    for kind, address, port, proto in entries:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM)
        if proto == "tcp":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        if proto == "tcp":
            sock.listen(128)
        bound.append([sock.detach(), kind, proto])
    return bound


def become_user(uid):
    """Give up root inside the sandbox for good: every capability, the bounding set's too, then the user's ids."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def proxy_connector(path):
    """connect(kind, local address) for the egress route: a connection to the proxy's socket (or "tcp:HOST:PORT",
    its host looked up at each connection: a gateway that restarts elsewhere keeps its name), its header sent."""

    def connect(kind, local):
        if path.startswith("tcp:"):
            host, _, port = path[4:].rpartition(":")
            conn, target = socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host, int(port))
        else:
            conn, target = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path
        conn.settimeout(2)
        try:
            conn.connect(target)
            conn.sendall(f"MSB-EGRESS 1 {kind} {local[0]} {local[1]}\n".encode())
        except OSError:
            conn.close()
            return None
        return conn

    return connect


def port_connector(family, target):
    """connect(kind, local) for the tcp transports: the same port at target(port), nothing sent first. None when nothing
    listens there (yet): the client sees its connection close, and ZMQ reconnects."""

    def connect(kind, local):
        conn = socket.socket(family, socket.SOCK_STREAM)
        try:
            conn.connect(target(local[1]))
        except OSError:
            conn.close()
            return None
        return conn

    return connect


def connector(spec):
    """connect(kind, local) for a spec's "socket", "unix" or "dial"."""
    if "unix" in spec:
        return port_connector(socket.AF_UNIX, lambda port: spec["unix"] + str(port))
    if "dial" in spec:
        return port_connector(socket.AF_INET, lambda port: (spec["dial"], port))
    return proxy_connector(spec["socket"])


def relay(bound, connect, reset=False):
    """Serve bound ([fd, kind, proto] each) for ever: each TCP connection joined to connect(kind, the address it was
    made to); each UDP datagram sent, framed as DNS over TCP, on a connection of its own, and its reply sent back.

    reset: end each accepted connection with a reset, not a FIN. gVisor's relay wants this: its runsc (2022) cannot
    checkpoint a TCP endpoint in TIME_WAIT or any other state but closed, and an orderly close leaves one for a minute."""
    poller = select.poll()
    listeners = {}
    for fd, kind, proto in bound:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM, fileno=fd)
        sock.setblocking(False)
        listeners[fd] = (sock, kind, proto)
        poller.register(fd, select.POLLIN)
    accepted = set()  # the fds of the connections accepted on a listener, whose close resets under reset
    socks, peer, pending = {}, {}, {}  # streams: fd -> socket, the socket its bytes go to, bytes waiting for it
    queries = {}  # a DNS datagram's connection: fd -> [udp socket, client address, reply bytes, deadline, connection]

    def watch(fd):
        other = peer[fd].fileno()
        events = (select.POLLIN if len(pending[other]) < BUFFER_LIMIT else 0) | (select.POLLOUT if pending[fd] else 0)
        poller.modify(fd, events)

    def close(fd):
        for one in (fd, peer[fd].fileno()):
            poller.unregister(one)
            if reset and one in accepted:
                socks[one].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
                accepted.discard(one)
            socks.pop(one).close()
            peer.pop(one)
            pending.pop(one)

    def flush(fd):
        try:
            sent = socks[fd].send(pending[fd])
        except BlockingIOError:
            return True
        except OSError:
            return False
        del pending[fd][:sent]
        return True

    def end_query(fd):
        poller.unregister(fd)
        queries.pop(fd)[4].close()

    def datagram(sock, kind):
        try:
            message, client = sock.recvfrom(65535)
        except OSError:
            return
        conn = connect(kind, sock.getsockname())
        if conn is None:
            return
        try:
            conn.sendall(len(message).to_bytes(2, "big") + message)
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        queries[conn.fileno()] = [sock, client, b"", time.monotonic() + DNS_TIMEOUT, conn]
        poller.register(conn.fileno(), select.POLLIN)

    def answer(fd):
        query = queries[fd]
        try:
            data = query[4].recv(65537)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        query[2] += data
        size = int.from_bytes(query[2][:2], "big") if len(query[2]) >= 2 else None
        whole = size is not None and len(query[2]) >= 2 + size
        if whole:
            try:
                query[0].sendto(query[2][2 : 2 + size], query[1])
            except OSError:
                pass
        if whole or not data:
            end_query(fd)

    def accept(sock, kind):
        try:
            outer, _ = sock.accept()
        except OSError:
            return
        inner = connect(kind, outer.getsockname())
        if inner is None:  # nothing listens there (yet): the client sees the connection close, as if refused
            if reset:
                outer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
            outer.close()
            return
        accepted.add(outer.fileno())
        for one, other in ((outer, inner), (inner, outer)):
            one.setblocking(False)
            if one.family == socket.AF_INET:
                one.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[one.fileno()], peer[one.fileno()], pending[one.fileno()] = one, other, bytearray()
            poller.register(one.fileno(), select.POLLIN)

    while True:
        for fd, events in poller.poll(1000 if queries else None):
            if fd in listeners:
                sock, kind, proto = listeners[fd]
                (datagram if proto == "udp" else accept)(sock, kind)
                continue
            if fd in queries:
                answer(fd)
                continue
            if fd not in socks:
                continue  # closed with its peer earlier in this round
            other = peer[fd].fileno()
            if events & select.POLLOUT and not flush(fd):
                close(fd)
                continue
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = socks[fd].recv(CHUNK)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    try:  # what the closing side sent before it closed still goes through
                        socks[other].settimeout(1)
                        socks[other].sendall(pending[other])
                    except OSError:
                        pass
                    close(fd)
                    continue
                if data:
                    pending[other] += data
                    if not flush(other):
                        close(fd)
                        continue
            watch(fd)
            watch(other)
        now = time.monotonic()
        for fd in [fd for fd, query in queries.items() if query[3] < now]:
            end_query(fd)


def main(spec):
    bound = [[fd, "kernel", "tcp"] for fd in spec["fds"]] if "fds" in spec else bind_listeners(spec["bind"])
    if spec.get("user") is not None:  # started as the sandbox's root (gVisor), for port 53
        become_user(spec["user"])
    relay(bound, connector(spec), reset=spec.get("reset", False))


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except KeyboardInterrupt:
        os._exit(0)
