"""Settings: environment variables first, Jupyter (traitlets) config on top.

Every setting has one trait here. Its default comes from an ``MSB_*`` variable, and
``c.MsbSettings.<name>`` in a Jupyter config file (``msb_kernels_config.py`` or
``.json`` on the Jupyter config path, or the config of the app that starts the
kernel) overrides it, the way ``JUPYTER_TOKEN`` and ``c.ServerApp.token`` relate.
A bad value raises ConfigError naming the variable and the accepted values.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Int, Unicode
from traitlets.config import Config, Configurable

from msb_kernels.egress import checks as egress_checks
from msb_kernels.errors import ConfigError
from msb_kernels.identity.person_registry import ACCOUNT_SOURCES
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.settings import value_checks as checks

BACKEND_ENTRY_POINTS = "msb_kernels.backends"  # name = module:SandboxBackend subclass
# The backends this package ships, also when it runs from a source tree that was never
# installed (no entry points then); other packages add theirs as entry points.
# The built-in backends' entry points (pyproject.toml), registered here too, as jupyter_client registers its
# LocalProvisioner: a checkout used without `pip install` (or an install whose metadata is stale) still has them.
BUILTIN_BACKENDS = {
    "namespace": "msb_kernels.backends.namespace.backend:NamespaceBackend",
    "gvisor": "msb_kernels.backends.gvisor.backend:GVisorBackend",
    "microsandbox": "msb_kernels.backends.microsandbox.backend:MicrosandboxBackend",
    "swarm": "msb_kernels.backends.cluster.backend:SwarmBackend",
}


@functools.cache
def backend_locations() -> dict[str, str]:
    """Every backend by name, as "module:class" (nothing imported here): the ``msb_kernels.backends`` entry points,
    the built-in ones among them.

    Read once per process: scanning the installed distributions costs milliseconds, and every
    load_settings (each kernel start) checks MSB_BACKEND against these names."""
    found = {entry_point.name: entry_point.value for entry_point in entry_points(group=BACKEND_ENTRY_POINTS)}
    return {**BUILTIN_BACKENDS, **found}


def backend_names() -> tuple[str, ...]:
    """What MSB_BACKEND accepts: auto and every backend's name (built-in ones first)."""
    return ("auto", *backend_locations())


TRANSPORTS = ("auto", "ipc", "tcp")  # MSB_TRANSPORT; each backend says which of ipc and tcp it can use


def _env_name(trait_name: str) -> str:
    return "MSB_" + trait_name.upper()


class MsbSettings(Configurable):
    """Settings shared by the provisioner, the gateway and the MCP bridge."""

    default_flavor = Unicode("small", help="Flavor for kernels that do not ask for one: small, medium or large.").tag(config=True)
    session_timeout_seconds = Int(1800, help="Idle seconds before a kernel is culled (0 = never).").tag(config=True)
    max_sessions = Int(10, help="Most sandboxed kernels one msb-kernels process runs at once.").tag(config=True)
    shared_volume_path = Unicode(None, allow_none=True, help="Host directory mounted into every sandbox (unset = none).").tag(config=True)
    shared_volume_guest_path = Unicode("/shared", help="Where the shared volume appears inside the sandbox.").tag(config=True)
    shared_volume_name = Unicode(
        None,
        allow_none=True,
        help="On Docker Swarm (no host directory reaches a node): the Docker named volume kernels mount at the guest path, "
        "msb-<name>; each person's own is <it>-<their name>. Unset = none.",
    ).tag(config=True)
    backend = Unicode("auto", help="Sandbox backend: auto, namespace, gvisor, microsandbox or swarm (never picked by auto).").tag(
        config=True
    )
    max_processes = Int(256, help="Most processes (and threads) one sandbox may hold; contains fork bombs.").tag(config=True)
    concurrent_starts = Int(
        None,
        allow_none=True,
        help="Sandboxes one process starts at once; more wait their turn, so a burst of starts "
        "is ready first come, first served instead of all late together. Unset = the host's CPUs.",
    ).tag(config=True)
    runtime_dir = Unicode(None, allow_none=True, help="Host directory for sandbox state and kernel sockets.").tag(config=True)
    state_dir = Unicode(
        None,
        allow_none=True,
        help="Host directory for what the gateway keeps across reboots: each person's key and host ids (people.json). "
        "Unset = /var/lib/msb-kernels as root, else $XDG_STATE_HOME/msb-kernels (~/.local/state/msb-kernels).",
    ).tag(config=True)
    host_accounts = Unicode(
        None,
        allow_none=True,
        help="The source whose names are this host's logins: hub (JupyterHub with LocalProcessSpawner, which runs each "
        "person's server as their login) or users-file. Such a person's files are their login's, and their Lab root may "
        "be their login's home. Unset = no name is an account: every person gets host ids of their own.",
    ).tag(config=True)
    environments_dir = Unicode(
        None,
        allow_none=True,
        help="Where the registered Python environments are recorded (environments.json) and created ones are built "
        "(unset = <this environment>/share/msb-kernels/environments).",
    ).tag(config=True)
    disk_reserve = Bool(
        True,
        help="Reserve each namespace sandbox's whole disk on the host at start, so sandboxes together can never fill "
        "the host's disk; false: sparse disks, each still capped at its flavor's size, started only while "
        "the host has that much free.",
    ).tag(config=True)
    scratch_dir = Unicode(
        None,
        allow_none=True,
        help="Host directory on a disk for the namespace sandboxes' scratch disk images (unset = /var/tmp/msb-kernels).",
    ).tag(config=True)
    fork_kernels = Bool(
        True,
        help="Start namespace-sandboxed Python kernels as forks of a server per Python environment that has "
        "imported ipykernel once (about 10 times faster, and their pages shared); false: every kernel "
        "starts its interpreter afresh.",
    ).tag(config=True)
    require_limits = Bool(False, help="Refuse to start a sandbox whose flavor limits cannot all be enforced with cgroups.").tag(config=True)
    transport = Unicode(
        "auto",
        help="How the host reaches kernels' ZMQ channels: auto (the backend's own: ipc for namespace and gVisor, "
        "tcp for microVMs), ipc, or tcp (namespace: through host ports from MSB_PORT_RANGE, with CurveZMQ on; "
        "for kernels whose ZMQ has no ipc).",
    ).tag(config=True)
    port_range = Unicode(
        "8000-9000", help="Host TCP ports for kernels reached over tcp (microVMs, MSB_TRANSPORT=tcp), as FIRST-LAST (5 per kernel)."
    ).tag(config=True)
    allow_network = Bool(
        False,
        help="Let kernels reach the public internet (outbound), never the host or its LAN: "
        "microVMs by their network policy, namespace sandboxes through slirp4netns.",
    ).tag(config=True)
    network_allow = Unicode(
        None,
        allow_none=True,
        help="Hosts kernels reach through the egress proxy: names, *.wildcards, * or networks, with :ports "
        "(none = 80 and 443); kernels have no other way out. Unset = no network (or MSB_ALLOW_NETWORK's).",
    ).tag(config=True)
    network_dns = Unicode(
        None, allow_none=True, help="DNS servers the egress proxy asks, ADDRESS[:PORT],...; unset = the host's resolver."
    ).tag(config=True)
    network_ca_file = Unicode(None, allow_none=True, help="A PEM file of CAs the egress proxy trusts beside the system's.").tag(config=True)
    network_secrets_file = Unicode(
        None, allow_none=True, help='Secrets for every kernel, as JSON {"NAME": {"value": ..., "hosts": [...]}}; kernels see placeholders.'
    ).tag(config=True)
    python_image = Unicode(
        "msb-kernels/python:latest", help="microVM image for python kernels (build it with `msb-kernels image build python`)."
    ).tag(config=True)
    node_image = Unicode(
        "msb-kernels/node:latest", help="microVM image for node kernels (build it with `msb-kernels image build node`)."
    ).tag(config=True)
    boot_timeout_seconds = Int(
        30, help="Seconds a microVM (and the smoke boot of MSB_BACKEND=auto), or a Swarm service's kernel, may take to start."
    ).tag(config=True)
    swarm_network = Unicode(
        "msb-kernels",
        help="MSB_BACKEND=swarm: the overlay network kernels run on, made internal and attachable if missing; the gateway joins it.",
    ).tag(config=True)
    swarm_owner = Unicode(
        None,
        allow_none=True,
        help="MSB_BACKEND=swarm: who this gateway is to the swarm, stable across its restarts (the stack file sets the service's "
        "name); unset = this host and runtime dir. Its kernels are adopted by the next gateway of the same owner.",
    ).tag(config=True)
    swarm_egress_host = Unicode(
        None, allow_none=True, help="MSB_BACKEND=swarm: the name kernels reach the egress proxy by; unset = this gateway's address."
    ).tag(config=True)
    swarm_egress_port = Int(3129, help="MSB_BACKEND=swarm: the port of the egress proxy on the kernels' network.").tag(config=True)

    # msb-kernels serve (the gateway)
    host = Unicode("127.0.0.1", help="Address msb-kernels serve listens on.").tag(config=True)
    port = Int(8765, help="TCP port msb-kernels serve listens on.").tag(config=True)
    token = Unicode(None, allow_none=True, help="Token clients send (Authorization: token ...); unset = generated and printed.").tag(
        config=True
    )
    users_file = Unicode(
        None,
        allow_none=True,
        help="A team's people without a JupyterHub: a JSON file of hashed tokens and admin flags, written by "
        "`msb-kernels users add`; each person sees only their own kernels. Unset = the single token (one person).",
    ).tag(config=True)
    hub_auth_cache_seconds = Int(
        30, help="Under JupyterHub: seconds a Hub token's check is remembered (a revoked token is refused after at most this)."
    ).tag(config=True)
    runsc = Unicode(
        None,
        allow_none=True,
        help="The runsc binary gVisor kernels run under. Unset = this environment's own (./scripts/run installs Debian 13's "
        "as root), else the host's runsc on PATH; either way the start probe runs `ls` and `stat` in it before auto picks it.",
    ).tag(config=True)
    runsc_platform = Unicode(
        "",
        help="gVisor's platform: systrap, ptrace or kvm; empty = measured on this host once (the kernel's imports under "
        "each) and the fastest kept (msb_kernels/backends/gvisor/platform.py).",
    ).tag(config=True)
    hub_proxy_url = Unicode(
        None,
        allow_none=True,
        help="Under JupyterHub: where the gateway reaches each person's JupyterLab through the Hub's proxy "
        "(<url>/user/<name>/), for the notebook tools. Unset = JupyterHub's public_url (its JUPYTERHUB_PUBLIC_URL); "
        "never a request's own Host or X-Forwarded-Host.",
    ).tag(config=True)
    max_sessions_per_user = Int(
        None, allow_none=True, help="Most kernels one person runs at once (admins too); unset = only MSB_MAX_SESSIONS."
    ).tag(config=True)
    user_memory_mib = Int(
        None,
        allow_none=True,
        help="Memory (MiB) one person's kernels' flavors may add up to, their share of MSB_CAPACITY_MEMORY_MIB; unset = no share.",
    ).tag(config=True)
    metrics_port = Int(
        None,
        allow_none=True,
        help="A port for /metrics without the token (for a scraper that sends none); unset = only /metrics on MSB_PORT.",
    ).tag(config=True)
    metrics_host = Unicode("127.0.0.1", help="The address MSB_METRICS_PORT's listener binds.").tag(config=True)
    capacity_memory_mib = Int(
        None, allow_none=True, help="Memory (MiB) the flavors of all kernels may add up to; unset = the host's memory."
    ).tag(config=True)
    capacity_cpus = Int(
        None,
        allow_none=True,
        help="CPUs the flavors of all kernels may add up to; unset = no CPU limit (CPU time is shared; each kernel is held to its flavor's CPUs).",
    ).tag(config=True)
    cull_interval_seconds = Int(60, help="How often the gateway looks for idle kernels.").tag(config=True)
    cull_connected = Bool(False, help="Cull idle kernels that still have a client connected (jupyter_server's default: no).").tag(
        config=True
    )
    cull_busy = Bool(False, help="Cull kernels that are busy (jupyter_server's default: no).").tag(config=True)
    offline_buffer_mib = Int(
        16,
        help="MiB of a kernel's messages the gateway keeps for a notebook client whose WebSocket "
        "closed, to replay when it reconnects (jupyter_server keeps them without a bound). Past it "
        "they are dropped and the client reconnects without them. 0: nothing is kept.",
    ).tag(config=True)
    hibernate_after_seconds = Int(
        0,
        help="gVisor: idle seconds after which a kernel is checkpointed to disk and its memory freed, restored with its "
        "state at its next request (0 = never; culling after MSB_SESSION_TIMEOUT_SECONDS still applies).",
    ).tag(config=True)
    hibernate_dir = Unicode(
        None, allow_none=True, help="Where hibernated kernels' images are kept; unset = MSB_SCRATCH_DIR/hibernate."
    ).tag(config=True)
    hibernate_key_file = Unicode(
        None, allow_none=True, help="A file of 32 random bytes (or 64 hex digits): hibernation images are encrypted with it (AES-GCM)."
    ).tag(config=True)
    hibernate_disk_mib = Int(None, allow_none=True, help="MiB all hibernation images may take together; unset = no limit.").tag(config=True)
    keep_kernels = Bool(
        False,
        help="A clean stop of msb-kernels serve leaves its kernels running, for the next one on the same "
        "runtime dir to adopt (`serve --keep-kernels`); without it a clean stop stops them all.",
    ).tag(config=True)
    adopt_grace_seconds = Int(
        300,
        help="Seconds the gateway's kernels outlive it (a keep stop, a crash, a kill -9) for the next "
        "msb-kernels serve on the same runtime dir to adopt them; past it they are stopped. "
        "0: kernels end with the gateway.",
    ).tag(config=True)
    # warm pool
    pool_size = Unicode("python-small=1", help="Kernels kept started per kernelspec, as [ENVIRONMENT-]TEMPLATE-FLAVOR=COUNT,...").tag(
        config=True
    )
    pool_counts_as_sessions = Bool(False, help="Count waiting pooled kernels toward MSB_MAX_SESSIONS and the capacity.").tag(config=True)
    # the MCP bridge
    mcp_running_after_seconds = Float(50.0, help="A tool call returns status running (with an execution id) after this long.").tag(
        config=True
    )
    mcp_default_timeout_seconds = Float(300.0, help="Timeout of an execution that names none; past it the kernel is interrupted.").tag(
        config=True
    )
    mcp_max_timeout_seconds = Float(86400.0, help="The largest timeout a caller may ask for.").tag(config=True)
    mcp_max_output_chars = Int(200_000, help="Characters of output kept per execution; more is truncated with a note.").tag(config=True)
    mcp_max_code_chars = Int(1_000_000, help="Largest code or command line accepted, in characters.").tag(config=True)
    mcp_progress_interval_seconds = Float(5.0, help="Progress notifications go out at least this often while code runs.").tag(config=True)
    mcp_kept_executions = Int(16, help="Finished executions kept per session for get_execution_output.").tag(config=True)
    mcp_kernel_start_timeout_seconds = Float(60.0, help="Seconds to wait for a kernel to start.").tag(config=True)
    lab_url = Unicode(
        None,
        allow_none=True,
        help="The JupyterLab server (run with --gateway-url) whose notebooks the MCP notebook tools edit; unset = no notebook tools.",
    ).tag(config=True)
    lab_token = Unicode(None, allow_none=True, help="The token of the JupyterLab server at lab_url.").tag(config=True)
    lab_root_path = Unicode(
        None,
        allow_none=True,
        help="JupyterLab's root directory on this host, shown in the sandbox at the same path; a notebook's kernel starts in "
        "its notebook's directory. With {username} (e.g. /home/{username}), each person's own root, shown read-write to their "
        "kernels only; without, one Lab's root, shown to the host's own user's kernels only, never to a person of the users "
        "file or the Hub. Unset = not shown.",
    ).tag(config=True)
    lab_root_writable = Bool(False, help="Let kernels write to lab_root_path (read-only by default).").tag(config=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        configured = set(self.config.get(type(self).__name__, {}))
        for name in self.trait_names(config=True):
            if name not in configured and _env_name(name) in os.environ:
                self._assign(name, os.environ[_env_name(name)], from_env=True)
        for name in self.trait_names(config=True):
            self._check(name, getattr(self, name))
        egress_checks.check_together(self.allow_network, self.network_allow, self.network_secrets_file)

    # -- parsing and checking -------------------------------------------------

    def _where(self, name: str) -> str:
        return f"{_env_name(name)} (c.{type(self).__name__}.{name})"

    def _assign(self, name: str, raw: str, *, from_env: bool) -> None:
        trait = self.traits()[name]
        value: Any = raw
        if raw.strip() == "" and trait.allow_none:
            value = None
        elif isinstance(trait, (Int, Float)):
            kind, noun = (int, "a whole number") if isinstance(trait, Int) else (float, "a number")
            try:
                value = kind(raw.strip())
            except ValueError:
                raise ConfigError(f"{self._where(name)}={raw!r} is not {noun}; {_ACCEPTED[name]}") from None
        elif isinstance(trait, Bool):
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", ""):
                raise ConfigError(f"{self._where(name)}={raw!r} is not a boolean; use true or false")
            value = lowered in ("1", "true", "yes")
        setattr(self, name, value)

    def _check(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None or value is None:
            return
        problem = check(value)
        if problem:
            raise ConfigError(f"{self._where(name)}={value!r} {problem}; {_ACCEPTED[name]}")

    # -- derived values -------------------------------------------------------

    @property
    def ports(self) -> tuple[int, int]:
        """MSB_PORT_RANGE as (first, last), both included."""
        return checks.parse_port_range(self.port_range)  # checked at start, so this does not raise

    @property
    def shared_volume(self) -> Path | None:
        return Path(self.shared_volume_path).resolve() if self.shared_volume_path else None

    @property
    def has_shared_volume(self) -> bool:
        """Whether kernels mount a shared volume: a host directory (MSB_SHARED_VOLUME_PATH), or on Docker Swarm a
        named volume (MSB_SHARED_VOLUME_NAME)."""
        return self.shared_volume is not None or self.shared_volume_name is not None

    @property
    def lab_root(self) -> Path | None:
        """The one Lab root (labroot.root_of tells whose root a kernel sees, a person's own among them)."""
        return Path(self.lab_root_path).resolve() if self.lab_root_path and checks.PERSON_FIELD not in self.lab_root_path else None

    def runtime_root(self) -> Path:
        """Where sandbox state and sockets live on the host (short, for AF_UNIX's 108-byte limit)."""
        if self.runtime_dir:
            return Path(self.runtime_dir)
        if os.geteuid() == 0:
            return Path("/run/msb-kernels")
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.access(xdg, os.W_OK):
            return Path(xdg) / "msb-kernels"
        return Path(f"/tmp/msb-kernels-{os.geteuid()}")

    def state_root(self) -> Path:
        """Where the gateway keeps what outlives a reboot (the person registry): on a disk, root's alone as root."""
        if self.state_dir:
            return Path(self.state_dir)
        if os.geteuid() == 0:
            return Path("/var/lib/msb-kernels")
        return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "msb-kernels"

    def environments_root(self) -> Path:
        """Where `msb-kernels env`, install and the gateway all find the environments: one place per msb-kernels install."""
        return Path(self.environments_dir) if self.environments_dir else Path(sys.prefix) / "share" / "msb-kernels" / "environments"

    def hibernate_root(self) -> Path:
        """Where hibernated kernels' images live: on a disk, as the scratch disks are."""
        return Path(self.hibernate_dir) if self.hibernate_dir else self.scratch_root() / "hibernate"

    def scratch_root(self) -> Path:
        """Where sandboxes' disk images live: on a disk, not under /run, which is RAM on most hosts."""
        return Path(self.scratch_dir) if self.scratch_dir else Path("/var/tmp/msb-kernels")


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "host": checks.check_host,
    "port": lambda v: None if 1 <= v <= 65535 else "is not a TCP port",
    "metrics_port": lambda v: None if 1 <= v <= 65535 else "is not a TCP port",
    "metrics_host": checks.check_host,
    "token": lambda v: "is empty, which would let anyone run code" if not v.strip() else None,
    "capacity_memory_mib": checks.at_least(1),
    "users_file": checks.check_users_file,
    "hub_auth_cache_seconds": lambda v: "is negative" if v < 0 else None,
    "runsc": lambda v: None if v is None or (os.path.isfile(v) and os.access(v, os.X_OK)) else "is not an executable file",
    "runsc_platform": lambda v: None if v in ("", "systrap", "ptrace", "kvm") else "is not a gVisor platform",
    "hub_proxy_url": lambda v: None if v is None or v.startswith(("http://", "https://")) else "is not an http:// or https:// URL",
    "max_sessions_per_user": checks.at_least(1),
    "user_memory_mib": checks.at_least(1),
    "capacity_cpus": checks.at_least(1),
    "cull_interval_seconds": checks.at_least(1),
    "pool_size": checks.check_pool_size,
    "environments_dir": checks.check_environments_dir,
    "mcp_running_after_seconds": checks.at_least(0.1),
    "mcp_default_timeout_seconds": checks.at_least(0.1),
    "mcp_max_timeout_seconds": checks.at_least(0.1),
    "mcp_max_output_chars": checks.at_least(100),
    "mcp_max_code_chars": checks.at_least(100),
    "mcp_progress_interval_seconds": lambda v: (
        None if 0.1 <= v <= 10 else "is not between 0.1 and 10 (clients expect a sign of life every 10 s)"
    ),
    "mcp_kept_executions": checks.at_least(1),
    "lab_url": lambda v: None if v is None or v.startswith(("http://", "https://")) else "is not an http:// or https:// URL",
    "mcp_kernel_start_timeout_seconds": checks.at_least(1),
    "default_flavor": checks.check_flavor,
    "session_timeout_seconds": lambda v: "is negative" if v < 0 else None,
    "max_sessions": lambda v: "is less than 1" if v < 1 else None,
    "max_processes": lambda v: "is less than 16" if v < 16 else None,
    "concurrent_starts": checks.at_least(1),
    "backend": lambda v: None if v in backend_names() else "is not a backend",
    "transport": lambda v: None if v in TRANSPORTS else "is not a transport",
    "shared_volume_path": checks.check_shared_path,
    "host_accounts": lambda v: None if v in ACCOUNT_SOURCES else "is not a source whose names are logins",
    "lab_root_path": checks.check_lab_root,
    "shared_volume_guest_path": checks.check_guest_path,
    "shared_volume_name": checks.check_volume_name,
    "port_range": checks.check_port_range,
    "python_image": checks.check_image,
    **egress_checks.CHECKS,
    "node_image": checks.check_image,
    "boot_timeout_seconds": lambda v: "is less than 1" if v < 1 else None,
    "swarm_network": lambda v: None if v and v.replace("-", "").replace("_", "").replace(".", "").isalnum() else "is not a network name",
    "swarm_owner": lambda v: "is empty" if not v.strip() else None,
    "swarm_egress_host": checks.check_host,
    "swarm_egress_port": lambda v: None if 1 <= v <= 65535 else "is not a TCP port",
    "adopt_grace_seconds": lambda v: "is negative" if v < 0 else None,
    "hibernate_after_seconds": lambda v: "is negative" if v < 0 else None,
    "hibernate_key_file": checks.check_key_file,
    "hibernate_disk_mib": checks.at_least(1),
    "offline_buffer_mib": lambda v: "is negative" if v < 0 else None,
}

_ACCEPTED: dict[str, str] = {
    "host": "use a host name or address such as 127.0.0.1 (or 0.0.0.0 for every interface)",
    "port": "use a TCP port from 1 to 65535",
    "metrics_port": "use a TCP port from 1 to 65535 other than MSB_PORT, or leave it unset",
    "metrics_host": "use an address only your Prometheus reaches, such as 127.0.0.1",
    "token": "set a long random secret, or leave it unset to have one generated",
    "capacity_memory_mib": "use a whole number of MiB >= 1, or leave it unset for the host's memory",
    "capacity_cpus": "use a whole number of CPUs >= 1, or leave it unset for no CPU limit",
    "users_file": "create it with `msb-kernels users add NAME --file PATH` (mode 0600), or leave it unset for the single token",
    "hub_auth_cache_seconds": "use a whole number of seconds >= 0 (0 asks the Hub at every request)",
    "runsc": "name runsc's full path, e.g. /usr/bin/runsc, or leave it unset for this environment's own (./scripts/run installs it)",
    "runsc_platform": "use systrap, ptrace or kvm, or leave it empty to have the fastest measured on this host",
    "hub_proxy_url": "use the URL this host reaches JupyterHub's proxy at, e.g. http://127.0.0.1:8000",
    "max_sessions_per_user": "use a whole number >= 1, or leave it unset for no per-person limit",
    "user_memory_mib": "use a whole number of MiB >= 1, or leave it unset for no per-person share",
    "cull_interval_seconds": "use a whole number of seconds >= 1",
    "cull_connected": "use true or false",
    "cull_busy": "use true or false",
    "offline_buffer_mib": "use a whole number of MiB >= 0 (0 keeps nothing for a closed WebSocket)",
    "pool_size": "use [ENVIRONMENT-]TEMPLATE-FLAVOR=COUNT pairs such as python-small=1,data-python-small=1,node-small=0 "
    "(0 everywhere turns the pool off)",
    "pool_counts_as_sessions": "use true or false",
    "mcp_running_after_seconds": "use a number of seconds > 0",
    "mcp_default_timeout_seconds": "use a number of seconds > 0",
    "mcp_max_timeout_seconds": "use a number of seconds > 0",
    "mcp_max_output_chars": "use a whole number >= 100",
    "mcp_max_code_chars": "use a whole number >= 100",
    "mcp_progress_interval_seconds": "use a number of seconds from 0.1 to 10",
    "mcp_kept_executions": "use a whole number >= 1",
    "lab_url": "use the URL JupyterLab prints, without the token, e.g. http://127.0.0.1:8888 (its token goes in MSB_LAB_TOKEN)",
    "mcp_kernel_start_timeout_seconds": "use a number of seconds >= 1",
    "default_flavor": f"use one of {', '.join(FLAVORS)}",
    "session_timeout_seconds": "use a whole number of seconds >= 0 (0 never culls)",
    "max_sessions": "use a whole number >= 1",
    "max_processes": "use a whole number >= 16",
    "concurrent_starts": "use a whole number >= 1, or leave it unset for the host's CPUs",
    "backend": "use one of " + ", ".join(backend_names()),
    "transport": "use one of " + ", ".join(TRANSPORTS),
    "shared_volume_path": "create the directory first, or unset the variable for no shared volume",
    "lab_root_path": "use the absolute path JupyterLab serves (its --ServerApp.root_dir), or a template of each person's such as /home/{username}; not a system directory, /tmp or /home itself",
    "shared_volume_guest_path": "use an absolute path such as /shared, outside /usr, /etc, /proc, /dev, /run, /tmp and /home",
    "shared_volume_name": "use a Docker volume name that starts with msb- (letters, digits, _ . -), such as msb-shared",
    "runtime_dir": "use a writable directory with a short path",
    "state_dir": "use a directory on a disk that survives reboots, readable by this user only",
    "host_accounts": f"use one of {', '.join(ACCOUNT_SOURCES)} (hub: JupyterHub's LocalProcessSpawner runs each person as their login), "
    "or leave it unset",
    "environments_dir": "use an absolute path to a directory (made at the first `msb-kernels env add`), or unset it for the default",
    "scratch_dir": "use a writable directory on a disk with room for the flavors' disks",
    "disk_reserve": "use true or false",
    "require_limits": "use true or false",
    "fork_kernels": "use true or false",
    "port_range": "use FIRST-LAST with 1024 <= FIRST <= LAST <= 65535 and at least 5 ports, such as 8000-9000",
    "allow_network": "use true or false",
    "python_image": "use an image reference such as msb-kernels/python:latest",
    **egress_checks.ACCEPTED,
    "node_image": "use an image reference such as msb-kernels/node:latest",
    "boot_timeout_seconds": "use a whole number of seconds >= 1",
    "swarm_network": "use a Docker network name such as msb-kernels (letters, digits, '-', '_', '.')",
    "swarm_owner": "use a name that stays the same across the gateway's restarts, such as its service name, or leave it unset",
    "swarm_egress_host": "use the gateway's service name (the stack sets it), or leave it unset for its address",
    "swarm_egress_port": "use a TCP port from 1 to 65535",
    "keep_kernels": "use true or false",
    "lab_root_writable": "use true or false",
    "adopt_grace_seconds": "use a whole number of seconds >= 0 (0: kernels end with the gateway)",
    "hibernate_after_seconds": "use a whole number of seconds >= 0 (0: kernels are culled, never hibernated)",
    "hibernate_dir": "use a writable directory on a disk with room for the kernels' memory",
    "hibernate_key_file": "use a file of 32 random bytes or 64 hex digits (head -c 32 /dev/urandom > key), readable by this user only",
    "hibernate_disk_mib": "use a whole number of MiB >= 1, or leave it unset for no limit",
}


def load_settings(parent_config: Config | None = None) -> MsbSettings:
    """Build settings from the environment, Jupyter config files and an app's config.

    Raises ConfigError on any bad value, naming the variable and what it accepts.
    """
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    merged = Config()
    for directory in reversed(jupyter_config_path()):
        for loader_class, filename in ((JSONFileConfigLoader, "msb_kernels_config.json"), (PyFileConfigLoader, "msb_kernels_config.py")):
            if os.path.isfile(os.path.join(directory, filename)):
                try:
                    merged.merge(loader_class(filename, path=directory).load_config())
                except Exception as exc:  # a broken config file is a config error, not a crash
                    raise ConfigError(f"cannot read {os.path.join(directory, filename)}: {exc}") from None
    if parent_config is not None:
        merged.merge(parent_config)
    return MsbSettings(config=merged)
