"""The kernel provisioner: jupyter_client's hook that puts each kernel in a sandbox.

Registered as the ``msb-sandbox`` entry point under ``jupyter_client.kernel_provisioners``.
A kernelspec selects it with::

    "metadata": {"kernel_provisioner": {"provisioner_name": "msb-sandbox",
                                        "config": {"flavor": "small", "template": "python"}}}

so JupyterLab, jupyter console, nbclient and papermill run sandboxed kernels with no
change of their own. What one start asks for (its flavor, the session's own variables, its network, its owner's
volume, its working directory) is its StartRequest (msb_kernels.provisioning.start_request): the ``start_request`` argument that
jupyter_client keeps for every later start of the kernel, or for a local start, the KERNEL_* variables its caller
passed. The start's ``env`` (jupyter_client's, which defaults to this process's environment) is never read.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from traitlets import Unicode

from msb_kernels.backends import Sandbox, SandboxBackend, SandboxSpec, get_backend
from msb_kernels.backends.core import hostpaths, iodir
from msb_kernels.backends.core.base import SharedVolume
from msb_kernels.backends.core.state import remove_state_dir
from msb_kernels.egress.grant import KernelNetwork, network_for
from msb_kernels.egress.route import EgressRoute
from msb_kernels.environments.kernel_images import kernel_image
from msb_kernels.errors import ConfigError, InvalidRequest, ResourceLimitExceeded, SandboxError
from msb_kernels.identity.person_registry import Registered
from msb_kernels.identity.volumes import docker_volume, user_base
from msb_kernels.jupyter.compat import curve_capable, kernel_supports_curve, send_interrupt_request, transport_encryption_policy
from msb_kernels.kernelspecs.choice import DEFAULT_ENVIRONMENT
from msb_kernels.kernelspecs.flavors import Flavor, get_flavor
from msb_kernels.kernelspecs.templates import Template, get_template
from msb_kernels.provisioning import labroot, person_places
from msb_kernels.provisioning.probe import backend_for_start, distrust
from msb_kernels.provisioning.registry import SandboxRegistry, live_in_this_process, registry_of
from msb_kernels.provisioning.start_request import START_REQUEST, StartRequest
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("msb_kernels")

GUEST_CONNECTION_FILE = "connection.json"

_last_sweeps: dict[str, float] = {}  # per runtime dir and backend: when this process last swept (time.monotonic)
# A later start in the same process sweeps the scratch dir's dead disks again once this much time has passed: what
# another gateway or a script left, dying with its keeper, goes at the next start of a gateway that runs for days.
DISK_SWEEP_EVERY = 10.0
# How long a start holds its turn at most while the kernel imports; past it the next start goes anyway.
LISTEN_WAIT_SECONDS = 30.0
BIND_WAIT_SECONDS = 120.0  # ipc: how long a start waits for the kernel's five sockets, out of its turn, to pin them
_start_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]] = weakref.WeakKeyDictionary()


def start_turn(settings: MsbSettings) -> asyncio.Semaphore:
    """Sandboxes starting at once in this process (MSB_CONCURRENT_STARTS, default the host's CPUs).

    Kernels that start together share the CPUs to the end: 50 at once on 2 cores were all ready
    together after about 45 s, and a slower host timed out every one of them. In turns, the first
    is ready in about a second and the rest follow in order."""
    size = settings.concurrent_starts or len(os.sched_getaffinity(0))
    turns = _start_turns.setdefault(asyncio.get_running_loop(), {})
    return turns.setdefault(size, asyncio.Semaphore(size))


@dataclass(frozen=True)
class SandboxDescription:
    """What a sandboxed kernel is and how its sandbox fares, as SandboxProvisioner.describe reports it."""

    template: Template | None  # None until the first launch chose it
    flavor: Flavor | None
    sandbox: Sandbox | None  # the live one; another object after a restart, None between a death and a restart
    created: float | None  # when the live sandbox started (time.time())
    last_exit_reason: str | None  # why the previous sandbox's kernel died, when the backend knew
    network: str = "none"  # its way out: "none", "public internet", or the egress proxy's allow-list
    egress: dict | None = None  # the egress proxy's counters for it (KernelEgress.snapshot), while it listens for it
    environment: str = DEFAULT_ENVIRONMENT  # the Python environment its interpreter is (msb_kernels.environments)


class SandboxProvisioner(KernelProvisionerBase):  # type: ignore[misc]
    """Runs the kernel inside a sandbox sized by a flavor."""

    flavor = Unicode(None, allow_none=True, config=True, help="small, medium or large; default MSB_DEFAULT_FLAVOR")
    template = Unicode("python", config=True, help="python or node")
    environment = Unicode(None, allow_none=True, config=True, help="the environment whose interpreter is argv[0]; None: the default")

    sandbox: Sandbox | None = None
    last_exit_reason: str | None = None
    network: KernelNetwork | None = None  # its way out, chosen by pre_launch (msb_kernels.egress.grant)
    start_request: StartRequest | None = None  # what this start asks for, set by pre_launch from the start's arguments
    channel_pins: iodir.ChannelPins | None = None  # ipc: the kernel's sockets, pinned once it bound them
    egress: Any = None  # its egress.attach.KernelRoute, while the proxy listens for it
    # Chosen by pre_launch, from the kernelspec's config and the start request's KERNEL_FLAVOR.
    template_spec: Template | None = None
    flavor_spec: Flavor | None = None

    # -- state ------------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.sandbox is not None

    async def poll(self) -> int | None:
        return None if self.sandbox is None else await self.sandbox.poll()

    async def wait(self) -> int | None:
        return None if self.sandbox is None else await self.sandbox.wait()

    async def send_signal(self, signum: int) -> None:
        if self.sandbox is None:
            return
        if signum == signal.SIGINT and self.backend.interrupt_by_message:
            # jupyter_client's own way for interrupt_mode "message": its control socket, kept open until the kernel's
            # cleanup. A socket closed right after the send can lose it: an asyncio socket sends once it is writable.
            send_interrupt_request(self.parent)
            return
        await self.sandbox.send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if self.sandbox is not None:
            await self.sandbox.kill()

    async def terminate(self, restart: bool = False) -> None:
        if self.sandbox is not None:
            await self.sandbox.terminate()

    def describe(self) -> SandboxDescription:
        """The template, flavor and live sandbox of this kernel, for readers outside jupyter_client.

        Called by mcp_bridge.local_sessions (a session's language, flavor and creation time for
        get_sessions; whether the kernel was replaced or died, and why, for the execution that
        was running) and by the gateway's kernel manager (stats, and why a kernel stopped or
        died), so that they need not know this class's attributes.
        """
        sandbox = self.sandbox
        return SandboxDescription(
            template=self.template_spec,
            flavor=self.flavor_spec,
            sandbox=sandbox,
            created=sandbox.created if sandbox is not None else None,
            last_exit_reason=self.last_exit_reason,
            network=self.network.describe() if self.network is not None else "none",
            egress=self.egress.egress.snapshot() if self.egress is not None else None,
            environment=self.environment or DEFAULT_ENVIRONMENT,
        )

    @property
    def sandbox_registry(self) -> SandboxRegistry:
        """Where this kernel's sandbox is counted and whether it is being adopted: the registry of the manager its kernel
        manager belongs to (the gateway's), else the process's (nbclient, papermill, the start probe)."""
        return registry_of(getattr(self.parent, "parent", None))

    # -- launch -------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        self.settings: MsbSettings = load_settings(getattr(km, "config", None))
        registry = self.sandbox_registry
        adopting = registry.adoptions.get(self.kernel_id)
        request = kwargs.pop(START_REQUEST, None)
        given_env = kwargs.pop("env", None)  # jupyter_client's, or this process's environment: never the kernel's
        if request is None:  # a local jupyter_client start: its caller is the host's own user
            request = StartRequest.for_local_start(os.environ if given_env is None else given_env)
        if not isinstance(request, StartRequest):
            raise InvalidRequest(f"{START_REQUEST} must be a StartRequest, not {type(request).__name__}")
        self.start_request = request
        if adopting:
            self.template = adopting["template"]
        self.flavor_spec = get_flavor(
            request.flavor or self.flavor or self.settings.default_flavor,
            argument="KERNEL_FLAVOR" if request.flavor else "flavor",
        )
        if request.environment is not None and request.environment != (self.environment or DEFAULT_ENVIRONMENT):
            raise InvalidRequest(
                f"the start asks for environment {request.environment}, but its kernelspec runs {self.environment or DEFAULT_ENVIRONMENT}",
                ["start the kernelspec of that environment (msb-<environment>-python-<flavor>)"],
            )
        self.template_spec = get_template(self.template, argument="template")
        reason = self.template_spec.unavailable_reason()
        if reason and not adopting:
            raise InvalidRequest(f"cannot start a {self.template} kernel: {reason}")
        interpreter = km.kernel_spec.argv[0] if km.kernel_spec and km.kernel_spec.argv else ""
        if self.environment and not adopting and not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
            # Said here, before a sandbox starts: inside one, a missing interpreter is only an exit status.
            raise InvalidRequest(
                f"cannot start a kernel of environment {self.environment}: its interpreter {interpreter} is gone or not executable",
                [
                    f"`msb-kernels env check {self.environment}` says what it finds",
                    f"`msb-kernels env remove {self.environment}`, then add it again",
                ],
            )
        if adopting:
            self.backend: SandboxBackend = get_backend(self.settings)
            registry.count_session(self.kernel_id)  # it runs already: it counts, whatever the limit says now
        else:  # under MSB_BACKEND=auto, a backend whose start probe passed for this interpreter
            self.backend = await backend_for_start(self.settings, km.kernel_spec.argv, self.template_spec.name)
            if self.kernel_id not in registry.pooled_kernel_ids and self.kernel_id not in registry.probe_kernel_ids:
                registry.claim_session(self.kernel_id, self.settings.max_sessions)
        try:
            settings = self.settings
            self.network = network_for(
                settings.allow_network,
                settings.network_allow,
                settings.network_secrets_file,
                request,
                settings.runtime_root(),
                self.kernel_id,
            )
            if self.environment and self.backend.runs_images and not adopting:
                # Refused before a kernel is started or counted: an environment without an image names the command that
                # builds it (on a node that lacks it, the engine's refusal says the same).
                kernel_image(settings, self.template_spec.name, self.environment)
            if self.network.proxied and not self.backend.egress_routes:
                raise SandboxError(
                    f"the {self.backend.name} backend cannot route a kernel through the egress proxy (MSB_NETWORK_ALLOW, "
                    "KERNEL_NETWORK_ALLOW or secrets)",
                    ["use MSB_BACKEND=namespace or gvisor for allow-listed network", "or start the kernel without an allow-list"],
                )
            await self._sweep_once()
        except BaseException:
            registry.release_session(self.kernel_id)
            raise

        try:
            self.io_dir = self.backend.io_dir_for(self.kernel_id)
            km.transport = self.backend.transport
            extra_arguments = kwargs.pop("extra_arguments", [])
            if adopting:
                km.load_connection_info(adopting["connection"])  # the running kernel's ports and keys
                km.write_connection_file()
                self.connection_info = km.get_connection_info()
            else:
                iodir.clear(self.io_dir)  # what a sandbox that ran here left (no sandbox runs here now)
                if self.backend.transport == "ipc":
                    km.ip = str(iodir.channels_dir(self.io_dir) / "kernel")  # links to the sockets pinned at launch
                else:
                    self._use_reserved_ports(km)
                await self._set_up_encryption(km)
                km.write_connection_file(jupyter_session=request.notebook_path or "")
                self.connection_info = km.get_connection_info()
                self._write_guest_files()
            cmd = km.format_kernel_cmd(extra_arguments=extra_arguments)
        except BaseException:
            self._forget_failed_start(remove_dir=not adopting)
            raise
        launch = await super().pre_launch(cmd=cmd, **kwargs)
        launch.pop("env", None)  # the base class's: this process's environment, which no sandbox is given
        return launch

    def _use_reserved_ports(self, km: Any) -> None:
        """tcp: connect to the backend's host ports (published at the same numbers in the guest)."""
        km.ip = self.backend.host_ip
        ports = self.backend.reserve_ports(self.kernel_id)
        if not ports:
            return
        names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
        if [getattr(km, name) for name in names] != list(ports):
            km.cleanup_connection_file()  # ports changed (a first start, or a restart after a failed one)
            for name, port in zip(names, ports, strict=True):
                setattr(km, name, port)

    async def _set_up_encryption(self, km: Any) -> None:
        """CurveZMQ on the kernel's channels: always over tcp where the kernel can, else as km.transport_encryption says."""
        import zmq

        if not curve_capable(km):
            return  # a jupyter_client without transport encryption
        policy = transport_encryption_policy(km)
        wanted = policy in ("auto", "required") or self.backend.transport == "tcp"
        supported = (
            bool(zmq.has("curve"))
            and kernel_supports_curve(km)
            and await self.backend.supports_curve(self.template_spec.name, self.environment)
        )
        if wanted and supported:
            if km.curve_publickey is None:  # a restart keeps the keys, as it keeps the session key
                km.curve_publickey, km.curve_secretkey = zmq.curve_keypair()
                km.cleanup_connection_file()
        elif policy == "required":
            raise SandboxError(
                f"transport_encryption='required' but the {self.template_spec.name} kernel of the "
                f"{self.backend.name} backend cannot use CurveZMQ"
            )
        elif wanted and self.backend.transport == "tcp":
            log.warning(
                "kernel %s: its TCP channels are signed (HMAC) but not encrypted: the %s kernel does not speak "
                "CurveZMQ (rebuild the image with `msb-kernels image build %s --online`)",
                self.kernel_id,
                self.template_spec.name,
                self.template_spec.name,
            )

    async def _sweep_once(self) -> None:
        """The first start in a process removes sandboxes that a dead process left behind; a later one, the scratch
        dir's disks that no live sandbox holds (every DISK_SWEEP_EVERY seconds at most)."""
        key = str(self.backend.settings.runtime_root()) + self.backend.name
        last, now = _last_sweeps.get(key), time.monotonic()
        if last is not None and now - last < DISK_SWEEP_EVERY:
            return
        _last_sweeps[key] = now
        await (self.backend.sweep_orphans() if last is None else self.backend.sweep_leftovers(live_in_this_process()))

    def _guest_path(self, name: str) -> str:
        """Where the guest sees a file the host wrote for it (iodir.host_dir): read-only, its own to read."""
        return f"{self.backend.guest_host_dir}/{name}"

    def _write_guest_files(self) -> None:
        """The guest's connection file, startup file and helpers, into the directory the sandbox cannot write."""
        info = dict(self.connection_info)
        for key in ("key", "curve_publickey", "curve_secretkey", "curve_serverkey"):
            if isinstance(info.get(key), bytes):
                info[key] = info[key].decode()
        if self.backend.transport == "tcp" and self.backend.guest_sockets:
            info.update(transport="ipc", ip=self.backend.guest_sockets)  # a relay inside joins them to the ports
        elif self.backend.transport == "tcp":
            info["ip"] = self.backend.guest_ip
        if self.backend.transport == "ipc":
            info["ip"] = f"{self.backend.guest_io_dir}/kernel"  # its sockets: in the directory that is its own
        iodir.write_host_file(self.io_dir, GUEST_CONNECTION_FILE, json.dumps(info, indent=1))
        startup = self.template_spec.startup_code(self.flavor_spec.out_of_memory_message(), self.backend.guest_host_dir)
        iodir.write_host_file(self.io_dir, self.template_spec.startup_file, startup)
        for name, code in self.template_spec.helper_files().items():
            iodir.write_host_file(self.io_dir, name, code)

    def channel_names(self) -> dict[int, str]:
        """ipc: the name each of the kernel's sockets has in its io dir, by port (tslab binds "kernel:1")."""
        separator = self.template_spec.ipc_port_separator
        ports = [self.connection_info[name] for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")]
        return {port: f"kernel{separator}{port}" for port in ports}

    def _pin_channels(self, sandbox: Sandbox) -> None:
        """ipc: hold the kernel's bound sockets, each checked to be one its sandbox made (iodir.pin_channels); the host's
        clients connect to them through channels/, never through a name in the io dir."""
        self._unpin_channels()
        if self.backend.transport == "ipc":
            self.channel_pins = iodir.pin_channels(self.io_dir, self.channel_names(), sandbox.channel_uid)

    def _unpin_channels(self) -> None:
        if self.channel_pins is not None:
            pins, self.channel_pins = self.channel_pins, None
            pins.close()

    def _guest_connection_file(self) -> str:
        """The connection file the kernel reads: its own copy in its own directory, where the host's is read-only
        (ipykernel rewrites the file when curve keys are in it); SandboxSpec.copies makes it."""
        return f"{self.backend.guest_io_dir}/{GUEST_CONNECTION_FILE}"

    def _copies(self) -> list[tuple[str, str]]:
        source, destination = self._guest_path(GUEST_CONNECTION_FILE), self._guest_connection_file()
        return [] if source == destination else [(source, destination)]

    def _guest_argv(self, cmd: list[str]) -> list[str]:
        host_file = os.path.realpath(self.parent.connection_file)
        guest_file = self._guest_connection_file()
        argv = [guest_file if arg in (host_file, self.parent.connection_file) else arg for arg in cmd]
        argv += self.template_spec.launch_arguments(self._guest_path(self.template_spec.startup_file))
        return argv

    def _guest_env(self, argv0: str, volume: bool = False) -> dict[str, str]:
        """What the sandbox needs, and the session's own variables from its start request: nothing of this process's
        environment (its tokens and keys) is read. volume: the kernel mounts a shared volume, where its person's own
        packages are kept (PYTHONUSERBASE)."""
        cpus = str(self.flavor_spec.cpus)
        guest = {
            "PATH": f"{os.path.dirname(argv0)}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/home/sandbox",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "SHELL": "/bin/sh",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": cpus,
            "OPENBLAS_NUM_THREADS": cpus,
            "MKL_NUM_THREADS": cpus,
            "MSB_FLAVOR": self.flavor_spec.name,
            "MSB_SANDBOX": self.backend.name,
        }
        guest.update(self.template_spec.kernel_env(self.flavor_spec.memory_mib, self._guest_path(self.template_spec.startup_file)))
        if self.settings.has_shared_volume:
            guest["MSB_SHARED_VOLUME"] = self.settings.shared_volume_guest_path
        if volume and self.template_spec.user_packages:
            guest["PYTHONUSERBASE"] = user_base(self.settings.shared_volume_guest_path, self.environment or DEFAULT_ENVIRONMENT)
        guest.update(self.kernel_spec.env or {})  # the operator's kernelspec
        guest.update(self.start_request.kernel_variables())  # checked against the deny list when the request was made
        return guest

    async def _open_egress(self, env: dict[str, str]) -> EgressRoute:
        """The kernel's way out through this process's egress proxy (msb_kernels.egress.attach)."""
        from msb_kernels.egress.attach import KernelRoute  # only where a kernel has an allow-list: h11, the proxy's thread

        self.egress = KernelRoute(
            self.settings,
            self.backend,
            self.kernel_id,
            self.network,
            iodir.host_dir(self.io_dir),
            functools.partial(iodir.write_host_file, self.io_dir),
        )
        return await self.egress.open(env)

    async def _egress_at(self, address: str | None) -> None:
        if self.egress is not None:
            await self.egress.at(address)

    async def _close_egress(self) -> None:
        if self.egress is not None:
            egress, self.egress = self.egress, None
            await egress.close()

    def _shared_volume(self, request: StartRequest, person: Registered | None) -> SharedVolume | None:
        """The part of the shared volume this kernel mounts (its StartRequest's volume: its person's own, or the whole
        one): a host directory; on a cluster with MSB_SHARED_VOLUME_NAME, a Docker named volume (a host directory there
        is refused by the backend, by name). person: whose kernel it is (person_places.whose)."""
        guest = self.settings.shared_volume_guest_path
        if self.backend.runs_on_cluster and self.settings.shared_volume_name and request.volume is not None:
            named = docker_volume(self.settings.shared_volume_name, person.key if person else request.volume)
            return SharedVolume(None, guest, named)
        shared = person_places.volume_directory(self.settings, request.volume, person)
        return SharedVolume(shared, guest) if shared else None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        argv = self._guest_argv(cmd)
        request = self.start_request
        handout = request.for_pool and self.backend.hands_out  # its volume and Lab root come at hand-out (hand_out)
        person = None if handout else person_places.whose(self.settings, request.owner, request.volume)
        shared = None if handout else self._shared_volume(request, person)
        env = self._guest_env(argv[0], volume=shared is not None or (handout and self.settings.shared_volume is not None))
        registry = self.sandbox_registry
        try:
            egress = await self._open_egress(env) if self.network.proxied else None
        except BaseException:
            self._forget_failed_start(remove_dir=registry.adoptions.get(self.kernel_id) is None)
            raise
        spec = SandboxSpec(
            sandbox_id=self.kernel_id,
            flavor=self.flavor_spec,
            template=self.template_spec.name,
            environment=self.environment or DEFAULT_ENVIRONMENT,
            argv=argv,
            env=env,
            io_dir=self.io_dir,
            readonly_paths=[*self.template_spec.readonly_paths(), *hostpaths.interpreter_paths(argv[0])],
            shared_volume=shared,
            host_directories=[] if handout else labroot.lab_directories(self.settings, person),
            working_dir=None if handout else labroot.working_dir(self.settings, request.working_dir, person),
            copies=self._copies(),
            max_processes=self.settings.max_processes,
            allow_network=self.network.public,
            egress=egress,
            owner_pid=os.getpid(),
            adopt_grace=self._adopt_grace(),
            # A fork server imports its interpreter's ipykernel (and every .pth of its site-packages) on the host, outside
            # any sandbox: only the gateway's own environment is trusted that far. Another environment's packages came
            # from a requirements file, so its kernels start afresh, each inside its sandbox from the first instruction.
            fork=self.settings.fork_kernels and not self.environment,
            handout=handout,
            placeholders=[
                *labroot.hand_out_places(self.settings),
                *([self.settings.shared_volume_guest_path] if self.settings.shared_volume is not None else []),
            ]
            if handout
            else [],
        )
        if registry.adoptions.pop(self.kernel_id, None) is not None:
            try:
                adopted = await self.backend.adopt(spec)
                try:
                    self._pin_channels(adopted)  # a kernel whose io dir holds anything but its own sockets is not adopted
                except SandboxError:
                    await adopted.cleanup()  # refused cleanly: its sandbox goes, its session with it
                    raise
                self.sandbox = adopted
            except BaseException:
                self._forget_failed_start()
                raise
            registry.live_sandboxes[self.kernel_id] = self.sandbox
            self._connect_at(self.sandbox.address)
            await self._egress_at(self.sandbox.address)
            log.info("kernel %s adopted, still running in its %s sandbox (%s)", self.kernel_id, self.backend.name, self.flavor_spec.name)
            return self.connection_info
        try:
            async with start_turn(self.settings):  # a start cancelled while it waits here held a session all the same
                self.sandbox = await self.backend.create(spec)
                registry.live_sandboxes[self.kernel_id] = self.sandbox
                self._connect_at(self.sandbox.address)
                await self._egress_at(self.sandbox.address)
                running = await self._until_listening(self.sandbox)
            if running:  # out of the start's turn: a kernel still importing past LISTEN_WAIT_SECONDS binds meanwhile
                running = await self._until_bound(self.sandbox)
                if running:
                    self._pin_channels(self.sandbox)
        except BaseException as exc:
            if isinstance(exc, Exception) and not isinstance(exc, (ConfigError, InvalidRequest, ResourceLimitExceeded)):
                self._distrust_backend()
            if self.sandbox is not None:  # cancelled while the kernel imported: nobody would ever stop this sandbox
                await asyncio.shield(self.cleanup(restart=False))
            else:
                self._forget_failed_start(remove_dir=True)
            raise
        if not running:  # gone before its kernel listened: jupyter_client reports it dead
            self._distrust_backend()
        log.info(
            "kernel %s started in a %s sandbox (%s, %d CPU, %d MiB)",
            self.kernel_id,
            self.backend.name,
            self.flavor_spec.name,
            self.flavor_spec.cpus,
            self.flavor_spec.memory_mib,
        )
        return self.connection_info

    async def hand_out(self, request: StartRequest) -> tuple[bool, str | None]:
        """Show this pooled kernel's sandbox (SandboxSpec.handout) the volume and Lab root a fresh start of request would
        have shown: whether it showed any, and the directory its kernel should work in (None: its home). SandboxError
        where it cannot: the pool then stops the kernel and the request starts its own. Called by the warm pool as it
        hands the kernel out."""
        sandbox = self.sandbox
        if sandbox is None or not sandbox.spec.handout:
            raise SandboxError("this kernel was not started for a hand-out")
        person = person_places.whose(self.settings, request.owner, request.volume)
        shared = self._shared_volume(request, person)
        directories = labroot.lab_directories(self.settings, person)
        working_dir = labroot.working_dir(self.settings, request.working_dir, person)
        if shared is not None or directories:  # else nothing to show: no helper, no exec
            await sandbox.hand_out(shared, directories)
        sandbox.spec = replace(sandbox.spec, shared_volume=shared, host_directories=directories, working_dir=working_dir)
        return shared is not None or bool(directories), working_dir

    def _distrust_backend(self) -> None:
        """This start failed in its backend: whatever start probe passed for it is proven again (msb_kernels.provisioning.probe)."""
        if self.kernel_id not in self.sandbox_registry.probe_kernel_ids:  # a probe's own failure is its verdict
            distrust(self.backend.name, self.parent.kernel_spec.argv, self.template_spec.name, self.settings)

    def _connect_at(self, address: str | None) -> None:
        """A kernel reached at its own address (a cluster's task): jupyter_client rewrites the connection file from this."""
        if address and self.connection_info.get("ip") != address:
            self.connection_info = {**self.connection_info, "ip": address}
            self.parent.ip = address
            for listener in list(self.sandbox_registry.kernel_moved_listeners):
                listener(self.kernel_id)

    def _forget_failed_start(self, remove_dir: bool = False) -> None:
        """Give back the ports and the session a start held: jupyter_client does not clean up after a failed start.

        remove_dir: no sandbox runs for this kernel, so its directory (connection file and key included) goes
        too; a later restart's pre_launch writes it anew. Never for a failed adoption, whose sandbox still runs."""
        self.backend.release_ports(self.kernel_id)
        self.sandbox_registry.release_session(self.kernel_id)
        if self.egress is not None:  # called from within the loop: close it there, without waiting for it
            asyncio.ensure_future(self._close_egress())
        if remove_dir and getattr(self, "io_dir", None) is not None:
            remove_state_dir(self.io_dir.parent, keep_io_dir=False)

    def _adopt_grace(self) -> float:
        """Seconds the sandbox outlives this process: a gateway's kernels (MSB_ADOPT_GRACE_SECONDS), so that the next
        gateway can adopt them; 0 for every other owner (msb-mcp, nbclient, papermill), whose kernels end with it."""
        manager = getattr(self.parent, "parent", None)
        return float(getattr(manager, "adopt_grace_seconds", 0) or 0)

    async def _until_listening(self, sandbox: Sandbox) -> bool:
        """Keep the start's turn until the kernel has bound its shell socket: past its imports, the CPU a start costs.
        False: the sandbox ended first."""
        port = self.connection_info["shell_port"]
        if self.backend.transport == "ipc":
            listening = functools.partial(iodir.bound_socket, self.io_dir, self.channel_names()[port])
        else:
            listening = functools.partial(sandbox.kernel_listening, port)
        deadline = time.monotonic() + LISTEN_WAIT_SECONDS
        while not listening() and time.monotonic() < deadline:
            if await sandbox.poll() is not None:
                return False
            await asyncio.sleep(0.002)  # a forked kernel binds within some 50 ms: a coarser step would add to every start
        return True

    async def _until_bound(self, sandbox: Sandbox) -> bool:
        """ipc: wait until the kernel has bound all five of its sockets (to pin them); False: the sandbox ended first.
        SandboxError after BIND_WAIT_SECONDS: a kernel that binds some and not the others is not one to connect to."""
        if self.backend.transport != "ipc":
            return True
        names = list(self.channel_names().values())
        deadline = time.monotonic() + BIND_WAIT_SECONDS
        while not all(iodir.bound_socket(self.io_dir, name, sandbox.channel_uid) for name in names):
            if await sandbox.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise SandboxError(f"the kernel did not bind its channels within {BIND_WAIT_SECONDS:.0f} s", ["run `msb-kernels doctor`"])
            await asyncio.sleep(0.005)
        return True

    async def cleanup(self, restart: bool = False) -> None:
        self._unpin_channels()
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            self.sandbox_registry.live_sandboxes.pop(self.kernel_id, None)
            self.last_exit_reason = sandbox.exit_reason()
            await sandbox.cleanup(keep_io_dir=restart)
        if not restart:
            self.sandbox_registry.release_session(self.kernel_id)
            await self._close_egress()
        if not restart and hasattr(self, "backend"):
            self.backend.release_ports(self.kernel_id)  # shutdown, cull, or the end after a crash

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update(
            flavor=self.flavor, template=self.template, environment=self.environment, sandbox=self.sandbox.info() if self.sandbox else None
        )
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.flavor = provisioner_info.get("flavor")
        self.template = provisioner_info.get("template", "python")
        self.environment = provisioner_info.get("environment")


def describe_kernel(km: Any) -> SandboxDescription | None:
    """The sandbox side of a kernel manager: its provisioner's describe(); None before its provisioner exists or for a
    kernel not in a sandbox. The one way the gateway and the MCP bridge look at a kernel's sandbox."""
    provisioner = getattr(km, "provisioner", None)
    return provisioner.describe() if isinstance(provisioner, SandboxProvisioner) else None
