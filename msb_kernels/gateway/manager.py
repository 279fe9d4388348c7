"""The gateway's kernel and kernelspec managers: jupyter_server's, plus limits, capacity and stats.

MsbKernelManager is jupyter_server's AsyncMappingKernelManager (so culling, restarts and
the WebSocket all stay jupyter_server's) with:

- a check before every start: MSB_MAX_SESSIONS, and the flavors' memory and CPUs added
  up against the host capacity (MSB_CAPACITY_MEMORY_MIB, MSB_CAPACITY_CPUS);
- a record of each kernel's flavor, template and start time, for /api/msb/stats;
- culling settings read from MSB_* variables, with the per-kernelspec
  ``metadata.cull_idle_timeout`` override that jupyter_server already honours;
- jupyter_server's activity tracking (what culling reads) by its rules, in one pass over
  each iopub message, which also records a kept kernel's running cell for adoption.

MsbKernelSpecManager offers only sandboxed (msb-sandbox provisioner) kernelspecs, so
nothing started through the gateway runs outside a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.session import Session
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from jupyter_server.utils import ensure_async
from tornado import web
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import default

from msb_kernels import registry
from msb_kernels.backends import get_backend
from msb_kernels.backends.adoption import ADOPTION_RECORD, trusted_json, write_private_json
from msb_kernels.choice import KernelChoice, parse_pool_sizes
from msb_kernels.config import load_settings
from msb_kernels.errors import (
    BackendUnavailable,
    ConfigError,
    InvalidRequest,
    MsbError,
    ResourceLimitExceeded,
    SandboxError,
    SessionNotFound,
    message_with_advice,
)
from msb_kernels.flavors import FLAVORS, Flavor, get_flavor
from msb_kernels.kernelspecs import PROVISIONER_NAME
from msb_kernels.pool import KernelPool, PooledMultiKernelManager
from msb_kernels.provisioner import SandboxDescription, SandboxProvisioner
from msb_kernels.registry import check_session_limit
from msb_kernels.status import iso_utc, session_status

# HTTP status for each error class. A start past a limit answers 429 (documented in the README).
STATUS_FOR = {ResourceLimitExceeded: 429, InvalidRequest: 400, ConfigError: 400, SessionNotFound: 404,
              BackendUnavailable: 503, SandboxError: 500}
RECENTLY_STOPPED = 20  # stopped kernels kept in the stats, newest last
RECORD_INTERVAL = 10.0  # seconds between refreshes of kept kernels' adoption records (their last activity)
BUSY_RECORD = "busy.json"
# Variables a start request may set for its kernel, besides KERNEL_*: the notebook path for stats.
ALLOWED_START_ENV = ("JPY_SESSION_NAME",)
# The WebSockets open on each kernel, by kernel id (PerSocketIdentityConnection adds and removes itself), and,
# per adopted kernel, the executions whose end it could not pass on: the adopting gateway tells the clients.
open_websockets: dict[str, set[Any]] = {}
lost_executions: dict[str, list[dict]] = {}


def start_env(requested: Any) -> dict[str, str]:
    """The environment a start request may give its kernel: KERNEL_* and a few named variables."""
    if requested is None:
        return {}
    if not isinstance(requested, dict):
        raise web.HTTPError(400, "env must be a JSON object of strings")
    return {str(k): str(v) for k, v in requested.items() if str(k).startswith("KERNEL_") or k in ALLOWED_START_ENV}


class MsbHTTPError(web.HTTPError):
    """An HTTP error whose JSON body carries the MsbError's message, type, suggestions and limit."""

    def __init__(self, error: MsbError, status: int | None = None, limit: str | None = None):
        status = status or next((code for cls, code in STATUS_FOR.items() if isinstance(error, cls)), 500)
        super().__init__(status, "%s", error.message)
        self.error = error
        self.payload = {
            **error.to_dict(),
            # "message" and "reason" are what jupyter_server's GatewayClient passes on: the advice goes in too.
            "message": message_with_advice(error.message, error.suggestions),
            "reason": error.error_type,
        }
        if limit:
            self.payload["limit"] = limit


# -- settings from the environment --------------------------------------------------


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




def _is_sandboxed(resource_dir: str) -> bool:
    try:
        spec = json.loads((Path(resource_dir) / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return spec.get("metadata", {}).get("kernel_provisioner", {}).get("provisioner_name") == PROVISIONER_NAME


class MsbKernelSpecManager(KernelSpecManager):
    """Only kernelspecs that run in a sandbox: a plain python3 spec would run on the host."""

    def find_kernel_specs(self) -> dict[str, str]:
        return {name: path for name, path in super().find_kernel_specs().items() if _is_sandboxed(path)}

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        spec = super().get_kernel_spec(kernel_name)
        if spec.metadata.get("kernel_provisioner", {}).get("provisioner_name") != PROVISIONER_NAME:
            raise NoSuchKernel(kernel_name)
        metadata = spec.metadata
        if "cull_idle_timeout" in metadata and metadata["cull_idle_timeout"] == metadata.get("msb", {}).get("installed_cull_idle_timeout"):
            # Only what install wrote, not an override: this server's MSB_SESSION_TIMEOUT_SECONDS decides.
            del metadata["cull_idle_timeout"]
        return spec


@dataclass
class Allocation:
    """What one kernel holds: counted against the limits from its start request until it stops."""

    kernel_id: str
    kernel_name: str
    flavor: Flavor
    template: str
    created: float = field(default_factory=time.time)
    notebook_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # what its start request set (start_env), for an adopting gateway


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


def describe(km: Any) -> SandboxDescription | None:
    """The sandbox side of a kernel manager; None before its provisioner exists or for a kernel not in a sandbox."""
    provisioner = getattr(km, "provisioner", None)
    return provisioner.describe() if isinstance(provisioner, SandboxProvisioner) else None


class MsbKernelManager(AsyncMappingKernelManager):
    """jupyter_server's kernel manager, with sandbox limits and stats."""

    # The capacity is MsbSettings' (MSB_CAPACITY_*, or `serve --capacity-*`). Memory is the real limit:
    # unset, the flavors add up to at most the host's memory, so no kernel filling its flavor is the reason
    # another is killed. CPU time is shared (each kernel is held to its flavor's CPUs by its quota, and an
    # idle one uses none), so unset, CPUs admit any number of kernels.
    @property
    def capacity_memory_mib(self) -> int:
        return self.msb_settings.capacity_memory_mib or host_memory_mib()

    @property
    def capacity_cpus(self) -> int | None:
        return self.msb_settings.capacity_cpus

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
        return KernelChoice.of("python", self.msb_settings.default_flavor).kernel_name

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.msb_settings = load_settings(self.config)
        # jupyter_server starts kernels through pinned_superclass._async_start_kernel: that is where the pool serves them.
        self.pinned_superclass = PooledMultiKernelManager
        self.pool = KernelPool(self, parse_pool_sizes(self.msb_settings.pool_size), self.msb_settings.pool_counts_as_sessions)
        self.allocations: dict[str, Allocation] = {}
        self.stopped: deque[dict] = deque(maxlen=RECENTLY_STOPPED)
        self._stop_reasons: dict[str, str] = {}
        self._busy_files: dict[str, BusyFile] = {}  # kept kernels: the execute_request each is running, on disk
        self._recorded: dict[str, float | None] = {}  # kept kernels: the last activity their adoption record holds
        self._loss_reports: dict[str, asyncio.Task] = {}
        self._record_callback: PeriodicCallback | None = None

    # -- limits -------------------------------------------------------------------

    def counted_flavors(self) -> list[Flavor]:
        """Every kernel the limits count: sessions, and waiting pooled kernels if MSB_POOL_COUNTS_AS_SESSIONS."""
        pooled = self.pool.waiting_flavors() if self.pool.counts_as_sessions else []
        return [a.flavor for a in self.allocations.values()] + pooled

    def allocated(self) -> tuple[int, int]:
        """Memory (MiB) and CPUs the counted kernels' flavors add up to."""
        flavors = self.counted_flavors()
        return sum(f.memory_mib for f in flavors), sum(f.cpus for f in flavors)

    def check_limits(self, flavor: Flavor) -> None:
        """Raise MsbHTTPError (429) when one more kernel of this flavor would pass a limit."""
        try:
            check_session_limit(len(self.counted_flavors()), self.msb_settings.max_sessions,
                                ["stop a session you no longer need (DELETE /api/kernels/<id>)", "or raise MSB_MAX_SESSIONS"])
        except ResourceLimitExceeded as exc:
            raise MsbHTTPError(exc, limit="max_sessions") from None
        memory, cpus = self.allocated()
        over = []
        if memory + flavor.memory_mib > self.capacity_memory_mib:
            over.append(("capacity_memory", f"memory {memory} + {flavor.memory_mib} MiB > MSB_CAPACITY_MEMORY_MIB={self.capacity_memory_mib}"))
        if self.capacity_cpus is not None and cpus + flavor.cpus > self.capacity_cpus:
            over.append(("capacity_cpus", f"CPUs {cpus} + {flavor.cpus} > MSB_CAPACITY_CPUS={self.capacity_cpus}"))
        if not over:
            return
        fitting = [f for f in FLAVORS.values() if f.memory_mib < flavor.memory_mib
                   and memory + f.memory_mib <= self.capacity_memory_mib
                   and (self.capacity_cpus is None or cpus + f.cpus <= self.capacity_cpus)]
        suggestions = ["stop a session you no longer need (DELETE /api/kernels/<id>)"]
        if fitting:
            suggestions.append("pick a smaller flavor: " + ", ".join(f"{f.name} ({f.cpus} CPU, {f.memory_mib} MiB)" for f in fitting))
        raise MsbHTTPError(ResourceLimitExceeded(
            f"host capacity reached: a {flavor.name} kernel ({flavor.cpus} CPU, {flavor.memory_mib} MiB) does not fit: "
            + "; ".join(text for _, text in over), suggestions), limit=over[0][0])

    def flavor_for(self, kernel_name: str, env: dict[str, str]) -> tuple[Flavor, str]:
        """The flavor and template a start request gets: KERNEL_FLAVOR in its env, else the kernelspec's."""
        try:
            spec = self.kernel_spec_manager.get_kernel_spec(kernel_name)
        except NoSuchKernel:
            names = sorted(self.kernel_spec_manager.find_kernel_specs())
            raise MsbHTTPError(InvalidRequest(
                f"no sandboxed kernelspec named {kernel_name!r}",
                [f"use one of: {', '.join(names)}" if names else "run `msb-kernels install` first"]), status=404) from None
        config = spec.metadata.get("kernel_provisioner", {}).get("config", {})
        try:
            if env.get("KERNEL_FLAVOR"):
                flavor = get_flavor(env["KERNEL_FLAVOR"], argument="KERNEL_FLAVOR")
            else:
                flavor = get_flavor(config.get("flavor") or self.msb_settings.default_flavor)
        except MsbError as exc:
            raise MsbHTTPError(exc) from None
        return flavor, config.get("template", "python")

    # -- kernel lifecycle -----------------------------------------------------------

    async def start_kernel(self, *, kernel_id: str | None = None, path: str | None = None, **kwargs: Any) -> str:  # type: ignore[override]
        if kernel_id is not None and kernel_id in self:
            return await super().start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        kernel_name = kwargs.pop("kernel_name", None) or self.default_kernel_name
        env = kwargs.get("env") or {}
        flavor, template = self.flavor_for(kernel_name, env)
        from_pool = kernel_id is None and self.pool.can_serve(kernel_name, kwargs)
        if not (from_pool and self.pool.counts_as_sessions):  # a counted pooled kernel is in the totals already
            self.check_limits(flavor)  # no await between the check and the reservation: starts cannot race past it
        kernel_id = (self.pool.reserve(kernel_name, kwargs) if from_pool else None) or kernel_id or self.new_kernel_id()
        allocation = Allocation(kernel_id, kernel_name, flavor, template, notebook_path=env.get("JPY_SESSION_NAME") or None,
                                env=start_env(env))
        self.allocations[kernel_id] = allocation
        try:
            started = await super().start_kernel(kernel_id=kernel_id, path=path, kernel_name=kernel_name, **kwargs)
            self.add_restart_callback(started, lambda: self._record_death(started), "restart")
            self.record_for_adoption(started)
            return started
        except BaseException as exc:
            self.allocations.pop(kernel_id, None)
            await self.pool.release(kernel_id)
            reason = exc.message if isinstance(exc, MsbError) else (exc.log_message if isinstance(exc, web.HTTPError) else str(exc))
            self._record_stop(allocation, "error", f"start failed: {reason}")
            if isinstance(exc, MsbError):
                raise MsbHTTPError(exc) from exc
            if isinstance(exc, web.HTTPError) or not isinstance(exc, Exception):  # HTTP errors, cancellation
                raise
            self.log.error("kernel %s did not start: %s", kernel_id, exc, exc_info=exc)
            raise MsbHTTPError(SandboxError(f"the {kernel_name} kernel did not start: {type(exc).__name__}: {exc}",
                                            ["run `msb-kernels doctor` to check this host"])) from exc

    async def shutdown_all(self, now: bool = True) -> None:  # type: ignore[override]
        """At the gateway's stop, every sandbox is killed at once: it is thrown away with whatever it held, so asking
        each kernel to shut down first only adds shutdown_wait_time (5 s) per kernel that is busy or ignores the request."""
        await self._async_shutdown_all(now=now)

    def remove_kernel(self, kernel_id: str):  # type: ignore[override]
        """Every way a kernel ends (shutdown, cull, death) comes through here: release what it held."""
        km = super().remove_kernel(kernel_id)
        busy = self._busy_files.pop(kernel_id, None)
        if busy is not None:
            busy.close()
        self._recorded.pop(kernel_id, None)
        lost_executions.pop(kernel_id, None)
        task = self._loss_reports.pop(kernel_id, None)
        if task is not None:
            task.cancel()
        allocation = self.allocations.pop(kernel_id, None)
        if allocation is not None:
            reason = self._stop_reasons.pop(kernel_id, "shut down")
            exit_reason = described.last_exit_reason if (described := describe(km)) else None
            self._record_stop(allocation, "stopped", f"{reason}: {exit_reason}" if exit_reason else reason, exit_reason)
        give_memory_back()
        return km

    def _record_stop(self, allocation: Allocation, status: str, reason: str, exit_reason: str | None = None) -> None:
        """``reason`` says what happened; ``exit_reason`` is the sandbox's word on why the kernel ended, when it knows."""
        self.stopped.append({"id": allocation.kernel_id, "kernel_name": allocation.kernel_name,
                             "flavor": allocation.flavor.name, "template": allocation.template,
                             "created": iso_utc(allocation.created), "stopped": iso_utc(time.time()),
                             "status": status, "reason": reason, "exit_reason": exit_reason})

    def _record_death(self, kernel_id: str) -> None:
        """The kernel died and jupyter_client restarts it: a fresh kernel under the same id, its state gone."""
        allocation = self.allocations.get(kernel_id)
        if allocation is None:
            return
        sandbox = described.sandbox if (described := describe(self._kernels.get(kernel_id))) else None
        reason = sandbox.exit_reason() if sandbox is not None else None
        self.log.warning("kernel %s died%s; restarting it", kernel_id, f" ({reason})" if reason else "")
        self._record_stop(allocation, "restarted", "died" + (f" ({reason})" if reason else "")
                          + " and was restarted with a fresh kernel under the same id; its state is lost", reason)

    def _handle_kernel_died(self, kernel_id: str) -> None:
        self._stop_reasons[kernel_id] = "died"
        super()._handle_kernel_died(kernel_id)

    def initialize_culler(self) -> None:
        """Poll for idle kernels even when the default timeout is 0 (never): a kernelspec may set its own."""
        if self.cull_idle_timeout > 0 or self._initialized_culler or self._culler_callback is not None:
            super().initialize_culler()
            return
        self._culler_callback = PeriodicCallback(self.cull_kernels, 1000 * self.cull_interval)
        self._culler_callback.start()
        self._initialized_culler = True

    def effective_cull_timeout(self, kernel_id: str) -> int:
        kernel = self._kernels[kernel_id]
        return int(kernel.kernel_spec.metadata.get("cull_idle_timeout", self.cull_idle_timeout) or 0)

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            return
        if getattr(kernel, "execution_state", None) != "dead" and self.effective_cull_timeout(kernel_id) <= 0:
            return  # 0 means never, for the server default and for a kernelspec's override alike
        self._stop_reasons[kernel_id] = "culled after being idle"
        try:
            await super().cull_kernel_if_idle(kernel_id)
        finally:
            if kernel_id in self:
                self._stop_reasons.pop(kernel_id, None)

    # -- kernels that outlive the gateway ----------------------------------------------

    @property
    def adopt_grace_seconds(self) -> int:
        """How long this gateway's kernels outlive it (MSB_ADOPT_GRACE_SECONDS); read by the provisioner."""
        return self.msb_settings.adopt_grace_seconds

    def _kept(self, kernel_id: str) -> tuple[Any, Path] | None:
        """The kernel manager and state dir of a kernel whose sandbox a keeper holds, else None."""
        km = self._kernels.get(kernel_id)
        described = describe(km)
        if described is None or getattr(described.sandbox, "keeper", None) is None:
            return None
        return km, km.provisioner.io_dir.parent

    def record_for_adoption(self, kernel_id: str) -> None:
        """Write what the next gateway needs to adopt this kernel (0600, in its root-only state dir): its connection
        keys, kernelspec, flavor, notebook and last activity (the cell it runs is BusyFile's)."""
        kept, allocation = self._kept(kernel_id), self.allocations.get(kernel_id)
        if kept is None or allocation is None:
            return
        km, state_dir = kept
        last = getattr(km, "last_activity", None)
        record = {"kernel_id": kernel_id, "kernel_name": allocation.kernel_name, "flavor": allocation.flavor.name,
                  "template": allocation.template, "created": allocation.created, "notebook_path": allocation.notebook_path,
                  "env": allocation.env, "last_activity": last.timestamp() if last is not None else None,
                  "connection": {key: value.decode() if isinstance(value, bytes) else value
                                 for key, value in km.get_connection_info().items()}}
        with contextlib.suppress(OSError):  # a kernel going away as it is recorded
            write_private_json(state_dir / ADOPTION_RECORD, record)
            self._recorded[kernel_id] = record["last_activity"]

    def _refresh_records(self) -> None:
        """Every RECORD_INTERVAL: kept kernels whose last activity moved get their record rewritten, and so do those
        restarted since (a sandbox's keeper removes the record when the sandbox ends)."""
        for kernel_id in list(self.allocations):
            kept = self._kept(kernel_id)
            if kept is None:
                continue
            km, state_dir = kept
            last = getattr(km, "last_activity", None)
            if self._recorded.get(kernel_id) != (last.timestamp() if last else None) \
                    or not (state_dir / ADOPTION_RECORD).exists():
                self.record_for_adoption(kernel_id)

    def start_buffering(self, kernel_id: str, session_key: str, channels: dict) -> None:
        """jupyter_server's buffer for a notebook client whose WebSocket closed, held to MSB_OFFLINE_BUFFER_MIB.

        Called by jupyter_server's WebSocket connection when a client that named a session goes
        away. Its buffer has no bound: while an assistant keeps running code on a kernel its
        notebook user left, every output would stay in the gateway's memory. Past the bound the
        buffer is dropped, and the client reconnects without a replay, as if it had none.
        """
        limit = self.msb_settings.offline_buffer_mib * 1024 * 1024
        if limit == 0:
            for stream in channels.values():
                stream.close()
            return
        super().start_buffering(kernel_id, session_key, channels)
        held = getattr(self, "_kernel_buffers", {}).get(kernel_id)
        if not held or held.get("channels") is not channels:
            return  # jupyter_server's own buffer_offline_messages=False: nothing is kept
        size = 0

        def keep(channel: str, frames: list) -> None:
            nonlocal size
            if held.get("dropped"):
                return
            size += sum(len(frame) for frame in frames)
            if size <= limit:
                held["buffer"].append((channel, frames))
                return
            held["dropped"] = True
            self.log.warning("kernel %s: dropped the %d messages kept for a closed WebSocket (session %s): they passed "
                             "MSB_OFFLINE_BUFFER_MIB=%d; the client reconnects without them", kernel_id, len(held["buffer"]),
                             session_key, self.msb_settings.offline_buffer_mib)
            held["buffer"].clear()
            # Closed from the loop, not from inside this stream's own callback; a client that reconnected
            # since then has buffering of its own, which must stay.
            IOLoop.current().add_callback(self._stop_dropped_buffering, kernel_id, held)

        for channel, stream in channels.items():
            stream.on_recv(functools.partial(keep, channel))

    def _stop_dropped_buffering(self, kernel_id: str, held: dict) -> None:
        if getattr(self, "_kernel_buffers", {}).get(kernel_id) is held:
            self.stop_buffering(kernel_id)

    def start_watching_activity(self, kernel_id: str) -> None:  # type: ignore[override]
        """Called by jupyter_server as a kernel starts or restarts. Records what its own watch records (each kernel's
        last_activity and execution_state, by the same rules), plus, for kept kernels, the execution each is running,
        as it starts and ends: a gateway that adopts a kernel busy at a crash knows what its clients were waiting for.

        One pass over each iopub message: jupyter_server's watch deserializes every message's header and parent,
        parsing their dates, and each status message a second time; this takes 0.4 to 0.5 ms less of the gateway's CPU
        per MCP execute (of about 6). The signature is checked once, with the kernel's key, and only the frames needed
        are parsed. A message that fails the check is ignored and reported, where jupyter_server's watch stopped
        watching the kernel at it."""
        kernel = self._kernels[kernel_id]
        kernel.reason = ""
        kernel.last_activity = utcnow()
        kernel._activity_stream = kernel.connect_iopub()
        session = Session(key=kernel.session.key, signature_scheme=kernel.session.signature_scheme)
        if self._record_callback is None:
            self._record_callback = PeriodicCallback(self._refresh_records, RECORD_INTERVAL * 1000)
            self._record_callback.start()
        busy = None
        kept = self._kept(kernel_id)
        if kept is not None:
            if kernel_id not in self._busy_files:  # a restart watches again, with the same file
                self._busy_files[kernel_id] = BusyFile(kept[1] / BUSY_RECORD)
            busy = self._busy_files[kernel_id]
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
                    self.log.warning("kernel %s: ignored an iopub message the activity watch cannot read (%s)", kernel_id,
                                     error if isinstance(error, ValueError) else f"no {error}")
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

        kernel._activity_stream.on_recv(record_activity)

    def keep_kernels(self) -> int:
        """At a stop with MSB_KEEP_KERNELS: bring every kept kernel's record up to date and leave it running; return how many."""
        kept = 0
        for kernel_id in list(self.allocations):
            if self._kept(kernel_id) is not None:
                self.record_for_adoption(kernel_id)
                kept += 1
        return kept

    async def adopt_kernels(self) -> list[str]:
        """Adopt every kernel a previous gateway on this runtime dir left running: same id, state, flavor, notebook,
        last activity and place in the limits. Called by the gateway at start, before it sweeps what is left."""
        if self.adopt_grace_seconds <= 0:
            return []
        backend = get_backend(self.msb_settings)
        adopted = []
        for found in backend.list_sandboxes():
            if not found.adoptable:
                continue
            state_dir = backend.io_dir_for(found.sandbox_id).parent
            record, problem = trusted_json(state_dir / ADOPTION_RECORD, private=True)
            if record is None or record.get("kernel_id") != found.sandbox_id:
                self.log.info("sandbox %s is not a session to adopt (%s); the sweep stops it", found.sandbox_id,
                              problem or "its record names another kernel")
                continue
            busy, _ = trusted_json(state_dir / BUSY_RECORD, private=True)
            busy = busy or {}
            if isinstance(busy.get("idle_since"), (int, float)):
                record["last_activity"] = max(record.get("last_activity") or 0, busy["idle_since"])
            try:
                await self._adopt(record, busy if busy.get("msg_id") else None)
            except Exception as exc:
                self.allocations.pop(found.sandbox_id, None)
                self.log.warning("could not adopt kernel %s: %s; the sweep stops it", found.sandbox_id,
                                 exc.message if isinstance(exc, MsbError) else exc)
                continue
            adopted.append(found.sandbox_id)
        if adopted:
            self.log.info("adopted %d kernel(s) from the previous msb-kernels serve: %s", len(adopted), ", ".join(adopted))
        return adopted

    async def _adopt(self, record: dict, busy_with: dict | None) -> None:
        kernel_id = record["kernel_id"]
        allocation = Allocation(kernel_id, record["kernel_name"], get_flavor(record["flavor"]), record["template"],
                                created=record.get("created") or time.time(), notebook_path=record.get("notebook_path"),
                                env=start_env(record.get("env")))
        self.allocations[kernel_id] = allocation
        registry.adoptions[kernel_id] = record
        try:
            # jupyter_server's start, so that restarts, culling, activity and the WebSocket treat it as any other kernel;
            # the provisioner adopts the sandbox where it would have created one.
            await AsyncMappingKernelManager.start_kernel(self, kernel_id=kernel_id, kernel_name=record["kernel_name"],
                                                         env={**os.environ, **allocation.env})
        finally:
            registry.adoptions.pop(kernel_id, None)
        km = self._kernels[kernel_id]
        if record.get("last_activity"):
            km.last_activity = datetime.fromtimestamp(record["last_activity"], timezone.utc)  # the culling clock goes on
        km.execution_state = "busy" if busy_with else "idle"
        self.add_restart_callback(kernel_id, lambda: self._record_death(kernel_id), "restart")
        if busy_with:
            if kernel_id in self._busy_files:
                self._busy_files[kernel_id].running(busy_with)  # still running it, should this gateway go too
            self._loss_reports[kernel_id] = asyncio.ensure_future(self._report_lost_execution(kernel_id, busy_with))
        self.record_for_adoption(kernel_id)

    async def _report_lost_execution(self, kernel_id: str, request: dict) -> None:
        """The kernel was running request when the last gateway went: what it sent then, and its reply, reached no one.
        Once it has finished (a kernel_info reply comes after it), its clients get a note and an error reply, so
        the cell ends with the loss said rather than waiting for ever."""
        km = self._kernels[kernel_id]
        client = km.client()
        client.start_channels()
        try:
            asked = client.kernel_info()
            while (await client.get_shell_msg()).get("parent_header", {}).get("msg_id") != asked:
                pass
        finally:
            client.stop_channels()
        busy = self._busy_files.get(kernel_id)
        if busy is not None and busy.request.get("msg_id") == request.get("msg_id"):
            busy.running(None)
        lost_executions.setdefault(kernel_id, []).append(request)
        self.tell_lost_executions(kernel_id)

    def tell_lost_executions(self, kernel_id: str) -> None:
        """Send the lost-execution notes to the kernel's open WebSockets; kept until one is open to hear them."""
        connections = list(open_websockets.get(kernel_id, ()))
        requests = lost_executions.get(kernel_id)
        km = self._kernels.get(kernel_id)
        if not connections or not requests or km is None:
            return
        lost_executions.pop(kernel_id, None)
        note = ("msb-kernels: the gateway restarted while this ran; the kernel and its variables were kept, "
                "but what the code printed during the restart, and how it ended, were lost.\n")
        for request in requests:
            for channel, msg_type, content in (
                    ("iopub", "stream", {"name": "stderr", "text": note}),
                    ("shell", "execute_reply", {"status": "error", "ename": "GatewayRestarted", "evalue": note.strip(),
                                                "traceback": [], "execution_count": None}),
                    ("iopub", "status", {"execution_state": "idle"})):
                message = km.session.msg(msg_type, content, parent=request)
                for connection in connections:
                    with contextlib.suppress(Exception):  # a socket closing as it is told
                        connection.send_to_client(message, channel)

    # -- stats ----------------------------------------------------------------------

    def kernel_status(self, kernel_id: str) -> str:
        if kernel_id not in self._kernels:
            return "creating"
        return session_status(getattr(self._kernels[kernel_id], "execution_state", "starting"))

    async def notebook_paths(self, session_manager: Any = None) -> dict[str, str]:
        """Each kernel's notebook, for stats and MCP's get_sessions alike.

        jupyter_server's session model decides: a session on this server names its kernel's
        notebook and follows renames (PATCH /api/sessions/{id}). A kernel with no session here
        has the JPY_SESSION_NAME its start request carried: JupyterLab with --gateway-url keeps
        its sessions in its own server and sends only that, once, at the start.
        """
        paths = {kernel_id: a.notebook_path for kernel_id, a in list(self.allocations.items()) if a.notebook_path}
        if session_manager is not None:
            for session in await ensure_async(session_manager.list_sessions()):
                kernel = session.get("kernel") or {}
                if kernel.get("id") and session.get("path"):
                    paths[kernel["id"]] = session["path"]
        return paths

    async def stats(self, session_manager: Any = None) -> dict:
        """Resource stats (sessions, ports, memory and CPUs allocated, per flavor, utilization), plus one entry per kernel."""
        paths = await self.notebook_paths(session_manager)
        memory, cpus = self.allocated()
        active = len(self.allocations)
        backend, backend_info = backend_stats(self.msb_settings)
        ports = port_stats(backend, backend_info)
        kernels = []
        for kernel_id, allocation in list(self.allocations.items()):
            km = self._kernels.get(kernel_id)
            sandbox = described.sandbox if (described := describe(km)) else None
            info = sandbox.info() if sandbox is not None else {}
            keeper = getattr(sandbox, "keeper", None)
            last = getattr(km, "last_activity", None)
            memory_bytes = None
            if sandbox is not None and hasattr(sandbox, "memory_bytes"):
                try:
                    memory_bytes = sandbox.memory_bytes()
                except OSError:
                    memory_bytes = None
            kernels.append({
                "id": kernel_id,
                "kernel_name": allocation.kernel_name,
                "flavor": allocation.flavor.name,
                "template": allocation.template,
                "backend": info.get("backend"),
                "created": iso_utc(allocation.created),
                "last_activity": iso_utc(last.timestamp()) if last is not None else None,
                "status": self.kernel_status(kernel_id),
                "execution_state": getattr(km, "execution_state", "starting") if km is not None else "starting",
                "connections": self._kernel_connections.get(kernel_id, 0),
                "notebook_path": paths.get(kernel_id),
                "cull_idle_timeout": self.effective_cull_timeout(kernel_id) if km is not None else None,
                "memory_bytes": memory_bytes,
                "keeper_pid": keeper.keeper_pid if keeper is not None else None,
            })

        def percent(used: float, total: float) -> float:
            return round(100.0 * used / total, 1) if total else 0.0

        return {
            "active_sessions": active,
            "max_sessions": self.msb_settings.max_sessions,
            "allocated_ports": ports["allocated"],
            "available_ports": ports["available"],
            "ports": ports,
            "total_memory_mb": memory,
            "total_cpus": cpus,
            "capacity": {"memory_mb": self.capacity_memory_mib, "cpus": self.capacity_cpus},
            "available": {"memory_mb": max(0, self.capacity_memory_mib - memory),
                          "cpus": None if self.capacity_cpus is None else max(0, self.capacity_cpus - cpus)},
            "flavor_counts": {name: sum(1 for a in self.allocations.values() if a.flavor.name == name) for name in FLAVORS},
            "utilization": {
                "sessions": percent(active, self.msb_settings.max_sessions),
                "ports": percent(ports["allocated"], ports["allocated"] + ports["available"]),
                "memory": percent(memory, self.capacity_memory_mib),
                "cpus": percent(cpus, self.capacity_cpus or host_cpus()),  # unlimited: the share of the host's CPUs
            },
            "culling": {"idle_timeout": self.cull_idle_timeout, "interval": self.cull_interval,
                        "connected": self.cull_connected, "busy": self.cull_busy},
            "pool": self.pool.stats(),
            # Not sessions: the namespace backend's fork servers, one per Python environment (forkservers.py).
            "fork_servers": backend_info.get("fork_servers", []),
            # Not sessions either: the process that holds this runtime dir's kernels for adoption (keeper.py). A kill
            # of it ends every kernel it holds.
            "keepers": [{"pid": pid, "kernels": count} for pid, count in
                        sorted(Counter(k["keeper_pid"] for k in kernels if k["keeper_pid"] is not None).items())],
            "kernels": kernels,
            "recently_stopped": list(self.stopped),
            "gateway": gateway_process_stats(),
        }


def backend_stats(settings: Any) -> tuple[Any, dict]:
    """The backend and what it says of itself; (None, {"note": why}) when there is none to ask."""
    try:
        from msb_kernels.backends import get_backend

        backend = get_backend(settings)
        return backend, backend.stats()
    except Exception as exc:  # stats must answer even when the backend cannot
        return None, {"note": f"no backend: {exc}"}


def port_stats(backend: Any, stats: dict) -> dict:
    """Host ports from the backend's stats: 5 per kernel over tcp (microVMs, MSB_TRANSPORT=tcp); none over ipc."""
    if backend is None:
        return {"allocated": 0, "available": 0, "note": stats["note"]}
    ports = dict(stats.get("ports") or {})
    if {"allocated", "available"} <= set(ports):
        return {**ports, "backend": backend.name}
    return {"allocated": 0, "available": 0, "backend": backend.name,
            "note": f"the {backend.name} backend talks to kernels over ZMQ ipc sockets, so it holds no TCP ports"}
