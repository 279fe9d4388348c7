"""The gVisor backend: each kernel in its own ``runsc`` sandbox, behind gVisor's application kernel.

Sandboxed code never makes a system call to the host kernel: gVisor's Sentry answers it.
Each sandbox has a directory under the runtime root:

    <runtime root>/<sandbox id>/state.json      who owns it, the runsc pid, its cgroup
    <runtime root>/<sandbox id>/io/             connection file and ZMQ ipc sockets (/run/kernel inside)
    <runtime root>/<sandbox id>/bundle/         the OCI bundle: config.json and a read-only root
    <runtime root>/<sandbox id>/disk/           the host's mount of its disk (core/scratch.py): /tmp and home
    <runtime root>/runsc/                       runsc's own state (its --root)

Under ipc (the default) the kernel creates its sockets in /run/kernel, a bind mount of io/; ``--host-uds=create``
lets them appear on the host, where jupyter_client connects to them. Under tcp (MSB_TRANSPORT=tcp, and where
kernels hibernate) they stay inside, behind gVisor's own network stack (netstack.py), which is what lets runsc
checkpoint the sandbox (checkpoint_images.py). Limits:

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
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msb_kernels.backends.gvisor.checkpoint_images as checkpoint_images
import msb_kernels.backends.gvisor.netstack as netstack
import msb_kernels.backends.gvisor.platform as gvisor_platform
import msb_kernels.backends.gvisor.runsc as runsc
from msb_kernels.backends.core import cgroups, handout, idmap, iodir, keeping, leftovers, scratch
from msb_kernels.backends.core.base import Availability, SandboxBackend, SandboxRecord, SandboxSpec
from msb_kernels.backends.core.keeping import KeeperLink
from msb_kernels.backends.core.ports import HostListeners, host_ports
from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ, PidfdProcess, process_start_time
from msb_kernels.backends.core.scratch import DISK_DIR
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
from msb_kernels.backends.gvisor.bundle import DISK_HOME, DISK_TMP, GUEST_UID, SENTRY_MEMORY_MIB, write_bundle
from msb_kernels.backends.gvisor.runsc import INSTALL_HINT, runsc_path
from msb_kernels.backends.gvisor.sandbox import GVisorSandbox, checkpoint_error
from msb_kernels.errors import BackendUnavailable, SandboxError
from msb_kernels.settings.config import MsbSettings
from msb_kernels.settings.value_checks import read_key

log = logging.getLogger("msb_kernels")

SHOWN_DIR = "shown"  # in a sandbox's state dir: the host's idmapped mounts of its shared volume and Lab root
RESTORE_TIMEOUT = 120  # seconds for runsc restore to bring a hibernated kernel back, a large one from a slow disk
HOST_PIDS_BACKSTOP = 32  # x max_processes: under ptrace each guest process holds about 12 host tasks
SENTRY_THREADS = 512
KEY_HINT = "keep MSB_HIBERNATE_KEY_FILE as it was when the kernel hibernated; a kernel whose image cannot be read is lost"


class GVisorBackend(SandboxBackend):
    name = "gvisor"
    auto_order = 50
    # ipc: host Unix sockets (--host-uds=create), no network at all; tcp: behind gVisor's own network stack
    # (netstack.py), which hibernation needs, so auto means tcp where MSB_HIBERNATE_AFTER_SECONDS is set.
    transports = ("ipc", "tcp")
    egress_routes = "socket"
    hands_out = True  # the host mounts under a shared slot that the gofer sees, the guest's root binds (core/handout.py)
    guest_io_dir = "/run/kernel"
    guest_host_dir = iodir.GUEST_HOST_DIR
    guest_sockets = f"{netstack.GUEST_SOCKETS}/kernel"
    _availability: Availability | None = None

    def __init__(self, settings: MsbSettings):
        super().__init__(settings)
        self.root = settings.runtime_root()
        self.runsc_root = self.root / "runsc"
        self.hierarchy, self.limits_note = cgroups.detect()
        self.no_disk = scratch.unavailable_reason()  # None: each kernel's /tmp and home are a disk of its flavor's size
        self.listeners = HostListeners(host_ports(settings), self.host_ip) if self.transport == "tcp" else None
        self.images = checkpoint_images.ImageStore(
            settings.hibernate_root(),
            read_key(settings.hibernate_key_file) if settings.hibernate_key_file else None,
            settings.hibernate_disk_mib << 20 if settings.hibernate_disk_mib else None,
        )

    @classmethod
    def transport_for(cls, settings: MsbSettings) -> str:
        if settings.transport == "auto" and settings.hibernate_after_seconds > 0:
            return "tcp"
        return super().transport_for(settings)

    def hibernation_unavailable(self) -> str | None:
        if self.transport != "tcp":
            return (
                "MSB_TRANSPORT=ipc: runsc cannot save a kernel whose sockets are the host's; "
                "set MSB_TRANSPORT to auto or tcp for gVisor kernels that hibernate"
            )
        return None

    # -- tcp: host ports -------------------------------------------------------

    def reserve_ports(self, sandbox_id: str) -> list[int] | None:
        return self.listeners.reserve(sandbox_id) if self.listeners else None

    def release_ports(self, sandbox_id: str) -> None:
        if self.listeners:
            self.listeners.release(sandbox_id)

    def saveable_listeners(self, spec: SandboxSpec) -> set[tuple[str, str, int]]:
        """What the sandbox's own relays listen on, as (protocol, address, port): they poll, so runsc saves them."""
        ports = self.listeners.ports.owned(spec.sandbox_id) if self.listeners else []
        saveable = {("tcp", netstack.GUEST_ADDRESS, port) for port in ports}
        if spec.egress:
            saveable |= {(protocol, address, port) for _, address, port, protocol in spec.egress.listeners}
        return saveable

    def stats(self) -> dict:
        stats: dict = {}
        if self.listeners:
            stats["ports"] = self.listeners.ports.stats()
            stats["hibernation_images_bytes"] = self.images.used()
        return stats

    # -- availability ----------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        if cls._availability is None:
            cls._availability = cls._probe()
        return cls._availability

    @classmethod
    def start_identity(cls) -> dict[str, Any]:
        # --version is in availability's reason; a wrapper or a rebuilt binary with the same version is not
        from msb_kernels.provisioning.probe_verdicts import file_identity

        return {"runsc": file_identity(runsc_path())}

    @classmethod
    def _probe(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(False, "gVisor runs only on Linux")
        if runsc_path() is None:
            return Availability(False, f"runsc is not installed; {INSTALL_HINT}")
        if os.geteuid() != 0:
            return Availability(False, "runsc needs root to create its sandboxes; run msb-kernels as root, or use MSB_BACKEND=namespace")
        try:
            binary = runsc.current()
        except (OSError, subprocess.SubprocessError) as exc:
            return Availability(False, f"{runsc_path()} does not run: {exc}; {INSTALL_HINT}")
        assert binary is not None
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
            True, f"gVisor ({binary.describe()}); limits by {note}" if hierarchy else f"gVisor ({binary.describe()})", warnings
        )

    @classmethod
    async def prepare(cls, settings: MsbSettings) -> None:
        if cls.availability().ok:
            choice = await asyncio.to_thread(gvisor_platform.chosen, settings.runsc_platform)
            log.info("msb-kernels: gVisor kernels run under %s", choice.describe())

    @classmethod
    def doctor_lines(cls, settings: MsbSettings) -> list[str]:
        if not cls.availability().ok:
            return []
        binary = runsc.current()
        assert binary is not None
        old = f"; older than {runsc.FIRST_GOOD_RELEASE}: {INSTALL_HINT}" if binary.known_old else ""
        return [f"gvisor: {binary.describe()}{old}", f"gvisor: {gvisor_platform.chosen(settings.runsc_platform).describe()}"]

    @classmethod
    def probe_hint(cls, error: str) -> str | None:
        try:
            binary = runsc.current()
        except (OSError, subprocess.SubprocessError):
            return INSTALL_HINT
        if binary is not None and (binary.known_old or "Invalid argument" in error):
            old = f", older than {runsc.FIRST_GOOD_RELEASE}, whose kernels cannot run coreutils' statx" if binary.known_old else ""
            return f"this is {binary.describe()}{old}; {INSTALL_HINT}"
        return None

    # -- create ----------------------------------------------------------------

    def io_dir_for(self, sandbox_id: str) -> Path:
        return iodir.make_dirs(self.root, sandbox_id, bounded=True)  # gVisor runs as root

    async def runsc(self, *args: str, sandbox_id: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        """One runsc command on this backend's state (kill, delete, state, exec, checkpoint). Under tcp it runs in the
        sandbox's network namespace, where runsc's control socket is."""
        argv = [runsc_path() or "runsc", f"--root={self.runsc_root}", *args]
        if sandbox_id is not None and self.transport == "tcp" and netstack.exists(sandbox_id):
            argv = netstack.in_sandbox_netns(sandbox_id, argv)
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            process.kill()
            out, err = await process.communicate()
        return subprocess.CompletedProcess(args, process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))

    async def create(self, spec: SandboxSpec) -> GVisorSandbox:
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailable(f"the gvisor backend cannot run here: {availability.reason}")
        if spec.allow_network:
            raise SandboxError(
                "MSB_ALLOW_NETWORK is not supported by the gvisor backend: its sandboxes reach no network",
                ["unset MSB_ALLOW_NETWORK", "or set MSB_BACKEND=namespace for kernels that need the internet"],
            )
        if self.hierarchy is None and self.settings.require_limits:
            raise SandboxError(
                f"cannot enforce flavor limits with cgroups ({self.limits_note}) and MSB_REQUIRE_LIMITS is set",
                ["run msb-kernels as root on a host with cgroups", "or unset MSB_REQUIRE_LIMITS"],
            )
        state_dir = spec.io_dir.parent
        iodir.open_to(spec.io_dir, GUEST_UID, GUEST_UID)  # what the kernel makes there through the gofer is uid 1000's
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
        listeners, relay = [], None
        try:
            if self.listeners:
                listeners = self.listeners.bound(spec.sandbox_id)
                await netstack.create(spec.sandbox_id)
            ports = [listener.getsockname()[1] for listener in listeners]
            disk = await self._make_disk(spec, state_dir) if self.no_disk is None else None
            shown = self._shown_as_own(spec, state_dir)
            slots = handout.open_slots(state_dir) if spec.handout else None
            bundle = write_bundle(
                spec,
                state_dir,
                f"/{cgroups.GROUP_PARENT}/{spec.sandbox_id}" if cgroup else None,
                ports,
                self.guest_io_dir,
                self.guest_host_dir,
                disk,
                shown,
                slots,
            )
            record = new_state(self.name, spec, cgroup=cgroup is not None, ports=ports)
            process, keeper, stderr = await self._start(spec, state_dir, ["run", f"--bundle={bundle}", spec.sandbox_id], record)
            if listeners:
                relay = netstack.HostRelay(spec.sandbox_id, listeners)
                await relay.start()
        except BaseException:
            if "process" in locals():
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                if keeper is not None:
                    keeper.close()
                stderr.close()
            await self.remove(state_dir, cgroup, keep_io_dir=True)
            raise
        write_state(state_dir, record)
        return GVisorSandbox(spec, self, state_dir, process, cgroup, stderr, keeper, relay)

    async def _make_disk(self, spec: SandboxSpec, state_dir: Path) -> Path:
        """The flavor's disk, formatted and mounted by the host at <state dir>/disk, with the kernel's tmp/ (1777) and
        home/ (uid 1000's) made before the kernel runs: nothing in it is the sandbox's yet."""
        image = scratch.image_path(self.settings.scratch_root(), spec.sandbox_id)
        scratch.reserve_image(image, spec.flavor, reserve=self.settings.disk_reserve, state_dir=state_dir)
        await scratch.format_image(image)
        disk = state_dir / DISK_DIR
        await scratch.mount_image(image, disk)
        os.chmod(disk, 0o755)  # the gofer serves tmp/ and home/ below it
        (disk / DISK_TMP).mkdir(mode=0o1777)
        os.chmod(disk / DISK_TMP, 0o1777)
        (disk / DISK_HOME).mkdir(mode=0o700)
        os.chown(disk / DISK_HOME, GUEST_UID, GUEST_UID)
        return disk

    @staticmethod
    def _shown_as_own(spec: SandboxSpec, state_dir: Path) -> dict[str, Path]:
        """The shared volume and each host directory whose owner is a person, mounted idmapped at <state dir>/shown/<n>
        (core/idmap.py), where the owner's files are the guest user's: what the kernel writes there through the gofer is
        the owner's on the host. By host path; one that is missing is served as it is (a directory of root's)."""
        shown: dict[str, Path] = {}
        wanted = [(str(spec.shared_volume.host_path), False)] if spec.shared_volume else []
        wanted += [(directory.path, not directory.writable) for directory in spec.host_directories if os.path.isdir(directory.path)]
        for number, (path, readonly) in enumerate(wanted):
            tree = idmap.shown_as(path, idmap.Owner(GUEST_UID, GUEST_UID), readonly=readonly, keep_root=True)
            if tree is None:
                continue
            try:
                target = state_dir / SHOWN_DIR / str(number)
                target.mkdir(mode=0o700, parents=True, exist_ok=True)
                idmap.attach(tree, str(target))
            finally:
                os.close(tree)
            shown[path] = target
        return shown

    async def _start(
        self, spec: SandboxSpec, state_dir: Path, command: list[str], record: dict
    ) -> tuple[asyncio.subprocess.Process | PidfdProcess, KeeperLink | None, KernelStderr]:
        """runsc run (or restore) with this backend's flags, attached, recorded in record: the sandbox lives as long
        as that process. runsc gets SIGKILL as its parent-death signal, so when its parent dies, even by kill -9, the
        whole sandbox goes with it; its parent is this process, or the sandbox's keeper."""
        if "platform_flags" not in record:  # a restore runs under the platform its sandbox was saved from
            choice = await asyncio.to_thread(gvisor_platform.chosen, self.settings.runsc_platform)
            record["platform_flags"] = choice.flags()
        runsc = [
            runsc_path() or "runsc",
            f"--root={self.runsc_root}",
            f"--network={'sandbox' if self.transport == 'tcp' else 'none'}",
            *record["platform_flags"],
            # all: the egress relay connects to the proxy's socket; create: the ipc kernel binds its own
            *(["--host-uds=all"] if spec.egress else ["--host-uds=create"] if self.transport == "ipc" else []),
            *command,
        ]
        if self.transport == "tcp":
            runsc = netstack.in_sandbox_netns(spec.sandbox_id, runsc, receives_mounts=spec.handout and command[0] == "run")
        # choom: the sandbox's and gofer's host processes inherit the score. util-linux has had it since 2.33 (2018); an
        # older one lacks only the bias, not the sandbox.
        choom = ["choom", "-n", str(SANDBOX_OOM_SCORE_ADJ), "--"] if shutil.which("choom") else []
        # umask 022: runsc makes the mount points of binds that lie under another mount (an interpreter in a venv under
        # /tmp lies on the kernel's disk) with the process's umask; a hardened host's 077 made them 0700, so the
        # kernel's user could not reach its own interpreter (exec: Permission denied).
        argv = ["setpriv", "--pdeathsig", "KILL", "--", "sh", "-c", 'umask 022 && exec "$@"', "sh", *choom, *runsc]
        stderr_read, stderr_write = os.pipe()
        keeper = None
        try:
            if spec.held:
                process, keeper = await self._start_kept(spec, state_dir, argv, stderr_read, stderr_write)
                record.update(keeper_pid=keeper.keeper_pid, keeper_start=process_start_time(keeper.keeper_pid))
            else:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr_write, start_new_session=True
                )
        except (OSError, SandboxError) as exc:
            os.close(stderr_read)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot start runsc: {exc}", [INSTALL_HINT]) from exc
        finally:
            with contextlib.suppress(OSError):
                os.close(stderr_write)
        record.update(init_pid=process.pid, init_start=process_start_time(process.pid))  # runsc run, which holds it
        return process, keeper, KernelStderr(spec.sandbox_id, stderr_read)

    async def _start_kept(
        self, spec: SandboxSpec, state_dir: Path, argv: list[str], stderr_read: int, stderr_write: int
    ) -> tuple[PidfdProcess, KeeperLink]:
        """runsc run as the child of the sandbox's keeper, which outlives this process."""
        keeper_pid, runsc_pid = await keeping.start_keeper(
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
            return PidfdProcess(runsc_pid, spec.io_dir), keeper
        except ProcessLookupError:
            keeper.close()
            raise SandboxError("runsc exited as soon as it started", [INSTALL_HINT]) from None

    async def restore(self, sandbox: GVisorSandbox) -> None:
        """runsc restore of a hibernated sandbox, as its run was started: the same bundle, cgroup and network. Returns
        once it runs; its image is deleted then. SandboxError (the image deleted too) when it does not come back."""
        spec, state_dir = sandbox.spec, sandbox.state_dir
        try:
            await netstack.readdress(spec.sandbox_id)
            try:
                directory = await asyncio.to_thread(self.images.open_for_restore, spec.sandbox_id)
            except (OSError, ValueError) as exc:
                raise SandboxError(f"cannot open the kernel's hibernation image: {exc}", [KEY_HINT]) from exc
            record = json.loads((state_dir / "state.json").read_text())
            # runsc 2024's attached restore leaves its container behind when the sandbox is saved again ("cannot restore
            # container ... in state stopped" at the next wake); its run, and the 2022 build, delete it themselves.
            await self.runsc("delete", "--force", spec.sandbox_id, sandbox_id=spec.sandbox_id)
            command = ["restore", f"--image-path={directory}", f"--bundle={state_dir / 'bundle'}", spec.sandbox_id]
            process, keeper, stderr = await self._start(spec, state_dir, command, record)
            try:
                await self._until_running(spec.sandbox_id, process, stderr)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                if keeper is not None:
                    keeper.close()
                stderr.close()
                raise
        finally:
            self.images.remove(spec.sandbox_id)
        sandbox.process, sandbox.keeper, sandbox.stderr = process, keeper, stderr
        write_state(state_dir, record)

    async def _until_running(self, sandbox_id: str, process: asyncio.subprocess.Process | PidfdProcess, stderr: KernelStderr) -> None:
        deadline = time.monotonic() + RESTORE_TIMEOUT
        while time.monotonic() < deadline:
            if process.returncode is not None:
                said = " ".join(stderr.last_lines()[-3:]).strip()
                raise SandboxError(f"runsc could not restore the kernel: {checkpoint_error(said) if said else 'it exited'}")
            result = await self.runsc("state", sandbox_id, sandbox_id=sandbox_id)
            with contextlib.suppress(ValueError):
                if result.returncode == 0 and json.loads(result.stdout).get("status") == "running":
                    return
            await asyncio.sleep(0.02)
        raise SandboxError(f"runsc did not restore the kernel within {RESTORE_TIMEOUT} s")

    async def adopt(self, spec: SandboxSpec) -> GVisorSandbox:
        state_dir = spec.io_dir.parent
        record, keeper, process = adopt_held_sandbox(self.name, state_dir, spec)
        cgroup = cgroups.SandboxCgroup(self.hierarchy, spec.sandbox_id) if self.hierarchy and record.get("cgroup") else None
        stderr = KernelStderr(spec.sandbox_id, keeper.stderr_fd) if keeper.stderr_fd is not None else None
        relay = None
        if self.listeners and record.get("ports"):  # the last gateway's relay ended with it: this one starts its own
            relay = netstack.HostRelay(spec.sandbox_id, self.listeners.bound(spec.sandbox_id, record["ports"]))
            await relay.start()
        sandbox = GVisorSandbox(spec, self, state_dir, process, cgroup, stderr, keeper, relay)
        sandbox.created = record.get("created", sandbox.created)
        return sandbox

    # -- removal and orphans ---------------------------------------------------

    async def remove(self, state_dir: Path, cgroup: cgroups.SandboxCgroup | None, *, keep_io_dir: bool) -> None:
        sandbox_id = state_dir.name
        await self.runsc("delete", "--force", sandbox_id, sandbox_id=sandbox_id)
        if cgroup is not None and not cgroup.destroy():
            log.warning("cgroup of sandbox %s still has processes", sandbox_id)
        await netstack.destroy(sandbox_id)
        self.images.remove(sandbox_id)
        shutil.rmtree(state_dir / "bundle", ignore_errors=True)
        # Before anything removes the state dir (never walk the kernel's files), and off the event loop: a lazy umount
        # and the unlink of a 2 GiB reserved file each take milliseconds that every other request would wait out.
        with contextlib.suppress(SandboxError):  # removal goes on, as it did when umount(8) failed
            await asyncio.to_thread(iodir.detach, state_dir / DISK_DIR)
            for mountpoint in [*iodir.mounts_under(state_dir / SHOWN_DIR), *iodir.mounts_under(state_dir / handout.SLOTS_DIR)]:
                await asyncio.to_thread(iodir.detach, mountpoint, "a person's directory")
        await asyncio.to_thread(scratch.remove_image, scratch.image_path(self.settings.scratch_root(), sandbox_id))
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
            await self.remove(self.root / record.sandbox_id, cgroup, keep_io_dir=False)
            swept.append(record.sandbox_id)
        await self.sweep_leftovers()  # disks no live sandbox holds, whichever runtime dir left them
        if swept:
            log.info("swept %d orphaned gVisor sandbox(es): %s", len(swept), ", ".join(swept))
        return swept
