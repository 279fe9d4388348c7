"""What a cluster backend asks of its engine: run one kernel as one unit of work, say how it fares, remove it.

Docker Swarm (swarm.py) is the one engine built; a Kubernetes sibling (a Pod per kernel with RuntimeClass gvisor or
kata, a NetworkPolicy, the pod label ``kernel_id``, the same image) is one more implementation of :class:`Engine`.
Everything an engine does not decide (the kernel's files, limits, labels, owners, adoption, the sweep) is
the backend's (backend.py), the same for every engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelService:
    """One kernel, as the engine is to run it: one replica, never restarted, sized, on the kernels' private network."""

    name: str  # unique per launch (a restart is a new one): the engine's name for it
    kernel_id: str
    image: str
    argv: list[str]
    env: dict[str, str]
    cpus: float  # reserved and the limit
    memory_bytes: int  # reserved and the limit
    scratch_bytes: int  # each writable directory (home, /tmp) is a tmpfs of this size, counted in the memory
    max_processes: int
    files: dict[str, bytes]  # name -> content, in files_dir for the kernel's user only before it starts (connection keys)
    files_dir: str
    labels: dict[str, str]
    user: str  # uid:gid
    home: str
    workdir: str
    volume: tuple[str, str] | None = None  # (named volume, where): the shared volume's, a person's own or the whole one


@dataclass
class TaskState:
    """Where a kernel's unit of work stands, as the engine last saw it."""

    phase: str  # "pending" (not placed, or starting), "running", "ended" (its kernel exited), "lost" (it or its node is gone)
    address: str | None = None  # where the kernel's ports are reached, once running
    node: str | None = None  # the node it was placed on
    exit_code: int | None = None
    reason: str = ""  # the engine's own words: the scheduler's, the runtime's, or why it is lost
    unplaceable: bool = False  # pending because no node can take it (its resources or constraints): it never will


@dataclass
class ServiceRecord:
    """A kernel's unit of work found in the engine (whoever started it)."""

    name: str
    labels: dict[str, str]
    created: float
    state: TaskState = field(default_factory=lambda: TaskState("pending"))


class Engine(abc.ABC):
    """An orchestrator that runs kernels. Each method is called by the cluster backend (backend.py), from a worker
    thread when an event loop runs: the engines' own clients (docker, kubernetes) block."""

    name: str  # what `msb-kernels doctor` and errors call it

    @abc.abstractmethod
    def availability(self) -> tuple[bool, str, list[str]]:
        """(usable, why, warnings): whether the engine answers and this process may run kernels on it.
        Called by the backend's availability (MSB_BACKEND, doctor); must be quick."""

    @abc.abstractmethod
    def doctor_lines(self) -> list[str]:
        """The engine's nodes, runtimes, network and images, one line each. Called by `msb-kernels doctor`."""

    @abc.abstractmethod
    def network_subnets(self) -> list[str]:
        """The CIDRs of the kernels' network, made if missing. Called by the gateway at start (through the backend)."""

    @abc.abstractmethod
    def existing_subnets(self) -> list[str] | None:
        """The CIDRs of the kernels' network, None where it does not exist; nothing is made. Called by the backend's
        availability: kernels are reached on that network only, so a process that is not on it cannot use them."""

    @abc.abstractmethod
    def image_labels(self, image: str) -> dict[str, str] | None:
        """The labels of image where the engine can read them (None: it cannot). Called once per image, for the
        label that says its kernel speaks CurveZMQ."""

    @abc.abstractmethod
    def run(self, service: KernelService) -> None:
        """Submit the kernel; return once the engine holds it (placement happens after). Called by the backend's create."""

    @abc.abstractmethod
    def state(self, name: str, max_age: float = 1.0) -> TaskState:
        """The kernel's state, at most max_age seconds old: one listing serves every kernel of this process.
        Called by the backend while a kernel starts, and by the sandbox's poll (jupyter_client's restarter)."""

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Stop the kernel and remove it with what it was given (its files); harmless if it is gone.
        Called by the sandbox's kill and cleanup, and the sweep."""

    @abc.abstractmethod
    def services(self) -> list[ServiceRecord]:
        """Every kernel of msb-kernels the engine runs, with its labels and state. Called by the sweep and adoption."""

    @abc.abstractmethod
    def tidy(self) -> None:
        """Remove what kernels that are gone left behind (files given to them). Called by the sweep."""

    @abc.abstractmethod
    def beat(self, owner: str) -> None:
        """Record that owner (a gateway, or a process) is alive now. Called every HEARTBEAT_INTERVAL while it runs kernels."""

    @abc.abstractmethod
    def last_beats(self) -> dict[str, float]:
        """owner -> when it last beat (time.time()). Called by the sweep: kernels whose owner stopped beating are orphans."""

    @abc.abstractmethod
    def forget(self, owner: str) -> None:
        """Remove what beat() keeps for owner (it is gone for good, its kernels swept). Called by the sweep."""
