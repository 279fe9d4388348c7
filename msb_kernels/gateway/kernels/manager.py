"""The gateway's kernel manager: jupyter_server's AsyncMappingKernelManager (so culling, restarts and the WebSocket
all stay jupyter_server's) with the warm pool and one mixin per concept, each in its own room:

- capacity.py: the check before every start (MSB_MAX_SESSIONS, the flavors against the host capacity);
- culling.py: culling with the per-kernelspec ``metadata.cull_idle_timeout`` override;
- adoption.py: kernels that outlive the gateway, adopting them, and jupyter_server's activity watch in one pass;
- hibernation.py: idle kernels checkpointed to disk, and woken by the next request;
- websocket.py: the bounded buffer for closed clients (beside the WebSocket itself);
- stats.py: /api/msb/stats.

What it keeps of each kernel is one KernelRecord (records.py), in ``records``: the rooms share state through it and
through each other's public methods, not through dicts of their own, so each stays a room of its own. It owns the
SandboxRegistry its provisioners, pool and the MCP bridge's sessions count sandboxes in (registry.py).

It raises the project's own errors (msb_kernels.errors); the handlers turn them into HTTP answers (gateway/http_errors.py).
The kernelspecs it offers are gateway/sandboxed_kernelspecs.py's: only sandboxed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import replace
from typing import Any

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from tornado import web
from traitlets import default

from msb_kernels.errors import InvalidRequest, MsbError, NobodyActing, ResourceLimitExceeded, SandboxError
from msb_kernels.gateway.host import give_memory_back
from msb_kernels.gateway.kernels.adoption import AdoptionMixin
from msb_kernels.gateway.kernels.capacity import CapacityMixin
from msb_kernels.gateway.kernels.culling import CullingMixin
from msb_kernels.gateway.kernels.hibernation import HibernationMixin
from msb_kernels.gateway.kernels.records import KernelRecord, backend_of, sandbox_of
from msb_kernels.gateway.kernels.stats import StatsMixin
from msb_kernels.gateway.kernels.websocket import ClosedClientBuffersMixin
from msb_kernels.identity.people import acting, may_see
from msb_kernels.jupyter.compat import (
    MappingKernelManagerHooks,
    kernels_of,
    pending_starts_of,
    serve_starts_through,
    shutdown_all_now,
    use_start_request,
)
from msb_kernels.kernelspecs.choice import DEFAULT_TEMPLATE, LISTED_NAMES, conventional_choice, parse_pool_sizes
from msb_kernels.observability import audit, metrics
from msb_kernels.observability.status import iso_utc
from msb_kernels.provisioning.limits import check_session_limit, over_limit, size_zmq_context
from msb_kernels.provisioning.person_places import volume_key
from msb_kernels.provisioning.pool import KernelPool, PooledMultiKernelManager
from msb_kernels.provisioning.provisioner import describe_kernel
from msb_kernels.provisioning.registry import SandboxRegistry
from msb_kernels.provisioning.start_request import NOTEBOOK, START_REQUEST, StartRequest
from msb_kernels.settings.config import load_settings

RESTART_WAIT_SECONDS = 60.0  # a shutdown waits this long at most for a restart in progress to end
RECENTLY_STOPPED = 20  # stopped kernels kept in the stats, newest last
SESSION_ADVICE = ["stop a session you no longer need (DELETE /api/kernels/<id>)", "or raise MSB_MAX_SESSIONS"]


class MsbKernelManager(
    CapacityMixin,
    CullingMixin,
    HibernationMixin,
    AdoptionMixin,
    ClosedClientBuffersMixin,
    StatsMixin,
    MappingKernelManagerHooks,
    AsyncMappingKernelManager,
):
    """jupyter_server's kernel manager, with sandbox limits and stats."""

    # jupyter_server's culling traits, with defaults from MSB_* variables.
    @default("cull_idle_timeout")
    def _cull_idle_timeout_default(self) -> int:
        return self.msb_settings.session_timeout_seconds

    @default("cull_interval")
    def _cull_interval_default(self) -> int:
        return self.msb_settings.cull_interval_seconds

    @default("cull_connected")
    def _cull_connected_default(self) -> bool:
        return self.msb_settings.cull_connected

    @default("cull_busy")
    def _cull_busy_default(self) -> bool:
        return self.msb_settings.cull_busy

    @default("default_kernel_name")
    def _default_kernel_name_default(self) -> str:
        """python3: the default template's listed name, which starts its kernelspec of the default flavor. Lab's
        launcher and its kernel dialog look the default up among the listed kernelspecs."""
        return LISTED_NAMES[DEFAULT_TEMPLATE]

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.msb_settings = load_settings(self.config)
        # jupyter_server starts kernels through pinned_superclass._async_start_kernel: that is where the pool serves them.
        serve_starts_through(self, PooledMultiKernelManager)
        # This gateway's sandboxes: its provisioners reach it as their manager's parent's (registry.registry_of), its
        # pool and the MCP bridge's sessions through this manager.
        self.sandbox_registry = SandboxRegistry()
        self.sandbox_registry.pool_counts_as_sessions = self.msb_settings.pool_counts_as_sessions
        self.pool = KernelPool(self, parse_pool_sizes(self.msb_settings.pool_size), self.msb_settings.pool_counts_as_sessions)
        # Every kernel's sockets are in this one context (jupyter_client's shared_context): ZeroMQ's default of 1023
        # would stop the gateway at about 500 idle kernels. Sized now, before its first socket.
        self.zmq_max_sockets = size_zmq_context(self.context, self.msb_settings.max_sessions + sum(self.pool.sizes.values()))
        # One record per kernel, from its start (or adoption) to remove_kernel: everything the gateway keeps of it.
        self.records: dict[str, KernelRecord] = {}
        self.stopped: deque[dict] = deque(maxlen=RECENTLY_STOPPED)
        self.init_adoption()
        self.sandbox_registry.kernel_moved_listeners.append(self._kernel_moved)
        self.init_hibernation()

    def record(self, kernel_id: str) -> KernelRecord | None:
        """The kernel's record; None for an id this gateway runs no kernel under (or not yet: a pooled one waiting)."""
        return self.records.get(kernel_id)

    # -- ownership: the one check of who may see a kernel ------------------------------
    # jupyter_server's handlers, the WebSocket, the session manager and the MCP bridge all find kernels through
    # ``in`` (jupyter_server's _check_kernel_id answers 404 from it) and list_kernel_ids; so this is where a kernel
    # that is not the caller's stops existing for them. The caller is msb_kernels.identity.people.acting().

    def visible(self, kernel_id: str) -> bool:
        """Whether the caller may see this kernel: the system and admins every one, a person their own, nobody none."""
        record = self.records.get(kernel_id)
        return may_see(acting(), record.owner if record is not None else None)

    def __contains__(self, kernel_id: object) -> bool:
        return super().__contains__(kernel_id) and self.visible(str(kernel_id))

    def list_kernel_ids(self) -> list[str]:
        return [kernel_id for kernel_id in super().list_kernel_ids() if self.visible(kernel_id)]

    def list_kernels(self) -> list[dict]:
        """jupyter_server's, over the caller's kernels only (its own walks every id, and would count each other
        person's kernel as a refused lookup)."""
        models = []
        for kernel_id in self.list_kernel_ids():
            with contextlib.suppress(web.HTTPError, KeyError):
                models.append(self.kernel_model(kernel_id))
        return models

    def kernel_model(self, kernel_id: str) -> dict:
        """jupyter_server's, with the name a kernel was started by where that is a listed conventional name (python3):
        the one Lab lists, shows on its toolbar and saves in the notebook (sandboxed_kernelspecs.find_kernel_specs)."""
        model = super().kernel_model(kernel_id)
        record = self.records.get(kernel_id)
        if record is not None and record.listed_as:
            model["name"] = record.listed_as
        return model

    def kernel_not_found(self, kernel_id: str) -> None:
        """jupyter_server answers 404 alike for a kernel that does not exist and for one that is not the caller's; the
        second is a refusal the audit trail keeps."""
        if kernel_id in kernels_of(self):
            audit.record("refusal", "not the caller's kernel", kernel_id)

    def update_env(self, *, kernel_id: str, env: dict[str, str]) -> None:
        """jupyter_server's session rename: it passes its whole environment with the notebook's new path. Only the path
        is taken, into the kernel's start request, which its next restart uses."""
        record = self.records.get(kernel_id)
        if record is None or kernel_id not in self:
            return
        record.request = replace(record.request, notebook_path=env.get(NOTEBOOK) or None)
        use_start_request(self.get_kernel(kernel_id), record.request)

    # -- kernel lifecycle -----------------------------------------------------------

    async def start_kernel(  # type: ignore[override]
        self, *, kernel_id: str | None = None, path: str | None = None, start_request: StartRequest | None = None, **kwargs: Any
    ) -> str:
        """Start a kernel for the caller. What it asks for is ``start_request`` (the handlers and the MCP bridge make it
        from the client's request); the gateway adds what only it decides: the flavor it chose, the kernelspec's
        environment, and the caller's owner and volume. ``env`` (jupyter_server's session manager passes this
        process's own) and ``path`` (a directory of this host) are never a kernel's: they are dropped."""
        if kernel_id is not None and kernel_id in self:
            return await super().start_kernel(kernel_id=kernel_id)
        kwargs.pop("env", None)
        person = acting()
        if person is None:
            raise NobodyActing("a kernel start came with nobody acting for it, so it has no owner: refused")
        if kernel_id is not None and not person.admin:
            # A person names no kernel id: an id taken by another person must not be told apart from a free one.
            raise InvalidRequest("kernel_id cannot be chosen here", ["leave kernel_id out: the gateway gives each new kernel its own id"])
        kernel_name = kwargs.pop("kernel_name", None) or self.default_kernel_name
        listed_as = kernel_name if kernel_name in LISTED_NAMES.values() else None
        conventional = conventional_choice(kernel_name, self.msb_settings.default_flavor)
        if conventional is not None:  # python3 and its kind start the msb kernelspec they stand for (pool, stats, MCP)
            kernel_name = conventional.kernel_name
        began = time.monotonic()
        try:
            asked = start_request if start_request is not None else StartRequest()
            flavor, template, environment = self.flavor_for(kernel_name, asked)
            request = replace(asked, flavor=flavor.name, environment=environment).for_caller(
                None if person.is_system else person.owner,
                volume_key(self.msb_settings, person),  # never what the request asserts
            )
            kwargs[START_REQUEST] = request
            self.check_share(flavor)  # the caller's own share first: a person at their limit costs the others nothing
            from_pool = kernel_id is None and self.pool.can_serve(kernel_name, kwargs)
            if not (from_pool and self.pool.counts_as_sessions):  # a counted pooled kernel is in the totals already
                check_session_limit(self.sandbox_registry.sessions_counted(), self.msb_settings.max_sessions, SESSION_ADVICE)
                self.check_capacity(flavor)
            pooled = self.pool.reserve(kernel_name, kwargs) if from_pool else None
            kernel_id = pooled or kernel_id or self.new_kernel_id()
            if not (pooled and self.pool.counts_as_sessions):  # no await since the check: starts cannot race past it
                self.sandbox_registry.claim_session(kernel_id, self.msb_settings.max_sessions, SESSION_ADVICE)
        except MsbError as exc:
            why = metrics.start_failure_reason(exc)
            metrics.KERNEL_START_FAILURES.labels(why).inc()
            audit.record("start", f"refused: {why}", None, kernel_name=kernel_name, message=exc.message)
            raise
        record = KernelRecord(kernel_id, kernel_name, template, request, listed_as=listed_as)
        self.records[kernel_id] = record
        try:
            started = await super().start_kernel(kernel_id=kernel_id, kernel_name=kernel_name, **kwargs)
            self.add_restart_callback(started, lambda: self._record_death(started), "restart")
            self.record_for_adoption(started)
            backend = backend_of(sandbox_of(kernels_of(self).get(started)))
            metrics.KERNEL_STARTS.labels(flavor.name, backend, str(pooled is not None).lower()).observe(time.monotonic() - began)
            audit.record("start", "ok", started, kernel_name=kernel_name, flavor=flavor.name, pooled=pooled is not None)
            return started
        except BaseException as exc:
            why = metrics.start_failure_reason(exc)
            metrics.KERNEL_START_FAILURES.labels(why).inc()
            audit.record("start", f"failed: {why}", kernel_id, kernel_name=kernel_name)
            self.records.pop(kernel_id, None)
            self.sandbox_registry.release_session(kernel_id)
            record.close()
            # jupyter_client keeps a failed start among its pending kernels, where shutdown_all would try (and fail) to stop it.
            pending_starts_of(self).pop(kernel_id, None)
            await self.pool.release(kernel_id)
            reason = exc.message if isinstance(exc, MsbError) else (exc.log_message if isinstance(exc, web.HTTPError) else str(exc))
            self._record_stop(record, "error", f"start failed: {reason}")
            if isinstance(exc, Exception) and not isinstance(exc, (ResourceLimitExceeded, web.HTTPError)):
                refusal = over_limit(exc, self.msb_settings.max_sessions, self.zmq_max_sockets)
                if refusal is not None:  # a limit of this process or host, not a fault: named, without a traceback
                    self.log.warning("kernel %s did not start: %s", kernel_id, refusal.message)
                    raise refusal from None
            if isinstance(exc, (MsbError, web.HTTPError)) or not isinstance(exc, Exception):  # ours, jupyter_server's, cancellation
                raise
            self.log.error("kernel %s did not start: %s", kernel_id, exc, exc_info=exc)
            raise SandboxError(
                f"the {kernel_name} kernel did not start: {type(exc).__name__}: {exc}", ["run `msb-kernels doctor` to check this host"]
            ) from exc

    async def shutdown_all(self, now: bool = True) -> None:  # type: ignore[override]
        """At the gateway's stop, every sandbox is killed at once: it is thrown away with whatever it held, so asking
        each kernel to shut down first only adds shutdown_wait_time (5 s) per kernel that is busy or ignores the request."""
        await shutdown_all_now(self, now=now)

    def remove_kernel(self, kernel_id: str):  # type: ignore[override]
        """Every way a kernel ends (shutdown, cull, death) comes through here: release what it held."""
        km = super().remove_kernel(kernel_id)
        self.sandbox_registry.release_session(kernel_id)  # its provisioner's cleanup does too, where it ran
        record = self.records.pop(kernel_id, None)
        if record is not None:
            record.close()
            reason = record.stop_reason or "shut down"
            exit_reason = described.last_exit_reason if (described := describe_kernel(km)) else None
            self._record_stop(record, "stopped", f"{reason}: {exit_reason}" if exit_reason else reason, exit_reason)
            how = "died" if reason == "died" else "culled" if reason.startswith("culled after being idle") else "shutdown"
            metrics.KERNEL_STOPS.labels(how).inc()
            audit.record("stop", how, kernel_id, owner=record.owner.name if record.owner else None, reason=reason)
            self._count_oom(record, exit_reason)
        for listener in list(self.sandbox_registry.kernel_removed_listeners):
            listener(kernel_id)
        give_memory_back()
        return km

    def _record_stop(self, record: KernelRecord, status: str, reason: str, exit_reason: str | None = None) -> None:
        """``reason`` says what happened; ``exit_reason`` is the sandbox's word on why the kernel ended, when it knows."""
        self.stopped.append(
            {
                "id": record.kernel_id,
                "owner": record.owner,  # an Owner: the stats show its name to those who may see it
                "kernel_name": record.kernel_name,
                "flavor": record.flavor.name,
                "template": record.template,
                "created": iso_utc(record.created),
                "stopped": iso_utc(time.time()),
                "status": status,
                "reason": reason,
                "exit_reason": exit_reason,
            }
        )

    @staticmethod
    def _count_oom(record: KernelRecord, exit_reason: str | None) -> None:
        if exit_reason == record.flavor.out_of_memory_message():
            metrics.OOM_KILLS.labels(record.flavor.name).inc()

    async def restart_kernel(self, kernel_id: str, now: bool = False) -> None:  # type: ignore[override]
        self.get_kernel(kernel_id)  # 404 for a kernel that is not the caller's, before anything is counted
        metrics.KERNEL_RESTARTS.labels("requested").inc()
        # A hibernated kernel is not woken to be told to shut down: its image is deleted, and a fresh kernel starts.
        await super().restart_kernel(kernel_id, now=now or self.is_hibernated(kernel_id))
        self.record_for_adoption(kernel_id)  # its new sandbox is one the next gateway adopts, from now, not at the next refresh

    async def shutdown_kernel(self, kernel_id: str, now: bool = False, restart: bool = False) -> None:  # type: ignore[override]
        manager = self.get_kernel(kernel_id)  # 404 for a kernel that is not the caller's
        ready = manager.ready
        if not ready.done():
            # A restart in progress (the restarter's, after the sandbox died): jupyter_client's shutdown reads
            # ready.exception() and raised InvalidStateError (a 500, and the restart then went on, kernel and disk
            # kept). Its end, either way, comes first.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(ready), RESTART_WAIT_SECONDS)
        await super().shutdown_kernel(kernel_id, now=now or self.is_hibernated(kernel_id), restart=restart)

    async def interrupt_kernel(self, kernel_id: str) -> None:  # type: ignore[override]
        self.get_kernel(kernel_id)  # 404 for a kernel that is not the caller's
        if self.is_hibernated(kernel_id):
            return  # nothing runs in it: there is nothing to interrupt, and no reason to wake it
        await super().interrupt_kernel(kernel_id)

    def retained_sizes(self) -> dict[str, int]:
        """How many entries each structure the gateway keeps holds now: each is bounded, or freed with its kernel
        (issue 28's soak reads these beside the gateway's RSS). What the gateway keeps per kernel is on its record,
        which remove_kernel pops: the records, and what they hold that a client's or a kernel's life adds to."""
        records = list(self.records.values())
        return {
            "kernels": len(kernels_of(self)),
            "records": len(records),
            "pending_kernels": len(pending_starts_of(self)),
            "recently_stopped": len(self.stopped),
            "lost_executions": sum(len(record.lost_executions) for record in records),
            "open_websockets": sum(len(record.websockets) for record in records),
            **self.websocket_sizes(),
            **{f"mcp_{name}": size for name, size in (self.mcp_sizes() if self.mcp_sizes else {}).items()},
        }

    mcp_sizes = None  # set by the gateway's /mcp mount: the MCP bridge's own structures (Bridge.sizes)

    def _kernel_moved(self, kernel_id: str) -> None:
        """A kernel now at another address (its registry's kernel_moved_listeners): the activity watch and the open
        WebSockets follow it at once; one that reconnects later finds its address changed (changed_address)."""
        if kernel_id not in self:
            return
        self.stop_watching_activity(kernel_id)
        self.start_watching_activity(kernel_id)
        record = self.records.get(kernel_id)
        for connection in list(record.websockets if record is not None else ()):
            connection.follow_kernel()

    def changed_address(self, kernel_id: str, changed: list | None) -> list | None:  # compat.MappingKernelManagerHooks
        """jupyter_server's test of whether a restart moved the kernel, which looks at ports only: the address counts too."""
        km = self.get_kernel(kernel_id)
        record = self.records.get(kernel_id)
        if record is not None and record.address is None:
            record.address = km.ip
        if changed is None and record is not None and record.address != km.ip:
            changed = list(km.ports)
        return changed

    def ports_changed(self, kernel_id: str) -> bool:
        changed = super().ports_changed(kernel_id)
        if (record := self.records.get(kernel_id)) is not None:
            record.address = self.get_kernel(kernel_id).ip
        return changed

    def _record_death(self, kernel_id: str) -> None:
        """The kernel died and jupyter_client restarts it: a fresh kernel under the same id, its state gone."""
        record = self.records.get(kernel_id)
        if record is None:
            return
        sandbox = sandbox_of(kernels_of(self).get(kernel_id))
        reason = sandbox.exit_reason() if sandbox is not None else None
        metrics.KERNEL_RESTARTS.labels("died").inc()
        self._count_oom(record, reason)
        self.log.warning("kernel %s died%s; restarting it", kernel_id, f" ({reason})" if reason else "")
        self._record_stop(
            record,
            "restarted",
            "died" + (f" ({reason})" if reason else "") + " and was restarted with a fresh kernel under the same id; its state is lost",
            reason,
        )
