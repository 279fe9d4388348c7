"""Which host processes still run: how both backends tell a live owner from a dead one.

A pid alone is not enough (pids are reused), so records keep the process's start tick too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import signal
from pathlib import Path

from msb_kernels.backends.core import iodir

# Every sandbox process's oom_score_adj on the host: when the host runs out of memory (flavors overcommitted, see
# docs/operations.md), the kernel's OOM killer ends a sandbox's process before the gateway, which holds every session,
# or the host's own services. Raising it needs no privilege; a sandboxed process may lower its own back to 0, as any
# process may, but not below (that takes CAP_SYS_RESOURCE): none can make itself immune.
SANDBOX_OOM_SCORE_ADJ = 500


def _stat(pid: int) -> tuple[str, int] | None:
    """pid's state letter and start tick, from /proc/<pid>/stat; None where it has none."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """The kernel's start tick for pid: with the pid, it names one process for good."""
    stat = _stat(pid)
    return stat[1] if stat else None


def process_alive(pid: int | None, start_time: int | None) -> bool:
    """Whether pid is the process that started at start_time, and runs: a zombie (killed, its parent has not reaped it
    yet, or never will) is dead, or a sandbox's keeper would take its killed owner for one that let go alive. A main
    thread that exited while others run shows Z too: that process lives (its kernels answered while a sweep took
    them), so a Z counts as dead only with no other thread."""
    stat = _stat(pid) if pid is not None and start_time is not None else None
    if stat is None or stat[1] != start_time or stat[0] == "X":
        return False
    return stat[0] != "Z" or _threads(pid) > 1


def _threads(pid: int) -> int:
    """The threads /proc/<pid>/status counts (0 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    return 0


@functools.cache
def pid_namespace() -> int | None:
    """This process's pid namespace (its inode): the pids a state file records are this namespace's."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def pids_of_another_namespace(state: dict) -> bool:
    """Whether a state file's pids were recorded in another pid namespace (an owner in a container, or `unshare -p`):
    read here they name other processes or none, so they tell nothing of whether its sandbox lives. A sweep from
    the host killed such an owner's live kernel (issue 58's hostile run); such a record is never taken for dead."""
    recorded = state.get("pid_ns")
    return recorded is not None and recorded != pid_namespace()


def owner_alive(pid: int | None, start: int | None) -> bool:
    """Whether the process that started a sandbox still runs: pid and start tick where /proc has them
    (a reused pid does not count), the pid alone where it does not (macOS)."""
    if pid is None:
        return False
    if start is not None or os.path.isdir("/proc/self"):
        return process_alive(pid, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PidfdProcess:
    """A sandbox's host process, followed through a pidfd: whether or not this process started it, it cannot be
    mistaken for another that reuses its pid.

    Its status is the one the sandbox's reaper wrote to exit_status in its io dir (a Popen returncode: negative for
    a signal); a sandbox killed whole leaves none, and reads as killed by SIGKILL, and so does anything else the
    kernel's code left under that name (a link, a FIFO, a directory, a huge file), which the host never follows,
    blocks on or reads past a few bytes (iodir.read_guest_file). Read once, when the process has ended; wait() reads
    it off the event loop. Used by the namespace sandbox, and by gVisor sandboxes that a keeper holds or that were
    adopted."""

    def __init__(self, pid: int, io_dir: Path, start_time: int | None = None):
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        if start_time is not None and process_start_time(pid) != start_time:
            os.close(self.pidfd)
            raise ProcessLookupError(f"pid {pid} is another process now")
        self.io_dir = io_dir
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._returncode is None and (self.pidfd < 0 or self._readable()):
            self._returncode = self._read_status()
        return self._returncode

    def _read_status(self) -> int:
        written = iodir.read_guest_file(self.io_dir, iodir.EXIT_STATUS)
        try:
            return int(written) if written is not None else -signal.SIGKILL
        except ValueError:
            return -signal.SIGKILL

    def _readable(self) -> bool:
        """poll(), not select(): a process holding many kernels has descriptors past select's 1024."""
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    async def wait(self) -> int | None:
        if self.returncode is None:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            loop.add_reader(self.pidfd, lambda: done.done() or done.set_result(None))
            try:
                await done
            finally:
                loop.remove_reader(self.pidfd)
            if self._returncode is None:
                self._returncode = await asyncio.to_thread(self._read_status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd >= 0:
            self.returncode  # noqa: B018 - read while the pidfd still says whether it ended
            os.close(self.pidfd)
            self.pidfd = -1
