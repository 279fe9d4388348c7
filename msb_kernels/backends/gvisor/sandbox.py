"""A running (or hibernated) gVisor kernel: its runsc process, the host relay of the tcp transport, and the checkpoint
and restore that hibernation asks for (checkpoint_images.py for the image, backend.py for runsc itself)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msb_kernels.backends.gvisor.checkpoint_images as checkpoint_images
import msb_kernels.backends.gvisor.netstack as netstack
from msb_kernels.backends.core import cgroups, handout, idmap, iodir
from msb_kernels.backends.core.base import HostDirectory, Reconnect, SandboxSpec, SharedVolume
from msb_kernels.backends.core.keeping import KeeperLink
from msb_kernels.backends.core.processes import PidfdProcess
from msb_kernels.backends.core.state import HostCgroupSandbox, KernelStderr
from msb_kernels.backends.gvisor.bundle import GUEST_UID
from msb_kernels.errors import HibernationRefused, SandboxError

log = logging.getLogger("msb_kernels")
CHECKPOINT_ENDS_WITHIN = 3.0  # seconds a failed save's end of the sandbox may lag `runsc checkpoint`'s answer


class GVisorSandbox(HostCgroupSandbox):
    """A kernel under ``runsc run`` (attached: the sandbox ends with that process), which is this process's child,
    or a keeper's (a PidfdProcess then). Under tcp, also its host relay; while hibernated, no process at all."""

    channel_uid = GUEST_UID  # runsc --host-uds=create makes the kernel's sockets as its uid inside, on the host too

    def __init__(
        self,
        spec: SandboxSpec,
        backend: Any,  # its GVisorBackend (backend.py), which imports this module
        state_dir: Path,
        process: asyncio.subprocess.Process | PidfdProcess,
        cgroup: cgroups.SandboxCgroup | None,
        stderr: KernelStderr | None,
        keeper: KeeperLink | None = None,
        relay: netstack.HostRelay | None = None,
    ):
        super().__init__(spec, cgroup)
        self.stderr = stderr
        self.backend = backend
        self.state_dir = state_dir
        self.process = process
        self.keeper = keeper
        self.relay = relay
        self.hibernated = False
        self._ended_asleep: int | None = None  # the status of a hibernated kernel that was stopped (its image deleted)
        self._woken = asyncio.Event()  # set while it runs: wait() follows a process that hibernation ends
        self._woken.set()
        self._probe: socket.socket | None = None

    async def hand_out(self, shared_volume: SharedVolume | None, host_directories: list[HostDirectory]) -> None:
        """The host attaches each directory under the sandbox's slots (as the guest user's where a person owns it), and
        the guest's root, by `runsc exec` with CAP_SYS_ADMIN, binds each at its guest path and detaches the slots."""
        slots = self.state_dir / handout.SLOTS_DIR
        mounts = await asyncio.to_thread(handout.fill_slots, slots, shared_volume, host_directories, idmap.Owner(GUEST_UID, GUEST_UID))
        argv = handout.guest_mount_argv(sys.executable, mounts)
        result = await self.backend.runsc("exec", "--user=0:0", "--cap=CAP_SYS_ADMIN", self.sandbox_id, *argv, sandbox_id=self.sandbox_id)
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip().splitlines()
            raise SandboxError(f"cannot show the kernel its directories: {said[-1] if said else f'runsc exec exited {result.returncode}'}")

    @property
    def init_pid(self) -> int:
        """The host process that holds the sandbox (runsc run): its descendants are the Sentry and the gofer."""
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """The kernel's status as a Popen returncode: negative for a signal, whether runsc or the kernel got it."""
        if self.hibernated:
            return self._ended_asleep
        code = self.process.returncode
        if isinstance(self.process, PidfdProcess):
            return code  # the reaper's word, from exit_status
        return -(code - 128) if code is not None and code > 128 else code  # runsc run exits 128+N for signal N

    async def poll(self) -> int | None:
        return self.exit_code

    async def wait(self) -> int | None:
        while True:
            await self._woken.wait()
            if self.hibernated:  # stopped while asleep
                return self.exit_code
            await self.process.wait()
            if not self.hibernated:
                return self.exit_code
            self._woken.clear()  # its runsc ended for a checkpoint: wait for the restored one, or for a stop

    async def send_signal(self, signum: int) -> None:
        if self.hibernated:
            if signum in (signal.SIGKILL, signal.SIGTERM):
                self._end_asleep(-signum)
            return  # an interrupt: nothing runs
        if self.process.returncode is not None:
            return
        if signum == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # runsc run is attached: the Sentry and the gofer go with it
            return
        await self.backend.runsc("kill", self.sandbox_id, str(int(signum)), sandbox_id=self.sandbox_id)

    async def kill(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.exit_code is None
        await self.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        self.stopped_by_owner = self.stopped_by_owner or self.exit_code is None
        await self.send_signal(signal.SIGTERM)

    def ended_with(self) -> int | None:
        return self.exit_code

    def _end_asleep(self, code: int) -> None:
        """A hibernated kernel stopped (shutdown, restart, cull): there is nothing to kill; its image goes at cleanup."""
        if self._ended_asleep is None:
            self._ended_asleep = code
        self._woken.set()

    def kernel_listening(self, port: int) -> bool:
        """tcp: whether the kernel answers on port, through both relays: its ZMQ socket greets a new connection at once,
        and a relay that cannot reach it closes the connection instead. One non-blocking look per call."""
        if self.backend.transport != "tcp":
            return True
        if self._probe is None:
            self._probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._probe.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._probe.connect_ex((self.backend.host_ip, port))
            return False
        try:
            greeted = bool(self._probe.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False
        except OSError:
            greeted = False
        self._probe.close()
        self._probe = None
        return greeted

    # -- hibernation ------------------------------------------------------------

    async def hibernate(self, reconnect: Reconnect | None = None) -> int:
        backend, sandbox_id = self.backend, self.sandbox_id
        reason = backend.hibernation_unavailable()
        if reason:
            raise HibernationRefused(reason)
        if self.hibernated or self.process.returncode is not None:
            raise HibernationRefused("it is not running")
        kept = iodir.unsaveable(self.spec.io_dir)  # what the kernel's code left in its io dir: runsc cannot save it
        if kept:
            raise HibernationRefused(f"its io directory holds what runsc cannot save: {'; '.join(kept[:5])}")
        images = backend.images
        images.check_room(sandbox_id, self.memory_bytes() or self.spec.flavor.memory_bytes)
        await self.relay.stop()  # every connection into the sandbox closes; ZMQ clients reconnect once it is back
        blocking = await self._settled_sockets()
        if blocking:
            await self._reopen(reconnect)
            raise HibernationRefused(f"it holds sockets that runsc cannot save: {'; '.join(blocking[:5])}")
        directory = images.prepare(sandbox_id)
        started = time.monotonic()
        self.hibernated = True
        self._woken.clear()
        result = await backend.runsc("checkpoint", f"--image-path={directory}", sandbox_id, sandbox_id=sandbox_id, timeout=600)
        if result.returncode != 0:
            self.hibernated = False
            self._woken.set()
            images.remove(sandbox_id)
            said = checkpoint_error(result.stderr)
            if await self._survived_checkpoint():
                await self._reopen(reconnect)
                raise HibernationRefused(f"runsc could not checkpoint it: {said}")
            # Its runsc run is on its way out: reap it, so the kernel reads as dead to whoever handles the error.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), 10)
            if self.process.returncode is None:
                await self.kill()
            raise SandboxError(f"runsc could not checkpoint the kernel, which ended it: {said}")
        await self.process.wait()  # runsc run ends once its sandbox is saved
        self._release_process()
        size = await asyncio.to_thread(images.seal, sandbox_id)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.reclaim)
        log.info("kernel %s hibernated: %d MiB image in %.2f s", sandbox_id, size >> 20, time.monotonic() - started)
        return size

    async def _settled_sockets(self, wait: float = 2.0) -> list[str]:
        """What in the sandbox would stop a checkpoint, once the connections the relay held had time to close."""
        saveable = self.backend.saveable_listeners(self.spec)
        deadline = time.monotonic() + wait
        while True:
            tables = {}
            for name in ("tcp", "tcp6", "udp", "udp6"):
                result = await self.backend.runsc("exec", self.sandbox_id, "cat", f"/proc/net/{name}", sandbox_id=self.sandbox_id)
                if result.returncode != 0:
                    return [f"cannot look at its sockets ({checkpoint_error(result.stderr)})"]
                tables[name] = result.stdout
            blocking = checkpoint_images.blocking_sockets(tables, saveable)
            if not blocking or time.monotonic() > deadline:
                return blocking
            await asyncio.sleep(0.05)

    async def _survived_checkpoint(self) -> bool:
        """Whether the kernel runs on after a failed checkpoint. A save that fails late ends the sandbox a moment after
        `runsc checkpoint` returns, and `runsc state` says "running" in that moment (a loaded host's CI saw it, and
        reopened a kernel that was gone): so its runsc run is given a while to end before the state is believed."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.process.wait(), CHECKPOINT_ENDS_WITHIN)
            return False
        result = await self.backend.runsc("state", self.sandbox_id, sandbox_id=self.sandbox_id)
        try:
            return result.returncode == 0 and json.loads(result.stdout).get("status") == "running"
        except ValueError:
            return False

    def _release_process(self) -> None:
        """Let go of the runsc run that a checkpoint ended: its keeper (which forgets the sandbox) and its stderr."""
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None
        if isinstance(self.process, PidfdProcess):
            self.process.close()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None

    async def wake(self, reconnect: Reconnect | None = None) -> None:
        if not self.hibernated:
            return
        if self._ended_asleep is not None:
            raise SandboxError("the kernel was stopped while it was hibernated")
        started = time.monotonic()
        await self.backend.restore(self)
        self.hibernated = False
        self._woken.set()
        await self._reopen(reconnect)
        log.info("kernel %s restored from hibernation in %.2f s", self.sandbox_id, time.monotonic() - started)

    async def _reopen(self, reconnect: Reconnect | None) -> None:
        """The kernel's ports relayed again: reconnect's first ports, its settle, then the rest."""
        if reconnect is not None:
            await self.relay.start(reconnect.first)
            await reconnect.settle()
        await self.relay.start()

    async def cleanup(self, keep_io_dir: bool = False) -> None:
        if not self.hibernated and self.process.returncode is None:
            await self.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), 10)
        self.latch_exit_reason()
        if self._probe is not None:
            self._probe.close()
        if self.relay is not None:
            await self.relay.stop()
        self._release_process()
        await self.backend.remove(self.state_dir, self.cgroup, keep_io_dir=keep_io_dir)

    def info(self) -> dict:
        info = {**super().info(), "backend": "gvisor", "runsc_pid": self.process.pid, "limits": "cgroup" if self.cgroup else "rlimit"}
        return {**info, "transport": self.backend.transport, "hibernated": self.hibernated}


def checkpoint_error(stderr: str) -> str:
    """What runsc said, without the object dump it prints around the reason (tens of kilobytes for a TCP endpoint)."""
    for known in (r"endpoint cannot be saved in connected state[^\n]*", r"endpoint still has waiters upon save", r"[Cc]annot save[^\n]*"):
        found = re.search(known, stderr)
        if found:
            return found.group(0).strip()
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return (lines[0] if lines else "no reason given")[:300]
