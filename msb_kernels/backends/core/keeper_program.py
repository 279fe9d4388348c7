"""The keeper: the host process that holds a gateway's sandboxes for whichever gateway owns each one.

Without it a sandbox ends with the process that started it. A gateway (with MSB_ADOPT_GRACE_SECONDS above 0)
hands every sandbox it starts to the keeper of its runtime dir: one process, ``python -S -I keeper_program.py --serve
<root>/keepers.sock`` (standard library only), in a session of its own so that a Ctrl-C or a kill of the gateway
does not reach it. For each sandbox it holds what the sandbox cannot live without: the namespace sandbox's
lifeline, or, for gVisor, it is the parent of ``runsc run``, which dies with it. One process for all of them, so
a sandbox costs the keeper a few descriptors and not an interpreter of its own; and so a kill of the keeper ends
every sandbox it holds, as a kill of a gateway without adoption would.

The keeper serves two kinds of socket, both 0600 in state dirs private to the gateway's user, which no sandbox sees:

- ``<root>/keepers.sock``: a gateway hands a sandbox over. A request is a 4-byte length and a JSON plan
  (keeping.keeper_plan), its descriptors (SCM_RIGHTS) on the first bytes: the lifeline, the sandbox's stderr,
  and runsc's stderr, those the plan names, in that order. The answer is one JSON line, ``{"pid": <sandbox pid>,
  "keeper": <its pid>}`` or ``{"error": ...}``. The gateway keeps that connection open while it runs: the keeper
  exits once no gateway is connected and it holds no sandbox.
- ``<state dir>/keeper.sock``, one per sandbox: its owner is whoever holds a connection there, the gateway that
  started it, or after that one's stop, crash or kill -9, the next gateway on the same runtime dir, which adopts it.
  ``{"op": "own"}`` is answered with ``{"pid": ..., "unowned_seconds": ...}`` and the sandbox's stderr attached,
  and the client owns the sandbox until it closes the connection (or sends ``gone``: it removed the sandbox).

While no one owns a sandbox the keeper drains its stderr (a full pipe would block the kernel), and once ``grace``
seconds pass without an owner it kills the sandbox, removes its adoption record and runs ``msb-kernels sweep``,
which removes what it left: its disk image and mount, io dir and state (issue 58). A sandbox of an owner that keeps
nothing for adoption (nbclient, papermill, a script's KernelManager) is held too, with a grace of 0: when that owner
dies, even by kill -9, or exits without removing it, the keeper ends the sandbox at once and sweeps. An owner that
removed its sandbox let go of it after it ended: nothing was killed, and nothing is swept. A microVM has no host pid: its keeper holds only the grace period, and ends it with
the sweep, which stops the VM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

REQUEST_TIMEOUT = 5.0
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
LENGTH = struct.Struct("!I")
MOST_PLAN_BYTES = 4 << 20
MOST_FDS = 32
PLAN_FDS = ("lifeline_fd", "stderr_fd", "child_stderr_fd")  # the order a plan's descriptors travel in
FIRST_OWNER_WAIT = 2 * REQUEST_TIMEOUT  # a sandbox handed over with a grace of 0 waits this long for its first owner
SWEEP_LOG = "keeper.log"  # in the sandbox's state dir: what its closing sweep said, for an operator looking into it


def peer_uid(connection: socket.socket) -> int:
    return PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))[1]


def listen_private(path: str, backlog: int) -> socket.socket:
    """A Unix socket listening at path, 0600 (only this user connects), in place of one a killed process left."""
    if os.path.lexists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(old_umask)
    listener.listen(backlog)
    return listener


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length, then a plan as JSON; its descriptors ride on the first bytes. The fork server
    reads its launch plans this way too."""
    data, fds, _, _ = socket.recv_fds(connection, 65536, MOST_FDS)
    try:
        if not data:
            raise EOFError("the peer hung up")
        if len(data) < LENGTH.size:
            raise ValueError("the request ended before its length")
        (length,) = LENGTH.unpack_from(data)
        if length > MOST_PLAN_BYTES:
            raise ValueError(f"a plan of {length} bytes is over the limit of {MOST_PLAN_BYTES}")
        body = bytearray(data[LENGTH.size :])
        while len(body) < length:
            more = connection.recv(length - len(body))
            if not more:
                raise ValueError("the request ended before its plan")
            body += more
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Kept:
    """One sandbox the keeper holds: its owner, its grace period, and its end."""

    def __init__(self, plan: dict):
        self.plan = plan
        self.grace = float(plan["grace"])
        self.lifeline = plan.get("lifeline_fd")
        self.stderr = plan.get("stderr_fd")
        if self.stderr is not None:
            os.set_blocking(self.stderr, False)
        self.child = None
        self.pidfd = None
        self.listener = None
        try:
            if plan.get("argv"):
                # close_fds: runsc inherits nothing of the other sandboxes this process holds
                self.child = subprocess.Popen(
                    plan["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=plan["child_stderr_fd"], close_fds=True
                )
                self.pid = self.child.pid
            else:
                self.pid = plan.get("sandbox_pid")  # None: a microVM, which no host process of ours stands for
            self.pidfd = os.pidfd_open(self.pid) if self.pid is not None else None
            self.path = plan["socket"]
            self.listener = listen_private(self.path, 8)
        except BaseException:  # what the plan brought stays the caller's to close (take)
            if self.child is not None:
                self.child.kill()
                self.child.wait()
            if self.pidfd is not None:
                os.close(self.pidfd)
            raise
        if plan.get("child_stderr_fd") is not None:
            os.close(plan["child_stderr_fd"])  # runsc holds its own copy
        self.owner: socket.socket | None = None
        self.owned = False  # a grace of 0 counts from the first owner's going, not from the hand-over
        self.unowned_since = time.monotonic()
        self.first_owner_by = self.unowned_since + FIRST_OWNER_WAIT
        self.killed = False

    def close(self) -> None:
        for fd in (self.pidfd, self.lifeline, self.stderr):
            if fd is not None:
                os.close(fd)
        self.pidfd = self.lifeline = self.stderr = None
        for held in (self.listener, self.owner):
            if held is not None:
                held.close()

    # -- the sandbox ---------------------------------------------------------------

    def kill(self) -> bool:
        """Kill the sandbox at the end of its grace period; True when it is over at once (a microVM)."""
        self.killed = True
        if self.pidfd is None:
            return True  # the sweep stops a microVM: it is no one's, and its record is gone
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        return False

    def end(self) -> subprocess.Popen | None:
        """The sandbox is gone: reap it if it is ours, and after a grace kill remove what it left, with the sweep
        (returned, for the keeper to reap). The adoption record goes first, or the sweep, which sees this keeper
        alive, would take the sandbox for adoptable."""
        if self.child is not None:
            self.child.wait()
        for leftover in (self.path, self.plan.get("record")):
            try:
                if leftover:
                    os.unlink(leftover)  # nothing is left to own or adopt, even while the sandbox is a zombie
            except OSError:
                pass
        sweep = None
        if self.killed and self.owner is None and self.plan.get("sweep_argv"):
            log = os.open(os.path.join(os.path.dirname(self.path), SWEEP_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                sweep = subprocess.Popen(
                    self.plan["sweep_argv"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=self.plan.get("sweep_env") or {},
                    close_fds=True,
                )
            except OSError as exc:
                print(f"the sweep after {self.path} did not start: {exc}", file=sys.stderr, flush=True)
            finally:
                os.close(log)
        self.close()
        return sweep

    # -- its owner -----------------------------------------------------------------

    def deadline(self) -> float:
        """When the grace period of an unowned sandbox ends: a grace of 0 still waits for the first owner."""
        ends = self.unowned_since + self.grace
        return ends if self.owned else max(ends, self.first_owner_by)

    def owner_gone(self) -> bool:
        if self.owner is None:
            return True
        try:
            return self.owner.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def from_owner(self) -> bool:
        """The owner hung up (its grace period starts), or says it removed the sandbox; True when that ends it."""
        try:
            data = self.owner.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.drop_owner()
            return False
        if b"gone" in data:
            self.owner.close()
            self.owner = None
            return True
        return False

    def drop_owner(self) -> None:
        if self.owner is not None:
            self.owner.close()
            self.owner = None
            self.unowned_since = time.monotonic()

    def answer(self, client: socket.socket) -> None:
        """One request from a process of our own user; anyone else is hung up on."""
        if peer_uid(client) != os.geteuid():
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
        self.owned = True

    # -- one turn of the keeper's loop ----------------------------------------------

    def watch(self, poller: select.poll) -> float | None:
        """Register what this sandbox waits on; the seconds until its grace period ends (None: no deadline)."""
        if self.pidfd is not None:
            poller.register(self.pidfd, select.POLLIN)
        poller.register(self.listener, select.POLLIN)
        if self.owner is not None:
            poller.register(self.owner, select.POLLIN)
        elif self.stderr is not None:
            poller.register(self.stderr, select.POLLIN)
        if self.owner is None and not self.killed:
            return max(0.0, self.deadline() - time.monotonic())
        return None

    def step(self, ready: dict[int, int]) -> bool:
        """Act on what is ready; True when the sandbox is over (then end() follows)."""
        if self.pidfd is not None and self.pidfd in ready:
            return True
        if self.owner is None and not self.killed and time.monotonic() >= self.deadline():
            return self.kill()
        if self.owner is not None and self.owner.fileno() in ready and self.from_owner():
            return True
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
                return False
            self.answer(client)
        return False


def take(plan: dict, fds: list[int]) -> Kept:
    """The sandbox a gateway handed over, its descriptors in PLAN_FDS order; if it cannot be held, they are closed."""
    try:
        names = [name for name in PLAN_FDS if plan.get(name) is not None]
        if len(names) != len(fds):
            raise ValueError(f"the plan names {len(names)} descriptors and {len(fds)} came with it")
        plan.update(zip(names, fds, strict=True))
        return Kept(plan)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Keeper:
    """Every sandbox of one runtime dir's gateways, and the socket they are handed over on."""

    def __init__(self, path: str):
        self.path = path
        self.listener = listen_private(path, 16)
        self.identity = os.stat(path).st_ino
        self.gateways: list[socket.socket] = []
        self.kept: list[Kept] = []
        self.sweeps: list[subprocess.Popen] = []
        self.served = False

    def hand_over(self, gateway: socket.socket) -> bool:
        """One sandbox from a connected gateway; False when the gateway hung up."""
        try:
            plan, fds = receive_request(gateway)
        except EOFError:
            return False
        except (OSError, ValueError) as exc:
            print(f"a gateway's request failed: {exc}", file=sys.stderr, flush=True)
            return False
        try:
            kept = take(plan, fds)
            answer = {"pid": kept.pid, "keeper": os.getpid()}
            self.kept.append(kept)
        except Exception as exc:
            answer = {"error": f"the keeper cannot hold the sandbox: {exc}"}
        try:
            gateway.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            return False
        return True

    def serve(self) -> None:
        """Until it holds nothing and no gateway is connected (the one that started it connects at once)."""
        first_gateway_by = time.monotonic() + 2 * REQUEST_TIMEOUT
        while self.kept or self.gateways or self.sweeps or (not self.served and time.monotonic() < first_gateway_by):
            poller = select.poll()
            poller.register(self.listener, select.POLLIN)
            for gateway in self.gateways:
                poller.register(gateway, select.POLLIN)
            deadlines = [deadline for kept in self.kept if (deadline := kept.watch(poller)) is not None]
            if self.sweeps:
                deadlines.append(0.5)  # to reap them; they are few and short
            if not self.served:
                deadlines.append(max(0.0, first_gateway_by - time.monotonic()))
            timeout = None if not deadlines else int(min(deadlines) * 1000)
            ready = dict(poller.poll(timeout))
            for kept in list(self.kept):
                if self.over(kept, ready):
                    self.kept.remove(kept)
                    try:
                        if (sweep := kept.end()) is not None:
                            self.sweeps.append(sweep)
                    except Exception:
                        traceback.print_exc()
                        kept.close()
            self.sweeps = [sweep for sweep in self.sweeps if sweep.poll() is None]
            for gateway in list(self.gateways):
                if gateway.fileno() in ready and not self.hand_over(gateway):
                    self.gateways.remove(gateway)
                    gateway.close()
            if self.listener.fileno() in ready:
                try:
                    gateway, _ = self.listener.accept()
                except OSError:
                    continue
                if peer_uid(gateway) != os.geteuid():
                    gateway.close()
                    continue
                gateway.settimeout(REQUEST_TIMEOUT)
                self.gateways.append(gateway)
                self.served = True
        self.close()

    @staticmethod
    def over(kept: Kept, ready: dict[int, int]) -> bool:
        """kept.step, except that a fault in it ends that one sandbox (its lifeline closes), not all of them."""
        try:
            return kept.step(ready)
        except Exception:
            traceback.print_exc()
            try:
                kept.kill()
            except Exception:
                pass
            return True

    def close(self) -> None:
        """Nothing held and no gateway connected: the socket goes, unless a newer keeper took the path over."""
        try:
            if os.stat(self.path).st_ino == self.identity:
                os.unlink(self.path)
        except OSError:
            pass
        self.listener.close()


def main() -> None:
    if "--detach" in sys.argv and os.fork() > 0:
        os._exit(0)  # its parent waits for this exit; the keeper, its child, is nobody's child for long
    try:
        keeper = Keeper(sys.argv[sys.argv.index("--serve") + 1])
    except Exception as exc:
        sys.stdout.write(json.dumps({"error": f"the keeper did not start: {exc}"}) + "\n")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write(json.dumps({"keeper": os.getpid()}) + "\n")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)  # the gateway's pipes: it may be gone long before this keeper
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keeper.serve()
    os._exit(0)


if __name__ == "__main__":
    main()
