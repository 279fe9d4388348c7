"""Which host processes still run: how both backends tell a live owner from a dead one.

A pid alone is not enough (pids are reused), so records keep the process's start tick too.
"""

from __future__ import annotations

import os


def process_start_time(pid: int) -> int | None:
    """The kernel's start tick for pid: with the pid, it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int | None, start_time: int | None) -> bool:
    return pid is not None and start_time is not None and process_start_time(pid) == start_time


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
