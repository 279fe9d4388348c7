"""Host uids for the namespace sandboxes of a root msb-kernels: one per live sandbox on the whole host.

Each sandbox runs as a host uid of its own, so no sandbox can signal, trace or read another's
processes. Gateways with different runtime dirs must not hand out the same uid either, so the
claims live in one host-wide directory: a file per uid that names the process holding it, first
the process that starts the sandbox, then the sandbox's init. A claim whose holder is gone is
free again, and a uid that any host process still runs as is never handed out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from msb_kernels.backends.core.processes import process_alive, process_start_time
from msb_kernels.errors import SandboxError

HOST_UIDS_DIR = Path("/run/msb-kernels-uids")  # host-wide on purpose: not under any one runtime dir
SANDBOX_UID_BASE = 2_000_000_000  # far above real users
SANDBOX_GID = SANDBOX_UID_BASE
MAX_SANDBOXES = 1_000_000


def _claim_path(uid: int) -> Path:
    return HOST_UIDS_DIR / str(uid)


def _read(uid: int) -> dict:
    try:
        return json.loads(_claim_path(uid).read_text())
    except (OSError, ValueError):
        return {}


def _write(uid: int, sandbox_id: str, pid: int) -> None:
    temporary = HOST_UIDS_DIR / f".{uid}.tmp"
    temporary.write_text(json.dumps({"sandbox_id": sandbox_id, "pid": pid, "start": process_start_time(pid)}))
    temporary.replace(_claim_path(uid))


def _uids_running() -> set[int]:
    """The uids host processes run as now (the owner of /proc/<pid>)."""
    running = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                running.add(entry.stat().st_uid)
    return running


def claim(sandbox_id: str) -> int:
    """A host uid no live sandbox of any msb-kernels process has, held by this process until hand_over."""
    HOST_UIDS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(HOST_UIDS_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        running = _uids_running()
        claimed = {int(name) for name in os.listdir(HOST_UIDS_DIR) if name.isdigit()}
        # First a uid nobody has claimed, without reading one claim: reading each live claim made a start at 1,000
        # sandboxes pay 37 ms here. Only when none is left are claims whose holder is gone (a crash) taken back.
        for uid in range(SANDBOX_UID_BASE + 1, SANDBOX_UID_BASE + MAX_SANDBOXES):
            if uid not in claimed and uid not in running:
                _write(uid, sandbox_id, os.getpid())
                return uid
        for uid in sorted(claimed):
            holder = _read(uid)
            if uid in running or process_alive(holder.get("pid"), holder.get("start")):
                continue
            _write(uid, sandbox_id, os.getpid())
            return uid
    raise SandboxError(
        f"no free host uid for another sandbox: {MAX_SANDBOXES} are held", ["stop sandboxes you no longer need (`msb-kernels list`)"]
    )


def hand_over(uid: int, sandbox_id: str, init_pid: int) -> None:
    """The sandbox's init holds uid from now on, whatever becomes of the process that started it."""
    if _read(uid).get("sandbox_id") == sandbox_id:
        _write(uid, sandbox_id, init_pid)


def release(uid: int | None, sandbox_id: str) -> None:
    """Free uid once the sandbox is gone; a claim that names another sandbox is left alone."""
    if uid is not None and _read(uid).get("sandbox_id") == sandbox_id:
        with contextlib.suppress(FileNotFoundError):
            _claim_path(uid).unlink()
