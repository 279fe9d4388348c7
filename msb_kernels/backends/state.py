"""A sandbox's state file, ``<runtime root>/<sandbox id>/state.json``: who owns the sandbox and which
host process holds it. The sweeps read it after a crash or a kill -9, when no live object remembers."""

from __future__ import annotations

import json
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
