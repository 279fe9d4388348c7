"""Every touch of jupyter_server's and jupyter_client's private internals (and of tornado's and nbclient's under them),
in one place.

Each name here stands for one private thing we rely on, and its docstring says what it is and why we need it. All were
checked against jupyter_server 2.21.1, jupyter_client 8.10.0, tornado 6.6.1 and nbclient 0.11.0. pyproject.toml bounds
jupyter_server and jupyter_client above, so that a minor release cannot break them silently: raising a bound, run
tests/msb_kernels/jupyter/test_compat.py, which checks each one by name.

Call sites import from here; nothing else in the project reaches for a private name of those packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jupyter_client.multikernelmanager import AsyncMultiKernelManager
from tornado.ioloop import IOLoop, PeriodicCallback

from msb_kernels.provisioning.start_request import START_REQUEST

if TYPE_CHECKING:
    from datetime import datetime

    from tornado import web

# jupyter_server is imported only where it is used (the gateway): the provisioner and the pool import this module in
# every process that starts a kernel (nbclient, papermill, msb-mcp), which have no server to pay for.


def __getattr__(name: str) -> Any:
    """KERNEL_ID_REGEX: jupyter_server's own pattern for a kernel id in a route (services/kernels/handlers.py's private
    ``_kernel_id_regex``, named group ``kernel_id``): our WebSocket route matches exactly the ids its own routes match.

    KERNEL_ACTION_REGEX: its pattern for a kernel action (``_kernel_action_regex``: restart|interrupt, group
    ``action``): our action route (a 404 for a kernel that is not the caller's) matches exactly its actions.

    SESSION_ID_REGEX: its pattern for a session id (services/sessions/handlers.py's private ``_session_id_regex``,
    group ``session_id``): the gateway's own route for a session matches exactly the ids jupyter_server's did.

    utcnow: jupyter_server's clock (the private ``jupyter_server._tz.utcnow``, timezone-aware UTC), which its
    last_activity values and the culler's comparisons use: ours must be of the same kind."""
    if name == "KERNEL_ID_REGEX":
        from jupyter_server.services.kernels.handlers import _kernel_id_regex

        return _kernel_id_regex
    if name == "KERNEL_ACTION_REGEX":
        from jupyter_server.services.kernels.handlers import _kernel_action_regex

        return _kernel_action_regex
    if name == "SESSION_ID_REGEX":
        from jupyter_server.services.sessions.handlers import _session_id_regex

        return _session_id_regex
    if name == "utcnow":
        from jupyter_server._tz import utcnow

        return utcnow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    KERNEL_ID_REGEX: str
    KERNEL_ACTION_REGEX: str
    SESSION_ID_REGEX: str

    def utcnow() -> datetime: ...


# -- kernel managers: jupyter_client's MultiKernelManager, jupyter_server's MappingKernelManager -------------------------


def kernels_of(manager: Any) -> dict[str, Any]:
    """The manager's own dict of kernel id to KernelManager (jupyter_client MultiKernelManager._kernels), itself, not a
    copy. Reads of it (``get``, ``in``) find a kernel without get_kernel's KeyError or its log line; the pool writes a
    pooled kernel into it, where jupyter_client's start would have put a new one."""
    return manager._kernels


def pending_starts_of(manager: Any) -> dict[str, Any]:
    """jupyter_client's kernels whose start is under way (MultiKernelManager._pending_kernels), itself. A failed start
    stays in it, where shutdown_all would try (and fail) to stop it: the gateway takes it out."""
    return manager._pending_kernels


def connection_counts_of(manager: Any) -> dict[str, int]:
    """jupyter_server's count of open WebSockets per kernel (MappingKernelManager._kernel_connections), for the stats
    and for retained_sizes; empty where the manager is not jupyter_server's."""
    return getattr(manager, "_kernel_connections", {})


def captured_ports_of(manager: Any) -> dict[str, list[int]]:
    """The ports jupyter_server captured per kernel at start (MappingKernelManager._kernel_ports), for retained_sizes."""
    return getattr(manager, "_kernel_ports", {})


def offline_buffers_of(manager: Any) -> dict[str, dict]:
    """jupyter_server's buffers for closed WebSockets (MappingKernelManager._kernel_buffers): per kernel a dict with
    ``session_key``, ``buffer`` (a list of (channel, frames)) and ``channels`` (the ZMQ streams), which start_buffering
    fills. A defaultdict: read it with ``get``, which adds nothing. The gateway bounds what it holds (gateway/kernels/websocket.py)."""
    return getattr(manager, "_kernel_buffers", {})


def start_culler(manager: Any) -> bool:
    """Start jupyter_server's culler (MappingKernelManager.initialize_culler's PeriodicCallback) even with a
    cull_idle_timeout of 0, which initialize_culler takes for "never": a kernelspec may set its own timeout.
    Returns False where jupyter_server's own initialize_culler is the one to run: a timeout over 0, or a culler that
    runs already (its private ``_initialized_culler`` and ``_culler_callback``)."""
    if manager.cull_idle_timeout > 0 or manager._initialized_culler or manager._culler_callback is not None:
        return False
    manager._culler_callback = PeriodicCallback(manager.cull_kernels, 1000 * manager.cull_interval)
    manager._culler_callback.start()
    manager._initialized_culler = True
    return True


def open_activity_stream(kernel: Any) -> Any:
    """Connect the iopub stream that an activity watch reads, where jupyter_server's own watch keeps it
    (KernelManager._activity_stream): its stop_watching_activity closes that stream (at a restart, a shutdown and a
    move), so a watch of ours that replaces its start_watching_activity is stopped by its own code."""
    kernel._activity_stream = kernel.connect_iopub()
    return kernel._activity_stream


def use_start_request(km: Any, request: Any) -> None:
    """Make ``request`` what every later start of this kernel uses: jupyter_client keeps a start's keyword arguments
    for its restarts in KernelManager._launch_args, and the provisioner keeps the request of the start under way. The
    pool hands a waiting kernel to a request this way; the gateway's record then holds the same request."""
    km._launch_args = {**(km._launch_args or {}), START_REQUEST: request}
    km._launch_args.pop("env", None)
    provisioner = getattr(km, "provisioner", None)
    if provisioner is not None and hasattr(provisioner, "start_request"):
        provisioner.start_request = request


def launch_arguments_of(km: Any) -> dict[str, Any]:
    """The keyword arguments jupyter_client keeps for a kernel's restarts (KernelManager._launch_args), itself."""
    return km._launch_args or {}


def serve_starts_through(manager: Any, cls: type[AsyncMultiKernelManager]) -> None:
    """jupyter_server's AsyncMappingKernelManager starts, restarts and stops kernels through
    ``self.pinned_superclass._async_start_kernel(self, ...)`` (and its siblings), which its __init__ sets to
    jupyter_client's MultiKernelManager: pinned to ``cls``, its starts go through cls's ``_async_start_kernel``, which
    is where the warm pool serves them (msb_kernels.provisioning.pool)."""
    manager.pinned_superclass = cls


async def jupyter_client_start_kernel(manager: Any, *, kernel_name: str | None = None, **kwargs: Any) -> str:
    """jupyter_client's own start of a kernel (AsyncMultiKernelManager._async_start_kernel, which its start_kernel is),
    called on ``manager`` whatever its class: what the pool falls back to when it has no kernel to hand out."""
    return await AsyncMultiKernelManager._async_start_kernel(manager, kernel_name=kernel_name, **kwargs)


async def jupyter_client_shutdown_all(manager: Any, now: bool = False) -> None:
    """jupyter_client's own stop of every kernel (AsyncMultiKernelManager._async_shutdown_all, which its shutdown_all
    is), on ``manager`` whatever its class: after the pool's own kernels have stopped."""
    await AsyncMultiKernelManager._async_shutdown_all(manager, now=now)


async def shutdown_all_now(manager: Any, now: bool = True) -> None:
    """The manager's own ``_async_shutdown_all`` (jupyter_client MultiKernelManager's coroutine, which
    AsyncMultiKernelManager.shutdown_all is), through the manager's class: what the gateway's shutdown_all override,
    whose ``now`` defaults to True, awaits."""
    await manager._async_shutdown_all(now=now)


class MappingKernelManagerHooks:
    """Placed just before jupyter_server's AsyncMappingKernelManager among a manager's bases, turns two of its private
    methods into hooks of ours:

    - ``_handle_kernel_died`` (the restarter's "dead" callback: the kernel died and will not be restarted) calls
      :meth:`kernel_died` first;
    - ``_get_changed_ports`` (ports_changed's test, which the WebSocket asks at each connection to learn whether a
      restart moved the kernel) passes its answer through :meth:`changed_address`;
    - ``_check_kernel_id`` (the 404 of every route that names a kernel: REST, the WebSocket's get_kernel) calls
      :meth:`kernel_not_found` before it answers.
    """

    def kernel_not_found(self, kernel_id: str) -> None:
        """A route named a kernel that is not ``in`` this manager (gone, never was, or not the caller's)."""

    def _check_kernel_id(self, kernel_id: str) -> None:
        if kernel_id not in self:  # type: ignore[operator]
            self.kernel_not_found(kernel_id)
        super()._check_kernel_id(kernel_id)  # type: ignore[misc]

    def kernel_died(self, kernel_id: str) -> None:
        """Called as a dead kernel is removed, before jupyter_server removes it."""

    def changed_address(self, kernel_id: str, changed_ports: list | None) -> list | None:
        """jupyter_server's answer: the kernel's new ports, or None where they are those captured at start."""
        return changed_ports

    def _handle_kernel_died(self, kernel_id: str) -> None:
        self.kernel_died(kernel_id)
        super()._handle_kernel_died(kernel_id)  # type: ignore[misc]

    def _get_changed_ports(self, kernel_id: str) -> list | None:
        return self.changed_address(kernel_id, super()._get_changed_ports(kernel_id))  # type: ignore[misc]


# -- the server application --------------------------------------------------------------------------------------------


class ServerAppHooks:
    """Placed just before jupyter_server's ServerApp among an app's bases, turns two of its private coroutines into hooks
    of ours: ``_post_start`` (run
    once the IOLoop runs, before the server says it has started) awaits :meth:`after_start` first, and ``_cleanup``
    (run at the stop, before the kernels are stopped) awaits :meth:`before_cleanup` first."""

    async def after_start(self) -> None:
        """The server listens and its loop runs."""

    async def before_cleanup(self) -> None:
        """The server stops."""

    async def _post_start(self) -> None:
        await self.after_start()
        await super()._post_start()  # type: ignore[misc]

    async def _cleanup(self) -> None:
        await self.before_cleanup()
        await super()._cleanup()  # type: ignore[misc]

    def stop_on_signal(self, sig: Any, frame: Any) -> None:
        """jupyter_server's SIGINT handler that stops the server without asking (ServerApp._signal_stop)."""
        self._signal_stop(sig, frame)  # type: ignore[attr-defined]

    def info_on_signal(self, sig: Any, frame: Any) -> None:
        """jupyter_server's SIGUSR1 handler that logs running_server_info (ServerApp._signal_info)."""
        self._signal_info(sig, frame)  # type: ignore[attr-defined]


def replace_not_found_handler(web_app: web.Application, handler: type[web.RequestHandler]) -> None:
    """Swap jupyter_server's catch-all HTML 404 (Template404, the target of the last rule of tornado's
    Application.wildcard_router) for ``handler``."""
    from jupyter_server.base.handlers import Template404

    for rule in web_app.wildcard_router.rules:
        if rule.target is Template404:
            rule.target = handler


# -- handlers ------------------------------------------------------------------------------------------------------------


def set_current_user(handler: web.RequestHandler, user: Any) -> None:
    """Set a jupyter_server handler's user as its prepare() does: tornado's ``current_user`` and jupyter_server's cache
    of it, ``_jupyter_current_user`` (JupyterHandler.get_current_user and its authorization read the latter)."""
    handler.current_user = handler._jupyter_current_user = user


def response_finished(handler: web.RequestHandler) -> bool:
    """Whether a tornado handler's answer has been finished (RequestHandler._finished): a second finish() raises."""
    return handler._finished


def stop_ping(handler: Any) -> None:
    """Stop jupyter_server's WebSocket ping timer (WebSocketMixin.ping_callback) now. jupyter_server stops it only at the
    next ping after the close, and the timer holds the handler and its connection till then."""
    if handler.ping_callback is not None:
        handler.ping_callback.stop()
        handler.ping_callback = None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def dropped_give_up_timer(connection: Any) -> Iterator[None]:
    """Within it, the timers that ``connection`` sets on the current IOLoop with ``add_timeout`` and whose callbacks
    close over it are removed at the end: jupyter_server's ZMQChannelsWebsocketConnection.prepare sets one (give_up,
    after kernel_info_timeout, 60 s), which holds the connection, and through it the WebSocket handler, for that long
    whatever happens.

    No hook: prepare calls ``IOLoop.current().add_timeout`` and keeps no handle, and jupyter_server offers nothing to
    cancel it, so the loop's method is wrapped while any connection is in here. One wrapper for all of them (the
    loop's _WATCHED registry): connections that prepare at once each register and leave alone, and the last one out
    puts the loop's own method back. A wrapper per connection stacked, and the inner one's exit unwrapped the outer
    one while it still waited, whose timer then held it."""
    loop = IOLoop.current()
    watched: dict[int, tuple[Any, list]] | None = loop.__dict__.get(_WATCHED)
    if watched is None:
        watched = {}
        original = loop.add_timeout

        def add_timeout(deadline: float, callback: Any, *args: Any, **kwargs: Any) -> object:
            handle = original(deadline, callback, *args, **kwargs)
            closure = [cell.cell_contents for cell in getattr(callback, "__closure__", None) or () if _filled(cell)]
            for watcher, timers in watched.values():
                if any(value is watcher for value in closure):
                    timers.append(handle)  # prepare's give_up, which closes over this connection
            return handle

        loop.add_timeout = add_timeout  # type: ignore[method-assign]
        setattr(loop, _WATCHED, watched)
    timers: list = []
    watched[id(connection)] = (connection, timers)
    try:
        yield
    finally:
        del watched[id(connection)]
        for handle in timers:
            loop.remove_timeout(handle)
        if not watched:
            del loop.add_timeout
            delattr(loop, _WATCHED)


_WATCHED = "_msb_give_up_watched"  # on an IOLoop: the connections dropped_give_up_timer watches now


# -- kernels and their clients -----------------------------------------------------------------------------------------


def send_interrupt_request(km: Any) -> None:
    """An interrupt_request on the kernel's control channel, as jupyter_client's KernelManager sends it for
    interrupt_mode "message": through its own control socket (``_connect_control_socket``, ``_control_socket``), kept
    open until the kernel's cleanup. A socket closed right after the send can lose it: an asyncio socket sends once it
    is writable."""
    km._connect_control_socket()
    km.session.send(km._control_socket, km.session.msg("interrupt_request", content={}))


def curve_capable(km: Any) -> bool:
    """Whether this jupyter_client provisions CurveZMQ keys at all (KernelManager.curve_publickey, and its private
    ``_kernel_supports_curve_encryption``): older ones have neither."""
    return hasattr(km, "curve_publickey") and hasattr(km, "_kernel_supports_curve_encryption")


def transport_encryption_policy(km: Any) -> str:
    """The KernelManager's transport_encryption, normalized ("disabled", "auto" or "required") by jupyter_client's own
    KernelManager._transport_encryption_policy, as its LocalProvisioner.pre_launch reads it; "disabled" without it."""
    return km._transport_encryption_policy() if hasattr(km, "_transport_encryption_policy") else "disabled"


def kernel_supports_curve(km: Any) -> bool:
    """Whether the kernelspec declares CurveZMQ (``metadata.supported_encryption``), by jupyter_client's own
    KernelManager._kernel_supports_curve_encryption, as its LocalProvisioner.pre_launch asks it."""
    return km._kernel_supports_curve_encryption()


def disarm_exit_cleanup(client: Any) -> None:
    """Take nbclient's exit hook off (NotebookClient._cleanup_kernel, registered with atexit by its async_setup_kernel):
    after a failed start it is left armed on a kernel nbclient has already cleaned up, and prints a traceback at exit."""
    import atexit

    atexit.unregister(client._cleanup_kernel)
