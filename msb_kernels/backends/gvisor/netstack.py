"""gVisor's tcp transport: the kernel behind gVisor's own network stack, so that every socket it holds lives inside the
sandbox, which is what lets runsc checkpoint it (checkpoint_images.py). Under ipc its sockets are host Unix sockets
(``--host-uds=create``), which runsc refuses to save.

Each kernel gets two network namespaces, joined by a veth pair and by nothing else:

    msb-<id>-k   the sandbox's: gVisor (--network=sandbox) takes its end, 10.0.0.2/30, into its network stack
    msb-<id>-l   the link's: the other end, 10.0.0.1/30, where only the host relay below makes connections

Every pair uses the same addresses: each lives alone in its namespaces, and neither has a route anywhere else, so
sandboxed code reaches no host, no other kernel and no network through it.

Inside, the kernel binds its channels as Unix sockets in a tmpfs of gVisor's (GUEST_SOCKETS), and a relay started by
the sandbox's init listens on the kernel's five ports at 10.0.0.2 and joins each connection to the kernel's socket.
On the host, this process binds the same five ports on 127.0.0.1 (core.ports.HostListeners), and the host relay,
running in the link's namespace, joins each connection to 10.0.0.2 at the same port. Why not the kernel's own TCP
sockets: ipykernel connects to its own shell socket and binds its IOPub pipe on TCP, and this runsc cannot save a TCP
endpoint that is connected or that epoll watches ("endpoint still has waiters upon save").

Stopping the host relay closes every connection into the sandbox; the gateway's ZMQ sockets reconnect by themselves
once it runs again, which is how a hibernated kernel's clients never reconnect by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Collection

from msb_kernels.egress.route import relay_source
from msb_kernels.errors import SandboxError

NETNS_DIR = "/run/netns"  # where `ip netns` keeps them: an operator sees them with `ip netns list`
GUEST_ADDRESS = "10.0.0.2"
LINK_ADDRESS = "10.0.0.1"
PREFIX = 30
GUEST_DEVICE, LINK_DEVICE = "msb0", "msb1"
GUEST_SOCKETS = "/run/sockets"  # a tmpfs inside gVisor: the kernel's channels, as <GUEST_SOCKETS>/kernel-<port>
INSTALL_HINT = "install iproute2 (apt-get install iproute2) and util-linux (unshare, nsenter)"

# Run runsc in the sandbox's namespace, where its control socket (abstract) and its network are. Debian's runsc
# (release 20221219) takes any namespace for the host's own when /proc/sys/net/core/rmem_default exists, which
# Linux shows in every network namespace, and refuses --network=sandbox there: a private mount namespace with an
# empty /proc/sys/net answers that check, and nothing else of runsc's reads it.
ENTER = 'mount -t tmpfs -o size=4k,mode=0555 msb-hide /proc/sys/net && ns="$1" && shift && exec nsenter --net="$ns" -- "$@"'


def names(sandbox_id: str) -> tuple[str, str]:
    """The sandbox's and the link's network namespaces."""
    return f"msb-{sandbox_id}-k", f"msb-{sandbox_id}-l"


def netns_path(name: str) -> str:
    return f"{NETNS_DIR}/{name}"


def in_sandbox_netns(sandbox_id: str, argv: list[str], *, receives_mounts: bool = False) -> list[str]:
    """argv (a runsc command) run in the sandbox's network namespace, past runsc's root-namespace check, in a mount
    namespace of its own where what ENTER mounts stays. receives_mounts: the host's slave, so that what the host mounts
    in a pooled sandbox's slots at hand-out reaches its gofer (core/handout.py); only the `runsc run` of such a sandbox
    asks. Else private: with every runsc command the host's slave, a checkpoint that failed (a full disk) left its
    kernel running but deaf (IOPub not heard within 10 s of its reopening); with only `run` the slave, it did not."""
    propagation = "slave" if receives_mounts else "private"
    return ["unshare", "--mount", "--propagation", propagation, "--", "sh", "-c", ENTER, "sh", netns_path(names(sandbox_id)[0]), *argv]


async def _ip(*args: str) -> str | None:
    """One `ip` command; what it said on failure, else None."""
    try:
        process = await asyncio.create_subprocess_exec(
            "ip", *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        return f"cannot run ip: {exc}"
    _, err = await process.communicate()
    return err.decode(errors="replace").strip() or f"exit status {process.returncode}" if process.returncode else None


async def create(sandbox_id: str) -> None:
    """Both namespaces and their veth pair, addressed and up; SandboxError (and nothing left) when it fails."""
    guest, link = names(sandbox_id)
    steps = [
        ("netns", "add", guest),
        ("netns", "add", link),
        ("link", "add", GUEST_DEVICE, "netns", guest, "type", "veth", "peer", "name", LINK_DEVICE, "netns", link),
        ("-n", guest, "addr", "add", f"{GUEST_ADDRESS}/{PREFIX}", "dev", GUEST_DEVICE),
        ("-n", guest, "link", "set", GUEST_DEVICE, "up"),
        ("-n", guest, "link", "set", "lo", "up"),
        ("-n", link, "addr", "add", f"{LINK_ADDRESS}/{PREFIX}", "dev", LINK_DEVICE),
        ("-n", link, "link", "set", LINK_DEVICE, "up"),
    ]
    for step in steps:
        said = await _ip(*step)
        if said is not None:
            await destroy(sandbox_id)
            raise SandboxError(f"cannot make the gVisor sandbox's network (ip {' '.join(step)}): {said}", [INSTALL_HINT])


async def readdress(sandbox_id: str) -> None:
    """Give the sandbox's device its address back before a restore: gVisor moved it into its own stack at the start."""
    said = await _ip("-n", names(sandbox_id)[0], "addr", "replace", f"{GUEST_ADDRESS}/{PREFIX}", "dev", GUEST_DEVICE)
    if said is not None:
        raise SandboxError(f"cannot readdress the hibernated sandbox's network: {said}")


async def destroy(sandbox_id: str) -> None:
    """Remove both namespaces (and the veth pair with them); harmless when they are gone."""
    for name in names(sandbox_id):
        if os.path.exists(netns_path(name)):
            await _ip("netns", "delete", name)


def exists(sandbox_id: str) -> bool:
    return os.path.exists(netns_path(names(sandbox_id)[0]))


def leftover_ids() -> list[str]:
    """Sandbox ids whose namespaces are on this host (a sweep removes those of sandboxes that are gone)."""
    try:
        entries = os.listdir(NETNS_DIR)
    except OSError:
        return []
    return sorted({entry[4:-2] for entry in entries if entry.startswith("msb-") and entry[-2:] in ("-k", "-l")})


def guest_relay(ports: list[int], separator: str, user: int) -> dict:
    """The relay inside the sandbox (started by its init, as user): the kernel's ports at 10.0.0.2, each joined to the
    kernel's socket (GUEST_SOCKETS/kernel<separator><port>). Its connections end in a reset, which leaves nothing that
    would stop a checkpoint (relay_program.relay)."""
    return {
        "bind": [["kernel", GUEST_ADDRESS, port, "tcp"] for port in ports],
        "unix": f"{GUEST_SOCKETS}/kernel{separator}",
        "user": user,
        "reset": True,
    }


class HostRelay:
    """The host's side: a relay in the link's namespace, holding (copies of) the kernel's host listeners.

    A child of this process, killed with it (its parent-death signal): a gateway that adopts the kernel starts its own.
    One process per start: a wake starts some ports first (the IOPub port, so its subscribers are back before any
    request is), then the rest.
    """

    def __init__(self, sandbox_id: str, listeners: list[socket.socket]):
        self.sandbox_id = sandbox_id
        self.listeners = listeners
        self.processes: dict[int, asyncio.subprocess.Process] = {}  # listener port -> the relay process serving it

    async def start(self, ports: Collection[int] | None = None) -> None:
        """Relay these host ports (all, by default) that are not relayed yet."""
        chosen = [
            listener
            for listener in self.listeners
            if (port := listener.getsockname()[1]) not in self.processes and (ports is None or port in ports)
        ]
        if not chosen:
            return
        fds = [listener.fileno() for listener in chosen]
        spec = json.dumps({"fds": fds, "dial": GUEST_ADDRESS, "user": None})
        try:
            process = await asyncio.create_subprocess_exec(
                "setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                "nsenter",
                f"--net={netns_path(names(self.sandbox_id)[1])}",
                "--",
                sys.executable,
                "-I",
                "-S",
                "-c",
                relay_source(),
                spec,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                pass_fds=fds,
                start_new_session=True,  # a Ctrl-C of the gateway is the gateway's to handle
            )
        except OSError as exc:
            raise SandboxError(f"cannot start the relay to the gVisor sandbox: {exc}", [INSTALL_HINT]) from exc
        self.processes.update((listener.getsockname()[1], process) for listener in chosen)

    async def stop(self) -> None:
        """Stop it: every connection into the sandbox closes; the listeners stay bound by this process."""
        processes, self.processes = set(self.processes.values()), {}
        for process in processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGKILL)
                await process.wait()
