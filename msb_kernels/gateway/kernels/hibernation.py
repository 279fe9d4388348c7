"""Hibernation: an idle kernel checkpointed to disk (MSB_HIBERNATE_AFTER_SECONDS), its memory freed, and woken by the
first request that needs it, every variable intact.

The backend does the checkpoint and the restore (Sandbox.hibernate and wake; gVisor's in backends/gvisor/). Here is
when: a periodic look for idle kernels, and a wake before anything reaches a hibernated kernel: a WebSocket's connect
and each of its messages (websocket.py), an MCP call (mcp_bridge.local_sessions), an interrupt. A shutdown or restart
of a hibernated kernel does not wake it: its image is deleted. The kernel stays in /api/kernels and the stats with
execution_state "hibernated"; culling still applies to it, by its last activity, as to any idle kernel.

A refusal (the kernel holds what runsc cannot save, the disk budget is full) leaves the kernel running as it was: it is
culled as it would have been without hibernation, and the log, the stats and the metrics say why. A checkpoint or
restore that ends the sandbox stops the kernel with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections import deque
from typing import Any

from tornado.ioloop import PeriodicCallback

from msb_kernels.backends.core.base import Reconnect
from msb_kernels.errors import HibernationRefused, MsbError, ResourceLimitExceeded, SandboxError
from msb_kernels.gateway.kernels.records import last_activity_of, sandbox_of
from msb_kernels.identity.people import SYSTEM, acting_as, may_see, set_acting
from msb_kernels.jupyter.compat import kernels_of, pending_starts_of, utcnow
from msb_kernels.observability import metrics
from msb_kernels.observability.status import iso_utc

log = logging.getLogger("msb_kernels")

HIBERNATED = "hibernated"  # the execution_state a hibernated kernel reports (the session status too: msb_kernels.observability.status)
RECENT_REFUSALS = 20
SETTLE_SECONDS = 10.0  # at most, for IOPub to be heard after a restore; then the other channels open all the same


def reconnect_of(km: Any) -> Reconnect:
    """How a kernel's ports reopen after a refused hibernation or a wake: IOPub and control first, until iopub_heard."""
    return Reconnect((km.iopub_port, km.control_port), lambda: iopub_heard(km))


async def iopub_heard(km: Any) -> None:
    """Once the kernel is back, only its IOPub and control ports open: ask it for kernel_info on control until a SUB of
    our own hears a status on IOPub. The clients' SUBs reconnected before this one, so they are subscribed again too,
    and the requests they queued (on shell, opened next) lose no output. jupyter_server's nudge, on control."""
    from jupyter_client.session import Session

    own = Session(key=km.session.key, signature_scheme=km.session.signature_scheme, username="msb-hibernation")
    kc = km.client(session=own)
    kc.start_channels(shell=False, iopub=True, stdin=False, hb=False, control=True)
    try:
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            kc.control_channel.send(own.msg("kernel_info_request"))
            with contextlib.suppress(queue.Empty):
                while True:
                    if (await kc.get_iopub_msg(timeout=0.1))["msg_type"] == "status":
                        return
        log.warning("kernel %s: IOPub was not heard within %.0f s of its restore", km.kernel_id, SETTLE_SECONDS)
    finally:
        kc.stop_channels()


class HibernationMixin:
    """MsbKernelManager's hibernation. State: on each kernel's record, a lock (hibernate and wake never overlap) and the
    last activity a refusal was for (not retried until the kernel is used again); here, counters for the stats."""

    def init_hibernation(self) -> None:
        self.hibernation_counts = {"hibernated": 0, "restored": 0, "refused": 0, "failed": 0}
        self.hibernation_refusals: deque[dict] = deque(maxlen=RECENT_REFUSALS)  # newest last: {"id", "reason", "at"}
        self._hibernation_callback: PeriodicCallback | None = None

    @property
    def hibernate_after(self) -> int:
        return self.msb_settings.hibernate_after_seconds

    def start_hibernation(self) -> str | None:
        """Start the periodic look, where MSB_HIBERNATE_AFTER_SECONDS is set; why kernels cannot hibernate here, if so.
        Called by the gateway app once the server runs."""
        if self.hibernate_after <= 0 or self._hibernation_callback is not None:
            return None
        from msb_kernels.backends import get_backend

        try:
            unavailable = get_backend(self.msb_settings).hibernation_unavailable()
        except MsbError as exc:
            unavailable = exc.message
        interval = max(1.0, min(30.0, self.hibernate_after / 2))
        self._hibernation_callback = PeriodicCallback(self.hibernate_idle_kernels, 1000 * interval)
        with acting_as(SYSTEM):  # the timer runs on in the context it was started in
            self._hibernation_callback.start()
        return unavailable

    def stop_hibernation(self) -> None:
        if self._hibernation_callback is not None:
            self._hibernation_callback.stop()
            self._hibernation_callback = None

    def _sandbox(self, kernel_id: str) -> Any:
        return sandbox_of(kernels_of(self).get(kernel_id))

    def is_hibernated(self, kernel_id: str) -> bool:
        sandbox = self._sandbox(kernel_id)
        return bool(sandbox is not None and sandbox.hibernated)

    def _lock(self, kernel_id: str) -> asyncio.Lock:
        record = self.records.get(kernel_id)
        return record.hibernation_lock if record is not None else asyncio.Lock()  # no record: a kernel on its way out

    def _at_rest(self, kernel_id: str, km: Any) -> bool:
        """Idle, or started and never asked anything: jupyter_server says "starting" until the kernel's first status
        message, which comes with the first request, so a kernel started over REST that no client has reached yet
        would never sleep (bench/fit.py: none of 23 did in 70 s). One still being started is not at rest."""
        state = getattr(km, "execution_state", None)
        return state == "idle" or (state == "starting" and kernel_id not in pending_starts_of(self))

    async def hibernate_idle_kernels(self) -> None:
        """The periodic look: each session's kernel idle for MSB_HIBERNATE_AFTER_SECONDS, and not busy, hibernates,
        whether or not a client is connected (it wakes when one sends something). The system's work."""
        set_acting(SYSTEM)
        now = time.time()
        for kernel_id, record in list(self.records.items()):
            km = kernels_of(self).get(kernel_id)
            sandbox = self._sandbox(kernel_id)
            last = last_activity_of(km)
            if km is None or sandbox is None or sandbox.hibernated or last is None:
                continue
            if not self._at_rest(kernel_id, km) or self._lock(kernel_id).locked():
                continue
            if now - last.timestamp() < self.hibernate_after or (record.hibernation_refused or (None,))[0] == last:
                continue
            try:
                await self.hibernate_kernel(kernel_id)
            except MsbError:
                pass  # said and counted by hibernate_kernel

    async def hibernate_kernel(self, kernel_id: str) -> int:
        """Checkpoint one kernel now; the image's bytes. HibernationRefused: it runs on; SandboxError: it is stopped."""
        km = kernels_of(self).get(kernel_id)
        sandbox = self._sandbox(kernel_id)
        if km is None or sandbox is None:
            raise HibernationRefused(f"kernel {kernel_id} has no sandbox to hibernate")
        async with self._lock(kernel_id):
            if sandbox.hibernated:
                return 0
            began = time.monotonic()
            try:
                size = await sandbox.hibernate(reconnect_of(km))
            except HibernationRefused as exc:
                self._refused(kernel_id, km, exc.message)
                raise
            except SandboxError as exc:
                await self._ended_by(kernel_id, "failed", "hibernation failed", exc)
                raise
            km.execution_state = HIBERNATED
            if (record := self.records.get(kernel_id)) is not None:
                record.hibernation_refused = None
            self.hibernation_counts["hibernated"] += 1
            metrics.HIBERNATIONS.labels("hibernated").inc()
            metrics.HIBERNATE_SECONDS.observe(time.monotonic() - began)
            self.log.info("kernel %s hibernated after %d s idle: %.1f MiB on disk", kernel_id, self.hibernate_after, size / 2**20)
            return size

    async def _ended_by(self, kernel_id: str, outcome: str, what: str, error: SandboxError) -> None:
        """A checkpoint or restore that ended the sandbox: the kernel stops, and its stop record says why."""
        self.hibernation_counts["failed"] += 1
        metrics.HIBERNATIONS.labels(outcome).inc()
        self.log.error("kernel %s: %s, which ended it: %s", kernel_id, what, error.message)
        if (record := self.records.get(kernel_id)) is not None:
            record.stop_reason = f"{what}: {error.message}"
        await self.shutdown_kernel(kernel_id, now=True)

    def _refused(self, kernel_id: str, km: Any, reason: str) -> None:
        record = self.records.get(kernel_id)
        if record is not None:
            record.hibernation_refused = (last_activity_of(km), reason)
        self.hibernation_counts["refused"] += 1
        metrics.HIBERNATIONS.labels("refused").inc()
        owner = record.owner if record is not None else None
        self.hibernation_refusals.append({"id": kernel_id, "owner": owner, "reason": reason, "at": time.time()})
        self.log.warning("kernel %s stays awake: it cannot hibernate: %s", kernel_id, reason)

    def _touch(self, kernel_id: str) -> None:
        """A request is on its way: the kernel counts as active from now, so the look does not checkpoint it between the
        request's arrival and the busy status that the kernel sends when it starts on it (the request would be lost)."""
        km = kernels_of(self).get(kernel_id)
        if km is not None and last_activity_of(km) is not None:
            km.last_activity = utcnow()

    async def wake_kernel(self, kernel_id: str) -> None:
        """Restore a hibernated kernel before a request reaches it; at once for one that is awake. SandboxError when it
        cannot come back: it is stopped then, with that reason."""
        self._touch(kernel_id)
        sandbox = self._sandbox(kernel_id)
        if sandbox is None or not sandbox.hibernated:
            return
        async with self._lock(kernel_id):
            if not sandbox.hibernated:
                return  # another request woke it while this one waited
            km = kernels_of(self)[kernel_id]
            began = time.monotonic()
            self.check_wake_share(kernel_id)  # its owner's share first: a refusal puts nobody else's kernel to sleep
            await self._make_room(kernel_id)
            try:
                await sandbox.wake(reconnect_of(km))
            except SandboxError as exc:
                await self._ended_by(kernel_id, "restore_failed", "restore from hibernation failed", exc)
                raise
            km.execution_state = "idle"
            self._touch(kernel_id)
            self.hibernation_counts["restored"] += 1
            metrics.HIBERNATIONS.labels("restored").inc()
            metrics.RESTORE_SECONDS.observe(time.monotonic() - began)

    async def _make_room(self, kernel_id: str) -> None:
        """Hibernate the least recently used idle kernels until the one waking fits the capacity (MSB_CAPACITY_*):
        so a host holds more sessions than its memory, as long as few are in use at once."""
        flavor = self.records[kernel_id].flavor
        tried: set[str] = {kernel_id}
        while not self.fits(flavor):
            idle = [
                (km.last_activity, other)
                for other in list(self.records)
                if other not in tried
                and (km := kernels_of(self).get(other)) is not None
                and self._at_rest(other, km)
                and last_activity_of(km) is not None
                and not self.is_hibernated(other)
            ]
            if not idle:
                memory, _ = self.allocated()
                raise ResourceLimitExceeded(
                    f"kernel {kernel_id} cannot wake: the host's capacity is taken by kernels in use "
                    f"({memory} MiB of MSB_CAPACITY_MEMORY_MIB={self.capacity_memory_mib} allocated, none idle to hibernate)",
                    ["try again once a kernel is idle or stopped", "or raise MSB_CAPACITY_MEMORY_MIB / MSB_CAPACITY_CPUS"],
                    limit="capacity_memory",
                )
            victim = min(idle)[1]
            tried.add(victim)
            # refused or failed: said and counted there; the next one is tried. The victim is likely another
            # person's kernel: the system puts it to sleep (and stops it, should its checkpoint end it).
            with contextlib.suppress(MsbError), acting_as(SYSTEM):
                await self.hibernate_kernel(victim)

    def wake_soon(self, kernel_id: str) -> None:
        """wake_kernel from sync code (a WebSocket message): what was sent waits in ZMQ's queue until the kernel is back."""
        self._touch(kernel_id)
        if self.is_hibernated(kernel_id):
            task = asyncio.ensure_future(self.wake_kernel(kernel_id))
            task.add_done_callback(lambda done: done.cancelled() or done.exception())  # said and counted by wake_kernel

    def hibernation_refused(self, kernel_id: str) -> str | None:
        """Why the kernel's last try to hibernate was refused, if it was: the cull that ends it says so."""
        record = self.records.get(kernel_id)
        return record.hibernation_refused[1] if record is not None and record.hibernation_refused else None

    async def wake_all(self, timeout: float) -> None:
        """Restore every hibernated kernel (at a stop with MSB_KEEP_KERNELS); one that does not come back in time is lost.

        A checkpoint or restore under way when the stop came finishes first (the periodic look is stopped by then, so
        no new one begins): a kernel mid-checkpoint was neither running for its keeper nor marked asleep to be woken,
        and the next gateway adopted 2 of 3 kernels while the third's disk was left behind (a fresh clone's run)."""
        deadline = time.monotonic() + timeout

        async def settled(lock: asyncio.Lock) -> None:
            async with lock:
                pass

        under_way = [record.hibernation_lock for record in list(self.records.values()) if record.hibernation_lock.locked()]
        if under_way:
            await asyncio.wait([asyncio.ensure_future(settled(lock)) for lock in under_way], timeout=timeout)
        hibernated = [kernel_id for kernel_id in list(self.records) if self.is_hibernated(kernel_id)]
        if hibernated:
            self.log.info("waking %d hibernated kernel(s), for the next msb-kernels serve to adopt", len(hibernated))
            wakes = [asyncio.ensure_future(self.wake_kernel(kernel_id)) for kernel_id in hibernated]
            await asyncio.wait(wakes, timeout=max(1.0, deadline - time.monotonic()))

    def hibernation_stats(self, person: Any = None) -> dict:
        """Counts for everyone; the recent refusals (which name kernels) only of kernels ``person`` may see."""
        hibernated = [kernel_id for kernel_id in list(self.records) if self.is_hibernated(kernel_id)]
        return {
            "after_seconds": self.hibernate_after,
            "hibernated_now": len(hibernated),
            **self.hibernation_counts,
            "recent_refusals": [
                {**refusal, "owner": str(refusal["owner"]) if refusal["owner"] else None, "at": iso_utc(refusal["at"])}
                for refusal in self.hibernation_refusals
                if may_see(person, refusal.get("owner"))
            ],
        }
