"""The namespace backend: each kernel in its own Linux namespaces, sized by cgroups.

The host side lives here; what runs inside is init_program.py. Each sandbox has a
directory under the runtime root:

    <runtime root>/<sandbox id>/state.json   who owns it, init's pid, its uid
    <runtime root>/<sandbox id>/io/          connection file and ZMQ ipc sockets (/run/kernel inside)
    <runtime root>/<sandbox id>/root/        mount point of the sandbox's root (in its own mount ns)
    <runtime root>/<sandbox id>/scratch/     mount point of its disk (or RAM) for /tmp and home (ditto)
    <scratch root>/<sandbox id>.img          that disk (core/scratch.py)

The state files are what the orphan sweep reads after a crash or a kill -9.

The host reaches the kernel over ipc sockets in io/ (the default), or with
MSB_TRANSPORT=tcp over five host ports: this process binds them on the host's
127.0.0.1 and holds them for the kernel's life (restarts included), and a relay
inside the sandbox joins them to the kernel's ports on the sandbox's own 127.0.0.1
(init_program._relay). The sandbox still has no route anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from msb_kernels.backends.core import cgroups, hostpaths, idmap, iodir, keeping, leftovers, scratch
from msb_kernels.backends.core.base import (
    Availability,
    SandboxBackend,
    SandboxRecord,
    SandboxSpec,
)
from msb_kernels.backends.core.guest import PIP_ENV, USER_PACKAGES
from msb_kernels.backends.core.keeping import KeeperLink
from msb_kernels.backends.core.ports import HostListeners, host_ports
from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ, PidfdProcess, process_start_time
from msb_kernels.backends.core.state import (
    KernelStderr,
    adopt_held_sandbox,
    new_state,
    read_states,
    remove_state_dir,
    take_orphans,
    unfinished_starts,
    write_state,
)
from msb_kernels.backends.namespace import network, uids
from msb_kernels.backends.namespace.forkservers import ForkServers, forkable
from msb_kernels.backends.namespace.sandbox import NamespaceSandbox
from msb_kernels.errors import BackendUnavailable, SandboxError
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.settings.config import MsbSettings

log = logging.getLogger("msb_kernels")

LAUNCH_TIMEOUT = 30.0
LAUNCHER = str(Path(__file__).resolve().with_name("init_program.py"))

_PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
flags = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
if os.geteuid() != 0:
    flags |= 0x10000000
if libc.unshare(flags) != 0:
    sys.exit(os.strerror(ctypes.get_errno()))
"""


class NamespaceBackend(SandboxBackend):
    name = "namespace"
    auto_order = 90
    transports = ("ipc", "tcp")
    egress_routes = "socket"
    guest_io_dir = "/run/kernel"
    guest_host_dir = iodir.GUEST_HOST_DIR
    guest_ip = "127.0.0.1"  # tcp: the sandbox's own loopback, where the relay connects
    _availability: Availability | None = None

    def __init__(self, settings: MsbSettings):
        super().__init__(settings)
        self.root = settings.runtime_root()
        self.hierarchy, self.limits_note = cgroups.detect()
        self.rootful = os.geteuid() == 0
        self.hands_out = self.rootful  # a hand-out enters the sandbox's mount namespace and attaches idmapped mounts
        self.no_disk = scratch.unavailable_reason()
        self.listeners = HostListeners(host_ports(settings), self.host_ip) if self.transport == "tcp" else None
        self.fork_servers = ForkServers(self.root / "forkservers")

    # -- tcp: host ports -------------------------------------------------------

    def reserve_ports(self, sandbox_id: str) -> list[int] | None:
        return self.listeners.reserve(sandbox_id) if self.listeners else None

    def release_ports(self, sandbox_id: str) -> None:
        if self.listeners:
            self.listeners.release(sandbox_id)

    def stats(self) -> dict:
        stats: dict = {"fork_servers": self.fork_servers.info()}
        if self.listeners:
            stats["ports"] = self.listeners.ports.stats()
        return stats

    # -- availability ----------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        if cls._availability is None:
            cls._availability = cls._probe()
        return cls._availability

    @classmethod
    def _probe(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, "Linux namespaces exist only on Linux")
        if not hasattr(os, "pidfd_open"):
            return Availability(False, "this Python lacks os.pidfd_open (needs Linux >= 5.3)")
        result = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=10)
        if result.returncode != 0:
            why = result.stderr.strip() or "unknown error"
            return Availability(
                False,
                f"cannot create namespaces ({why}); enable unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces>0) or run as root",
            )
        hierarchy, note = cgroups.detect()
        warnings = [] if hierarchy else [limits_warning(note)]
        no_disk = scratch.unavailable_reason()
        if no_disk:
            warnings.append(scratch.memory_scratch_note(no_disk))
        return Availability(True, f"Linux namespaces; limits by {note}" if hierarchy else "Linux namespaces; limits by rlimits", warnings)

    @classmethod
    def doctor_lines(cls, settings: MsbSettings) -> list[str]:
        """The network helper, and whether each flavor's disk is disk or RAM here."""
        lines = [f"namespace network: {network.describe(settings.allow_network)}"]
        reason = scratch.unavailable_reason()
        if reason is not None:
            return [*lines, f"disk (namespace and gvisor backends): {scratch.memory_scratch_note(reason)}"]
        root = settings.scratch_root()
        existing = next(p for p in (root, *root.parents) if p.exists())
        free_mib = shutil.disk_usage(existing).free // 2**20
        return [*lines, f"disk (namespace and gvisor backends): {scratch.disk_note(root)}; {free_mib} MiB free there now"]

    # -- create ----------------------------------------------------------------

    def io_dir_for(self, sandbox_id: str) -> Path:
        return iodir.make_dirs(self.root, sandbox_id, bounded=self.rootful)

    async def create(self, spec: SandboxSpec) -> NamespaceSandbox:
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailable(f"the namespace backend cannot run here: {availability.reason}")
        if self.hierarchy is None and self.settings.require_limits:
            raise SandboxError(
                f"cannot enforce flavor limits with cgroups ({self.limits_note}) and MSB_REQUIRE_LIMITS is set",
                ["run msb-kernels as root on a host with cgroups", "or unset MSB_REQUIRE_LIMITS to accept rlimits"],
            )
        listeners = self.listeners.bound(spec.sandbox_id) if self.listeners else []
        state_dir = spec.io_dir.parent
        network_plan = network.network_plan(state_dir, self.rootful) if spec.allow_network else None
        (state_dir / "root").mkdir(exist_ok=True)
        (state_dir / "scratch").mkdir(exist_ok=True)
        record = new_state(self.name, spec)
        uid, gid = (uids.claim(spec.sandbox_id), uids.SANDBOX_GID) if self.rootful else (os.geteuid(), os.getegid())
        record["uid"] = uid
        write_state(state_dir, record)
        iodir.open_to(spec.io_dir, uid, gid)

        image = formatting = None
        if self.no_disk is None:
            image = scratch.image_path(self.settings.scratch_root(), spec.sandbox_id)
            try:
                scratch.reserve_image(image, spec.flavor, reserve=self.settings.disk_reserve, state_dir=state_dir)
            except BaseException:
                self.remove_state(state_dir, None, keep_io_dir=True)
                raise
            formatting = scratch.Formatting(image)

        cgroup = None
        if self.hierarchy is not None:
            cgroup = cgroups.SandboxCgroup(self.hierarchy, spec.sandbox_id)
            try:
                cgroup.create(spec.flavor, spec.max_processes)
            except OSError as exc:
                cgroup.destroy(timeout=0)
                if formatting is not None:
                    formatting.close()
                self.remove_state(state_dir, None, keep_io_dir=True)
                raise SandboxError(f"cannot set flavor limits in cgroups: {exc}") from exc

        keep = spec.held  # a keeper holds the lifeline: for adoption, or to sweep at its owner's death
        try:
            shared_fd, shown_fds = self._shown_as_own(spec, uid, gid)
        except BaseException:
            if cgroup is not None:
                cgroup.destroy(timeout=0)
            if formatting is not None:
                formatting.close()
            self.remove_state(state_dir, None, keep_io_dir=True)
            raise
        lifeline_read, lifeline_write = os.pipe() if (spec.owner_pid or keep) else (None, None)
        template = TEMPLATES[spec.template]
        plan = {
            "sandbox_id": spec.sandbox_id,
            "rootful": self.rootful,
            "oom_score_adj": SANDBOX_OOM_SCORE_ADJ,
            "uid": uid,
            "gid": gid,
            "home_uid": uid if self.rootful else 0,
            "home_gid": gid if self.rootful else 0,
            "hostname": "sandbox",
            "root_dir": str(state_dir / "root"),
            "io_dir": str(spec.io_dir),
            "guest_io_dir": self.guest_io_dir,
            "host_dir": str(iodir.host_dir(spec.io_dir)),
            "guest_host_dir": self.guest_host_dir,
            "readonly_paths": hostpaths.binds_for({*spec.readonly_paths, *hostpaths.own_interpreter_paths()}),
            "shared": [str(spec.shared_volume.host_path), spec.shared_volume.guest_path] if spec.shared_volume else None,
            "shared_fd": shared_fd,
            "host_dirs": [[d.path, d.writable, fd] for d, fd in zip(spec.host_directories, shown_fds, strict=True)],
            "working_dir": spec.working_dir,
            "placeholders": spec.placeholders,
            "scratch_mount": str(state_dir / "scratch"),
            "scratch_image": str(image) if image else None,
            "scratch_bytes": spec.flavor.memory_scratch_mib * 1024 * 1024,
            "shm_bytes": spec.flavor.shm_mib * 1024 * 1024,
            "cgroup_procs": cgroup.procs_files() if cgroup else [],
            "nproc_limit": None if cgroup else spec.max_processes,
            "cpu_affinity": None if cgroup else spec.flavor.cpus,
            "data_limit": spec.flavor.memory_bytes if template.data_limit_caps_memory else None,
            "argv": spec.argv,
            "env": _with_user_packages(spec) if template.user_packages else spec.env,
            "python": sys.executable,
            "lifeline_fd": lifeline_read,
            "scratch_ready_fd": formatting.ready_fd if formatting else None,
            "kernel_dirs": [USER_PACKAGES] if template.user_packages else [],
            "kernel_copies": [list(copy) for copy in spec.copies],
            "network": network_plan,
            "egress": spec.egress.plan(with_source=False) if spec.egress else None,
            "listen_fds": [listener.fileno() for listener in listeners],
        }
        stderr_read, stderr_write = os.pipe()
        keeper = None
        try:
            try:
                process, forked = await self._launch(plan, stderr_write, spec.io_dir, spec.fork)
            except SandboxError:
                if formatting is not None and (failure := formatting.failure()) is not None:
                    raise failure from None  # what mkfs said, not only that init found no disk
                raise
            if formatting is not None:
                await formatting.finish()
            if keep:
                try:
                    keeper_pid, _ = await keeping.start_keeper(
                        state_dir,
                        spec.adopt_grace,
                        sandbox_pid=process.pid,
                        lifeline_fd=lifeline_write,
                        stderr_fd=stderr_read,
                        sweep_env=self.settings_env(),
                    )
                    keeper = KeeperLink.own(state_dir, keeper_pid)
                except BaseException:
                    process.kill()
                    process.close()
                    raise
                record.update(keeper_pid=keeper_pid, keeper_start=process_start_time(keeper_pid))
        except BaseException:
            with contextlib.suppress(OSError):
                os.set_blocking(stderr_read, False)
                said = os.read(stderr_read, 4096).decode(errors="replace").strip()
                if said:
                    log.warning("sandbox %s did not start; its stderr: %s", spec.sandbox_id, said)
            for fd in (lifeline_read, lifeline_write, stderr_read):
                if fd is not None:
                    os.close(fd)
            if formatting is not None:
                formatting.close()
            self.remove_state(state_dir, cgroup, keep_io_dir=True)
            raise
        finally:
            os.close(stderr_write)  # the sandbox holds its own copy now
            for fd in (shared_fd, *shown_fds):
                if fd is not None:
                    os.close(fd)  # attached in the sandbox by now, or never: either way no longer this process's
        if lifeline_read is not None:
            os.close(lifeline_read)  # init holds its own copy now
        if keeper is not None:
            os.close(lifeline_write)  # the keeper holds it
            lifeline_write = None
            if keeper.stderr_fd is not None:
                os.close(keeper.stderr_fd)  # this process reads its own copy
        record.update(
            init_pid=process.pid,
            init_start=process_start_time(process.pid),
            cgroup=cgroup is not None,
            forked=forked,
            ports=[listener.getsockname()[1] for listener in listeners],
        )
        write_state(state_dir, record)
        if self.rootful:
            uids.hand_over(uid, spec.sandbox_id, process.pid)
        sandbox = NamespaceSandbox(
            spec, self, state_dir, process, cgroup, lifeline_write, KernelStderr(spec.sandbox_id, stderr_read), keeper, forked
        )
        sandbox.channel_uid = uid
        return sandbox

    async def adopt(self, spec: SandboxSpec) -> NamespaceSandbox:
        state_dir = spec.io_dir.parent
        record, keeper, process = adopt_held_sandbox(self.name, state_dir, spec)
        if self.listeners and record.get("ports"):
            self.listeners.ports.claim(spec.sandbox_id, record["ports"])  # bound by the sandbox's relay, which kept them open
        cgroup = cgroups.SandboxCgroup(self.hierarchy, spec.sandbox_id) if self.hierarchy and record.get("cgroup") else None
        stderr = KernelStderr(spec.sandbox_id, keeper.stderr_fd) if keeper.stderr_fd is not None else None
        sandbox = NamespaceSandbox(spec, self, state_dir, process, cgroup, None, stderr, keeper, bool(record.get("forked")))
        sandbox.created = record.get("created", sandbox.created)
        sandbox.channel_uid = record.get("uid")
        return sandbox

    async def _launch(self, plan: dict, stderr: int, io_dir: Path, fork: bool) -> tuple[PidfdProcess, bool]:
        """Init's process, and whether the kernel was forked from a fork server (else exec'd by the launcher)."""
        interpreter = forkable(plan["argv"]) if fork else None
        if interpreter is not None:
            fds = [stderr, *self._passed_fds(plan)]
            forked = await self.fork_servers.launch(interpreter, plan, fds)
            if forked is not None:
                report, connection = forked
                with connection:  # the launcher waits for it to close: by then init's pidfd is held
                    return self._launched(report, io_dir), True
        # -S -I: no site-packages, no environment; the launcher needs only the standard library.
        launcher = await asyncio.create_subprocess_exec(
            sys.executable,
            "-S",
            "-I",
            LAUNCHER,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={"PATH": "/usr/bin:/bin"},
            pass_fds=self._passed_fds(plan),
            start_new_session=True,
        )
        assert launcher.stdin and launcher.stdout
        try:
            launcher.stdin.write((json.dumps(plan) + "\n").encode())
            await launcher.stdin.drain()
            line = await asyncio.wait_for(launcher.stdout.readline(), LAUNCH_TIMEOUT)
            process = self._launched(json.loads(line or b'{"error": "the sandbox launcher exited without a report"}'), io_dir)
        except asyncio.TimeoutError:
            launcher.kill()
            raise SandboxError(f"the sandbox did not start within {LAUNCH_TIMEOUT:.0f} s") from None
        finally:
            launcher.stdin.close()
            await launcher.wait()
        return process, False

    @staticmethod
    def _passed_fds(plan: dict) -> list[int]:
        """The descriptors the launcher gets with the plan, in the order forkserver_program.py takes them."""
        named = (plan["lifeline_fd"], plan["scratch_ready_fd"], plan["shared_fd"], *(entry[2] for entry in plan["host_dirs"]))
        return [fd for fd in named if fd is not None] + plan["listen_fds"]

    def _shown_as_own(self, spec: SandboxSpec, uid: int, gid: int) -> tuple[int | None, list[int | None]]:
        """The shared volume's and each host directory's detached idmapped mount (core/idmap.py), where the owner's
        files are the sandbox user's, for init to attach; None for each bound as it is (not root: the sandbox runs as
        this user; or a directory of the system's, root's)."""
        if not self.rootful:
            return None, [None] * len(spec.host_directories)
        seen_as, made = idmap.Owner(uid, gid), []
        try:
            if spec.shared_volume is not None:
                made.append(idmap.shown_as(str(spec.shared_volume.host_path), seen_as))
            for directory in spec.host_directories:
                made.append(
                    idmap.shown_as(directory.path, seen_as, readonly=not directory.writable) if os.path.isdir(directory.path) else None
                )
        except BaseException:
            for fd in made:
                if fd is not None:
                    os.close(fd)
            raise
        return (made.pop(0) if spec.shared_volume is not None else None), made

    @staticmethod
    def _launched(report: dict, io_dir: Path) -> PidfdProcess:
        """Init's process from the launcher's report, taken before the launcher (init's parent) may exit."""
        if "error" in report:
            # From the OSError the launcher or the fork server met, so limits.over_limit sees its errno (EAGAIN).
            cause = OSError(report["errno"], os.strerror(report["errno"])) if isinstance(report.get("errno"), int) else None
            raise SandboxError(report["error"], ["run `msb-kernels doctor` to check this host"]) from cause
        return PidfdProcess(int(report["pid"]), io_dir)

    # -- removal and orphans ---------------------------------------------------

    def remove_state(self, state_dir: Path, cgroup: cgroups.SandboxCgroup | None, *, keep_io_dir: bool) -> None:
        if cgroup is not None and not cgroup.destroy():
            log.warning("cgroup of sandbox %s still has processes", state_dir.name)
        if self.rootful:
            with contextlib.suppress(OSError, ValueError):
                uids.release(json.loads((state_dir / "state.json").read_text()).get("uid"), state_dir.name)
        if self.no_disk is None:
            # Its loop device lets go once the sandbox's mount namespace is gone; the blocks are freed then.
            scratch.remove_image(scratch.image_path(self.settings.scratch_root(), state_dir.name))
        remove_state_dir(state_dir, keep_io_dir=keep_io_dir)

    def list_sandboxes(self) -> list[SandboxRecord]:
        return read_states(self.root, self.name)

    async def sweep_orphans(self, include_adoptable: bool = False) -> list[str]:
        swept = []
        for state_dir in unfinished_starts(self.root, leftovers.STARTS_WITHIN):  # an owner that died mid-start
            remove_state_dir(state_dir, keep_io_dir=False)
            swept.append(state_dir.name)
        for record in take_orphans(self.list_sandboxes(), include_adoptable=include_adoptable):
            cgroup = cgroups.SandboxCgroup(self.hierarchy, record.sandbox_id) if self.hierarchy and record.details.get("cgroup") else None
            self.remove_state(self.root / record.sandbox_id, cgroup, keep_io_dir=False)
            swept.append(record.sandbox_id)
        if swept:
            log.info("swept %d orphaned sandbox(es): %s", len(swept), ", ".join(swept))
        await self.sweep_leftovers()
        return swept


def _with_user_packages(spec: SandboxSpec) -> dict[str, str]:
    """The kernel's Python environment is read-only here, so `%pip install` goes to the sandbox's home (PIP_ENV)."""
    return {**spec.env, **PIP_ENV}


def limits_warning(note: str) -> str:
    return (
        f"flavor limits are only partly enforced: {note}. Without cgroups, memory is capped per process "
        "(RLIMIT_DATA), not for the whole sandbox, and page cache and tmpfs are not counted; CPU is pinned to "
        "the flavor's number of cores rather than a quota; processes are capped per user (RLIMIT_NPROC). "
        "Run msb-kernels as root on a host with cgroups for full limits."
    )
