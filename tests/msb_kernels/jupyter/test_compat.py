"""Each private thing of jupyter_server, jupyter_client, tornado and nbclient that msb_kernels.jupyter.compat relies on still
exists and behaves as relied on: an upgrade that breaks one fails here, by its name. Run this file first when raising
the upper bounds in pyproject.toml. No kernel starts here: fakes stand in where a kernel would."""

from __future__ import annotations

import asyncio
import atexit
import inspect
import re
import types
from typing import Any

import pytest
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.multikernelmanager import AsyncMultiKernelManager, MultiKernelManager
from jupyter_server.base.handlers import Template404
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.serverapp import ServerApp, ServerWebApplication
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager, MappingKernelManager
from tornado import web
from tornado.ioloop import IOLoop

from msb_kernels.gateway.app import MsbGatewayApp
from msb_kernels.gateway.kernels.manager import MsbKernelManager
from msb_kernels.jupyter import compat

KERNEL_ID = "0b3c5f2e-1d4a-4c8e-9f00-123456789abc"


class FakeStream:
    def __init__(self) -> None:
        self.socket = types.SimpleNamespace(closed=False)
        self.closed_by = None

    def close(self) -> None:
        self.socket.closed = True
        self.closed_by = "close"


class FakeKernel:
    """What of a KernelManager jupyter_server's activity watch and ports test read."""

    def __init__(self) -> None:
        self.ports = [1, 2, 3, 4, 5]
        self.stream = FakeStream()

    def connect_iopub(self) -> FakeStream:
        return self.stream


@pytest.fixture
def mapping_manager(tmp_path) -> AsyncMappingKernelManager:
    return AsyncMappingKernelManager(root_dir=str(tmp_path))


def source(function: Any) -> str:
    return inspect.getsource(function)


# -- kernel managers -----------------------------------------------------------------------------------------------------


def test_kernels_of_is_the_dict_jupyter_client_looks_kernels_up_in():
    manager = AsyncMultiKernelManager()
    kernels = compat.kernels_of(manager)
    kernel = FakeKernel()
    kernels[KERNEL_ID] = kernel
    assert KERNEL_ID in manager
    assert manager.list_kernel_ids() == [KERNEL_ID]
    assert manager.get_kernel(KERNEL_ID) is kernel


def test_pending_starts_of_is_what_shutdown_all_stops_too():
    manager = AsyncMultiKernelManager()
    assert compat.pending_starts_of(manager) == {}
    assert compat.pending_starts_of(manager) is compat.pending_starts_of(manager)  # the manager's own, not a copy
    assert "_pending_kernels" in source(MultiKernelManager._async_start_kernel)
    assert "self._pending_kernels" in source(MultiKernelManager._async_shutdown_all)


def test_connection_ports_and_buffer_maps_are_jupyter_servers(mapping_manager):
    assert compat.connection_counts_of(mapping_manager) is mapping_manager._kernel_connections
    assert compat.captured_ports_of(mapping_manager) is mapping_manager._kernel_ports
    assert compat.offline_buffers_of(mapping_manager) is mapping_manager._kernel_buffers
    # Managers that are not jupyter_server's have none: empty, not an error.
    assert compat.connection_counts_of(AsyncMultiKernelManager()) == {}
    assert compat.offline_buffers_of(AsyncMultiKernelManager()) == {}


def test_start_buffering_fills_the_buffer_the_gateway_bounds(mapping_manager):
    compat.kernels_of(mapping_manager)[KERNEL_ID] = FakeKernel()
    channels = {"iopub": types.SimpleNamespace(on_recv=lambda callback: None)}
    mapping_manager.start_buffering(KERNEL_ID, "session", channels)
    held = compat.offline_buffers_of(mapping_manager).get(KERNEL_ID)
    assert held is not None and held["channels"] is channels and held["buffer"] == [] and held["session_key"] == "session"
    assert compat.offline_buffers_of(mapping_manager).get("no-such-kernel") is None
    assert "no-such-kernel" not in compat.offline_buffers_of(mapping_manager)  # get adds nothing to the defaultdict


async def test_start_culler_runs_jupyter_servers_culler_with_a_timeout_of_0(mapping_manager):
    mapping_manager.cull_idle_timeout = 0
    assert compat.start_culler(mapping_manager)
    try:
        assert mapping_manager._initialized_culler and mapping_manager._culler_callback.is_running()
        assert mapping_manager._culler_callback.callback == mapping_manager.cull_kernels
        assert not compat.start_culler(mapping_manager)  # it runs: jupyter_server's own initialize_culler is the one now
        mapping_manager.initialize_culler()  # and that adds no second culler
        assert mapping_manager._culler_callback.callback == mapping_manager.cull_kernels
    finally:
        mapping_manager._culler_callback.stop()


def test_start_culler_leaves_a_positive_timeout_to_jupyter_server(mapping_manager):
    mapping_manager.cull_idle_timeout = 60
    assert not compat.start_culler(mapping_manager)
    assert mapping_manager._culler_callback is None
    assert "_culler_callback" in source(MappingKernelManager.initialize_culler)
    assert "_initialized_culler" in source(MappingKernelManager.initialize_culler)


def test_stop_watching_activity_closes_the_stream_open_activity_stream_opened(mapping_manager):
    kernel = FakeKernel()
    compat.kernels_of(mapping_manager)[KERNEL_ID] = kernel
    assert compat.open_activity_stream(kernel) is kernel.stream
    mapping_manager.stop_watching_activity(KERNEL_ID)
    assert kernel.stream.closed_by == "close"


def test_jupyter_server_calls_the_activity_watch_at_each_start_and_restart():
    assert "self.start_watching_activity(kernel_id)" in source(MappingKernelManager._finish_kernel_start)
    assert "self.start_watching_activity(kernel_id)" in source(MappingKernelManager._async_restart_kernel)
    # Its own watch keeps what ours keeps current, by the same names.
    own = source(MappingKernelManager.start_watching_activity)
    for name in ("kernel.reason", "kernel.last_activity", "kernel.execution_state", "self.last_kernel_activity", "track_message_type"):
        assert name in own


def test_utcnow_is_jupyter_servers_clock():
    from jupyter_server import _tz

    assert compat.utcnow is _tz.utcnow
    assert compat.utcnow().tzinfo is not None


def test_jupyter_server_starts_kernels_through_the_pinned_superclass(mapping_manager):
    assert mapping_manager.pinned_superclass is MultiKernelManager
    assert "self.pinned_superclass._async_start_kernel(self" in source(MappingKernelManager._async_start_kernel)

    class Pinned(AsyncMultiKernelManager):
        pass

    compat.serve_starts_through(mapping_manager, Pinned)
    assert mapping_manager.pinned_superclass is Pinned


def test_jupyter_clients_start_and_shutdown_all_are_the_private_coroutines():
    # What the pool overrides (_async_start_kernel, _async_shutdown_all) is what jupyter_client's public names are.
    assert AsyncMultiKernelManager.start_kernel is MultiKernelManager._async_start_kernel
    assert AsyncMultiKernelManager.shutdown_all is MultiKernelManager._async_shutdown_all
    assert not hasattr(MappingKernelManager, "_async_shutdown_all") or (
        MappingKernelManager._async_shutdown_all is MultiKernelManager._async_shutdown_all
    )


async def test_jupyter_client_start_kernel_and_shutdown_all_take_any_manager(monkeypatch):
    called = []

    async def start(self, *, kernel_name=None, **kwargs):
        called.append(("start", self, kernel_name, kwargs))
        return "started"

    async def shutdown_all(self, now=False):
        called.append(("shutdown_all", self, now))

    monkeypatch.setattr(MultiKernelManager, "_async_start_kernel", start)
    monkeypatch.setattr(MultiKernelManager, "_async_shutdown_all", shutdown_all)
    manager = object()
    assert await compat.jupyter_client_start_kernel(manager, kernel_name="k", kernel_id="i") == "started"
    await compat.jupyter_client_shutdown_all(manager, now=True)
    assert called == [("start", manager, "k", {"kernel_id": "i"}), ("shutdown_all", manager, True)]


async def test_shutdown_all_now_stops_every_kernel_and_pending_start():
    manager = AsyncMultiKernelManager()
    stopped = []

    async def shutdown_kernel(kernel_id, now=False, restart=False):
        stopped.append((kernel_id, now))

    manager._async_shutdown_kernel = shutdown_kernel
    compat.kernels_of(manager)[KERNEL_ID] = FakeKernel()
    compat.pending_starts_of(manager)["pending"] = asyncio.get_running_loop().create_future()
    await compat.shutdown_all_now(manager)
    assert sorted(stopped) == sorted([(KERNEL_ID, True), ("pending", True)])


def test_the_kernel_manager_hooks_are_jupyter_servers_private_methods(mapping_manager):
    assert "self._handle_kernel_died(kernel_id)" in source(MappingKernelManager._finish_kernel_start)
    assert "self._get_changed_ports(kernel_id)" in source(MappingKernelManager.ports_changed)
    assert "self._check_kernel_id(kernel_id)" in source(MappingKernelManager.kernel_model)
    # The hooks sit before jupyter_server's class, after every mixin of the gateway's manager.
    mro = MsbKernelManager.__mro__
    assert mro.index(compat.MappingKernelManagerHooks) == mro.index(AsyncMappingKernelManager) - 1


def test_the_kernel_manager_hooks_are_called(tmp_path):
    class Manager(compat.MappingKernelManagerHooks, AsyncMappingKernelManager):
        died: list[str] = []

        def kernel_died(self, kernel_id: str) -> None:
            self.died.append(kernel_id)

        def changed_address(self, kernel_id: str, changed: list | None) -> list | None:
            return changed or ["moved"]

        def kernel_not_found(self, kernel_id: str) -> None:
            self.died.append(f"missing {kernel_id}")

        def remove_kernel(self, kernel_id: str):
            return compat.kernels_of(self).pop(kernel_id, None)

    manager = Manager(root_dir=str(tmp_path))
    kernel = FakeKernel()
    compat.kernels_of(manager)[KERNEL_ID] = kernel
    compat.captured_ports_of(manager)[KERNEL_ID] = list(kernel.ports)
    assert manager.ports_changed(KERNEL_ID)  # the ports are the same: the hook's answer counts
    manager._handle_kernel_died(KERNEL_ID)
    assert manager.died == [KERNEL_ID] and KERNEL_ID not in manager
    with pytest.raises(web.HTTPError) as missing:  # jupyter_server's 404, after the hook heard of it
        manager.kernel_model(KERNEL_ID)
    assert missing.value.status_code == 404 and manager.died[-1] == f"missing {KERNEL_ID}"


# -- the server application --------------------------------------------------------------------------------------------


def test_the_server_app_hooks_are_jupyter_servers_private_coroutines():
    assert inspect.iscoroutinefunction(ServerApp._post_start)
    assert inspect.iscoroutinefunction(ServerApp._cleanup)
    assert "self._post_start" in source(ServerApp.start_ioloop)
    assert "self._cleanup()" in source(ServerApp._stop)
    assert callable(ServerApp._signal_stop) and callable(ServerApp._signal_info)
    mro = MsbGatewayApp.__mro__
    assert mro.index(compat.ServerAppHooks) == mro.index(ServerApp) - 1


async def test_the_server_app_hooks_run_before_jupyter_servers_own(monkeypatch):
    order = []

    async def post_start(self):
        order.append("jupyter_server's _post_start")

    async def cleanup(self):
        order.append("jupyter_server's _cleanup")

    monkeypatch.setattr(ServerApp, "_post_start", post_start)
    monkeypatch.setattr(ServerApp, "_cleanup", cleanup)
    monkeypatch.setattr(ServerApp, "_signal_stop", lambda self, sig, frame: order.append(("stop", sig)))
    monkeypatch.setattr(ServerApp, "_signal_info", lambda self, sig, frame: order.append(("info", sig)))

    class App(compat.ServerAppHooks, ServerApp):
        async def after_start(self) -> None:
            order.append("after_start")

        async def before_cleanup(self) -> None:
            order.append("before_cleanup")

    app = App()
    await app._post_start()
    await app._cleanup()
    app.stop_on_signal(15, None)
    app.info_on_signal(10, None)
    assert order == [
        "after_start",
        "jupyter_server's _post_start",
        "before_cleanup",
        "jupyter_server's _cleanup",
        ("stop", 15),
        ("info", 10),
    ]


def test_replace_not_found_handler_swaps_jupyter_servers_catch_all():
    class NotFound(web.RequestHandler):
        pass

    app = web.Application()
    app.wildcard_router.add_rules([(r"(.*)", Template404)])
    compat.replace_not_found_handler(app, NotFound)
    assert [rule.target for rule in app.wildcard_router.rules] == [NotFound]
    assert '(r"(.*)", Template404)' in source(ServerWebApplication.init_handlers)


def test_kernel_id_regex_is_jupyter_servers():
    from jupyter_server.services.kernels import handlers

    assert compat.KERNEL_ID_REGEX == handlers._kernel_id_regex
    assert re.fullmatch(compat.KERNEL_ID_REGEX, KERNEL_ID).group("kernel_id") == KERNEL_ID
    assert compat.KERNEL_ACTION_REGEX == handlers._kernel_action_regex
    assert {re.fullmatch(compat.KERNEL_ACTION_REGEX, a).group("action") for a in ("restart", "interrupt")} == {"restart", "interrupt"}
    with pytest.raises(AttributeError):
        _ = compat.no_such_name


# -- handlers ----------------------------------------------------------------------------------------------------------


def test_set_current_user_sets_jupyter_servers_cache_of_it():
    from jupyter_server.base.handlers import JupyterHandler

    assert "self._jupyter_current_user" in source(JupyterHandler.get_current_user)
    handler = types.SimpleNamespace()
    compat.set_current_user(handler, None)
    assert handler.current_user is None and handler._jupyter_current_user is None


def test_response_finished_is_tornados_flag():
    assert "self._finished = True" in source(web.RequestHandler.finish)
    assert "self._finished = False" in source(web.RequestHandler.clear) or "_finished" in source(web.RequestHandler.__init__)
    assert compat.response_finished(types.SimpleNamespace(_finished=True))


def test_stop_ping_stops_jupyter_servers_ping_timer():
    assert WebSocketMixin.ping_callback is None
    assert "self.ping_callback = ioloop.PeriodicCallback" in source(WebSocketMixin.open)

    class Callback:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    callback = Callback()
    handler = types.SimpleNamespace(ping_callback=callback)
    compat.stop_ping(handler)
    assert callback.stopped and handler.ping_callback is None
    compat.stop_ping(handler)  # no timer: nothing to do


async def test_dropped_give_up_timer_removes_the_timers_that_hold_the_connection():
    prepare = source(ZMQChannelsWebsocketConnection.prepare)
    assert "loop.add_timeout(" in prepare and "give_up" in prepare and "IOLoop.current()" in prepare
    loop = IOLoop.current()
    connection, fired = object(), []

    def give_up() -> None:
        fired.append(connection)

    def other() -> None:
        fired.append("other")

    with compat.dropped_give_up_timer(connection):
        loop.add_timeout(loop.time() + 0.01, give_up)
        loop.add_timeout(loop.time() + 0.01, other)
    assert "add_timeout" not in loop.__dict__  # the loop's own method again
    await asyncio.sleep(0.05)
    assert fired == ["other"]


async def test_two_websockets_connecting_at_once_each_drop_their_own_timer():
    """Two connections prepare at once, and the one that came in second leaves first: the first one's timer, set after
    that, is still dropped (a wrapper per connection let it fire and hold its connection), and the loop's own method is
    back once both are out."""
    loop = IOLoop.current()
    first, second, fired = object(), object(), []

    def give_up_of(connection: object):
        def give_up() -> None:
            fired.append(connection)

        return give_up

    outer = compat.dropped_give_up_timer(first)
    outer.__enter__()
    with compat.dropped_give_up_timer(second):
        loop.add_timeout(loop.time() + 0.01, give_up_of(second))
    loop.add_timeout(loop.time() + 0.01, give_up_of(first))  # the first still waits for its kernel's answer
    outer.__exit__(None, None, None)
    assert "add_timeout" not in loop.__dict__
    await asyncio.sleep(0.05)
    assert fired == []


# -- kernels and their clients -----------------------------------------------------------------------------------------


def test_send_interrupt_request_uses_jupyter_clients_control_socket():
    sent = []
    km = types.SimpleNamespace(_control_socket=None)

    def connect() -> None:
        km._control_socket = "control"

    km._connect_control_socket = connect
    km.session = types.SimpleNamespace(
        msg=lambda msg_type, content: {"msg_type": msg_type, "content": content}, send=lambda *args: sent.append(args)
    )
    compat.send_interrupt_request(km)
    assert sent == [("control", {"msg_type": "interrupt_request", "content": {}})]
    # jupyter_client's own: the socket it keeps open, and the way it sends an interrupt for interrupt_mode "message".
    assert "self._connect_control_socket()" in source(AsyncKernelManager._async_interrupt_kernel)
    assert "self.session.send(self._control_socket, msg)" in source(AsyncKernelManager._async_interrupt_kernel)


def test_the_curve_helpers_are_jupyter_clients_own():
    class Manager(AsyncKernelManager):
        spec: Any = None

        @property
        def kernel_spec(self) -> Any:
            return self.spec

    km = Manager()
    assert compat.curve_capable(km)
    assert compat.transport_encryption_policy(km) == "disabled"
    km.spec = types.SimpleNamespace(metadata={})
    assert not compat.kernel_supports_curve(km)  # not declared: not supported
    km.spec = types.SimpleNamespace(metadata={"supported_encryption": ["curve"]})  # what our kernelspecs declare
    assert compat.kernel_supports_curve(km)
    assert compat.transport_encryption_policy(types.SimpleNamespace()) == "disabled"
    assert not compat.curve_capable(types.SimpleNamespace())
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    assert "_kernel_supports_curve_encryption()" in source(LocalProvisioner.pre_launch)


def test_disarm_exit_cleanup_takes_nbclients_exit_hook_off(monkeypatch):
    from nbclient import NotebookClient

    assert "atexit.register(self._cleanup_kernel)" in source(NotebookClient.async_setup_kernel)
    unregistered = []
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    client = types.SimpleNamespace(_cleanup_kernel=object())
    compat.disarm_exit_cleanup(client)
    assert unregistered == [client._cleanup_kernel]
