"""Flavor limits through cgroups (v2, or v1 as on older hosts).

One group per sandbox, ``msb-kernels/<sandbox id>`` under each controller. The
sandbox launcher joins it before it unshares anything, so every process in the
sandbox is charged to it and a fork bomb or a memory hog stops at the flavor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.kernelspecs.flavors import Flavor

GROUP_PARENT = "msb-kernels"
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupHierarchy:
    version: int  # 1 or 2
    mounts: dict[str, Path]  # controller -> mount point ("unified" for v2)


def detect() -> tuple[CgroupHierarchy | None, str]:
    """Find usable memory, cpu and pids controllers; the string says why not, when not."""
    if os.geteuid() != 0:
        return None, "cgroups need root here (msb-kernels is not running as root)"
    v1: dict[str, Path] = {}
    unified: Path | None = None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _dev, mount_point, fstype, options, *_ = line.split()
            if fstype == "cgroup2":
                unified = Path(mount_point)
            elif fstype == "cgroup":
                for controller in ("memory", "cpu", "pids", "cpuacct"):
                    if controller in options.split(","):
                        v1[controller] = Path(mount_point)
    if v1.get("cpuacct") == v1.get("cpu"):
        v1.pop("cpuacct", None)  # mounted together (cpu,cpuacct): one group holds both
    if {"memory", "cpu", "pids"} <= set(v1) and all(os.access(p, os.W_OK) for p in v1.values()):
        return CgroupHierarchy(1, v1), "cgroup v1 (memory, cpu, pids)"
    if unified is not None:
        available = (unified / "cgroup.controllers").read_text().split() if (unified / "cgroup.controllers").exists() else []
        missing = [c for c in ("memory", "cpu", "pids") if c not in available]
        if not missing and os.access(unified, os.W_OK):
            return CgroupHierarchy(2, {"unified": unified}), "cgroup v2 (memory, cpu, pids)"
        return None, f"cgroup v2 lacks controllers {missing} or is not writable"
    return None, "no cgroup memory, cpu and pids controllers are mounted"


RCU_EXPEDITED = Path("/sys/kernel/rcu_expedited")


def start_speed_note(hierarchy: CgroupHierarchy | None) -> str | None:
    """A host setting that slows every sandbox start, and how to change it; None when there is none. Called by doctor."""
    if hierarchy is None:
        return None
    try:
        expedited = RCU_EXPEDITED.read_text().strip()
    except OSError:
        return None
    if expedited != "0":
        return None
    # Moving a process into a cgroup takes the kernel's cgroup_threadgroup_rwsem for writing, which waits out an RCU
    # grace period unless another move has just done so: the first join of each start pays it.
    return (
        "each kernel start waits out an RCU grace period while its sandbox joins its cgroups (6 to 8 ms of a start "
        "on a 2-CPU VM). `echo 1 > /sys/kernel/rcu_expedited` (or the boot option rcupdate.rcu_expedited=1) takes "
        "that off for the whole host: every RCU wait then interrupts all CPUs, which a host that runs kernels can "
        "usually afford"
    )


class SandboxCgroup:
    """The cgroup(s) of one sandbox."""

    def __init__(self, hierarchy: CgroupHierarchy, sandbox_id: str):
        self.hierarchy = hierarchy
        self.sandbox_id = sandbox_id
        self.paths: dict[str, Path] = {controller: mount / GROUP_PARENT / sandbox_id for controller, mount in hierarchy.mounts.items()}

    def create(self, flavor: Flavor, max_processes: int, *, memory_bytes: int | None = None) -> None:
        """memory_bytes: the group's memory limit where it holds more than the kernel (a gVisor Sentry); default the flavor's."""
        memory = str(memory_bytes or flavor.memory_bytes)
        if self.hierarchy.version == 1:
            for path in self.paths.values():
                path.mkdir(parents=True, exist_ok=True)
            _write(self.paths["memory"] / "memory.limit_in_bytes", memory)
            with contextlib.suppress(OSError):  # absent without swap accounting
                _write(self.paths["memory"] / "memory.memsw.limit_in_bytes", memory)
            _write(self.paths["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(self.paths["cpu"] / "cpu.cfs_quota_us", str(flavor.cpus * CPU_PERIOD_US))
            _write(self.paths["pids"] / "pids.max", str(max_processes))
        else:
            parent = self.hierarchy.mounts["unified"] / GROUP_PARENT
            parent.mkdir(exist_ok=True)
            _write(self.hierarchy.mounts["unified"] / "cgroup.subtree_control", "+memory +cpu +pids")
            _write(parent / "cgroup.subtree_control", "+memory +cpu +pids")
            group = self.paths["unified"]
            group.mkdir(exist_ok=True)
            _write(group / "memory.max", memory)
            with contextlib.suppress(OSError):
                _write(group / "memory.swap.max", "0")
            _write(group / "cpu.max", f"{flavor.cpus * CPU_PERIOD_US} {CPU_PERIOD_US}")
            _write(group / "pids.max", str(max_processes))

    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join this sandbox's groups."""
        return [str(path / "cgroup.procs") for path in self.paths.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel OOM killer took in this sandbox."""
        name = "memory.oom_control" if self.hierarchy.version == 1 else "memory.events"
        directory = self.paths["memory" if self.hierarchy.version == 1 else "unified"]
        with contextlib.suppress(OSError):
            for line in (directory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def memory_bytes(self) -> int | None:
        name = "memory.usage_in_bytes" if self.hierarchy.version == 1 else "memory.current"
        directory = self.paths["memory" if self.hierarchy.version == 1 else "unified"]
        try:
            return int((directory / name).read_text())
        except (OSError, ValueError):
            return None

    def reclaim(self) -> None:
        """Give back the page cache still charged to an emptied group (the files its processes read or wrote).

        Called once a sandbox's processes are gone but its group stays (a hibernated gVisor kernel): the cache is
        reclaimable anyway, but until it goes the group, its stats and /metrics say the kernel holds memory."""
        with contextlib.suppress(OSError):
            if self.hierarchy.version == 1:
                _write(self.paths["memory"] / "memory.force_empty", "0")  # only an empty group accepts it
            else:
                _write(self.paths["unified"] / "memory.reclaim", str(self.memory_bytes() or 0))

    def cpu_seconds(self) -> float | None:
        """CPU time the sandbox's processes used, all of them since it started (cpuacct's or cpu.stat's)."""
        try:
            if self.hierarchy.version == 1:
                return int((self.paths.get("cpuacct", self.paths["cpu"]) / "cpuacct.usage").read_text()) / 1e9
            for line in (self.paths["unified"] / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            return None
        return None

    def destroy(self, timeout: float = 5.0) -> bool:
        """Kill whatever is left in the groups and remove them. True when all are gone."""
        deadline = time.monotonic() + timeout
        while True:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for path in self.paths.values():
                with contextlib.suppress(FileNotFoundError, OSError):
                    path.rmdir()
            if not any(path.exists() for path in self.paths.values()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)
