"""Sessions over a jupyter_client kernel manager in this process (``msb-mcp`` standalone, or the gateway's own).

The gateway hands its ``AsyncMappingKernelManager`` (with jupyter_server's SessionManager,
for notebook paths), so kernels that JupyterLab users started are sessions too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from mcp_bridge.jupyter_ws import execute_content
from mcp_bridge.sessions import (
    KernelConnection,
    KernelSessions,
    Listener,
    SessionInfo,
    not_found,
    parse_kernel_name,
)
from msb_kernels.errors import MsbError, SandboxError
from msb_kernels.jupyter.turns import in_turns
from msb_kernels.kernelspecs.choice import KernelChoice
from msb_kernels.observability.status import epoch_seconds, session_status
from msb_kernels.provisioning import registry
from msb_kernels.provisioning.provisioner import describe_kernel
from msb_kernels.provisioning.start_request import StartRequest


async def wait_until_connected(kc: Any, timeout: float, is_alive: Callable) -> None:
    """Send kernel_info until its reply arrives on shell and a status message on iopub.

    jupyter_client's wait_for_ready also checks iopub, but gives it 0.2 s after each reply, and a
    just-made SUB socket usually misses the first status: a warm (pooled) kernel then takes 200 ms
    to "connect". Here the first request waits for its reply (a kernel still starting answers it
    once it can; sent again only after a second, should it be lost), and then requests go at a
    short, growing interval until iopub carries one's status: both channels work within a few ms,
    and a starting kernel is not handed a queue of requests before the user's first cell.
    """
    deadline = time.monotonic() + timeout
    replied = subscribed = False
    interval = 1.0
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
                message = await get(timeout=min(remaining, 0.1))  # liveness is checked between waits
            except (queue.Empty, asyncio.TimeoutError, TimeoutError):
                if not replied and not await is_alive():
                    raise RuntimeError("the kernel died before it answered") from None
                continue
            if replied:
                subscribed = True
            elif message["msg_type"] == "kernel_info_reply":
                replied = True
                interval = 0.005  # from now on, for iopub: each request's status is a chance for it
                until = time.monotonic() + interval
        interval = min(interval * 2, 1.0) if replied else 1.0


class ManagedConnection(KernelConnection):
    """A jupyter_client kernel client on a kernel of a local kernel manager."""

    def __init__(self, km: Any):
        super().__init__()
        self.km = km
        # A Session of its own: km.client() would reuse the manager's, whose id is the zmq identity
        # of every such client, so kernel replies meant for a notebook's client could come here.
        import zmq.asyncio
        from jupyter_client.session import Session

        own = Session(key=km.session.key, signature_scheme=km.session.signature_scheme, username="msb-mcp")
        # The manager's ZeroMQ context, where it is an asyncio one (the gateway's, sized for MSB_MAX_SESSIONS): a
        # client's own would be one more I/O thread and a few descriptors per session, 500 threads at 500 sessions.
        shared = {"context": km.context} if isinstance(getattr(km, "context", None), zmq.asyncio.Context) else {}
        self.kc = km.client(session=own, **shared)
        description = describe_kernel(km)
        self.sandbox = description.sandbox if description else None  # to tell a restart's new sandbox from it
        self.tasks: list[asyncio.Task] = []

    async def open(self, timeout: float) -> None:
        # Shell and iopub only: the manager interrupts and restarts, is_alive says whether the kernel lives (no
        # heartbeat thread per session), and no execution here asks for input.
        self.kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        try:
            await wait_until_connected(self.kc, timeout, self.km.is_alive)
        except Exception:
            self.kc.stop_channels()
            raise
        self.tasks = [asyncio.create_task(self._pump("iopub")), asyncio.create_task(self._pump("shell"))]

    async def _pump(self, channel: str) -> None:
        """Hand each message of a channel to its listener as it comes.

        One receive per message, deserialized by the client's Session as jupyter_client's get_msg does; get_msg
        also polls the socket, with a timeout, before each receive."""
        socket = getattr(self.kc, f"{channel}_channel").socket
        session = self.kc.session
        while not self.closed:
            try:
                frames = await socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.closed:
                    return
                await asyncio.sleep(0.2)
                continue
            try:
                message = session.deserialize(session.feed_identities(frames)[1])
            except Exception:
                continue  # a message the kernel did not sign, or not a message at all: nobody's reply
            self.dispatch(channel, message)

    async def execute(self, code: str, listener: Listener, *, silent: bool, store_history: bool) -> str:
        content = execute_content(code, silent=silent, store_history=store_history, stop_on_error=False)
        message = self.kc.session.msg("execute_request", content)
        msg_id = message["header"]["msg_id"]
        self.listen(msg_id, listener)
        self.kc.shell_channel.send(message)
        return msg_id

    async def death_reason(self) -> str | None:
        description = describe_kernel(self.km)
        replaced = description is not None and self.sandbox is not None and description.sandbox is not self.sandbox
        if not replaced and await self.km.is_alive():
            return None
        reason = None
        if self.sandbox is not None:
            with contextlib.suppress(Exception):
                reason = self.sandbox.exit_reason()
        reason = reason or (description.last_exit_reason if description else None)
        if replaced:
            return (reason or "the kernel died") + "; it was restarted with a fresh kernel"
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

    from msb_kernels.kernelspecs.choice import parse_pool_sizes
    from msb_kernels.provisioning.limits import size_zmq_context
    from msb_kernels.provisioning.pool import KernelPool, PooledMultiKernelManager
    from msb_kernels.settings.config import load_settings

    runtime = jupyter_runtime_dir()
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    kernel_log = logging.getLogger("mcp_bridge.kernels")
    if not any(isinstance(f, _NoTracebackForMsbErrors) for f in kernel_log.filters):
        kernel_log.addFilter(_NoTracebackForMsbErrors())
    manager = PooledMultiKernelManager(connection_dir=runtime, log=kernel_log)
    settings = load_settings()
    manager.pool = KernelPool(manager, parse_pool_sizes(settings.pool_size), settings.pool_counts_as_sessions)
    size_zmq_context(manager.context, settings.max_sessions + sum(manager.pool.sizes.values()))  # the clients' too (ManagedConnection)
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
        self.sandbox_registry = registry.registry_of(kernel_manager)
        self.sandbox_registry.kernel_removed_listeners.append(self.forget)  # the gateway's removals: culls, Lab's, deaths

    async def kernelspecs(self) -> dict[str, dict]:
        from jupyter_client.kernelspec import KernelSpecManager

        manager = getattr(self.kernel_manager, "kernel_spec_manager", None) or KernelSpecManager()  # None before a first start
        specs = manager.get_all_specs()
        return {name: entry["spec"] for name, entry in specs.items()}

    def _km(self, session_id: str) -> Any:
        if not isinstance(session_id, str) or session_id not in self.kernel_manager.list_kernel_ids():
            raise not_found(str(session_id))
        return self.kernel_manager.get_kernel(session_id)

    async def create(self, choice: KernelChoice, request: StartRequest) -> str:
        from jupyter_client.kernelspec import NoSuchKernel

        name = choice.kernel_name
        try:
            session_id = await self.kernel_manager.start_kernel(kernel_name=name, start_request=request)
        except NoSuchKernel:
            raise SandboxError(f"the kernelspec {name} is not installed", suggestions=["run `msb-kernels install`"]) from None
        except MsbError:
            raise  # a refusal with its advice (the gateway's kernel manager raises these too)
        except Exception as exc:
            raise SandboxError(f"could not start a {choice.template.name} kernel ({choice.flavor.name}): {exc}") from None
        return await self._connect_new(session_id)

    async def _notebook_paths(self) -> dict[str, str]:
        """The gateway's notebook paths (its kernel manager's, as /api/msb/stats shows them); none standalone."""
        paths_of = getattr(self.kernel_manager, "notebook_paths", None)
        if paths_of is None:
            return {}
        try:
            return await paths_of(self.session_manager)
        except Exception:
            return {}

    async def _describe(self, session_id: str, paths: dict[str, str]) -> SessionInfo:
        km = self.kernel_manager.get_kernel(session_id)
        language, flavor = parse_kernel_name(km.kernel_name)
        description = describe_kernel(km)
        if description is not None and description.template is not None and description.flavor is not None:
            language, flavor = description.template.name, description.flavor.name
        try:
            alive = await km.is_alive()
        except Exception:
            alive = False
        if not alive:
            # A kernel being restarted (after a death, by jupyter_client's restarter) is not alive for a moment.
            status = "creating" if not km.ready.done() else "error"
        else:
            # execution_state and last_activity: what jupyter_server's kernel manager adds; a standalone one lacks them.
            status = session_status(getattr(km, "execution_state", None))
        return self.session_info(
            session_id,
            language=language,
            flavor=flavor,
            status=status,
            created=description.created if description else None,
            kernel_active=epoch_seconds(getattr(km, "last_activity", None)),
            kernel_name=km.kernel_name,
            notebook_path=paths.get(session_id),
            network=description.network if description is not None else None,
        )

    async def check(self, session_id: str) -> None:
        self._km(session_id)

    async def info(self, session_id: str) -> SessionInfo:
        self._km(session_id)
        return await self._describe(session_id, await self._notebook_paths())

    async def list(self) -> list[SessionInfo]:
        paths = await self._notebook_paths()
        infos = []
        async for session_id in in_turns(list(self.kernel_manager.list_kernel_ids())):
            with contextlib.suppress(KeyError):
                infos.append(await self._describe(session_id, paths))
        return infos

    async def connection(self, session_id: str) -> KernelConnection:
        km = self._km(session_id)
        wake = getattr(self.kernel_manager, "wake_kernel", None)  # the gateway's: a hibernated kernel is restored first
        if wake is not None:
            await wake(session_id)
        record = self.record(session_id)
        async with record.connecting:
            connection = record.connection
            assert connection is None or isinstance(connection, ManagedConnection)
            # The same kernel, still at the address it was connected at (a cluster kernel restarts at a new one).
            if connection is not None and connection.km is km and not connection.closed and connection.kc.ip == km.ip:
                return connection
            if connection is not None:
                await connection.close()
            if km.ready.done() and not await km.is_alive():
                await self._restart_begun(km)  # dead, and perhaps about to be started again: then wait for that one
            if not km.ready.done():  # a start or a restart under way
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(km.ready)), self.start_timeout)
            connection = ManagedConnection(km)
            try:
                await connection.open(self.start_timeout)
            except Exception:
                reason = await connection.death_reason()
                raise SandboxError(
                    f"the kernel of session {session_id} died before it answered: {reason}"
                    if reason
                    else f"the kernel of session {session_id} did not answer within {self.start_timeout:g} s",
                    suggestions=["stop_session and start a new one", "check the host with `msb-kernels doctor`"],
                ) from None
            record.connection = connection
            self.records.setdefault(session_id, record)  # forgotten while it connected: kept, so that it is closed
            return connection

    async def restarted_after_death(self, session_id: str) -> bool:
        km = self._km(session_id)
        if await km.is_alive():
            return False
        if not await self._restart_begun(km):
            return False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(km.ready)), self.start_timeout)
        return True

    @staticmethod
    async def _restart_begun(km: Any) -> bool:
        """Whether jupyter_client's restarter has begun to start this dead kernel again, waiting for it up to two of
        its polls (time_to_dead, 3 s by default): between a kernel's death and the restarter's next poll the kernel is
        neither alive nor starting, and a call then was told to give up a session whose next kernel was coming."""
        restarter = getattr(km, "_restarter", None)
        if not getattr(km, "autorestart", False) or restarter is None:
            return False
        ready = km.ready
        deadline = time.monotonic() + 2 * float(getattr(restarter, "time_to_dead", 3.0)) + 1
        while time.monotonic() < deadline:
            if km.ready is not ready or await km.is_alive():
                return True
            await asyncio.sleep(0.1)
        return False

    async def stop(self, session_id: str) -> None:
        self._km(session_id)
        await self.drop_connection(session_id)
        await self.kernel_manager.shutdown_kernel(session_id, now=True)
        self.forget(session_id)

    async def interrupt(self, session_id: str) -> None:
        self._km(session_id)
        await self.kernel_manager.interrupt_kernel(session_id)

    async def restart(self, session_id: str) -> None:
        self._km(session_id)
        await self.drop_connection(session_id)
        await self.kernel_manager.restart_kernel(session_id, now=True)

    async def close(self) -> None:
        """Close connections and stop every kernel this bridge started, when it owns the kernel manager. A manager
        it was given (the gateway's) decides what happens to its kernels: the gateway stops them, or, with
        MSB_KEEP_KERNELS, leaves them for the next gateway, MCP sessions included."""
        with contextlib.suppress(ValueError):
            self.sandbox_registry.kernel_removed_listeners.remove(self.forget)
        for session_id in list(self.records):
            await self.drop_connection(session_id)
        if not self.owns_kernel_manager:
            for record in self.records.values():
                record.started_here = False
            return

        async def shutdown(session_id: str) -> None:
            with contextlib.suppress(Exception):
                if session_id in self.kernel_manager.list_kernel_ids():
                    await self.kernel_manager.shutdown_kernel(session_id, now=True)
            self.forget(session_id)

        await asyncio.gather(*[shutdown(session_id) for session_id in self.started_here()])
        pool = getattr(self.kernel_manager, "pool", None)
        if self.owns_kernel_manager and pool is not None:
            await pool.shutdown()
