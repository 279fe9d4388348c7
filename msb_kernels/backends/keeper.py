"""A sandbox's keeper: the host process that holds one sandbox for whichever gateway owns it.

Without it a sandbox ends with the process that started it. A gateway (with
MSB_ADOPT_GRACE_SECONDS above 0) starts one keeper per sandbox, as ``python -S -I keeper.py``
(standard library only), in a session of its own so that a Ctrl-C or a kill of the
gateway does not reach it. The keeper holds what the sandbox cannot live without: the
namespace sandbox's lifeline, or, for gVisor, it is the parent of ``runsc run``, which dies with it.

The owner is whoever holds a connection to ``<state dir>/keeper.sock``. That socket is
0600 in the root-only state dir, which no sandbox sees. The owner is the gateway that
started the sandbox, or after that one's stop, crash or kill -9, the next gateway on the
same runtime dir, which adopts it. While no one owns the sandbox the keeper drains its
stderr (a full pipe would block the kernel), and once ``grace`` seconds pass without an
owner it kills the sandbox and runs the sweep that removes what it left. It exits when the sandbox ends.

Protocol. The plan is one JSON line on stdin; the keeper answers ``{"pid": <sandbox pid>, "keeper": <its pid>}``
(or ``{"error": ...}``) on stdout once its socket listens. A client sends one JSON line:
``{"op": "own"}`` is answered with ``{"pid": ..., "unowned_seconds": ...}`` and the
sandbox's stderr attached (SCM_RIGHTS), and the client owns the sandbox until it closes
the connection (or sends ``gone``: it removed the sandbox). A microVM has no host pid: its
keeper holds no process, only the grace period, and ends it with the sweep, which stops the VM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import NoReturn

REQUEST_TIMEOUT = 5.0
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Keeper:
    def __init__(self, plan: dict):
        self.plan = plan
        self.grace = float(plan["grace"])
        self.lifeline = plan.get("lifeline_fd")
        self.stderr = plan.get("stderr_fd")
        self.child = None
        if plan.get("argv"):
            import subprocess  # gVisor's keepers only: 1 MiB more for each

            self.child = subprocess.Popen(plan["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=plan["child_stderr_fd"], close_fds=True)
            os.close(plan["child_stderr_fd"])
            self.pid = self.child.pid
        else:
            self.pid = plan.get("sandbox_pid")  # None: a microVM, which no host process of ours stands for
        self.pidfd = os.pidfd_open(self.pid) if self.pid is not None else None
        self.path = plan["socket"]
        if os.path.lexists(self.path):
            os.unlink(self.path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self.listener.bind(self.path)
        finally:
            os.umask(old_umask)
        self.listener.listen(8)
        self.owner: socket.socket | None = None
        self.unowned_since = time.monotonic()
        self.killed = False

    # -- the sandbox ---------------------------------------------------------------

    def kill(self) -> None:
        self.killed = True
        if self.pidfd is None:
            self.ended()  # the sweep stops a microVM: it is no one's, and its record is gone
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    def ended(self) -> NoReturn:
        """The sandbox is gone: reap it if it is ours, and after a grace kill remove what it left (the sweep runs
        under this keeper's pid, so the adoption record must go first, or the sweep would take it for adoptable)."""
        if self.child is not None:
            self.child.wait()
        for leftover in (self.path, self.plan.get("record")):
            try:
                if leftover:
                    os.unlink(leftover)  # nothing is left to own or adopt, even while the sandbox is a zombie
            except OSError:
                pass
        if self.killed and self.owner is None and self.plan.get("sweep_argv"):
            os.execve(self.plan["sweep_argv"][0], self.plan["sweep_argv"], self.plan.get("sweep_env") or {})
        os._exit(0)

    # -- owners --------------------------------------------------------------------

    def owner_gone(self) -> bool:
        if self.owner is None:
            return True
        try:
            return self.owner.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def from_owner(self) -> None:
        """The owner hung up (its grace period starts), or says it removed the sandbox (for a microVM: this keeper is done)."""
        try:
            data = self.owner.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.drop_owner()
        elif b"gone" in data:
            self.owner.close()
            self.owner = None
            self.ended()

    def drop_owner(self) -> None:
        if self.owner is not None:
            self.owner.close()
            self.owner = None
            self.unowned_since = time.monotonic()

    def answer(self, client: socket.socket) -> None:
        """One request from a process of our own user; anyone else is hung up on."""
        _, uid, _ = PEERCRED.unpack(client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        if uid != os.geteuid():
            client.close()
            return
        client.settimeout(REQUEST_TIMEOUT)
        try:
            line = client.makefile("rb").readline(4096)
            request = json.loads(line or b"{}")
            if request.get("op") != "own":
                raise ValueError("unknown request")
            if not self.owner_gone():
                client.sendall(json.dumps({"error": "another process owns this sandbox"}).encode() + b"\n")
                client.close()
                return
            self.drop_owner()
            reply = json.dumps({"pid": self.pid, "unowned_seconds": round(time.monotonic() - self.unowned_since, 3)}).encode() + b"\n"
            socket.send_fds(client, [reply], [self.stderr] if self.stderr is not None else [])
        except (OSError, ValueError):
            client.close()
            return
        client.setblocking(False)
        self.owner = client

    # -- the loop --------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            poller = select.poll()
            if self.pidfd is not None:
                poller.register(self.pidfd, select.POLLIN)
            poller.register(self.listener, select.POLLIN)
            if self.owner is not None:
                poller.register(self.owner, select.POLLIN)
            elif self.stderr is not None:
                poller.register(self.stderr, select.POLLIN)
            timeout = None
            if self.owner is None and not self.killed:
                timeout = max(0, int((self.unowned_since + self.grace - time.monotonic()) * 1000))
            ready = dict(poller.poll(timeout))
            if self.pidfd is not None and self.pidfd in ready:
                self.ended()
            if self.owner is None and not self.killed and time.monotonic() >= self.unowned_since + self.grace:
                self.kill()
                continue
            if self.owner is not None and self.owner.fileno() in ready:
                self.from_owner()
            if self.owner is None and self.stderr is not None and self.stderr in ready:
                try:
                    if not os.read(self.stderr, 65536):
                        os.close(self.stderr)
                        self.stderr = None
                except BlockingIOError:
                    pass
            if self.listener.fileno() in ready:
                try:
                    client, _ = self.listener.accept()
                except OSError:
                    continue
                self.answer(client)


def start(plan: dict) -> Keeper:
    """The keeper of plan, its socket listening. Called by main(), and by forkserver.py's launcher, which becomes
    the keeper of the sandbox it built (so the keeper's pages stay shared with the fork server's)."""
    for name in ("lifeline_fd", "stderr_fd"):
        if plan.get(name) is not None:
            os.set_inheritable(plan[name], False)  # never into runsc or the sweep
    if plan.get("stderr_fd") is not None:
        os.set_blocking(plan["stderr_fd"], False)
    return Keeper(plan)


def main() -> None:
    if "--detach" in sys.argv and os.fork() > 0:
        os._exit(0)  # its parent waits for this exit; the keeper, its child, is nobody's child for long
    plan = json.loads(sys.stdin.readline())
    try:
        keeper = start(plan)
    except Exception as exc:
        sys.stdout.write(json.dumps({"error": f"the sandbox's keeper did not start: {exc}"}) + "\n")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write(json.dumps({"pid": keeper.pid, "keeper": os.getpid()}) + "\n")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)  # the gateway's pipes: it may be gone long before this keeper
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keeper.serve()


if __name__ == "__main__":
    main()
