"""A running namespace sandbox: init (pid 1) as a pidfd, its cgroup, its lifeline to the owner (or the keeper that
holds it), and its stderr; what the provisioner polls, signals and cleans up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from msb_kernels.backends.core import cgroups, handout, idmap
from msb_kernels.backends.core.base import HostDirectory, SandboxBackend, SandboxSpec, SharedVolume
from msb_kernels.backends.core.keeping import KeeperLink
from msb_kernels.backends.core.processes import PidfdProcess
from msb_kernels.backends.core.state import HostCgroupSandbox, KernelStderr
from msb_kernels.backends.namespace import uids
from msb_kernels.errors import SandboxError


class NamespaceSandbox(HostCgroupSandbox):
    def __init__(
        self,
        spec: SandboxSpec,
        backend: SandboxBackend,  # the NamespaceBackend that made it (its remove_state, forks)
        state_dir: Path,
        process: PidfdProcess,
        cgroup: cgroups.SandboxCgroup | None,
        lifeline: int | None,
        stderr: KernelStderr | None = None,
        keeper: KeeperLink | None = None,
        forked: bool = False,
    ):
        super().__init__(spec, cgroup)
        self.backend = backend
        self.state_dir = state_dir
        self.process = process  # init, pid 1 of the sandbox: the whole pid namespace goes with it
        self.init_pid = process.pid
        self.lifeline = lifeline  # None when a keeper holds it
        self.keeper = keeper
        self.stderr = stderr
        self.forked = forked  # the kernel is a fork of a fork server (forkservers.py), not an exec

    async def hand_out(self, shared_volume: SharedVolume | None, host_directories: list[HostDirectory]) -> None:
        """The host makes a detached mount of each directory (idmapped as the sandbox's user where a person owns it)
        and attaches it in the sandbox's mount namespace, at its guest path, by a helper that enters it
        (core/handout.py's ATTACH_IN_NAMESPACE); the placeholders hold what it makes."""
        seen_as = idmap.Owner(self.channel_uid if self.channel_uid is not None else os.geteuid(), uids.SANDBOX_GID)
        trees = await asyncio.to_thread(handout.detached_trees, shared_volume, host_directories, seen_as)
        namespace = os.open(f"/proc/{self.init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            argv = [sys.executable, "-I", "-S", "-c", handout.ATTACH_IN_NAMESPACE, str(namespace)]
            argv.append(json.dumps([[tree, guest_path] for tree, guest_path, _ in trees]))
            helper = await asyncio.create_subprocess_exec(
                *argv,
                pass_fds=[namespace, *(tree for tree, _, _ in trees)],
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, said = await asyncio.wait_for(helper.communicate(), 30)
        finally:
            os.close(namespace)
            for tree, _, _ in trees:
                os.close(tree)
        if helper.returncode != 0:
            lines = said.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"cannot show the kernel its directories: {lines[-1] if lines else f'exit status {helper.returncode}'}")

    async def poll(self) -> int | None:
        return self.process.returncode

    async def wait(self) -> int | None:
        return await self.process.wait()

    async def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def kill(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.process.returncode is None  # killing the dead (a restart) changes no reason
        self.process.kill()

    async def terminate(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.process.returncode is None
        self.process.send_signal(signal.SIGTERM)

    def ended_with(self) -> int | None:
        return self.process.returncode

    def kernel_listening(self, port: int) -> bool:
        """tcp: whether a socket in the sandbox's network namespace listens on port (its /proc/<init>/net/tcp)."""
        try:
            table = Path(f"/proc/{self.init_pid}/net/tcp").read_text()
        except OSError:
            return True  # gone, or unreadable: nothing to wait for
        listening = f":{port:04X} 00000000:0000 0A"
        return any(listening in line for line in table.splitlines())

    async def cleanup(self, keep_io_dir: bool = False) -> None:
        if self.process.returncode is None:
            await self.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wait(), 5)
        self.latch_exit_reason()
        if self.lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(self.lifeline)
            self.lifeline = None
        if self.keeper is not None:
            self.keeper.close()  # after the sandbox ended: the keeper sees that first, and only exits
        self.process.close()
        if self.stderr is not None:
            self.stderr.close()
        self.backend.remove_state(self.state_dir, self.cgroup, keep_io_dir=keep_io_dir)

    def info(self) -> dict:
        return {
            **super().info(),
            "backend": "namespace",
            "init_pid": self.init_pid,
            "limits": "cgroup" if self.cgroup else "rlimit",
            "forked": self.forked,
        }
