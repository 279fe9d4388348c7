"""The run's own environment and the machine it ran on, so a run neither touches nor depends on a live gateway."""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def isolate(base: Path, max_sessions: int, backend: str = "namespace") -> None:
    """Own runtime dirs (short paths: ipc sockets), no stray MSB_* settings, room for the capacity run."""
    for name in list(os.environ):
        if name.startswith("MSB_"):
            del os.environ[name]
    os.environ["MSB_RUNTIME_DIR"] = str(base / "rt")
    os.environ["MSB_BACKEND"] = backend  # never auto: which backend the figures measure is the run's choice
    os.environ["JUPYTER_RUNTIME_DIR"] = str(base / "jr")
    os.environ["MSB_MAX_SESSIONS"] = str(max_sessions)
    os.environ["MSB_POOL_SIZE"] = "0"
    os.environ["MSB_SESSION_TIMEOUT_SECONDS"] = "0"
    # The capacity run holds 50 small sessions: their disks reserved in full would need 100 GiB.
    os.environ["MSB_DISK_RESERVE"] = "false"
    os.environ["PATH"] = f"{VENV_BIN}:{os.environ.get('PATH', '')}"


def raise_host_limits(sessions: int) -> list[str]:
    """Lift what would stop the capacity run short of sessions idle kernels, where this process may; say what was
    changed, and what is still in the way and how to lift it."""
    from msb_kernels.provisioning.limits import raise_open_files

    said = []
    # All the hard limit allows, as the gateway takes: a direct client's kernel holds a pidfd, pipes, a zmq context's
    # I/O thread and descriptors, and its client's sockets; 8 per kernel ran out at 1,000 (issue 39).
    soft, raised, hard = raise_open_files()
    needed = 64 + 16 * sessions
    if raised != soft:
        said.append(f"open files (RLIMIT_NOFILE) raised from {soft} to {raised}")
    if hard < needed:
        said.append(f"open files: the hard limit {hard} is below the {needed} the run needs: raise it (ulimit -Hn, or LimitNOFILE=)")
    tasks = 12 * sessions  # a kernel's threads and its sandbox's init
    for path, what in (("/proc/sys/kernel/pid_max", "kernel.pid_max"), ("/proc/sys/kernel/threads-max", "kernel.threads-max")):
        try:
            value = int(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if value < tasks:
            said.append(f"{what} is {value}, below the {tasks} tasks the run may need: sysctl -w {what}={tasks * 2}")
    return said


def meminfo_mib(field: str) -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) // 1024
    return None


def available_mib() -> int:
    available = meminfo_mib("MemAvailable")
    return -1 if available is None else available


def machine() -> dict:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    import ipykernel
    import jupyter_client

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_mib": meminfo_mib("MemTotal"),
        "python": platform.python_version(),
        "linux": platform.release(),
        "ipykernel": ipykernel.__version__,
        "jupyter_client": jupyter_client.__version__,
        "user": "root" if os.geteuid() == 0 else "unprivileged",
    }


async def settle(quiet_load: float = 0.5, most_seconds: float = 3.0) -> None:
    """Wait until the CPUs are about idle again (the 1-second run queue, from /proc/loadavg's running count)."""
    deadline = time.perf_counter() + most_seconds
    while time.perf_counter() < deadline:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1  # this process is running
        if running <= quiet_load:
            return
        await asyncio.sleep(0.05)
