"""Where the MCP tools find kernels, whichever back end holds them: a session id is a kernel id.

A back end is a :class:`KernelSessions` (start, list, describe, stop, interrupt and restart
kernels) handing out :class:`KernelConnection` objects (send execute requests, route each
reply to whoever listens for its msg_id). There are two:

* mcp_bridge.local_sessions.ManagedKernelSessions: kernels of a jupyter_client kernel
  manager in this process (``msb-mcp`` standalone, or the gateway's own);
* mcp_bridge.gateway_sessions.GatewayKernelSessions: kernels of a running
  ``msb-kernels serve`` gateway, over its REST API and channels WebSocket (``msb-mcp --gateway``).

A new back end is one more subclass of both, in a module of its own.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mcp_bridge.executions import Execution
from msb_kernels.errors import MsbError, SessionNotFound
from msb_kernels.kernelspecs.choice import KernelChoice
from msb_kernels.observability.status import iso_utc
from msb_kernels.provisioning.start_request import StartRequest

log = logging.getLogger("mcp_bridge")

Listener = Callable[[str, dict], None]


def parse_kernel_name(name: str | None) -> tuple[str | None, str | None]:
    """("python", "small") for "msb-python-small"; (None, None) for kernels that are not msb kernels."""
    choice = KernelChoice.from_kernel_name(name)
    return (choice.template.name, choice.flavor.name) if choice else (None, None)


@dataclass
class SessionInfo:
    """What get_sessions reports about one kernel (models.SessionSummary is its JSON form)."""

    id: str
    language: str | None  # python or node; None for a kernel that is not an msb kernel
    flavor: str | None
    status: str  # creating, ready, running, hibernated, error, stopped
    created_at: float | None
    last_accessed: float | None
    kernel_name: str | None = None
    notebook_path: str | None = None
    started_by: str = "other"  # "mcp" when this bridge started it; "other" for notebook users and other clients
    network: str | None = None  # its way out: none, public internet, or the egress proxy's allow-list; None: not known

    @property
    def sandboxed(self) -> bool:
        return self.language is not None

    @property
    def environment(self) -> str | None:
        """The Python environment its kernelspec names (msb-<env>-python-<flavor>); None for a kernel that is not an msb kernel."""
        choice = KernelChoice.from_kernel_name(self.kernel_name)
        return choice.environment_name if choice is not None else None

    def summary(self) -> dict:
        now = time.time()
        return {
            "id": self.id,
            "language": self.language or "unknown",
            "flavor": self.flavor or "unknown",
            "status": self.status,
            "created_at": iso_utc(self.created_at),
            "last_accessed": iso_utc(self.last_accessed or self.created_at),
            "uptime_seconds": int(now - self.created_at) if self.created_at else 0,
            "kernel_name": self.kernel_name,
            "notebook_path": self.notebook_path,
            "started_by": self.started_by,
            "sandboxed": self.sandboxed,
            "network": self.network,
            "environment": self.environment,
        }


class KernelConnection(abc.ABC):
    """A channel to one kernel: send execute requests, get their messages by msg_id."""

    def __init__(self) -> None:
        self.listeners: dict[str, Listener] = {}
        self.closed = False

    def listen(self, msg_id: str, listener: Listener) -> None:
        self.listeners[msg_id] = listener

    def unlisten(self, msg_id: str) -> None:
        self.listeners.pop(msg_id, None)

    def dispatch(self, channel: str, message: dict) -> None:
        parent = (message.get("parent_header") or {}).get("msg_id")
        listener = self.listeners.get(parent) if parent else None
        if listener is not None:
            try:
                listener(channel, message)
            except Exception:  # a listener bug must not stop the pump
                log.exception("listener failed for %s", parent)

    @abc.abstractmethod
    async def execute(self, code: str, listener: Listener, *, silent: bool, store_history: bool) -> str:
        """Send an execute request and return its msg_id; ``listener`` gets its messages.

        The listener is registered before the request leaves: messages whose parent no one
        listens for are dropped, and a fast kernel may answer before the sender runs again.
        """

    @abc.abstractmethod
    async def death_reason(self) -> str | None:
        """None while the kernel lives; else why it died (e.g. out of memory)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class Runs:
    """A kernel's executions: they run one at a time, in order, and finished ones are kept a while for
    get_execution_output."""

    def __init__(self, kept: int):
        self.lock = asyncio.Lock()
        self.executions: collections.OrderedDict[str, Execution] = collections.OrderedDict()
        self.kept = kept
        # The kernel died and a call has said so (to whichever client made it): the next calls, from any client, wait
        # for its fresh kernel and run there, instead of being told again.
        self.death_told = False

    def add(self, execution: Execution) -> None:
        self.executions[execution.id] = execution
        finished = [key for key, e in self.executions.items() if e.done.is_set()]
        while len(self.executions) > self.kept and finished:
            self.executions.pop(finished.pop(0), None)

    def running(self) -> list[Execution]:
        """The executions the kernel is working on now (for interrupt and restart)."""
        return [e for e in self.executions.values() if not e.done.is_set() and e.status == "running"]


@dataclass
class KernelRecord:
    """All this bridge keeps of one kernel (an MCP tool's session_id is a kernel id), in one place: forget() drops it
    whole when the kernel is gone, however it went."""

    first_seen: float = field(default_factory=time.time)
    last_accessed: float | None = None  # this bridge's last call on it
    started_here: bool = False  # this bridge started it (and a standalone bridge stops it on close)
    connection: KernelConnection | None = None
    connecting: asyncio.Lock = field(default_factory=asyncio.Lock)  # one connection is made at a time
    runs: Runs | None = None  # made by the first execution (Bridge.runs)


class KernelSessions(abc.ABC):
    """The kernels the MCP tools can use."""

    local_kernels = True  # kernels run on this host (so this host's node/tslab decide what can start)

    def __init__(self) -> None:
        self.records: dict[str, KernelRecord] = {}

    def record(self, session_id: str) -> KernelRecord:
        """The kernel's record, made when this bridge first meets it."""
        found = self.records.get(session_id)
        if found is None:
            found = self.records[session_id] = KernelRecord()
        return found

    def started_here(self) -> list[str]:
        return [session_id for session_id, record in self.records.items() if record.started_here]

    def touch(self, session_id: str) -> None:
        self.record(session_id).last_accessed = time.time()

    def session_info(
        self,
        session_id: str,
        *,
        language: str | None,
        flavor: str | None,
        status: str,
        created: float | None,
        kernel_active: float | None,
        kernel_name: str | None,
        notebook_path: str | None,
        network: str | None,
    ) -> SessionInfo:
        """One kernel's SessionInfo, whichever manager told its facts: created (else when this bridge first saw it), last
        accessed (this bridge's call or the kernel's own activity, the later), its notebook, and who started it."""
        record = self.record(session_id)
        created = created or record.first_seen
        accessed = [t for t in (record.last_accessed, kernel_active) if t]
        return SessionInfo(
            id=session_id,
            language=language,
            flavor=flavor,
            status=status,
            created_at=created,
            last_accessed=max(accessed) if accessed else created,
            kernel_name=kernel_name,
            notebook_path=notebook_path,
            started_by="mcp" if record.started_here else "other",
            network=network,
        )

    async def death_reason(self, session_id: str) -> str | None:
        """Why the kernel died, as this bridge's connection to it saw it; None when it lives or there is none."""
        record = self.records.get(session_id)
        return await record.connection.death_reason() if record is not None and record.connection is not None else None

    async def restarted_after_death(self, session_id: str) -> bool:
        """Whether the session's dead kernel is being started again by its kernel manager's restarter (waiting for the
        restart to begin): its next kernel is coming, and a call may wait for it instead of giving the session up.
        False where this bridge cannot tell (a remote gateway's kernels)."""
        return False

    def forget(self, session_id: str) -> None:
        """Let go of what this bridge keeps for a session that is gone (stopped, culled, deleted by its notebook user)."""
        record = self.records.pop(session_id, None)  # its kept executions too: a call waiting on one keeps it
        if record is not None and record.connection is not None:
            task = asyncio.ensure_future(record.connection.close())
            task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def drop_connection(self, session_id: str) -> None:
        record = self.records.get(session_id)
        if record is not None and record.connection is not None:
            connection, record.connection = record.connection, None
            await connection.close()

    def connections(self) -> list[KernelConnection]:
        return [record.connection for record in self.records.values() if record.connection is not None]

    async def _connect_new(self, session_id: str) -> str:
        """Record a kernel this bridge just started and connect to it; stop it if that fails."""
        record = self.record(session_id)
        record.started_here, record.first_seen = True, time.time()
        self.touch(session_id)
        try:
            await self.connection(session_id)
        except MsbError:
            with contextlib.suppress(Exception):
                await self.stop(session_id)
            raise
        return session_id

    @abc.abstractmethod
    async def create(self, choice: KernelChoice, request: StartRequest) -> str:
        """Start a kernel of choice for request (what the session asked for); return its id once it answers."""

    async def check(self, session_id: str) -> None:
        """SessionNotFound unless the session exists for this caller (a person sees their own kernels only)."""
        await self.info(session_id)

    @abc.abstractmethod
    async def info(self, session_id: str) -> SessionInfo:
        """Raise SessionNotFound for an id that is not a live kernel."""

    @abc.abstractmethod
    async def list(self) -> list[SessionInfo]: ...

    @abc.abstractmethod
    async def kernelspecs(self) -> dict[str, dict]:
        """{name: kernel.json's content} of what a new session can start: what names the environments, wherever
        the kernels run (this host's kernelspecs, or a remote gateway's)."""

    @abc.abstractmethod
    async def connection(self, session_id: str) -> KernelConnection: ...

    @abc.abstractmethod
    async def stop(self, session_id: str) -> None: ...

    @abc.abstractmethod
    async def interrupt(self, session_id: str) -> None: ...

    @abc.abstractmethod
    async def restart(self, session_id: str) -> None: ...

    async def close(self) -> None:
        """Release connections; a standalone owner also stops the kernels it started.

        Called by the server's lifespan on shutdown. Sessions that hold nothing keep this default.
        """
        return None


def not_found(session_id: str) -> SessionNotFound:
    return SessionNotFound(f"session {session_id!r} does not exist (it was stopped, culled after being idle, or never existed)")
