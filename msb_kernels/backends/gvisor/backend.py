"""The gVisor backend: each kernel in its own ``runsc`` sandbox, behind gVisor's application kernel.

Sandboxed code never makes a system call to the host kernel: gVisor's Sentry answers it.
Each sandbox has a directory under the runtime root:

    <runtime root>/<sandbox id>/state.json      who owns it, the runsc pid, its cgroup
    <runtime root>/<sandbox id>/io/             connection file and ZMQ ipc sockets (/run/kernel inside)
    <runtime root>/<sandbox id>/bundle/         the OCI bundle: config.json and a read-only root
    <runtime root>/runsc/                       runsc's own state (its --root)

The kernel creates its ipc sockets in /run/kernel, a bind mount of io/; ``--host-uds=create``
lets those sockets appear on the host, where jupyter_client connects to them. Limits:

- memory: the kernel's address space is capped at the flavor inside gVisor (RLIMIT_AS), so an
  allocation past it is a MemoryError; the host cgroup holds the whole sandbox, Sentry included,
  to the flavor plus ``SENTRY_MEMORY_MIB``, and its OOM kill is the exit reason;
- processes: RLIMIT_NPROC inside gVisor refuses the fork; a host pids limit near the kernel's own
  count would crash the Sentry instead, so the host limit is only a distant backstop;
- CPU: the host cgroup's CFS quota, for the whole sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from msb_kernels.backends.core import adoption, cgroups, hostpaths
from msb_kernels.backends.core.adoption import KeeperLink
from msb_kernels.backends.core.base import Availability, SandboxBackend, SandboxRecord, SandboxSpec
from msb_kernels.backends.core.guest import ETC_ENTRIES, REAPER, SANDBOX_HOME, SANDBOX_USER, SYSTEM_DIRS
from msb_kernels.backends.core.processes import PidfdProcess, process_start_time
from msb_kernels.backends.core.state import (
    HostCgroupSandbox,
    KernelStderr,
    adopt_held_sandbox,
    make_io_dir,
    new_state,
    read_states,
    remove_state_dir,
    take_orphans,
    write_state,
)
from msb_kernels.config import MsbSettings
from msb_kernels.errors import BackendUnavailable, SandboxError
from msb_kernels.flavors import Flavor
from msb_kernels.templates import TEMPLATES

log = logging.getLogger("msb_kernels")

SENTRY_MEMORY_MIB = 384  # the Sentry, the gofer and their page tables, beside the kernel's own memory
# An idle ipykernel reserves about 750 MiB of address space it never touches (thread stacks, malloc
# arenas), so RLIMIT_AS is the flavor plus this: an allocation past the flavor is still a MemoryError.
ADDRESS_SPACE_HEADROOM_MIB = 768
# Under ptrace a forked guest process costs about 30 MiB of the sandbox's host memory even when it only
# sleeps (29 to 31 MiB each for 10 to 80 children of an idle kernel, read from the cgroup): gVisor copies
# written pages in large units. So the process limit inside is sized to the flavor's memory, to refuse a
# fork (EAGAIN, the kernel alive) well before the host's OOM kill would end the whole sandbox.
GUEST_PROCESS_MIB = 32
KERNEL_RESERVE_MIB = 256  # the kernel's own memory before it forks, left out of the room for processes
PROCESS_ROOM_SHARE = 0.8  # of the host memory limit: the process limit bites while a fifth is still free
HOST_PIDS_BACKSTOP = 32  # x max_processes: under ptrace each guest process holds about 12 host tasks
SENTRY_THREADS = 512
USER_PACKAGES = f"{SANDBOX_HOME}/.local/site-packages"
INSTALL_HINT = "install gVisor's runsc: apt-get install runsc (Debian, Ubuntu), or see https://gvisor.dev/docs/user_guide/install/"

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
if sys.argv[3] != "-" and os.fork() == 0:  # the egress relay binds port 53 as root, then becomes the sandbox's user
    os.setsid()
    egress = json.loads(sys.argv[3])
    spec = json.dumps({"socket": egress["socket"], "bind": egress["listeners"], "user": 1000})
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", egress["source"], spec])
kernel = os.fork()
if kernel == 0:
    os.setpgid(0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.setgroups([])
    os.setresgid(1000, 1000, 1000)
    os.setresuid(1000, 1000, 1000)
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
INIT_CAPABILITIES = ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_OVERRIDE", "CAP_NET_BIND_SERVICE", "CAP_KILL"]


def process_limit(flavor: Flavor, max_processes: int) -> int:
    """RLIMIT_NPROC inside the sandbox: MSB_MAX_PROCESSES, or fewer where the flavor's memory holds fewer guest
    processes (small 27, medium 52, large 104: the kernel's own threads count too)."""
    room = (flavor.memory_mib + SENTRY_MEMORY_MIB) * PROCESS_ROOM_SHARE - KERNEL_RESERVE_MIB
    return max(16, min(max_processes, int(room // GUEST_PROCESS_MIB)))


@functools.cache
def runsc_path() -> str | None:
    return shutil.which("runsc") or next(
        (p for p in ("/usr/bin/runsc", "/usr/local/bin/runsc", "/usr/sbin/runsc") if os.access(p, os.X_OK)), None
    )


class GVisorSandbox(HostCgroupSandbox):
    """A kernel under ``runsc run`` (attached: the sandbox ends with that process), which is this process's child,
    or a keeper's (a PidfdProcess then)."""

    def __init__(
        self,
        spec: SandboxSpec,
        backend: GVisorBackend,
        state_dir: Path,
        process: asyncio.subprocess.Process | PidfdProcess,
        cgroup: cgroups.SandboxCgroup | None,
        stderr: KernelStderr | None,
        keeper: KeeperLink | None = None,
    ):
        super().__init__(spec, cgroup)
        self.stderr = stderr
        self.backend = backend
        self.state_dir = state_dir
        self.process = process
        self.keeper = keeper

    @property
    def init_pid(self) -> int:
        """The host process that holds the sandbox (runsc run): its descendants are the Sentry and the gofer."""
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """The kernel's status as a Popen returncode: negative for a signal, whether runsc or the kernel got it."""
        code = self.process.returncode
        if isinstance(self.process, PidfdProcess):
            return code  # the reaper's word, from exit_status
        return -(code - 128) if code is not None and code > 128 else code  # runsc run exits 128+N for signal N

    async def poll(self) -> int | None:
        return self.exit_code

    async def wait(self) -> int | None:
        await self.process.wait()
        return self.exit_code

    async def send_signal(self, signum: int) -> None:
        if self.process.returncode is not None:
            return
        if signum == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # runsc run is attached: the Sentry and the gofer go with it
            return
        await self.backend.runsc("kill", self.sandbox_id, str(int(signum)))

    async def kill(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.process.returncode is None
        await self.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.process.returncode is None
        await self.send_signal(signal.SIGTERM)

    def ended_with(self) -> int | None:
        return self.exit_code

    async def cleanup(self, keep_io_dir: bool = False) -> None:
        if self.process.returncode is None:
            await self.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), 10)
        self.latch_exit_reason()
        if self.keeper is not None:
            self.keeper.close()
        if isinstance(self.process, PidfdProcess):
            self.process.close()
        if self.stderr is not None:
            self.stderr.close()
        await self.backend.remove(self.state_dir, self.cgroup, keep_io_dir=keep_io_dir)

    def info(self) -> dict:
        return {**super().info(), "backend": "gvisor", "runsc_pid": self.process.pid, "limits": "cgroup" if self.cgroup else "rlimit"}


class GVisorBackend(SandboxBackend):
    name = "gvisor"
    auto_order = 50
    transports = ("ipc",)  # --network=none: no tcp path into the sandbox
    egress_routes = "socket"
    guest_io_dir = "/run/kernel"
    _availability: Availability | None = None

    def __init__(self, settings: MsbSettings):
        super().__init__(settings)
        self.root = settings.runtime_root()
        self.runsc_root = self.root / "runsc"
        self.hierarchy, self.limits_note = cgroups.detect()

    # -- availability ----------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        if cls._availability is None:
            cls._availability = cls._probe()
        return cls._availability

    @classmethod
    def _probe(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, "gVisor runs only on Linux")
        runsc = runsc_path()
        if runsc is None:
            return Availability(False, f"runsc is not installed; {INSTALL_HINT}")
        if os.geteuid() != 0:
            return Availability(False, "runsc needs root to create its sandboxes; run msb-kernels as root, or use MSB_BACKEND=namespace")
        try:
            version = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError) as exc:
            return Availability(False, f"{runsc} does not run: {exc}; {INSTALL_HINT}")
        hierarchy, note = cgroups.detect()
        warnings = (
            []
            if hierarchy
            else [
                f"the CPU quota and the host's memory backstop need cgroups ({note}); "
                "memory (RLIMIT_AS) and processes (RLIMIT_NPROC) are still capped inside gVisor"
            ]
        )
        return Availability(
            True,
            f"gVisor ({version.strip() or runsc}); limits by {note}" if hierarchy else f"gVisor ({version.strip() or runsc})",
            warnings,
        )

    # -- create ----------------------------------------------------------------

    def io_dir_for(self, sandbox_id: str) -> Path:
        return make_io_dir(self.root, sandbox_id)

    async def runsc(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """One runsc command on this backend's state (kill, delete, list)."""
        process = await asyncio.create_subprocess_exec(
            runsc_path() or "runsc", f"--root={self.runsc_root}", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            process.kill()
            out, err = await process.communicate()
        return subprocess.CompletedProcess(args, process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))

    def _bundle(self, spec: SandboxSpec, state_dir: Path, cgroup_path: str | None) -> Path:
        """The OCI bundle: a root that holds only generated /etc files and mount points, and the host's
        system directories, the kernel's interpreter and its io dir mounted into it."""
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
        for destination, size_mib, mode in (
            ("/tmp", flavor.memory_scratch_mib, "1777"),
            (SANDBOX_HOME, flavor.memory_scratch_mib, "0700"),
            ("/dev/shm", flavor.shm_mib, "1777"),
            ("/run", 1, "0755"),
        ):
            options = [f"size={size_mib}m", f"mode={mode}", "nosuid", "nodev"]
            if destination == SANDBOX_HOME:
                options += ["uid=1000", "gid=1000"]
            mounts.append({"destination": destination, "type": "tmpfs", "source": "tmpfs", "options": options})
        # After the tmpfs mounts, so what lies under /tmp or /home shows on top of them: Lab's root first, then the
        # kernel's and pid 1's interpreters, read-only even inside a writable Lab root.
        for directory in spec.host_directories:
            bind(directory.path, directory.path, readonly=not directory.writable)
        for path in hostpaths.binds_for({*spec.readonly_paths, *hostpaths.own_interpreter_paths()}):
            bind(path, path, readonly=True)
        bind(str(spec.io_dir), self.guest_io_dir, readonly=False)
        if spec.shared_volume:
            bind(str(spec.shared_volume.host_path), spec.shared_volume.guest_path, readonly=False)

        template = TEMPLATES[spec.template]
        env = dict(spec.env)
        if template.user_packages:
            env.update(PIP_TARGET=USER_PACKAGES, PYTHONPATH=USER_PACKAGES, PIP_DISABLE_PIP_VERSION_CHECK="1")
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
                    f"{self.guest_io_dir}/exit_status",
                    json.dumps(spec.egress.plan(with_source=True)) if spec.egress else "-",
                    *spec.argv,
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
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}, *mounts],
            "linux": {"namespaces": [{"type": kind} for kind in ("pid", "network", "ipc", "uts", "mount")]},
        }
        if cgroup_path:  # made and sized by us beforehand; runsc moves the Sentry and the gofer into it
            config["linux"]["cgroupsPath"] = cgroup_path
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    async def create(self, spec: SandboxSpec) -> GVisorSandbox:
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailable(f"the gvisor backend cannot run here: {availability.reason}")
        if spec.allow_network:
            raise SandboxError(
                "MSB_ALLOW_NETWORK is not supported by the gvisor backend: its sandboxes have no network",
                ["unset MSB_ALLOW_NETWORK", "or set MSB_BACKEND=namespace for kernels that need the internet"],
            )
        if self.hierarchy is None and self.settings.require_limits:
            raise SandboxError(
                f"cannot enforce flavor limits with cgroups ({self.limits_note}) and MSB_REQUIRE_LIMITS is set",
                ["run msb-kernels as root on a host with cgroups", "or unset MSB_REQUIRE_LIMITS"],
            )
        state_dir = spec.io_dir.parent
        os.chown(spec.io_dir, 1000, 1000)
        for child in spec.io_dir.iterdir():
            os.chown(child, 1000, 1000, follow_symlinks=False)
        self.runsc_root.mkdir(mode=0o700, exist_ok=True)
        cgroup = None
        if self.hierarchy is not None:
            cgroup = cgroups.SandboxCgroup(self.hierarchy, spec.sandbox_id)
            try:
                cgroup.create(
                    spec.flavor,
                    HOST_PIDS_BACKSTOP * spec.max_processes + SENTRY_THREADS,
                    memory_bytes=spec.flavor.memory_bytes + SENTRY_MEMORY_MIB * 1024 * 1024,
                )
            except OSError as exc:
                cgroup.destroy(timeout=0)
                raise SandboxError(f"cannot set flavor limits in cgroups: {exc}") from exc
        bundle = self._bundle(spec, state_dir, f"/{cgroups.GROUP_PARENT}/{spec.sandbox_id}" if cgroup else None)
        record = new_state(self.name, spec, cgroup=cgroup is not None)
        # runsc with SIGKILL as its parent-death signal: runsc run is attached, so when its parent dies, even by
        # kill -9, the whole sandbox goes with it. Its parent is this process, or the sandbox's keeper.
        argv = [
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
            runsc_path() or "runsc",
            f"--root={self.runsc_root}",
            "--network=none",
            "--host-uds=all" if spec.egress else "--host-uds=create",  # all: the relay connects to the proxy's socket
            "run",
            f"--bundle={bundle}",
            spec.sandbox_id,
        ]
        stderr_read, stderr_write = os.pipe()
        keeper = None
        try:
            if spec.adopt_grace > 0:
                process, keeper = await self._start_kept(spec, state_dir, argv, stderr_read, stderr_write)
                record.update(keeper_pid=keeper.keeper_pid, keeper_start=process_start_time(keeper.keeper_pid))
            else:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr_write, start_new_session=True
                )
        except (OSError, SandboxError) as exc:
            os.close(stderr_read)
            await self.remove(state_dir, cgroup, keep_io_dir=True)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot start runsc: {exc}", [INSTALL_HINT]) from exc
        finally:
            with contextlib.suppress(OSError):
                os.close(stderr_write)
        record.update(init_pid=process.pid, init_start=process_start_time(process.pid))  # runsc run, which holds it
        write_state(state_dir, record)
        return GVisorSandbox(spec, self, state_dir, process, cgroup, KernelStderr(spec.sandbox_id, stderr_read), keeper)

    async def _start_kept(
        self, spec: SandboxSpec, state_dir: Path, argv: list[str], stderr_read: int, stderr_write: int
    ) -> tuple[PidfdProcess, KeeperLink]:
        """runsc run as the child of the sandbox's keeper, which outlives this process."""
        keeper_pid, runsc_pid = await adoption.start_keeper(
            state_dir, spec.adopt_grace, argv=argv, stderr_fd=stderr_read, child_stderr_fd=stderr_write, sweep_env=self.settings_env()
        )
        try:
            keeper = KeeperLink.own(state_dir, keeper_pid)
        except SandboxError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(runsc_pid, signal.SIGKILL)
            raise
        if keeper.stderr_fd is not None:
            os.close(keeper.stderr_fd)  # this process reads its own copy
            keeper.stderr_fd = None
        try:
            return PidfdProcess(runsc_pid, spec.io_dir / "exit_status"), keeper
        except ProcessLookupError:
            keeper.close()
            raise SandboxError("runsc exited as soon as it started", [INSTALL_HINT]) from None

    async def adopt(self, spec: SandboxSpec) -> GVisorSandbox:
        state_dir = spec.io_dir.parent
        record, keeper, process = adopt_held_sandbox(self.name, state_dir, spec)
        cgroup = cgroups.SandboxCgroup(self.hierarchy, spec.sandbox_id) if self.hierarchy and record.get("cgroup") else None
        stderr = KernelStderr(spec.sandbox_id, keeper.stderr_fd) if keeper.stderr_fd is not None else None
        sandbox = GVisorSandbox(spec, self, state_dir, process, cgroup, stderr, keeper)
        sandbox.created = record.get("created", sandbox.created)
        return sandbox

    # -- removal and orphans ---------------------------------------------------

    async def remove(self, state_dir: Path, cgroup: cgroups.SandboxCgroup | None, *, keep_io_dir: bool) -> None:
        await self.runsc("delete", "--force", state_dir.name)
        if cgroup is not None and not cgroup.destroy():
            log.warning("cgroup of sandbox %s still has processes", state_dir.name)
        shutil.rmtree(state_dir / "bundle", ignore_errors=True)
        remove_state_dir(state_dir, keep_io_dir=keep_io_dir)

    def list_sandboxes(self) -> list[SandboxRecord]:
        return read_states(self.root, self.name)

    async def sweep_orphans(self, include_adoptable: bool = False) -> list[str]:
        swept = []
        for record in take_orphans(self.list_sandboxes(), include_adoptable=include_adoptable):
            cgroup = cgroups.SandboxCgroup(self.hierarchy, record.sandbox_id) if self.hierarchy and record.details.get("cgroup") else None
            await self.remove(self.root / record.sandbox_id, cgroup, keep_io_dir=False)
            swept.append(record.sandbox_id)
        if swept:
            log.info("swept %d orphaned gVisor sandbox(es): %s", len(swept), ", ".join(swept))
        return swept
