"""Kernels that outlive the gateway: the records the next gateway adopts them by (connection keys, flavor, notebook,
owner, last activity, the cell each is running), the activity watch that keeps them current (and that culling reads),
the adoption itself, and the word to clients whose cell ran through it."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jupyter_client.session import Session
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from tornado.ioloop import PeriodicCallback

from msb_kernels.backends import get_backend
from msb_kernels.backends.core.keeping import ADOPTION_RECORD, trusted_json, write_private_json
from msb_kernels.errors import MsbError
from msb_kernels.gateway.kernels.records import BusyFile, KernelRecord, last_activity_of
from msb_kernels.identity.people import SYSTEM, acting_as
from msb_kernels.jupyter.compat import kernels_of, open_activity_stream, utcnow
from msb_kernels.observability import metrics
from msb_kernels.provisioning.provisioner import describe_kernel
from msb_kernels.provisioning.start_request import START_REQUEST

RECORD_INTERVAL = 10.0  # seconds between refreshes of kept kernels' adoption records (their last activity)
BUSY_RECORD = "busy.json"  # BusyFile's, beside the adoption record


class AdoptionMixin:
    """MsbKernelManager's adoption and activity watch. Reads its msb_settings, _kernels and records (and their busy
    files)."""

    def init_adoption(self) -> None:
        self._record_callback: PeriodicCallback | None = None  # _refresh_records, started by the first activity watch

    def start_watching_activity(self, kernel_id: str) -> None:  # type: ignore[override]
        """Called by jupyter_server as a kernel starts or restarts. Records what its own watch records (each kernel's
        last_activity and execution_state, by the same rules), plus, for kept kernels, the execution each is running,
        as it starts and ends: a gateway that adopts a kernel busy at a crash knows what its clients were waiting for.

        One pass over each iopub message: jupyter_server's watch deserializes every message's header and parent,
        parsing their dates, and each status message a second time; this takes 0.4 to 0.5 ms less of the gateway's CPU
        per MCP execute (of about 6). The signature is checked once, with the kernel's key, and only the frames needed
        are parsed. A message that fails the check is ignored and reported, where jupyter_server's watch stopped
        watching the kernel at it."""
        kernel = kernels_of(self)[kernel_id]
        kernel.reason = ""
        kernel.last_activity = utcnow()
        stream = open_activity_stream(kernel)
        session = Session(key=kernel.session.key, signature_scheme=kernel.session.signature_scheme)
        if self._record_callback is None:
            self._record_callback = PeriodicCallback(self._refresh_records, RECORD_INTERVAL * 1000)
            with acting_as(SYSTEM):  # the system's work, not that of the request whose start got here first
                self._record_callback.start()
        busy = None
        kept, record = self._kept(kernel_id), self.records.get(kernel_id)
        if kept is not None and record is not None:
            if record.busy_file is None:  # a restart watches again, with the same file
                record.busy_file = BusyFile(kept[1] / BUSY_RECORD)
            busy = record.busy_file
        reported = False

        def record_activity(msg_list: list[bytes]) -> None:
            nonlocal reported
            _, frames = session.feed_identities(msg_list)
            try:
                signature, header_frame, parent_frame, _, content_frame = frames[:5]
                if not hmac.compare_digest(signature, session.sign(frames[1:5])):
                    raise ValueError("its signature is not the kernel's")
                msg_type = json.loads(header_frame)["msg_type"]
                parent = json.loads(parent_frame) or {}  # dates stay strings: nothing here reads them
                state = json.loads(content_frame)["execution_state"] if msg_type == "status" else None
            except (ValueError, KeyError, TypeError) as error:
                if not reported:  # once per kernel: its iopub is the kernel's to flood
                    self.log.warning(
                        "kernel %s: ignored an iopub message the activity watch cannot read (%s)",
                        kernel_id,
                        error if isinstance(error, ValueError) else f"no {error}",
                    )
                    reported = True
                return
            if msg_type == "iopub_welcome":
                return  # ipykernel greeting a new subscriber (this watch, at adoption): not the kernel at work
            parent_msg_type = parent.get("msg_type")
            tracked = self.track_message_type(parent_msg_type)
            if self.track_message_type(msg_type) or tracked or kernel.execution_state == "busy":
                self.last_kernel_activity = kernel.last_activity = utcnow()
            if state is None:
                return
            if tracked:
                kernel.execution_state = state
            elif kernel.execution_state == "starting" and state != "starting":
                kernel.execution_state = "idle"  # as jupyter_server: after starting, idle unless a tracked request says
            if busy is not None and parent_msg_type == "execute_request":
                if state == "busy":
                    busy.running(parent)
                elif state == "idle" and busy.request.get("msg_id") == parent.get("msg_id"):
                    busy.running(None)

        stream.on_recv(record_activity)

    @property
    def adopt_grace_seconds(self) -> int:
        """How long this gateway's kernels outlive it (MSB_ADOPT_GRACE_SECONDS); read by the provisioner."""
        return self.msb_settings.adopt_grace_seconds

    def _kept(self, kernel_id: str) -> tuple[Any, Path] | None:
        """The kernel manager and state dir of a kernel whose sandbox outlives this gateway, else None."""
        km = kernels_of(self).get(kernel_id)
        described = describe_kernel(km)
        if kernel_id not in self.records or described is None or described.sandbox is None or not described.sandbox.kept:
            return None
        return km, km.provisioner.io_dir.parent

    def record_for_adoption(self, kernel_id: str) -> None:
        """Write what the next gateway needs to adopt this kernel (0600, in its root-only state dir): its connection
        keys, kernelspec, flavor, notebook, owner and last activity (the cell it runs is BusyFile's)."""
        kept, kernel = self._kept(kernel_id), self.records.get(kernel_id)
        if kept is None or kernel is None:
            return
        km, state_dir = kept
        last = last_activity_of(km)
        record = {
            **kernel.to_adoption(),
            "last_activity": last.timestamp() if last is not None else None,
            "connection": {key: value.decode() if isinstance(value, bytes) else value for key, value in km.get_connection_info().items()},
        }
        with contextlib.suppress(OSError):  # a kernel going away as it is recorded
            write_private_json(state_dir / ADOPTION_RECORD, record)
            kernel.recorded_activity = record["last_activity"]

    def _refresh_records(self) -> None:
        """Every RECORD_INTERVAL: kept kernels whose last activity moved get their record rewritten, and so do those
        restarted since (a sandbox's keeper removes the record when the sandbox ends)."""
        for kernel_id, kernel in list(self.records.items()):
            kept = self._kept(kernel_id)
            if kept is None:
                continue
            km, state_dir = kept
            last = last_activity_of(km)
            if kernel.recorded_activity != (last.timestamp() if last else None) or not (state_dir / ADOPTION_RECORD).exists():
                self.record_for_adoption(kernel_id)

    def keep_kernels(self) -> int:
        """At a stop with MSB_KEEP_KERNELS: bring every kept kernel's record up to date and leave it running; return how many."""
        kept = 0
        for kernel_id in list(self.records):
            if self._kept(kernel_id) is not None:
                self.record_for_adoption(kernel_id)
                kept += 1
        return kept

    async def adopt_kernels(self) -> list[str]:
        """Adopt every kernel a previous gateway on this runtime dir left running: same id, state, start request (its
        flavor, notebook, owner and volume), last activity and place in the limits. Called by the gateway at start,
        before it sweeps what is left; the system's work."""
        if self.adopt_grace_seconds <= 0:
            return []
        with acting_as(SYSTEM):
            return await self._adopt_all()

    async def _adopt_all(self) -> list[str]:
        backend = get_backend(self.msb_settings)
        adopted = []
        for found in backend.list_sandboxes():
            if not found.adoptable:
                continue
            state_dir = backend.io_dir_for(found.sandbox_id).parent
            record, problem = trusted_json(state_dir / ADOPTION_RECORD, private=True)
            if record is None or record.get("kernel_id") != found.sandbox_id:
                self.log.info(
                    "sandbox %s is not a session to adopt (%s); the sweep stops it",
                    found.sandbox_id,
                    problem or "its record names another kernel",
                )
                continue
            busy, _ = trusted_json(state_dir / BUSY_RECORD, private=True)
            busy = busy or {}
            if isinstance(busy.get("idle_since"), (int, float)):
                record["last_activity"] = max(record.get("last_activity") or 0, busy["idle_since"])
            try:
                await self._adopt(record, busy if busy.get("msg_id") else None)
            except Exception as exc:
                metrics.ADOPTIONS.labels("lost").inc()
                if (kernel := self.records.pop(found.sandbox_id, None)) is not None:
                    kernel.close()
                self.log.warning(
                    "could not adopt kernel %s: %s; the sweep stops it", found.sandbox_id, exc.message if isinstance(exc, MsbError) else exc
                )
                continue
            adopted.append(found.sandbox_id)
            metrics.ADOPTIONS.labels("adopted").inc()
        if adopted:
            self.log.info("adopted %d kernel(s) from the previous msb-kernels serve: %s", len(adopted), ", ".join(adopted))
        return adopted

    async def _adopt(self, record: dict, busy_with: dict | None) -> None:
        kernel_id = record["kernel_id"]
        kernel = KernelRecord.from_adoption(record)
        self.records[kernel_id] = kernel
        self.sandbox_registry.adoptions[kernel_id] = record
        try:
            # jupyter_server's start, so that restarts, culling, activity and the WebSocket treat it as any other kernel;
            # the provisioner adopts the sandbox where it would have created one. Its start request is the one it was
            # started with, which every later start of it (a restart, an auto-restart after its death) uses again.
            await AsyncMappingKernelManager.start_kernel(
                self, kernel_id=kernel_id, kernel_name=record["kernel_name"], **{START_REQUEST: kernel.request}
            )
        finally:
            self.sandbox_registry.adoptions.pop(kernel_id, None)
        km = kernels_of(self)[kernel_id]
        if record.get("last_activity"):
            km.last_activity = datetime.fromtimestamp(record["last_activity"], timezone.utc)  # the culling clock goes on
        km.execution_state = "busy" if busy_with else "idle"
        self.add_restart_callback(kernel_id, lambda: self._record_death(kernel_id), "restart")
        if busy_with:
            if kernel.busy_file is not None:
                kernel.busy_file.running(busy_with)  # still running it, should this gateway go too
            kernel.loss_report = asyncio.ensure_future(self._report_lost_execution(kernel_id, busy_with))
        self.record_for_adoption(kernel_id)

    async def _report_lost_execution(self, kernel_id: str, request: dict) -> None:
        """The kernel was running request when the last gateway went: what it sent then, and its reply, reached no one.
        Once it has finished (a kernel_info reply comes after it), its clients get a note and an error reply, so
        the cell ends with the loss said rather than waiting for ever."""
        km = kernels_of(self)[kernel_id]
        client = km.client()
        client.start_channels()
        try:
            asked = client.kernel_info()
            while (await client.get_shell_msg()).get("parent_header", {}).get("msg_id") != asked:
                pass
        finally:
            client.stop_channels()
        kernel = self.records.get(kernel_id)
        if kernel is None:
            return  # gone while it ran: no one to tell
        busy = kernel.busy_file
        if busy is not None and busy.request.get("msg_id") == request.get("msg_id"):
            busy.running(None)
        kernel.lost_executions.append(request)
        self.tell_lost_executions(kernel_id)

    def tell_lost_executions(self, kernel_id: str) -> None:
        """Send the lost-execution notes to the kernel's open WebSockets; kept until one is open to hear them."""
        kernel = self.records.get(kernel_id)
        km = kernels_of(self).get(kernel_id)
        if kernel is None or km is None or not kernel.websockets or not kernel.lost_executions:
            return
        connections = list(kernel.websockets)
        requests, kernel.lost_executions = kernel.lost_executions, []
        note = (
            "msb-kernels: the gateway restarted while this ran; the kernel and its variables were kept, "
            "but what the code printed during the restart, and how it ended, were lost.\n"
        )
        for request in requests:
            for channel, msg_type, content in (
                ("iopub", "stream", {"name": "stderr", "text": note}),
                (
                    "shell",
                    "execute_reply",
                    {"status": "error", "ename": "GatewayRestarted", "evalue": note.strip(), "traceback": [], "execution_count": None},
                ),
                ("iopub", "status", {"execution_state": "idle"}),
            ):
                message = km.session.msg(msg_type, content, parent=request)
                for connection in connections:
                    with contextlib.suppress(Exception):  # a socket closing as it is told
                        connection.send_to_client(message, channel)
