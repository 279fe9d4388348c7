"""Where the MCP tools find kernels: a session id is a kernel id.

* :class:`ManagedKernelSessions` wraps any jupyter_client ``AsyncMultiKernelManager``:
  one it creates itself (``msb-mcp`` standalone) or the gateway's
  ``AsyncMappingKernelManager`` (with its ``SessionManager`` for notebook paths), so
  kernels that JupyterLab users started are sessions too.
* :class:`GatewayKernelSessions` talks to a running ``msb-kernels serve`` gateway over
  the Jupyter REST API and the kernel channels websocket (``msb-mcp --gateway``).

Both hand out :class:`KernelConnection` objects that send execute requests and route
the kernel's replies to whoever listens for that request's msg_id.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import datetime
import json
import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from msb_kernels.errors import InvalidRequest, MsbError, ResourceLimitExceeded, SandboxError, SessionNotFound
from msb_kernels.flavors import FLAVORS, Flavor
from msb_kernels.templates import TEMPLATES, Template

log = logging.getLogger("mcp_bridge")

Listener = Callable[[str, dict], None]


def kernel_name(template: str, flavor: str) -> str:
    return f"msb-{template}-{flavor}"


def parse_kernel_name(name: str | None) -> tuple[str | None, str | None]:
    """("python", "small") for "msb-python-small"; (None, None) for kernels that are not msb kernels."""
    parts = (name or "").split("-")
    if len(parts) == 3 and parts[0] == "msb" and parts[1] in TEMPLATES and parts[2] in FLAVORS:
        return parts[1], parts[2]
    return None, None


def iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _timestamp(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


@dataclass
class SessionInfo:
    """What get_sessions reports about one kernel (the design's SessionSummary, plus a little)."""

    id: str
    language: str | None  # python or node; None for a kernel that is not an msb kernel
    flavor: str | None
    status: str  # creating, ready, running, error, stopped
    created_at: float | None
    last_accessed: float | None
    kernel_name: str | None = None
    notebook_path: str | None = None
    started_by: str = "other"  # "mcp" when this bridge started it; "other" for notebook users and other clients

    @property
    def sandboxed(self) -> bool:
        return self.language is not None

    def summary(self) -> dict:
        now = time.time()
        return {
            "id": self.id,
            "language": self.language or "unknown",
            "flavor": self.flavor or "unknown",
            "status": self.status,
            "created_at": iso(self.created_at),
            "last_accessed": iso(self.last_accessed or self.created_at),
            "uptime_seconds": int(now - self.created_at) if self.created_at else 0,
            "kernel_name": self.kernel_name,
            "notebook_path": self.notebook_path,
            "started_by": self.started_by,
            "sandboxed": self.sandboxed,
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
    async def execute(self, code: str, *, silent: bool, store_history: bool) -> str:
        """Send an execute request; return its msg_id."""

    @abc.abstractmethod
    async def death_reason(self) -> str | None:
        """None while the kernel lives; else why it died (e.g. out of memory)."""

    @abc.abstractmethod
    async def close(self) -> None:
        ...


class KernelSessions(abc.ABC):
    """The kernels the MCP tools can use."""

    local_kernels = True  # kernels run on this host (so this host's node/tslab decide what can start)

    def __init__(self) -> None:
        self.last_accessed: dict[str, float] = {}
        self.started: set[str] = set()  # the kernels this bridge started (and stops on close)
        self.first_seen: dict[str, float] = {}
        self.connections: dict[str, KernelConnection] = {}

    def touch(self, session_id: str) -> None:
        self.last_accessed[session_id] = time.time()

    async def _drop_connection(self, session_id: str) -> None:
        connection = self.connections.pop(session_id, None)
        if connection is not None:
            await connection.close()

    async def _connect_new(self, session_id: str) -> str:
        """Record a kernel this bridge just started and connect to it; stop it if that fails."""
        self.started.add(session_id)
        self.first_seen[session_id] = time.time()
        self.touch(session_id)
        try:
            await self.connection(session_id)
        except MsbError:
            with contextlib.suppress(Exception):
                await self.stop(session_id)
            raise
        return session_id

    @abc.abstractmethod
    async def create(self, template: Template, flavor: Flavor) -> str:
        """Start a kernel; return its id once it answers."""

    @abc.abstractmethod
    async def info(self, session_id: str) -> SessionInfo:
        """Raise SessionNotFound for an id that is not a live kernel."""

    @abc.abstractmethod
    async def list(self) -> list[SessionInfo]:
        ...

    @abc.abstractmethod
    async def connection(self, session_id: str) -> KernelConnection:
        ...

    @abc.abstractmethod
    async def stop(self, session_id: str) -> None:
        ...

    @abc.abstractmethod
    async def interrupt(self, session_id: str) -> None:
        ...

    @abc.abstractmethod
    async def restart(self, session_id: str) -> None:
        ...

    async def close(self) -> None:
        """Release connections; a standalone owner also stops the kernels it started."""


def not_found(session_id: str) -> SessionNotFound:
    return SessionNotFound(f"session {session_id!r} does not exist (it was stopped, culled after being idle, or never existed)")


# -- in-process kernels (jupyter_client) -------------------------------------------------------


async def wait_until_connected(kc: Any, timeout: float, is_alive: Callable) -> None:
    """Send kernel_info until its reply arrives on shell and a status message on iopub.

    jupyter_client's wait_for_ready also checks iopub, but gives it 0.2 s after each reply, and a
    just-made SUB socket usually misses the first status: a warm (pooled) kernel then takes 200 ms
    to "connect". A short, growing interval finds both channels working within a few ms.
    """
    deadline = time.monotonic() + timeout
    replied = subscribed = False
    interval = 0.01
    while not (replied and subscribed):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s")
        if not await is_alive():
            raise RuntimeError("the kernel died before it answered")
        kc.kernel_info()
        until = time.monotonic() + interval
        while not (replied and subscribed) and (remaining := until - time.monotonic()) > 0:
            get = kc.get_iopub_msg if replied else kc.get_shell_msg
            try:
                message = await get(timeout=remaining)
            except (queue.Empty, asyncio.TimeoutError, TimeoutError):
                break
            if replied:
                subscribed = True
            else:
                replied = message["msg_type"] == "kernel_info_reply"
        interval = min(interval * 2, 0.5)


class ManagedConnection(KernelConnection):
    """A jupyter_client kernel client on a kernel of a local kernel manager."""

    def __init__(self, km: Any):
        super().__init__()
        self.km = km
        # A Session of its own: km.client() would reuse the manager's, whose id is the zmq identity
        # of every such client, so kernel replies meant for a notebook's client could come here.
        from jupyter_client.session import Session

        own = Session(key=km.session.key, signature_scheme=km.session.signature_scheme, username="msb-mcp")
        self.kc = km.client(session=own)
        self.sandbox = getattr(getattr(km, "provisioner", None), "sandbox", None)
        self.tasks: list[asyncio.Task] = []

    async def open(self, timeout: float) -> None:
        self.kc.start_channels()
        try:
            await wait_until_connected(self.kc, timeout, self.km.is_alive)
        except Exception:
            self.kc.stop_channels()
            raise
        self.tasks = [asyncio.create_task(self._pump(self.kc.get_iopub_msg, "iopub")),
                      asyncio.create_task(self._pump(self.kc.get_shell_msg, "shell"))]

    async def _pump(self, get: Callable, channel: str) -> None:
        while not self.closed:
            try:
                message = await get(timeout=1)
            except (queue.Empty, asyncio.TimeoutError, TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.closed:
                    return
                await asyncio.sleep(0.2)
                continue
            self.dispatch(channel, message)

    async def execute(self, code: str, *, silent: bool, store_history: bool) -> str:
        return self.kc.execute(code, silent=silent, store_history=store_history, allow_stdin=False, stop_on_error=False)

    async def death_reason(self) -> str | None:
        provisioner = getattr(self.km, "provisioner", None)
        replaced = provisioner is not None and self.sandbox is not None and getattr(provisioner, "sandbox", None) is not self.sandbox
        if not replaced and await self.km.is_alive():
            return None
        reason = None
        if self.sandbox is not None:
            with contextlib.suppress(Exception):
                reason = self.sandbox.exit_reason()
        reason = reason or getattr(provisioner, "last_exit_reason", None)
        if replaced:
            return (reason or "the kernel died") + " (it was restarted, so its state is lost)"
        return reason or "the kernel process exited"

    async def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            self.kc.stop_channels()


def standalone_kernel_manager() -> Any:
    """A kernel manager with a warm pool (MSB_POOL_SIZE), connection files in the Jupyter runtime dir."""
    import os

    from jupyter_core.paths import jupyter_runtime_dir

    from msb_kernels.config import load_settings
    from msb_kernels.pool import KernelPool, PooledMultiKernelManager, parse_pool_sizes

    runtime = jupyter_runtime_dir()
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    kernel_log = logging.getLogger("mcp_bridge.kernels")
    if not any(isinstance(f, _NoTracebackForMsbErrors) for f in kernel_log.filters):
        kernel_log.addFilter(_NoTracebackForMsbErrors())
    manager = PooledMultiKernelManager(connection_dir=runtime, log=kernel_log)
    settings = load_settings()
    manager.pool = KernelPool(manager, parse_pool_sizes(settings.pool_size), settings.pool_counts_as_sessions)
    return manager


class _NoTracebackForMsbErrors(logging.Filter):
    """jupyter_client logs a failed start with its traceback; a refusal such as MSB_MAX_SESSIONS is no crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], MsbError):
            record.msg, record.args, record.exc_info, record.exc_text = f"kernel start refused: {record.exc_info[1]}", (), None, None
        return True


class ManagedKernelSessions(KernelSessions):
    """Sessions over a jupyter_client AsyncMultiKernelManager (standalone, or the gateway's own).

    ``session_manager`` is jupyter_server's SessionManager, when there is one: it names
    the notebook each kernel belongs to.
    """

    def __init__(self, kernel_manager: Any = None, session_manager: Any = None, *, start_timeout: float = 60.0):
        super().__init__()
        self.owns_kernel_manager = kernel_manager is None
        if kernel_manager is None:
            kernel_manager = standalone_kernel_manager()
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.start_timeout = start_timeout
        self.connections: dict[str, ManagedConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    def _km(self, session_id: str) -> Any:
        if not isinstance(session_id, str) or session_id not in self.kernel_manager.list_kernel_ids():
            raise not_found(str(session_id))
        return self.kernel_manager.get_kernel(session_id)

    async def create(self, template: Template, flavor: Flavor) -> str:
        from jupyter_client.kernelspec import NoSuchKernel

        name = kernel_name(template.name, flavor.name)
        try:
            session_id = await self.kernel_manager.start_kernel(kernel_name=name)
        except NoSuchKernel:
            raise SandboxError(f"the kernelspec {name} is not installed", suggestions=["run `msb-kernels install`"]) from None
        except MsbError:
            raise
        except Exception as exc:
            raise SandboxError(f"could not start a {template.name} kernel ({flavor.name}): {exc}") from None
        return await self._connect_new(session_id)

    async def _notebook_paths(self) -> dict[str, str]:
        if self.session_manager is None:
            return {}
        try:
            sessions = await self.session_manager.list_sessions()
        except Exception:
            return {}
        return {s["kernel"]["id"]: s.get("path") for s in sessions if s.get("kernel")}

    async def _describe(self, session_id: str, paths: dict[str, str]) -> SessionInfo:
        km = self.kernel_manager.get_kernel(session_id)
        self.first_seen.setdefault(session_id, time.time())
        provisioner = getattr(km, "provisioner", None)
        language, flavor = parse_kernel_name(getattr(km, "kernel_name", None))
        template_spec = getattr(provisioner, "template_spec", None)
        flavor_spec = getattr(provisioner, "flavor_spec", None)
        if template_spec is not None and flavor_spec is not None:
            language, flavor = template_spec.name, flavor_spec.name
        sandbox = getattr(provisioner, "sandbox", None)
        created = getattr(sandbox, "created", None) or self.first_seen[session_id]
        accessed = [t for t in (self.last_accessed.get(session_id), _timestamp(getattr(km, "last_activity", None))) if t]
        state = getattr(km, "execution_state", None)
        try:
            alive = await km.is_alive()
        except Exception:
            alive = False
        if not alive:
            status = "error"
        else:
            status = {"busy": "running", "idle": "ready", "starting": "creating", "dead": "error"}.get(state, "ready")
        return SessionInfo(id=session_id, language=language, flavor=flavor, status=status, created_at=created,
                           last_accessed=max(accessed) if accessed else created, kernel_name=getattr(km, "kernel_name", None),
                           notebook_path=paths.get(session_id), started_by="mcp" if session_id in self.started else "other")

    async def info(self, session_id: str) -> SessionInfo:
        self._km(session_id)
        return await self._describe(session_id, await self._notebook_paths())

    async def list(self) -> list[SessionInfo]:
        paths = await self._notebook_paths()
        infos = []
        for session_id in list(self.kernel_manager.list_kernel_ids()):
            with contextlib.suppress(KeyError):
                infos.append(await self._describe(session_id, paths))
        return infos

    async def connection(self, session_id: str) -> KernelConnection:
        km = self._km(session_id)
        lock = self._connecting.setdefault(session_id, asyncio.Lock())
        async with lock:
            connection = self.connections.get(session_id)
            if connection is not None and connection.km is km and not connection.closed:
                return connection
            if connection is not None:
                await connection.close()
            connection = ManagedConnection(km)
            try:
                await connection.open(self.start_timeout)
            except Exception:
                reason = await connection.death_reason()
                raise SandboxError(f"the kernel of session {session_id} did not answer within {self.start_timeout:g} s"
                                   + (f": {reason}" if reason else ""),
                                   suggestions=["stop_session and start a new one", "check the host with `msb-kernels doctor`"]) from None
            self.connections[session_id] = connection
            return connection

    async def stop(self, session_id: str) -> None:
        self._km(session_id)
        await self._drop_connection(session_id)
        await self.kernel_manager.shutdown_kernel(session_id, now=True)
        self.started.discard(session_id)
        self.last_accessed.pop(session_id, None)
        self._connecting.pop(session_id, None)

    async def interrupt(self, session_id: str) -> None:
        self._km(session_id)
        await self.kernel_manager.interrupt_kernel(session_id)

    async def restart(self, session_id: str) -> None:
        self._km(session_id)
        await self._drop_connection(session_id)
        await self.kernel_manager.restart_kernel(session_id, now=True)

    async def close(self) -> None:
        """Close connections and stop every kernel this bridge started (the gateway's own kernels stay)."""
        for session_id in list(self.connections):
            await self._drop_connection(session_id)

        async def shutdown(session_id: str) -> None:
            with contextlib.suppress(Exception):
                if session_id in self.kernel_manager.list_kernel_ids():
                    await self.kernel_manager.shutdown_kernel(session_id, now=True)
            self.started.discard(session_id)

        await asyncio.gather(*[shutdown(session_id) for session_id in list(self.started)])
        pool = getattr(self.kernel_manager, "pool", None)
        if self.owns_kernel_manager and pool is not None:
            await pool.shutdown()


# -- a remote gateway (Jupyter REST + websocket) -------------------------------------------------


class GatewayConnection(KernelConnection):
    """The kernel channels websocket of a Jupyter-compatible gateway (JSON messages with a "channel" key)."""

    def __init__(self, sessions: GatewayKernelSessions, session_id: str):
        super().__init__()
        self.sessions = sessions
        self.session_id = session_id
        self.client_session = uuid.uuid4().hex
        self.ws: Any = None
        self.task: asyncio.Task | None = None
        self.dead_reason: str | None = None

    async def open(self, timeout: float) -> None:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = self.sessions.ws_url(f"/api/kernels/{self.session_id}/channels?session_id={self.client_session}")
        request = HTTPRequest(url, headers=self.sessions.headers(), connect_timeout=timeout, request_timeout=timeout)
        try:
            self.ws = await asyncio.wait_for(websocket_connect(request, max_message_size=256 * 1024 * 1024), timeout)
        except Exception as exc:
            raise SandboxError(f"cannot open the kernel channels of session {self.session_id} at the gateway: {exc}") from None
        self.task = asyncio.create_task(self._pump())
        # wait until the kernel answers a kernel_info_request
        msg_id = self._send("shell", "kernel_info_request", {})
        answered = asyncio.Event()
        self.listen(msg_id, lambda channel, message: answered.set() if channel == "shell" else None)
        try:
            await asyncio.wait_for(answered.wait(), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise SandboxError(f"the kernel of session {self.session_id} did not answer within {timeout:g} s") from None
        finally:
            self.unlisten(msg_id)

    def _send(self, channel: str, msg_type: str, content: dict) -> str:
        msg_id = uuid.uuid4().hex
        message = {
            "header": {"msg_id": msg_id, "msg_type": msg_type, "username": "msb-mcp", "session": self.client_session,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "5.3"},
            "parent_header": {}, "metadata": {}, "content": content, "channel": channel, "buffers": [],
        }
        self.ws.write_message(json.dumps(message))
        return msg_id

    async def _pump(self) -> None:
        while not self.closed:
            try:
                raw = await self.ws.read_message()
            except asyncio.CancelledError:
                raise
            except Exception:
                raw = None
            if raw is None:
                if not self.closed:
                    self.dead_reason = self.dead_reason or "the connection to the kernel at the gateway closed"
                return
            if isinstance(raw, bytes):
                continue  # binary frames carry buffers; tool output does not need them
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            channel = message.get("channel", "iopub")
            if message.get("msg_type") == "status" and not (message.get("parent_header") or {}).get("msg_id"):
                state = (message.get("content") or {}).get("execution_state")
                if state in ("dead", "restarting"):
                    self.dead_reason = "the kernel died" + (" and was restarted, so its state is lost" if state == "restarting" else "")
            self.dispatch(channel, message)

    async def execute(self, code: str, *, silent: bool, store_history: bool) -> str:
        return self._send("shell", "execute_request", {"code": code, "silent": silent, "store_history": store_history,
                                                       "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})

    async def death_reason(self) -> str | None:
        if self.dead_reason:
            entry = (await self.sessions._kernel_stats()).get(self.session_id) or {}
            reason = entry.get("last_exit_reason") or entry.get("exit_reason")
            return f"{self.dead_reason}: {reason}" if reason else self.dead_reason
        return None

    async def close(self) -> None:
        self.closed = True
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


class GatewayKernelSessions(KernelSessions):
    """Sessions of a running gateway (``msb-kernels serve``), over its Jupyter REST and websocket API."""

    local_kernels = False

    def __init__(self, url: str, token: str | None = None, *, start_timeout: float = 60.0):
        super().__init__()
        import httpx

        self.url = url.rstrip("/")
        self.token = token
        self.start_timeout = start_timeout
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers(), timeout=httpx.Timeout(start_timeout + 30))
        self.connections: dict[str, GatewayConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    def ws_url(self, path: str) -> str:
        base = self.url.replace("https://", "wss://", 1) if self.url.startswith("https://") else self.url.replace("http://", "ws://", 1)
        return base + path

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SandboxError(f"the gateway at {self.url} cannot be reached: {exc}",
                               suggestions=["check that `msb-kernels serve` runs there", "check --gateway URL"]) from None
        if response.status_code in (401, 403):
            raise SandboxError(f"the gateway at {self.url} refused the token (HTTP {response.status_code})",
                               suggestions=["pass the gateway's token with --token or MSB_GATEWAY_TOKEN"])
        return response

    @staticmethod
    def _message(response: Any) -> str:
        try:
            body = response.json()
        except ValueError:
            return response.text[:300]
        return str(body.get("message") or body.get("reason") or body)[:500]

    async def kernel_model(self, session_id: str, missing_ok: bool = False) -> dict | None:
        if not isinstance(session_id, str) or not session_id or "/" in session_id or "?" in session_id:
            raise not_found(str(session_id))
        response = await self._request("GET", f"/api/kernels/{session_id}")
        if response.status_code == 404:
            if missing_ok:
                return None
            raise not_found(session_id)
        if response.status_code >= 400:
            raise SandboxError(f"the gateway answered HTTP {response.status_code}: {self._message(response)}")
        return response.json()

    async def create(self, template: Template, flavor: Flavor) -> str:
        name = kernel_name(template.name, flavor.name)
        response = await self._request("POST", "/api/kernels", json={"name": name})
        if response.status_code >= 400:
            message = self._message(response)
            if response.status_code in (429, 503) or "MSB_MAX_SESSIONS" in message or "ResourceLimit" in message:
                raise ResourceLimitExceeded(message)
            if response.status_code in (400, 404, 422):
                raise InvalidRequest(f"the gateway cannot start {name}: {message}")
            raise SandboxError(f"the gateway could not start {name}: {message}")
        session_id = response.json()["id"]
        return await self._connect_new(session_id)

    def _describe(self, model: dict, paths: dict[str, str], stats: dict[str, dict]) -> SessionInfo:
        session_id = model["id"]
        self.first_seen.setdefault(session_id, time.time())
        language, flavor = parse_kernel_name(model.get("name"))
        msb = stats.get(session_id) or {}
        language = msb.get("template", language) if language else language
        flavor = msb.get("flavor", flavor) if flavor else flavor
        created = _timestamp(msb.get("created")) or self.first_seen[session_id]
        accessed = [t for t in (self.last_accessed.get(session_id), _timestamp(model.get("last_activity"))) if t]
        state = model.get("execution_state")
        status = {"busy": "running", "idle": "ready", "starting": "creating", "dead": "error"}.get(state, "ready")
        return SessionInfo(id=session_id, language=language, flavor=flavor, status=status, created_at=created,
                           last_accessed=max(accessed) if accessed else created, kernel_name=model.get("name"),
                           notebook_path=paths.get(session_id), started_by="mcp" if session_id in self.started else "other")

    async def _notebook_paths(self) -> dict[str, str]:
        response = await self._request("GET", "/api/sessions")
        if response.status_code >= 400:
            return {}
        return {s["kernel"]["id"]: s.get("path") for s in response.json() if s.get("kernel")}

    async def _kernel_stats(self) -> dict[str, dict]:
        """Per-kernel facts the msb gateway adds (/api/msb/stats): flavor, template, creation time."""
        response = await self._request("GET", "/api/msb/stats")
        if response.status_code >= 400:
            return {}
        try:
            return {k["id"]: k for k in response.json().get("kernels", []) if isinstance(k, dict) and "id" in k}
        except (ValueError, AttributeError):
            return {}

    async def info(self, session_id: str) -> SessionInfo:
        model = await self.kernel_model(session_id)
        return self._describe(model, await self._notebook_paths(), await self._kernel_stats())

    async def list(self) -> list[SessionInfo]:
        response = await self._request("GET", "/api/kernels")
        if response.status_code >= 400:
            raise SandboxError(f"the gateway answered HTTP {response.status_code}: {self._message(response)}")
        paths = await self._notebook_paths()
        stats = await self._kernel_stats()
        return [self._describe(model, paths, stats) for model in response.json()]

    async def connection(self, session_id: str) -> KernelConnection:
        await self.kernel_model(session_id)
        lock = self._connecting.setdefault(session_id, asyncio.Lock())
        async with lock:
            connection = self.connections.get(session_id)
            if connection is not None and not connection.closed and connection.dead_reason is None:
                return connection
            if connection is not None:
                await connection.close()
            connection = GatewayConnection(self, session_id)
            await connection.open(self.start_timeout)
            self.connections[session_id] = connection
            return connection

    async def _kernel_call(self, method: str, session_id: str, action: str, path: str = "") -> None:
        """One call on /api/kernels/<id><path>; a 404 is SessionNotFound, other failures SystemError."""
        response = await self._request(method, f"/api/kernels/{session_id}{path}")
        if response.status_code == 404:
            raise not_found(session_id)
        if response.status_code >= 400:
            raise SandboxError(f"the gateway could not {action} session {session_id}: {self._message(response)}")

    async def _post(self, session_id: str, action: str) -> None:
        await self.kernel_model(session_id)
        await self._kernel_call("POST", session_id, action, f"/{action}")

    async def stop(self, session_id: str) -> None:
        await self.kernel_model(session_id)
        await self._drop_connection(session_id)
        await self._kernel_call("DELETE", session_id, "stop")
        self.started.discard(session_id)
        self.last_accessed.pop(session_id, None)

    async def interrupt(self, session_id: str) -> None:
        await self._post(session_id, "interrupt")

    async def restart(self, session_id: str) -> None:
        await self._drop_connection(session_id)
        await self._post(session_id, "restart")

    async def close(self) -> None:
        """Close the websockets and stop the kernels this bridge started; the notebook users' kernels stay."""
        for session_id in list(self.connections):
            await self._drop_connection(session_id)
        for session_id in list(self.started):
            with contextlib.suppress(Exception):
                await self._request("DELETE", f"/api/kernels/{session_id}")
            self.started.discard(session_id)
        await self.http.aclose()
