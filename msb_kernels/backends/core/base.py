"""The sandbox backend interface.

A backend turns a SandboxSpec (a kernel command, a flavor, a directory for the
kernel's connection file and sockets) into a running, sized, isolated Sandbox.
The provisioner (msb_kernels.provisioning.provisioner) only talks to these two abstract classes,
so a new backend is one module and an entry point in the ``msb_kernels.backends`` group, as the
built-in ones are (pyproject.toml). Each docstring names its caller.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from msb_kernels.backends.core import leftovers
from msb_kernels.egress.route import EgressRoute
from msb_kernels.errors import ConfigError, HibernationRefused, SandboxError
from msb_kernels.kernelspecs.flavors import Flavor

if TYPE_CHECKING:
    from msb_kernels.settings.config import MsbSettings

SANDBOX_LABEL = "msb-kernels"  # every sandbox we create carries this label, for orphan sweeps
log = logging.getLogger("msb_kernels")


@dataclass(frozen=True)
class SharedVolume:
    """The shared volume a kernel mounts at guest_path: host_path, the host directory where the backend shows one; on a
    cluster (whose kernels run on other nodes), the named volume docker_name, a person's own or the whole one's."""

    host_path: Path | None
    guest_path: str
    docker_name: str | None = None


@dataclass(frozen=True)
class HostDirectory:
    """A host directory shown in the sandbox at its own path (JupyterLab's root: MSB_LAB_ROOT_PATH)."""

    path: str
    writable: bool = False


@dataclass(frozen=True)
class Reconnect:
    """How a kernel's ports reopen after they were all closed (a wake, a refused hibernation): ``first`` (IOPub and
    control) before the others, and ``settle`` awaited in between. Clients reconnect every channel at once, and what
    they queued meanwhile goes out as soon as the kernel is reachable: the gateway's settle waits until a SUB of its own
    hears the kernel, so the SUBs that reconnected before it are subscribed again before any queued request runs,
    and none of its output is lost."""

    first: tuple[int, ...]
    settle: Callable[[], Awaitable[None]]


@dataclass
class SandboxSpec:
    """What to run, and how big and how open its sandbox is."""

    sandbox_id: str  # the kernel id: one sandbox per kernel
    flavor: Flavor
    template: str  # "python" or "node"
    argv: list[str]  # the kernel command as the guest sees it
    env: dict[str, str]  # the guest's whole environment; nothing is inherited from the host
    io_dir: Path  # the sandbox's own dir on the host (its sockets); what the host writes for it is in iodir.host_dir
    readonly_paths: list[str] = field(default_factory=list)  # host paths the kernel needs, shown read-only at the same path
    shared_volume: SharedVolume | None = None
    host_directories: list[HostDirectory] = field(default_factory=list)  # under the interpreter's read-only binds
    working_dir: str | None = None  # where the kernel starts (inside a host directory); None = the sandbox's home
    max_processes: int = 256
    allow_network: bool = False  # outbound to the public internet (MSB_ALLOW_NETWORK); never the host or its LAN
    egress: EgressRoute | None = None  # MSB_NETWORK_ALLOW: out only through the egress proxy (allow_network is then False)
    owner_pid: int | None = None  # sandboxes die with this host process unless it is None or adopt_grace is set
    adopt_grace: float = 0  # > 0: a keeper holds the sandbox, which outlives its owner this long for another to adopt it
    environment: str = "default"  # the Python environment argv[0] belongs to; recorded so `env remove` sees who uses it
    # (guest source, guest destination): what the host wrote read-only that the kernel may rewrite (ipykernel rewrites
    # its connection file when curve keys are in it), copied into its own io dir as its user, before it starts.
    copies: list[tuple[str, str]] = field(default_factory=list)
    fork: bool = False  # the kernel may be forked from a server that imported it already (MSB_FORK_KERNELS), where the backend can
    # Started for the warm pool on a backend that hands out (SandboxBackend.hands_out): no volume or host directory of
    # anyone's, and empty slots that Sandbox.hand_out fills with the directories of whoever takes it (core/handout.py).
    handout: bool = False
    # With handout: guest paths shown as empty directories (a tmpfs of root's) from the start, where a hand-out mounts
    # the taker's volume, or makes and mounts their Lab root: the guest's root filesystem is read-only.
    placeholders: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Whether the keeper holds the sandbox: for adoption (adopt_grace), or to end it and sweep what it left
        (its disk, io dir and state) the moment its owner dies, however (issue 58). None owns one with no owner_pid."""
        return self.adopt_grace > 0 or self.owner_pid is not None


@dataclass
class SandboxRecord:
    """A sandbox found on the host, whether or not a live process owns it."""

    sandbox_id: str
    backend: str
    owner_alive: bool
    running: bool
    created: float
    details: dict = field(default_factory=dict)
    keeper_alive: bool = False  # a keeper holds it (its owner may come and go)
    adoptable: bool = False  # its owner is gone, and its keeper holds it running for the next gateway to adopt


@dataclass
class Availability:
    ok: bool
    reason: str
    warnings: list[str] = field(default_factory=list)


class Sandbox(abc.ABC):
    """A running sandbox holding one kernel."""

    # The host uid the kernel's files in its io dir are made with (its sockets: iodir.pin_channels checks them); None
    # where the host cannot tell. Set by each backend that shows the kernel an io dir it binds sockets in.
    channel_uid: int | None = None

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.created = time.time()

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id

    # tcp: where this kernel's ports are reached when that is not the backend's host_ip (a cluster task's address).
    # Read by the provisioner once the sandbox runs: the connection file then names it.
    address: str | None = None

    @property
    def kept(self) -> bool:
        """Whether the sandbox outlives this process for the next gateway to adopt (SandboxSpec.adopt_grace).
        Called by the gateway, which writes adoption records for kept kernels only."""
        return self.spec.adopt_grace > 0 and getattr(self, "keeper", None) is not None

    @abc.abstractmethod
    async def poll(self) -> int | None:
        """None while the kernel runs, else its exit status. Called by the provisioner's poll (jupyter_client's restarter)."""

    @abc.abstractmethod
    async def wait(self) -> int | None:
        """Wait for the kernel to exit and return its status. Called by the provisioner's wait, after a stop."""

    @abc.abstractmethod
    async def send_signal(self, signum: int) -> None:
        """Deliver a signal to the kernel inside the sandbox. Called by the provisioner's send_signal (SIGINT: an interrupt)."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Stop everything in the sandbox at once. Called by the provisioner's kill (shutdown with now=True, a failed stop)."""

    @abc.abstractmethod
    async def terminate(self) -> None:
        """Ask the kernel to stop (SIGTERM); kill() follows if it does not. Called by the provisioner's terminate."""

    @abc.abstractmethod
    async def cleanup(self, keep_io_dir: bool = False) -> None:
        """Release what the sandbox held (limits, mounts, dirs). Called by the provisioner's cleanup;
        keep_io_dir is true on a restart, which reuses the connection directory."""

    def kernel_listening(self, port: int) -> bool:
        """tcp: whether the kernel has bound port yet; True where the backend cannot tell.

        Called by the provisioner, which holds a start's turn until the shell port is bound."""
        return True

    hibernated: bool = False  # checkpointed to disk: no process runs, and poll() still answers None

    async def hibernate(self, reconnect: Reconnect | None = None) -> int:
        """Checkpoint the idle kernel to disk and free its memory; the image's bytes. HibernationRefused where the kernel
        runs on as it was (it holds what cannot be saved, the disk budget is full; reconnect: how its ports reopen);
        SandboxError where the attempt ended the sandbox. Called by the gateway's hibernation (gateway/kernels/hibernation.py)."""
        raise HibernationRefused("its backend cannot checkpoint kernels")

    async def wake(self, reconnect: Reconnect | None = None) -> None:
        """Restore a hibernated kernel, every variable intact, and make it reachable at its old ports again (reconnect:
        how); SandboxError when it cannot be (the sandbox is then gone). Called by the gateway's hibernation."""
        raise SandboxError(f"{type(self).__name__} cannot hibernate")

    def memory_bytes(self) -> int | None:
        """Memory the sandbox uses now, when the backend can tell. Called by the gateway's stats and `msb-kernels list`."""
        return None

    def cpu_seconds(self) -> float | None:
        """CPU time the sandbox used since it started, when the backend can tell. Called by the gateway's metrics."""
        return None

    def exit_reason(self) -> str | None:
        """Why the kernel died, when the backend knows (for example out of memory).

        Called by the provisioner when the kernel ends (describe().last_exit_reason) and by the
        gateway when jupyter_client restarts a dead kernel."""
        return None

    def stderr_tail(self) -> list[str]:
        """The kernel's last lines on stderr, where the host reads them; [] where it cannot.

        Called by the start probe (msb_kernels.provisioning.probe) and cleanup's log line, to say why a kernel died at once."""
        return []

    async def hand_out(self, shared_volume: SharedVolume | None, host_directories: list[HostDirectory]) -> None:
        """Show this volume and these directories to the kernel of a sandbox started with SandboxSpec.handout, where a fresh start would
        have shown them, and take its slots away; SandboxError where it cannot (the pool then stops it). Called by the
        warm pool when it hands the kernel to a request (msb_kernels.provisioning.pool)."""
        raise SandboxError(f"{type(self).__name__} cannot show directories to a running kernel")

    def info(self) -> dict:
        """What the provisioner's get_provisioner_info persists and the gateway's stats report."""
        return {"sandbox_id": self.sandbox_id, "flavor": self.spec.flavor.name, "template": self.spec.template}


class SandboxBackend(abc.ABC):
    """Creates sandboxes and finds the ones it created before."""

    name: ClassVar[str]  # its MSB_BACKEND value and entry point name
    auto_order: ClassVar[int]  # MSB_BACKEND=auto tries lower numbers first: the stronger boundary
    transports: ClassVar[tuple[str, ...]]  # the ZMQ transports ("ipc", "tcp") it can reach kernels by; MSB_TRANSPORT=auto takes the first
    # How its sandboxes reach the egress proxy (SandboxSpec.egress): "socket", a Unix socket in the io dir; "tcp", the
    # proxy's port on the kernels' network, where the proxy knows a kernel by its address; None: they cannot.
    egress_routes: ClassVar[str | None] = None
    guest_io_dir: ClassVar[str]  # where the guest sees SandboxSpec.io_dir, read-write (its sockets, its exit status)
    guest_host_dir: ClassVar[str]  # where the guest sees what the host wrote for it (iodir.host_dir), read-only
    # Why its sandboxes have no disk image in the scratch dir (core/scratch.py); None where they do (set per host).
    no_disk: str | None = "its sandboxes keep no disk image on this host"

    def __init__(self, settings: MsbSettings):
        """One instance per (backend, runtime dir, transport) in a process, made by get_backend."""
        self.settings = settings
        self.transport = self.transport_for(settings)

    @classmethod
    def transport_for(cls, settings: MsbSettings) -> str:
        """The transport MSB_TRANSPORT means for this backend; ConfigError where it has no such path.

        Called by get_backend (one instance per transport), `msb-kernels doctor` and the backend's own __init__."""
        requested = settings.transport
        if requested == "auto":
            return cls.transports[0]
        if requested not in cls.transports:
            raise ConfigError(
                f"MSB_TRANSPORT={requested}: the {cls.name} backend reaches its kernels only over {' or '.join(cls.transports)}",
                [
                    f"set MSB_TRANSPORT to auto or {' or '.join(cls.transports)}",
                    "or pick a backend with that transport (MSB_BACKEND=namespace does ipc and tcp)",
                ],
            )
        return requested

    @abc.abstractmethod
    def io_dir_for(self, sandbox_id: str) -> Path:
        """The host dir for the kernel's connection file (and ipc sockets), shared with the guest.

        Called by the provisioner's pre_launch, before the connection file is written; made if missing."""

    @classmethod
    @abc.abstractmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here; the reason says why not, or what is degraded.

        Called by choose_backend (MSB_BACKEND) and `msb-kernels doctor`; must be quick and safe to repeat."""

    @classmethod
    def start_identity(cls) -> dict[str, Any]:
        """What besides availability's reason tells this backend's runtime replaced: its binary's file (see
        msb_kernels.provisioning.probe_verdicts.file_identity). Part of the key a start probe's verdict is kept under on disk."""
        return {}

    @classmethod
    def probe_hint(cls, error: str) -> str | None:
        """What to do about a failed start probe whose error is given, when this backend knows (a runtime too old).

        Called by msb_kernels.provisioning.probe, whose summary `msb-kernels doctor` prints and auto logs."""
        return None

    # Why this backend's kernels get no disk of the flavor's size (core/scratch.py), or None where they get one. A
    # backend that can give one sets it per host (scratch.unavailable_reason()); the others never do.
    no_disk: str | None = "this backend gives /tmp and home as tmpfs"

    def scratch_bytes(self, flavor: Flavor) -> int:
        """What each of a kernel's /tmp and home holds; a write past it fails with ENOSPC: the flavor's disk, shared by
        both, or else a tmpfs of half the flavor's memory. Called by the contract tests, whose figures
        docs/backends/README.md gives."""
        return flavor.disk_bytes if self.no_disk is None else flavor.memory_scratch_mib * 2**20

    @classmethod
    async def prepare(cls, settings: MsbSettings) -> None:
        """What this backend works out once per process before its first start (gVisor: which platform is fastest).

        Called by msb_kernels.provisioning.probe before its clock starts, so a probe's time is a start's; a backend's create needs
        it too and does it there when no probe ran."""
        return None

    @classmethod
    def doctor_lines(cls, settings: MsbSettings) -> list[str]:
        """What this backend needs of the host beyond availability (its network, disk, images), one line each.

        Called by `msb-kernels doctor`, after every backend's availability and start probe."""
        return []

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Create a sandbox sized by spec.flavor and start the kernel in it. Called by the provisioner's launch_kernel."""

    @abc.abstractmethod
    def list_sandboxes(self) -> list[SandboxRecord]:
        """Every sandbox of ours on this host, live or orphaned. Called by `msb-kernels list` and the sweeps."""

    @abc.abstractmethod
    async def sweep_orphans(self, include_adoptable: bool = False) -> list[str]:
        """Stop and remove sandboxes whose owner is gone; return their ids. Adoptable ones (SandboxRecord.adoptable)
        are left for the next gateway, unless include_adoptable.

        Called by the provisioner before its first start in a process, the gateway at start (after adopting what
        it could, with include_adoptable), and `msb-kernels sweep`."""

    async def sweep_leftovers(self, live: Collection[str] = ()) -> list[str]:
        """Remove what dead sandboxes left on this host, whichever runtime dir they were in (core/leftovers.py): the
        scratch dir's disk images no live sandbox holds, with their mounts and state dirs, and the state dirs whose
        io tmpfs is mounted for a sandbox that is gone; return their names. Called by sweep_orphans, and by the
        provisioner at a later start in the same process (every DISK_SWEEP_EVERY seconds at most): a gateway that
        runs for days sweeps what another gateway or a script left when it died with its keeper. live: sandbox ids
        this process runs, whose state is not read."""
        if self.no_disk is not None:
            return []
        # On the loop, not in a thread: the default executor's threads outlive the call (the steady-state test counts
        # them), and with the process's own sandboxes known this is 20 ms at 1,000 (bench/scratch_sweep.py).
        swept = leftovers.sweep(self.settings.scratch_root(), leftovers.STARTS_WITHIN, live)
        for disk in swept:
            log.info("removed the disk of a sandbox that is gone: %s (%s)", disk.image.name, disk.why)
        io_dirs = leftovers.sweep_io_dirs(leftovers.STARTS_WITHIN, live)
        for state_dir in io_dirs:
            log.info("removed the state dir of a sandbox that is gone: %s", state_dir)
        return [disk.image.name for disk in swept] + [state_dir.name for state_dir in io_dirs]

    async def adopt(self, spec: SandboxSpec) -> Sandbox:
        """Take over the running sandbox spec.sandbox_id that a keeper holds (see SandboxSpec.adopt_grace), as
        create would have returned it. Called by the provisioner when the gateway adopts its kernels at start."""
        raise SandboxError(f"the {self.name} backend cannot adopt the sandboxes of another process")

    # -- optional hooks for tcp backends (defaults suit a backend the host reaches over ipc) --

    # True where SIGINT cannot reach the kernel (it runs on another machine): the provisioner interrupts it with an
    # interrupt_request on the control channel instead, as jupyter_client does for kernelspecs with interrupt_mode "message".
    interrupt_by_message: ClassVar[bool] = False
    # Its sandboxes can be started with empty slots and shown a person's directories at hand-out (Sandbox.hand_out): the
    # warm pool then serves people too, where it could serve only starts with nothing of a person's.
    hands_out: bool = False
    runs_images: ClassVar[bool] = False  # kernels run an image (an environment's own, built for it), not the host's interpreter
    runs_on_cluster: ClassVar[bool] = False  # kernels run on a cluster's nodes: this host's memory bounds nothing (gateway capacity)
    host_ip: ClassVar[str] = "127.0.0.1"  # tcp: where the host connects to the kernel's published ports
    guest_ip: ClassVar[str] = "0.0.0.0"  # tcp: the address the kernel binds inside the guest
    # tcp: where the kernel binds Unix sockets instead (as <prefix>-<port>), which a relay in the guest joins to its ports
    guest_sockets: ClassVar[str | None] = None

    def reserve_ports(self, sandbox_id: str) -> list[int] | None:
        """tcp: the host ports for shell, iopub, stdin, control and hb, published at the same numbers in
        the guest and held until release_ports (a restart gets the same ones). None: jupyter_client picks."""
        return None

    def release_ports(self, sandbox_id: str) -> None:  # noqa: B027 - a hook: backends without ports have nothing to give back
        """Give back what reserve_ports held; called on every way a kernel ends, harmless twice."""

    async def supports_curve(self, template: str, environment: str | None = None) -> bool:
        """Whether the kernel this backend runs for template (of environment) can speak CurveZMQ (transport encryption)."""
        return True

    def hibernation_unavailable(self) -> str | None:
        """Why this backend's kernels cannot hibernate here (MSB_HIBERNATE_AFTER_SECONDS), or None where they can.
        Called by the gateway at start, which says so once, and by `msb-kernels doctor`."""
        return f"the {self.name} backend cannot checkpoint its kernels; MSB_BACKEND=gvisor runs kernels that can"

    def settings_env(self) -> dict[str, str]:
        """The settings that find this backend's sandboxes, as MSB_* variables, whatever config file or flag set them:
        for a process of ours that outlives this one (a keeper's closing sweep)."""
        return {
            "MSB_BACKEND": self.name,
            "MSB_RUNTIME_DIR": str(self.settings.runtime_root()),
            "MSB_SCRATCH_DIR": str(self.settings.scratch_root()),
            "MSB_HIBERNATE_DIR": str(self.settings.hibernate_root()),  # a swept sandbox's image goes with it
            "MSB_TRANSPORT": self.transport,
        }

    def egress_endpoint(self) -> tuple[str, int, str]:
        """egress_routes "tcp": (the address the proxy listens on, its port, the name kernels dial it by).
        Called by the provisioner before a proxied kernel's start."""
        raise SandboxError(f"the {self.name} backend has no way to the egress proxy")

    def kernel_networks(self) -> list[str]:
        """CIDRs the kernels' own addresses are on, where they could reach the gateway itself (a cluster's overlay,
        which the gateway's container joins). Called by the gateway at start: it refuses connections from these."""
        return []

    def stats(self) -> dict:
        """Backend counters for stats endpoints (for example host ports allocated and available)."""
        return {}
