"""What the gateway reads of its host and itself: memory and CPUs for the capacity, its own footprint for the
stats, and glibc's malloc_trim to give a finished kernel's buffers back."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def host_memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4096


def gateway_process_stats() -> dict:
    """The gateway's own footprint, for an operator watching it over days: it should return to where it was
    once the kernels it ran are gone."""
    stats: dict[str, Any] = {"pid": os.getpid()}
    with contextlib.suppress(OSError, ValueError):
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        stats.update(rss_mib=round(int(status["VmRSS"].split()[0]) / 1024, 1), threads=int(status["Threads"]))
        stats["open_fds"] = len(os.listdir("/proc/self/fd"))
    return stats


def give_memory_back() -> None:
    """Return the heap a finished kernel's buffers used to the OS (glibc keeps freed memory otherwise, and
    RSS would only ever grow)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc() -> Any:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 - glibc only; musl and macOS have none
        return libc
    return None


_libc = _load_libc()


def host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
