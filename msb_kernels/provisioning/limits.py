"""Where the session limit lives: MSB_MAX_SESSIONS's one rule (check_session_limit, applied to the one count,
registry.SandboxRegistry.sessions_counted), and the process limits a msb-kernels process lifts for it: open files (RLIMIT_NOFILE), and the ZeroMQ
sockets of the one context its kernel manager talks to every kernel through (jupyter_client's shared_context; the
gateway's, and the MCP bridge's clients on it).

Both defaults stop a gateway far short of a thousand idle sessions: ZeroMQ's MAX_SOCKETS is 1023 per context, and
each idle kernel holds two sockets in it (its manager's control socket and the activity watch's iopub), each open
WebSocket four more; systemd's soft RLIMIT_NOFILE is 1024, and each of those sockets is two descriptors (its mailbox
and its connection). Past either, a start fails with EMFILE ("Too many open files"); over_limit turns that into a
refusal that names the limit and what moves it."""

from __future__ import annotations

import errno
import resource
from pathlib import Path
from typing import Any

from msb_kernels.errors import ResourceLimitExceeded

# ZeroMQ sockets one session may hold in the kernel manager's context: 2 while idle (its manager's control, the
# activity watch's iopub), 2 for an MCP client (shell, iopub), 4 per WebSocket (shell, control, iopub, stdin, kept
# after a close for the client's reconnection).
ZMQ_SOCKETS_PER_SESSION = 12
ZMQ_SOCKETS_SPARE = 256  # shutdowns, pooled kernels and the MCP bridge's probes
ZMQ_DEFAULT_MAX_SOCKETS = 1023
# Descriptors per session in the gateway: 10 or 11 idle, measured at 30 sessions (bench/scale.py: its ZeroMQ sockets'
# mailboxes and connections, the sandbox's pidfd, a pipe, the keeper's socket), 9 more per open WebSocket.
FILES_PER_SESSION = 24
FILES_SPARE = 1024


def zmq_max_sockets(max_sessions: int) -> int:
    """MAX_SOCKETS for the kernel manager's context: room for every session at once, never below ZeroMQ's default."""
    return max(ZMQ_DEFAULT_MAX_SOCKETS, ZMQ_SOCKETS_PER_SESSION * max_sessions + ZMQ_SOCKETS_SPARE)


def files_needed(max_sessions: int) -> int:
    return FILES_PER_SESSION * max_sessions + FILES_SPARE


def size_zmq_context(context: Any, max_sessions: int) -> int:
    """Set the context's MAX_SOCKETS before its first socket (ZeroMQ reads it once, when the context starts); return it."""
    import zmq

    wanted = zmq_max_sockets(max_sessions)
    if context.get(zmq.MAX_SOCKETS) < wanted:
        context.set(zmq.MAX_SOCKETS, wanted)
    return context.get(zmq.MAX_SOCKETS)


def raise_open_files() -> tuple[int, int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard one (a process may, unprivileged); return (before, after, hard).

    Only the hard limit is the operator's choice (LimitNOFILE= in a systemd unit, ulimit -Hn): the soft one is a
    default kept low for select() users, and the gateway polls, never selects."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft, hard
        return soft, target, hard
    return soft, soft, hard


def open_files_advice(max_sessions: int) -> str | None:
    """What the open-file limit still lacks for MSB_MAX_SESSIONS, once lifted; None when it has room."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = files_needed(max_sessions)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    return (
        f"open files (RLIMIT_NOFILE) are limited to {soft}, and MSB_MAX_SESSIONS={max_sessions} may need about {needed}: "
        f"raise the hard limit (LimitNOFILE={needed} in the systemd unit, or ulimit -Hn {needed}) or lower MSB_MAX_SESSIONS"
    )


def _raised(exc: BaseException, number: int) -> bool:
    """Whether exc, or an exception it was raised from or during, carries errno number."""
    seen: BaseException | None = exc
    while seen is not None and getattr(seen, "errno", None) != number:
        seen = seen.__cause__ or seen.__context__
    return seen is not None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def own_pids_cgroup() -> tuple[int | None, int | None]:
    """(pids.current, pids.max) of this process's cgroup, where the pids controller bounds it (systemd's TasksMax=);
    (None, None) where nothing does."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "pids" or (controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists()):
            group = Path("/sys/fs/cgroup/pids" if controllers == "pids" else "/sys/fs/cgroup") / path.lstrip("/")
            limit = _read_int(group / "pids.max")
            if limit is not None:
                return _read_int(group / "pids.current"), limit
    return None, None


def host_tasks() -> tuple[int | None, int | None]:
    """(tasks on the host now, the lower of kernel.pid_max and kernel.threads-max)."""
    try:
        total = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        total = None
    limits = [v for v in (_read_int(Path("/proc/sys/kernel/pid_max")), _read_int(Path("/proc/sys/kernel/threads-max"))) if v]
    return total, min(limits) if limits else None


def over_task_limit(exc: BaseException) -> ResourceLimitExceeded | None:
    """The refusal for a start that failed because no process could be made for its sandbox (EAGAIN from fork): the
    host's tasks (kernel.pid_max, kernel.threads-max) or this process's cgroup (systemd's TasksMax=), each with what it
    holds now. A gVisor kernel is some 150 host tasks under ptrace, a namespace one a handful."""
    if not _raised(exc, errno.EAGAIN):
        return None
    in_group, group_max = own_pids_cgroup()
    tasks, tasks_max = host_tasks()
    held = [f"the host runs {tasks} tasks of kernel.pid_max / kernel.threads-max = {tasks_max}"] if tasks_max else []
    if group_max:
        held.append(f"this service's cgroup holds {in_group} of its pids.max = {group_max} (systemd's TasksMax=)")
    return ResourceLimitExceeded(
        "no process could be made for the kernel's sandbox (fork: Resource temporarily unavailable): " + "; ".join(held),
        [
            "stop a session you no longer need (DELETE /api/kernels/<id>)",
            "or raise the limit that is full: sysctl -w kernel.pid_max=4194304 (and kernel.threads-max), "
            "or TasksMax=infinity in the gateway's systemd unit",
        ],
        limit="host_tasks",
    )


def over_limit(exc: BaseException, max_sessions: int, max_sockets: int | None) -> ResourceLimitExceeded | None:
    """The refusal for a start that failed on a limit of this process or host, not a fault: descriptors or ZeroMQ
    sockets (EMFILE, as ZeroMQ also says when a context passes MAX_SOCKETS), or tasks (EAGAIN from fork); None for
    any other failure."""
    if not _raised(exc, errno.EMFILE):
        return over_task_limit(exc)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ResourceLimitExceeded(
        f"this msb-kernels process has run out of open files or ZeroMQ sockets (RLIMIT_NOFILE={soft}, ZeroMQ "
        f"MAX_SOCKETS={max_sockets}): no more kernels can be reached from it",
        [
            "stop a session you no longer need (DELETE /api/kernels/<id>)",
            f"or raise its open-file limit (LimitNOFILE={files_needed(max_sessions)} in a systemd unit, ulimit -Hn); "
            "MAX_SOCKETS follows MSB_MAX_SESSIONS",
        ],
        limit="open_files",
    )


def check_session_limit(active: int, max_sessions: int, suggestions: list[str] | None = None) -> None:
    """Raise ResourceLimitExceeded when ``active`` sessions leave no room for one more: the one MSB_MAX_SESSIONS rule."""
    if active >= max_sessions:
        raise ResourceLimitExceeded(
            f"session limit reached: {active} of MSB_MAX_SESSIONS={max_sessions} sandboxed kernels run", suggestions, limit="max_sessions"
        )
