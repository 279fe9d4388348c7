"""The OCI bundle of a gVisor sandbox: its root, mounts, limits, and pid 1's program (GUEST_INIT), which starts the
kernel, and the relays, as the sandbox's user.

Limits inside gVisor are sized here: RLIMIT_AS (the flavor and the address space an idle ipykernel reserves) and
RLIMIT_NPROC (process_limit: under ptrace each guest process costs the sandbox real host memory).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msb_kernels.backends.gvisor.netstack as netstack
from msb_kernels.backends.core import handout, hostpaths, iodir
from msb_kernels.backends.core.base import SandboxSpec
from msb_kernels.backends.core.guest import ETC_ENTRIES, PIP_ENV, REAPER, SANDBOX_HOME, SANDBOX_USER, SYSTEM_DIRS
from msb_kernels.egress.route import relay_source
from msb_kernels.kernelspecs.flavors import Flavor
from msb_kernels.kernelspecs.templates import TEMPLATES

GUEST_UID = 1000  # the kernel's uid and gid inside; what it makes through the gofer is this host uid's too
SENTRY_MEMORY_MIB = 384  # the Sentry, the gofer and their page tables, beside the kernel's own memory
# An idle ipykernel reserves about 750 MiB of address space it never touches (thread stacks, malloc
# arenas), so RLIMIT_AS is the flavor plus this: an allocation past the flavor is still a MemoryError.
ADDRESS_SPACE_HEADROOM_MIB = 768
# Under ptrace a forked guest process costs about 30 MiB of the sandbox's host memory even when it only
# sleeps (29 to 31 MiB each for 10 to 80 children of an idle kernel, read from the cgroup): gVisor copies
# written pages in large units. So the process limit inside is sized to the flavor's memory, to refuse a
# fork (EAGAIN, the kernel alive) well before the host's OOM kill would end the whole sandbox.
DISK_TMP, DISK_HOME = "tmp", "home"  # on the sandbox's disk: its /tmp and its home
GUEST_PROCESS_MIB = 32
KERNEL_RESERVE_MIB = 256  # the kernel's own memory before it forks, left out of the room for processes
PROCESS_ROOM_SHARE = 0.8  # of the host memory limit: the process limit bites while a fifth is still free

# pid 1 inside: starts the kernel in its own process group as the sandbox user, then becomes the
# namespace sandbox's reaper, which passes signals on (an interrupt is a SIGINT to pid 1 from `runsc
# kill`), reaps the orphans of shell escapes and exits as the kernel did. gVisor, unlike Linux, lets a
# process signal its namespace's init when their users match, so init is not the kernel's user: it
# starts as gVisor's root with INIT_CAPABILITIES, and keeps only CAP_KILL (to pass signals on) for
# the reaper. The kernel gives up every capability, its bounding set too.
GUEST_INIT = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_CAPBSET_DROP, CAP_KILL = 24, 5
status = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
relays = json.loads(sys.argv[3])  # each binds its ports as root (the egress relay's 53), then becomes the sandbox's user
for spec in relays["specs"]:
    if os.fork() == 0:
        os.setsid()
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", relays["source"], json.dumps(spec)])
kernel = os.fork()
if kernel == 0:
    os.setpgid(0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.setgroups([])
    os.setresgid(1000, 1000, 1000)
    os.setresuid(1000, 1000, 1000)
    for source, destination in relays["copies"]:  # the kernel's own copy of what the host wrote read-only
        data = open(source, "rb").read()
        copy = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.write(copy, data)
        os.close(copy)
    if os.environ.get("PIP_TARGET"):  # on sys.path from the start, so what %pip installs there imports at once
        os.makedirs(os.environ["PIP_TARGET"], exist_ok=True)
    os.execv(sys.argv[4], sys.argv[4:])
for cap in range(64):
    if cap != CAP_KILL:
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
os.set_inheritable(status, True)
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", sys.argv[1], str(kernel), "-1", str(status)])
"""
# What pid 1 holds until it has started the kernel: enough to change users, to open its status file in the
# kernel user's io dir, to bind the egress relay's port 53 and to trim its own bounding set; CAP_KILL is all it keeps.
# The relays (the egress route's, the tcp transport's) are msb_kernels/egress/relay_program.py.
INIT_CAPABILITIES = ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_OVERRIDE", "CAP_NET_BIND_SERVICE", "CAP_KILL"]


def process_limit(flavor: Flavor, max_processes: int) -> int:
    """RLIMIT_NPROC inside the sandbox: MSB_MAX_PROCESSES, or fewer where the flavor's memory holds fewer guest
    processes (small 27, medium 52, large 104: the kernel's own threads count too)."""
    room = (flavor.memory_mib + SENTRY_MEMORY_MIB) * PROCESS_ROOM_SHARE - KERNEL_RESERVE_MIB
    return max(16, min(max_processes, int(room // GUEST_PROCESS_MIB)))


def write_bundle(
    spec: SandboxSpec,
    state_dir: Path,
    cgroup_path: str | None,
    ports: list[int],
    guest_io_dir: str,
    guest_host_dir: str,
    disk: Path | None = None,
    shown: dict[str, Path] | None = None,
    slots: Path | None = None,
) -> Path:
    """The OCI bundle: a root that holds only generated /etc files and mount points, and the host's
    system directories, the kernel's interpreter and its io dir mounted into it. disk: the host's mount of the
    sandbox's disk (core/scratch.py), whose tmp/ and home/ are its /tmp and home; None: both are tmpfs. shown: the
    host's idmapped mounts of the shared volume and the host directories (core/idmap.py), by host path, served in their
    place. slots: a pooled sandbox's (core/handout.py), served at handout.GUEST_SLOTS until its hand-out."""
    shown = shown or {}
    bundle = state_dir / "bundle"
    root = bundle / "rootfs"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "passwd").write_text(
        f"root:x:0:0::/root:/usr/sbin/nologin\n{SANDBOX_USER}:x:1000:1000::{SANDBOX_HOME}:/bin/sh\n"
        "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
    )
    (root / "etc" / "group").write_text(f"root:x:0:\n{SANDBOX_USER}:x:1000:\nnogroup:x:65534:\n")
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "etc" / "hosts").write_text("127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n")
    (root / "etc" / "resolv.conf").write_text("nameserver 127.0.0.1\n" if spec.egress else "")
    mounts: list[dict] = []

    def bind(source: str, destination: str, readonly: bool) -> None:
        mounts.append({"destination": destination, "type": "bind", "source": source, "options": ["rbind", "ro" if readonly else "rw"]})

    for name in SYSTEM_DIRS:
        source = "/" + name
        if os.path.islink(source):  # merged /usr: the link, not a second mount
            os.symlink(os.readlink(source), root / name)
        elif os.path.isdir(source):
            bind(source, source, readonly=True)
    for name in ETC_ENTRIES:
        source = "/etc/" + name
        if os.path.exists(source):
            bind(os.path.realpath(source), source, readonly=True)
    flavor = spec.flavor
    if disk is not None:  # the flavor's disk, served by the gofer: on storage, not the kernel's memory
        bind(str(disk / DISK_TMP), "/tmp", readonly=False)
        bind(str(disk / DISK_HOME), SANDBOX_HOME, readonly=False)
    scratch_in_memory = (
        [] if disk is not None else [("/tmp", flavor.memory_scratch_mib, "1777"), (SANDBOX_HOME, flavor.memory_scratch_mib, "0700")]
    )
    for destination, size_mib, mode in (
        *scratch_in_memory,
        ("/dev/shm", flavor.shm_mib, "1777"),
        ("/run", 1, "0755"),
        *([(netstack.GUEST_SOCKETS, 1, "0700")] if ports else []),
    ):
        options = [f"size={size_mib}m", f"mode={mode}", "nosuid", "nodev"]
        if destination in (SANDBOX_HOME, netstack.GUEST_SOCKETS):
            options += ["uid=1000", "gid=1000"]
        mounts.append({"destination": destination, "type": "tmpfs", "source": "tmpfs", "options": options})
    if slots is not None:  # under /run's tmpfs: nothing of the host's path shows, and the hand-out detaches it
        bind(str(slots), handout.GUEST_SLOTS, readonly=False)
    for place in spec.placeholders:
        mounts.append({"destination": place, "type": "tmpfs", "source": "tmpfs", "options": ["size=64k", "mode=0755", "nosuid", "nodev"]})
    # After the tmpfs mounts, so what lies under /tmp or /home shows on top of them: Lab's root first, then the
    # kernel's and pid 1's interpreters, read-only even inside a writable Lab root.
    for directory in spec.host_directories:
        bind(str(shown.get(directory.path, directory.path)), directory.path, readonly=not directory.writable)
    for path in hostpaths.binds_for({*spec.readonly_paths, *hostpaths.own_interpreter_paths()}):
        bind(path, path, readonly=True)
    bind(str(spec.io_dir), guest_io_dir, readonly=False)
    bind(str(iodir.host_dir(spec.io_dir)), guest_host_dir, readonly=True)  # what the host wrote: the kernel's to read
    if spec.shared_volume:
        source = str(spec.shared_volume.host_path)
        bind(str(shown.get(source, source)), spec.shared_volume.guest_path, readonly=False)

    template = TEMPLATES[spec.template]
    argv = spec.argv
    relays = []
    if ports:  # tcp: the kernel's channels are Unix sockets of gVisor's, which the relay joins to its ports
        argv = template.unix_sockets_argv(argv, f"{netstack.GUEST_SOCKETS}/iopub-pipe")
        relays.append(netstack.guest_relay(ports, template.ipc_port_separator, 1000))
    if spec.egress:
        relays.append({"socket": spec.egress.socket, "bind": spec.egress.listeners, "user": 1000})
    env = dict(spec.env)
    if template.user_packages:
        env.update(PIP_ENV)
    processes = process_limit(spec.flavor, spec.max_processes)
    rlimits = [{"type": "RLIMIT_NPROC", "hard": processes, "soft": processes}, {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}]
    if template.data_limit_caps_memory:
        address_space = flavor.memory_bytes + ADDRESS_SPACE_HEADROOM_MIB * 1024 * 1024
        rlimits.append({"type": "RLIMIT_AS", "hard": address_space, "soft": address_space})
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "cwd": spec.working_dir or SANDBOX_HOME,
            "args": [
                sys.executable,
                "-I",
                "-S",
                "-c",
                GUEST_INIT,
                REAPER,
                f"{guest_io_dir}/exit_status",
                json.dumps({"specs": relays, "source": relay_source() if relays else "", "copies": [list(c) for c in spec.copies]}),
                *argv,
            ],
            "env": [f"{k}={v}" for k, v in env.items()],
            "noNewPrivileges": True,
            "rlimits": rlimits,
            "capabilities": {
                "bounding": INIT_CAPABILITIES,
                "effective": INIT_CAPABILITIES,
                "permitted": INIT_CAPABILITIES,
                "inheritable": [],
                "ambient": [],
            },
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        # A pooled sandbox's placeholders go where they lie: parents before what lies in them (a placeholder under /tmp
        # after /tmp's disk, an interpreter's binds under a placeholder after it). Other sandboxes keep the order above.
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            *(sorted(mounts, key=lambda m: len(Path(m["destination"]).parts)) if spec.placeholders else mounts),
        ],
        "linux": {"namespaces": [{"type": kind} for kind in ("pid", "network", "ipc", "uts", "mount")]},
    }
    if ports:  # gVisor's network stack takes the veth of the namespace made for it
        config["linux"]["namespaces"][1]["path"] = netstack.netns_path(netstack.names(spec.sandbox_id)[0])
    if cgroup_path:  # made and sized by us beforehand; runsc moves the Sentry and the gofer into it
        config["linux"]["cgroupsPath"] = cgroup_path
    _open_to_the_kernel(bundle, root, mounts)
    (bundle / "config.json").write_text(json.dumps(config, indent=1))
    return bundle


def _open_to_the_kernel(bundle: Path, root: Path, mounts: list[dict]) -> None:
    """The root's directories and /etc files with modes of their own, not what the operator's umask leaves: with umask
    077 the root and the mount points runsc would make (/home among them) were 0700, and the kernel's user (uid 1000
    inside) could reach nothing, its home included. The mount points are made here first, so runsc makes none."""
    for directory in (bundle, root, root / "etc"):
        os.chmod(directory, 0o755)
    for written in (root / "etc").iterdir():
        if not written.is_symlink():
            os.chmod(written, 0o644)
    for mount in mounts:
        parts = Path(mount["destination"]).parts[1:]
        if mount["type"] == "bind" and not os.path.isdir(mount["source"]):
            parts = parts[:-1]  # a file's mount point is made by runsc; its directories are made here
        place = root
        for part in parts:
            place = place / part
            if place.is_symlink():  # a merged /usr's link: what lies beyond is a mount of the host's own
                break
            if not place.exists():
                place.mkdir()
                os.chmod(place, 0o755)
