"""A sandbox's state file, ``<runtime root>/<sandbox id>/state.json``: who owns the sandbox and which
host process holds it. The sweeps read it after a crash or a kill -9, when no live object remembers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

from msb_kernels.backends.base import SandboxRecord
from msb_kernels.backends.processes import process_alive


def write_state(state_dir: Path, record: dict) -> None:
    """Replace the state file whole, so a reader never sees half of one."""
    temporary = state_dir / "state.json.tmp"
    temporary.write_text(json.dumps(record))
    temporary.replace(state_dir / "state.json")


def read_states(root: Path, backend: str) -> list[SandboxRecord]:
    """The sandboxes of one backend under root: ``owner_pid`` is the host process that started each,
    ``init_pid`` the host process that holds it (records without "backend" are the namespace backend's)."""
    records: list[SandboxRecord] = []
    if not root.is_dir():
        return records
    for state_file in root.glob("*/state.json"):
        try:
            data = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        if data.get("backend", "namespace") != backend:
            continue  # another backend's sandbox in the same runtime dir
        owner_alive = process_alive(data.get("owner_pid"), data.get("owner_start"))
        running = process_alive(data.get("init_pid"), data.get("init_start"))
        records.append(SandboxRecord(data["sandbox_id"], backend, owner_alive, running, data.get("created", 0.0), data))
    return records


def make_io_dir(root: Path, sandbox_id: str) -> Path:
    """``<root>/<sandbox id>/io``: reachable through root, private to the host's root below it."""
    io_dir = root / sandbox_id / "io"
    io_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    os.chmod(io_dir.parent, 0o700)
    os.chmod(io_dir, 0o700)
    return io_dir


def remove_state_dir(state_dir: Path, *, keep_io_dir: bool) -> None:
    """The sandbox's directory, or (a restart reuses the connection dir) only its state file."""
    if keep_io_dir:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "state.json").unlink()
    else:
        shutil.rmtree(state_dir, ignore_errors=True)


def take_orphans(records: list[SandboxRecord]) -> list[SandboxRecord]:
    """The sandboxes whose owner is gone (or, owned by none, that no longer run); a holder still
    running is killed first, so the caller only removes what is left."""
    orphans = []
    for record in records:
        if record.owner_alive or (record.details.get("owner_pid") is None and record.running):
            continue
        if record.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.details["init_pid"], signal.SIGKILL)
        orphans.append(record)
    return orphans


def exit_status_reason(code: int) -> str:
    """A kernel's exit status (a Popen returncode: negative for a signal) in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"the kernel exited with status {code}"
