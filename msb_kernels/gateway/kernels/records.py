"""What the gateway knows of each kernel it runs: one KernelRecord per kernel (what it was started as, who started it,
what it holds while it runs), and the sandbox side of its kernel manager.

MsbKernelManager owns the records (``records``, by kernel id; ``record(kernel_id)``): a start or an adoption makes one,
``remove_kernel`` pops it and closes what it holds. Its rooms (capacity, culling, hibernation, adoption, activity,
stats) and the WebSocket handler read and write a kernel's state on its record, never in dicts of their own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import Owner
from msb_kernels.kernelspecs.flavors import Flavor, get_flavor
from msb_kernels.provisioning.provisioner import describe_kernel
from msb_kernels.provisioning.start_request import StartRequest


class BusyFile:
    """``busy.json`` in a kept kernel's state dir: the execute_request it is running, or when it went idle.

    Written as each cell starts and ends, so a gateway that adopts a kernel busy at a crash knows what its
    clients were waiting for, and one that adopts an idle kernel knows its last activity to the moment.
    One pwrite into a file held open, padded with spaces to the length before (JSON allows them), costs a
    few microseconds; a whole record replaced by rename cost 0.35 ms per write here."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.written = 0
        self.request: dict = {}
        self.running(None)

    def running(self, request: dict | None) -> None:
        self.request = request or {}
        data = json.dumps(self.request or {"idle_since": time.time()}).encode()
        with contextlib.suppress(OSError):  # a kernel going away as it is written
            os.pwrite(self.fd, data.ljust(self.written), 0)  # one write: a process killed mid-way cannot tear it
            self.written = max(self.written, len(data))

    def close(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class KernelRecord:
    """One kernel of the gateway's, from its start (or adoption) to its removal: counted against the limits from its
    start request until it stops, and persisted for adoption (to_adoption, from_adoption) while its sandbox is kept.

    Its StartRequest is the one jupyter_client starts it again with (a restart, an auto-restart after a death), the
    same object: its flavor (as the gateway chose it), its owner (from the caller, never the request), its volume."""

    # What it was started as; an adopting gateway restores these from the adoption record.
    kernel_id: str
    kernel_name: str
    template: str
    request: StartRequest
    created: float = field(default_factory=time.time)
    listed_as: str | None = None  # the conventional name it was started by (python3), which its model reports

    # What the gateway holds for it while it runs; close() lets it go.
    stop_reason: str | None = None  # why it is being stopped (a cull, a death, a failed hibernation), for its stop record
    busy_file: BusyFile | None = None  # kept kernels: the execute_request it is running, on disk (adoption.py)
    recorded_activity: float | None = None  # kept kernels: the last activity its adoption record holds
    address: str | None = None  # where it was reached when its WebSockets' channels were made
    loss_report: asyncio.Task | None = None  # an adopted kernel's report of the execution its last gateway lost
    lost_executions: list[dict] = field(default_factory=list)  # execute_requests whose end no client has been told yet
    websockets: set[Any] = field(default_factory=set)  # its open WebSockets (websocket.PerSocketIdentityConnection)
    hibernation_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # hibernate and wake never overlap
    hibernation_refused: tuple[Any, str] | None = None  # (the last_activity a refusal was for, why): not retried till used

    @property
    def flavor(self) -> Flavor:
        return get_flavor(self.request.flavor)

    @property
    def owner(self) -> Owner | None:
        """Who started it; None: nobody's (a pooled kernel until it is handed out), which only admins see."""
        return self.request.owner

    @property
    def notebook_path(self) -> str | None:
        return self.request.notebook_path

    def to_adoption(self) -> dict[str, Any]:
        """What the adoption record holds of this record (gateway/kernels/adoption.py adds the connection and last activity)."""
        return {
            "kernel_id": self.kernel_id,
            "kernel_name": self.kernel_name,
            "template": self.template,
            "created": self.created,
            "request": self.request.to_record(),
            "listed_as": self.listed_as,
        }

    @classmethod
    def from_adoption(cls, record: dict) -> KernelRecord:
        """The record an adopting gateway makes from an adoption record. One without a start request (written before
        requests were typed) is not adopted: nothing would say what its restarts may mount."""
        if not isinstance(record.get("request"), dict) or not record["request"].get("flavor"):
            raise InvalidRequest("its adoption record holds no start request (an older msb-kernels wrote it)")
        return cls(
            record["kernel_id"],
            record["kernel_name"],
            record["template"],
            StartRequest.from_record(record["request"]),
            created=record.get("created") or time.time(),
            listed_as=record.get("listed_as") if isinstance(record.get("listed_as"), str) else None,
        )

    def close(self) -> None:
        """The kernel is gone (MsbKernelManager.remove_kernel): what the record holds open goes with it. Its WebSockets
        close themselves; the record only forgets them."""
        if self.busy_file is not None:
            self.busy_file.close()
            self.busy_file = None
        if self.loss_report is not None:
            self.loss_report.cancel()
            self.loss_report = None
        self.lost_executions.clear()
        self.websockets.clear()


def last_activity_of(km: Any) -> Any:
    """The kernel's last activity (a datetime), or None: jupyter_server sets it once its start returns, and until then
    reading the trait raises (it allows no None), which a timer or a stats request that comes in between must not."""
    from traitlets import TraitError

    try:
        return getattr(km, "last_activity", None)
    except TraitError:
        return None


def sandbox_of(km: Any) -> Any:
    """The kernel's Sandbox (msb_kernels.backends.core.base); None where describe_kernel() has none."""
    described = describe_kernel(km)
    return described.sandbox if described is not None else None


def backend_of(sandbox: Any) -> str:
    """The backend a sandbox_of() runs on, as metrics label it: "none" for a kernel not in a sandbox."""
    return (sandbox.info().get("backend") if sandbox is not None else None) or "none"
