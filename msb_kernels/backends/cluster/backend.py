"""Kernels on a cluster's engine (Docker Swarm today): one unit of work per kernel, placed on whichever node has room.

The gateway, on the kernels' network, reaches each kernel over TCP at the address of its task, with CurveZMQ on:
every kernel binds the same five ports inside its own network namespace. What the kernel needs from the
host (its connection file with the keys, the startup file) goes as the engine's secrets, never as labels,
environment or logs.

Owners: every kernel is labelled with its owner and how long it outlives it (MSB_ADOPT_GRACE_SECONDS for a
gateway's kernels, 0 for everyone else's). Each process that runs kernels beats every HEARTBEAT_INTERVAL.
A kernel is

- held: this process runs it;
- adoptable: a gateway's, whose owner is this process's own (the next gateway of the same MSB_SWARM_OWNER
  after a crash), or whose owner has been silent for less than the grace;
- an orphan: its owner has been silent for OWNER_TIMEOUT and its grace is over; any process's sweep
  (a gateway every SWEEP_INTERVAL, `msb-kernels sweep`) removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import ClassVar

from msb_kernels.backends.cluster.engine import Engine, KernelService, ServiceRecord, TaskState
from msb_kernels.backends.cluster.sandbox import ClusterSandbox
from msb_kernels.backends.core import iodir
from msb_kernels.backends.core.base import SANDBOX_LABEL, Availability, SandboxBackend, SandboxRecord, SandboxSpec
from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.core.state import remove_state_dir
from msb_kernels.egress.route import RELAY_LAUNCHER, relay_source
from msb_kernels.environments.kernel_images import kernel_argv, kernel_image, missing_image_advice
from msb_kernels.errors import BackendUnavailable, ResourceLimitExceeded, SandboxError
from msb_kernels.images import GUEST_HOME, GUEST_PATH, GUEST_UID, IMAGE_CURVE_LABEL, IMAGE_SHARED_DIR, image_for
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.provisioning import registry
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("msb_kernels")

KERNEL_PORTS = [50001, 50002, 50003, 50004, 50005]  # shell, iopub, stdin, control, hb: each kernel has its own address
GUEST_FILES_DIR = "/run/msb-kernel"  # the connection and startup files: not in the image, so its tmpfs is the mode we ask
HEARTBEAT_INTERVAL = 10.0
OWNER_TIMEOUT = 45.0  # an owner silent this long is gone: its kernels are adoptable for their grace, then orphans
SWEEP_INTERVAL = 60.0
START_POLL_SECONDS = 0.1

LABEL_KERNEL = "msb-kernels.kernel-id"
LABEL_FLAVOR = "msb-kernels.flavor"
LABEL_TEMPLATE = "msb-kernels.template"
LABEL_CREATED = "msb-kernels.created"
LABEL_OWNER = "msb-kernels.owner"
LABEL_GRACE = "msb-kernels.grace"
LABEL_HOST = "msb-kernels.host"


def _address_on(cidrs: list[str]) -> str | None:
    """This process's address in one of cidrs, or None: the route to the network's first address leaves from one of
    this process's addresses on it, or not (UDP connect: nothing is sent)."""
    for cidr in cidrs:
        subnet = ipaddress.ip_network(cidr)
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((str(next(subnet.hosts())), 9))
            if ipaddress.ip_address(probe.getsockname()[0]) in subnet:
                return probe.getsockname()[0]
    return None


def _on_network_advice(network: str) -> list[str]:
    return [
        "run the gateway as a service of the stack: docker stack deploy -c deploy/swarm/stack.yml msb",
        f"or run it in a container attached to {network} (it is attachable)",
    ]


def _off_network(network: str, engine: str, subnets: list[str] | None) -> str:
    where = "it does not exist yet" if subnets is None else ", ".join(subnets) or "no subnet"
    return f"this process is not on the kernels' network {network} ({where}), where {engine} kernels are reached"


class ClusterBackend(SandboxBackend):
    """The engine-neutral part: a subclass names its engine (make_engine) and its MSB_BACKEND name."""

    transports = ("tcp",)
    egress_routes = "tcp"
    guest_io_dir = GUEST_FILES_DIR
    guest_host_dir = GUEST_FILES_DIR  # what the host wrote, as the task's Docker secrets: no directory is shared
    interrupt_by_message = True
    runs_images = True
    runs_on_cluster = True
    _availability: ClassVar[tuple[float, Availability] | None] = None

    def __init__(self, settings: MsbSettings):
        super().__init__(settings)
        self.engine = self.make_engine(settings)
        self.root = settings.runtime_root() / self.name
        self._curve: dict[str, bool] = {}
        self._owners: set[str] = set()
        self._beating: asyncio.Task | None = None
        self._on_network = False
        self._starting: set[str] = set()  # kernels this process is creating: not yet live_sandboxes, never an orphan

    @classmethod
    def make_engine(cls, settings: MsbSettings) -> Engine:
        raise NotImplementedError

    # -- availability ----------------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        """The engine's word, and whether this process is on the kernels' network: one that is not (a gateway or a
        bench started on a manager's host, not as the stack's service) could start kernels it never reaches, so the
        backend is unavailable here, as a microVM is where none boots (MSB_BACKEND=auto, doctor, the bench)."""
        if cls._availability is None or time.monotonic() - cls._availability[0] > 30:
            settings = load_settings()
            engine = cls.make_engine(settings)
            ok, reason, warnings = engine.availability()
            if ok:
                try:
                    subnets = engine.existing_subnets()
                except Exception as exc:  # the engine's client: any of its errors means we cannot tell
                    ok, reason = False, f"cannot read the kernels' network {settings.swarm_network} ({str(exc)[:200]})"
                else:
                    if subnets is None or _address_on(subnets) is None:
                        advice = "; ".join(_on_network_advice(settings.swarm_network))
                        ok, reason = False, f"{_off_network(settings.swarm_network, engine.name, subnets)}: {advice}"
            cls._availability = (time.monotonic(), Availability(ok, reason, warnings))
        return cls._availability[1]

    @classmethod
    def doctor_lines(cls, settings: MsbSettings) -> list[str]:
        lines = cls.make_engine(settings).doctor_lines()
        for template in TEMPLATES:
            lines.append(f"{cls.name} image {template}: {image_for(settings, template)} (load it on every node, or name a registry's)")
        return lines

    # -- what the provisioner asks ----------------------------------------------------------

    def io_dir_for(self, sandbox_id: str) -> Path:
        io_dir = iodir.make_dirs(self.root, sandbox_id, bounded=False)
        os.chmod(self.root, 0o700)
        return io_dir

    def reserve_ports(self, sandbox_id: str) -> list[int]:
        return list(KERNEL_PORTS)

    async def supports_curve(self, template: str, environment: str | None = None) -> bool:
        image = kernel_image(self.settings, template, environment)
        if image not in self._curve:
            labels = await asyncio.to_thread(self.engine.image_labels, image)
            # An image the manager does not hold is taken at its template's word; the nodes that run it have it.
            self._curve[image] = TEMPLATES[template].speaks_curve and (labels is None or labels.get(IMAGE_CURVE_LABEL) == "true")
        return self._curve[image]

    def kernel_networks(self) -> list[str]:
        return self.engine.network_subnets()

    def egress_endpoint(self) -> tuple[str, int, str]:
        """This process's address on the kernels' network (its proxy listens there), the port, and the name kernels dial:
        MSB_SWARM_EGRESS_HOST (the stack's service name, which follows the gateway to its next task), else the address."""
        address = self._own_address()
        return address, self.settings.swarm_egress_port, self.settings.swarm_egress_host or address

    def _own_address(self) -> str:
        address = _address_on(self.kernel_networks())
        if address is not None:
            return address
        raise SandboxError(
            f"this process has no address on the kernels' network {self.settings.swarm_network}, where their egress proxy must listen",
            ["run the gateway as a service of the stack", "or start the kernel without MSB_NETWORK_ALLOW"],
        )

    def _check_on_kernel_network(self) -> None:
        """Kernels are reached on their network only: a process that is not on it (a gateway started on a node's host
        rather than as the stack's service) would wait out every start. Asked once: the route to the network's
        first address leaves from one of this process's addresses on it, or not."""
        if self._on_network:
            return
        subnets = self.kernel_networks()
        if _address_on(subnets) is not None:
            self._on_network = True
            return
        raise BackendUnavailable(
            _off_network(self.settings.swarm_network, self.engine.name, subnets), _on_network_advice(self.settings.swarm_network)
        )

    def settings_env(self) -> dict[str, str]:
        env = super().settings_env()
        env["MSB_SWARM_NETWORK"] = self.settings.swarm_network
        if os.environ.get("DOCKER_HOST"):
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        return env

    # -- owners -------------------------------------------------------------------------------

    def gateway_owner(self) -> str:
        """Who a gateway is to the cluster, the same across its restarts: MSB_SWARM_OWNER, else this host and runtime dir."""
        return self.settings.swarm_owner or f"{socket.gethostname()}:{hashlib.sha256(str(self.root).encode()).hexdigest()[:12]}"

    def owner_for(self, spec: SandboxSpec) -> str:
        """A gateway's kernels belong to the gateway as the cluster knows it across restarts; anyone else's to the process."""
        if spec.adopt_grace > 0:
            return self.gateway_owner()
        pid = spec.owner_pid or os.getpid()
        return f"{socket.gethostname()}:{pid}:{process_start_time(pid) or 0}"

    async def _adopt_owner(self, owner: str) -> None:
        """Beat for owner from now on; the first beat is in place before its first kernel is."""
        if owner not in self._owners:
            await asyncio.to_thread(self.engine.beat, owner)
            self._owners.add(owner)
        if self._beating is None or self._beating.done():
            self._beating = asyncio.get_running_loop().create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        last_sweep = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            for owner in list(self._owners):
                try:
                    await asyncio.to_thread(self.engine.beat, owner)
                except Exception as exc:  # the engine away for a moment: beat again next time
                    log.warning("%s: cannot record that %s is alive: %s", self.name, owner, exc)
            if time.monotonic() - last_sweep > SWEEP_INTERVAL:
                last_sweep = time.monotonic()
                try:
                    await self.sweep_orphans()
                except Exception as exc:
                    log.warning("%s orphan sweep failed: %s", self.name, exc)

    # -- create and adopt -------------------------------------------------------------------------

    def _service_for(self, spec: SandboxSpec, owner: str) -> KernelService:
        files = {}
        for entry in os.scandir(iodir.host_dir(spec.io_dir)):
            if entry.is_file(follow_symlinks=False):
                with open(entry.path, "rb") as handle:
                    files[entry.name] = handle.read()
        env = {**spec.env, "PATH": GUEST_PATH, "HOME": GUEST_HOME}
        labels = {
            SANDBOX_LABEL: "1",
            LABEL_KERNEL: spec.sandbox_id,
            LABEL_FLAVOR: spec.flavor.name,
            LABEL_TEMPLATE: spec.template,
            LABEL_CREATED: f"{time.time():.3f}",
            LABEL_OWNER: owner,
            LABEL_GRACE: f"{spec.adopt_grace:g}",
            LABEL_HOST: socket.gethostname(),
        }
        argv = kernel_argv(spec.template, spec.argv, spec.environment)
        if spec.egress is not None:  # the relay beside the kernel, on 127.0.0.1:3128, to the proxy's port on this network
            relay = {"socket": spec.egress.socket, "bind": spec.egress.listeners, "user": None, "source": relay_source()}
            argv = ["python3", "-I", "-S", "-c", RELAY_LAUNCHER, json.dumps(relay), *argv]
        return KernelService(
            name=f"msb-{spec.sandbox_id}-{secrets.token_hex(3)}",
            kernel_id=spec.sandbox_id,
            image=kernel_image(self.settings, spec.template, spec.environment),
            argv=argv,
            env=env,
            cpus=spec.flavor.cpus,
            memory_bytes=spec.flavor.memory_bytes,
            scratch_bytes=spec.flavor.memory_scratch_mib * 2**20,
            max_processes=spec.max_processes,
            files=files,
            files_dir=GUEST_FILES_DIR,
            labels=labels,
            user=f"{GUEST_UID}:{GUEST_UID}",
            home=GUEST_HOME,
            workdir=GUEST_HOME,
            volume=(spec.shared_volume.docker_name, spec.shared_volume.guest_path)
            if spec.shared_volume and spec.shared_volume.docker_name
            else None,
        )

    async def create(self, spec: SandboxSpec) -> ClusterSandbox:
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailable(f"the {self.name} backend cannot run here: {availability.reason}", ["run `msb-kernels doctor`"])
        if spec.host_directories or (spec.shared_volume is not None and spec.shared_volume.docker_name is None):
            raise SandboxError(
                f"the {self.name} backend shows no host directory to its kernels (MSB_SHARED_VOLUME_PATH, MSB_LAB_ROOT_PATH): "
                "they run on other nodes",
                [
                    "unset those settings for this gateway",
                    "set MSB_SHARED_VOLUME_NAME=msb-shared for a Docker named volume per person",
                    "upload and download files with the MCP file tools",
                ],
            )
        if spec.shared_volume is not None and spec.shared_volume.guest_path != IMAGE_SHARED_DIR:
            raise SandboxError(
                f"MSB_SHARED_VOLUME_GUEST_PATH={spec.shared_volume.guest_path}: on {self.name} a named volume takes its owner "
                f"from the kernel image's {IMAGE_SHARED_DIR}, which no other path of the image has",
                [f"unset MSB_SHARED_VOLUME_GUEST_PATH (it is {IMAGE_SHARED_DIR})"],
            )
        await asyncio.to_thread(self._check_on_kernel_network)
        owner = self.owner_for(spec)
        await self._adopt_owner(owner)
        service = self._service_for(spec, owner)
        self._starting.add(spec.sandbox_id)
        try:
            await asyncio.to_thread(self.engine.run, service)
            state = await self._until_running(spec, service.name)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(self.engine.remove, service.name))
            raise
        finally:
            self._starting.discard(spec.sandbox_id)
        return ClusterSandbox(spec, self.engine, self.name, service.name, state)

    async def _until_running(self, spec: SandboxSpec, name: str) -> TaskState:
        """Placed and running within MSB_BOOT_TIMEOUT_SECONDS, or refused with the scheduler's own reason as soon as it has
        one: a kernel that no node can take is refused at once, never left pending."""
        timeout = self.settings.boot_timeout_seconds
        deadline = time.monotonic() + timeout
        state = TaskState("pending")
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(self.engine.state, name, START_POLL_SECONDS)
            if state.phase == "running" and state.address:
                return state
            if state.unplaceable:
                flavor = spec.flavor
                raise ResourceLimitExceeded(
                    f"no {self.engine.name} node can take a {flavor.name} kernel ({flavor.cpus} CPU, {flavor.memory_mib} MiB "
                    f"reserved): {state.reason}",
                    [
                        f"pick a smaller flavor than {flavor.name}"
                        if flavor.next_larger() is None or flavor.name != "small"
                        else "stop a kernel",
                        "stop kernels you no longer need, or add a node (docker swarm join)",
                    ],
                    limit="cluster_capacity",
                )
            if state.phase in ("ended", "lost"):
                advice = missing_image_advice(self.settings, spec.template, spec.environment)
                no_image = "no such image" in (state.reason or "").lower()
                raise SandboxError(
                    f"kernel {spec.sandbox_id} could not start on {self.engine.name}"
                    + (f" (node {state.node})" if state.node else "")
                    + f": {state.reason or 'it exited'}"
                    + (f": {advice}" if no_image else "")  # in the message: clients such as papermill show nothing else
                    + (f", exit status {state.exit_code}" if state.exit_code is not None and not no_image else ""),
                    [advice, "run `msb-kernels doctor`"],
                )
            await asyncio.sleep(START_POLL_SECONDS)
        raise SandboxError(
            f"kernel {spec.sandbox_id} did not start on {self.engine.name} within {timeout} s (MSB_BOOT_TIMEOUT_SECONDS): {state.reason}",
            ["raise MSB_BOOT_TIMEOUT_SECONDS", "run `msb-kernels doctor`"],
        )

    async def adopt(self, spec: SandboxSpec) -> ClusterSandbox:
        for record in await asyncio.to_thread(self.engine.services):
            if record.labels.get(LABEL_KERNEL) == spec.sandbox_id and record.state.phase == "running":
                await self._adopt_owner(self.owner_for(spec))
                sandbox = ClusterSandbox(spec, self.engine, self.name, record.name, record.state)
                sandbox.created = float(record.labels.get(LABEL_CREATED) or record.created)
                return sandbox
        raise SandboxError(f"kernel {spec.sandbox_id} no longer runs on {self.engine.name}")

    # -- finding and sweeping ---------------------------------------------------------------------

    def _classify(self, records: list[ServiceRecord], beats: dict[str, float]) -> list[SandboxRecord]:
        now = time.time()
        gateway = self.gateway_owner()
        found = []
        for record in records:
            labels = record.labels
            kernel_id = labels.get(LABEL_KERNEL, record.name)
            owner = labels.get(LABEL_OWNER, "")
            try:
                grace = float(labels.get(LABEL_GRACE) or 0)
            except ValueError:
                grace = 0.0
            silent = now - beats.get(owner, record.created)
            held = registry.runs_in_this_process(kernel_id) or kernel_id in self._starting
            own_gateway = owner == gateway and grace > 0
            owner_alive = held or (silent <= OWNER_TIMEOUT and not own_gateway)
            adoptable = not held and grace > 0 and record.state.phase == "running" and (own_gateway or silent <= OWNER_TIMEOUT + grace)
            details = {"service": record.name, "owner": owner, "grace": grace, "silent_seconds": round(silent, 1), **labels}
            details.update(node=record.state.node, phase=record.state.phase, reason=record.state.reason)
            found.append(
                SandboxRecord(
                    kernel_id,
                    self.name,
                    owner_alive,
                    record.state.phase == "running",
                    float(labels.get(LABEL_CREATED) or record.created),
                    details,
                    keeper_alive=adoptable,
                    adoptable=adoptable and not owner_alive,
                )
            )
        return found

    def list_sandboxes(self) -> list[SandboxRecord]:
        return self._classify(self.engine.services(), self.engine.last_beats())

    async def sweep_orphans(self, include_adoptable: bool = False) -> list[str]:
        """Remove kernels whose owner is gone for good; with include_adoptable (a gateway after adopting what it could),
        also this owner's that nobody adopted. Other gateways' adoptable kernels wait for their own gateway."""
        try:
            records = await asyncio.to_thread(self.engine.services)
            beats = await asyncio.to_thread(self.engine.last_beats)
        except Exception as exc:  # a sweep that cannot list must not stop a kernel from starting
            log.warning("cannot list %s kernels for the orphan sweep: %s", self.name, exc)
            return []
        swept = []
        for found in self._classify(records, beats):
            if found.owner_alive:
                continue
            if found.adoptable and not (include_adoptable and found.details.get("owner") == self.gateway_owner()):
                continue
            await asyncio.to_thread(self.engine.remove, found.details["service"])
            state_dir = self.root / found.sandbox_id
            if state_dir.is_dir() and not registry.runs_in_this_process(found.sandbox_id):
                remove_state_dir(state_dir, keep_io_dir=False)
            swept.append(found.sandbox_id)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.engine.tidy)
        living = {record.labels.get(LABEL_OWNER) for record in records if record.labels.get(LABEL_KERNEL) not in swept}
        for owner, last in beats.items():
            if owner not in living and owner not in self._owners and time.time() - last > OWNER_TIMEOUT:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.engine.forget, owner)
        if swept:
            log.info("swept %d orphaned %s kernel(s): %s", len(swept), self.name, ", ".join(swept))
        return swept


class SwarmBackend(ClusterBackend):
    """MSB_BACKEND=swarm: each kernel a Docker Swarm service (cluster/swarm.py)."""

    name = "swarm"
    auto_order = 100  # never picked by auto over this host's own sandboxes: a cluster is the operator's choice

    @classmethod
    def make_engine(cls, settings: MsbSettings) -> Engine:
        from msb_kernels.backends.cluster.swarm import DockerSwarm

        return DockerSwarm(settings.swarm_network, allow_network=settings.allow_network)
