"""``msb-kernels serve``: a jupyter_server that runs every kernel in a sandbox.

It speaks the Jupyter kernel gateway API (jupyter_server's own kernel, kernelspec and
session handlers), so ``jupyter lab --gateway-url=http://127.0.0.1:PORT`` runs its
kernels here; it adds /api/msb/stats and /api/msb/health, and mounts the MCP bridge at
/mcp when mcp_bridge is installed. Only the kernel services are exposed: no contents,
files, terminals or nbconvert, which would reach the host outside any sandbox.

Settings (each also a trait of ``c.MsbSettings.*``, msb_kernels.settings.config):

=========================== ============================================ ==========================
variable                    meaning                                      default
=========================== ============================================ ==========================
MSB_HOST                    address to listen on                         127.0.0.1
MSB_PORT                    TCP port                                     8765
MSB_TOKEN                   the token clients send as                    generated and printed
                            ``Authorization: token ...``
MSB_CAPACITY_MEMORY_MIB     memory the flavors of all kernels may use    the host's memory
MSB_CAPACITY_CPUS           CPUs the flavors of all kernels may use      no limit (CPU time is shared)
MSB_CULL_INTERVAL_SECONDS   how often idle kernels are looked for        60
MSB_CULL_CONNECTED          cull idle kernels that have a client         false (jupyter_server's)
MSB_CULL_BUSY               cull busy kernels                            false (jupyter_server's)
=========================== ============================================ ==========================

A start past MSB_MAX_SESSIONS or the capacity answers HTTP 429 with a JSON body:
``{"type": "ResourceLimitExceeded", "limit": "max_sessions" | "capacity_memory" | "capacity_cpus",
"message": ..., "suggestions": [...]}``; an unknown kernelspec or kernel id answers 404, a bad
KERNEL_FLAVOR 400, always as JSON and never with a traceback.

Plus MSB_SESSION_TIMEOUT_SECONDS (idle time before a kernel is culled; a kernelspec's
``metadata.cull_idle_timeout`` overrides it) and MSB_MAX_SESSIONS from msb_kernels.settings.config.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import os
import signal
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jupyter_core.application import JupyterApp
from jupyter_server.serverapp import ServerApp
from traitlets import Bool, Integer, default

from msb_kernels import __version__
from msb_kernels.backends import choose_backend
from msb_kernels.errors import ConfigError, MsbError
from msb_kernels.gateway.auth.authorizer import MsbAuthorizer
from msb_kernels.gateway.auth.identity import MsbIdentityProvider
from msb_kernels.gateway.handlers import JsonNotFoundHandler, gateway_handlers, serve_only, use_json_not_found
from msb_kernels.gateway.kernels.manager import MsbKernelManager
from msb_kernels.gateway.kernels.websocket import PerSocketIdentityConnection
from msb_kernels.gateway.mcp.asgi import AsgiHandler
from msb_kernels.gateway.sandboxed_kernelspecs import MsbKernelSpecManager
from msb_kernels.gateway.sessions import MsbSessionManager
from msb_kernels.identity.hub import HubService
from msb_kernels.identity.people import SYSTEM, acting_as, set_acting
from msb_kernels.identity.tokens import Tokens
from msb_kernels.jupyter.compat import ServerAppHooks
from msb_kernels.jupyter.server_logs import quiet_the_ping_unit_clash
from msb_kernels.provisioning.limits import open_files_advice, raise_open_files
from msb_kernels.settings.config import load_settings

# The variables JupyterLab's server is told to pass on (--GatewayClient.allowed_envs): it sends KERNEL_*
# variables by itself, JPY_SESSION_NAME (the notebook's path, for stats and get_sessions) only when allowed.
JUPYTERLAB_ALLOWED_ENVS = ("JPY_SESSION_NAME", "KERNEL_FLAVOR")


def jupyterlab_command(url: str) -> str:
    """The one command that starts JupyterLab on this gateway, as the banner, README.md and docs/notebooks.md give it:
    Lab's own token is one the operator chooses, since the notebook tools reach Lab with it (MSB_LAB_TOKEN); the
    allowed variables carry a notebook's path and its flavor to the kernel's start."""
    return (
        f"jupyter lab --IdentityProvider.token=<lab-token> --gateway-url={url} --GatewayClient.auth_token=<token> "
        f"--GatewayClient.allowed_envs={','.join(JUPYTERLAB_ALLOWED_ENVS)}"
    )


def hold_runtime_dir(root: Path) -> int:
    """One gateway per runtime dir: a gateway answers for the sandboxes there (its start-up sweep, its stats),
    so two on one dir would act on each other's. Returns the descriptor that holds the lock for this process's life."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "gateway.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another msb-kernels serve (pid {holder}) already uses the runtime dir {root}",
            ["stop that server first", "or give this one a runtime dir of its own: MSB_RUNTIME_DIR=/path"],
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


class MsbGatewayApp(ServerAppHooks, ServerApp):
    """jupyter_server with sandboxed kernels only, limits, stats and the MCP bridge."""

    name = "msb-kernels-serve"  # reads msb_kernels_serve_config.py, not a JupyterLab user's jupyter_server_config
    description = "Serve sandboxed Jupyter kernels to JupyterLab (--gateway-url) and MCP clients."
    # The kernel gateway's services only: contents, files, terminals and nbconvert would reach the host.
    default_services = ("api", "auth", "kernels", "kernelspecs", "sessions")

    kernel_manager_class = MsbKernelManager
    kernel_spec_manager_class = MsbKernelSpecManager
    session_manager_class = MsbSessionManager
    identity_provider_class = MsbIdentityProvider
    authorizer_class = MsbAuthorizer
    kernel_websocket_connection_class = PerSocketIdentityConnection

    hub_service: HubService | None = None  # JupyterHub's word on this process, when it runs as a Hub service

    @default("port")
    def _msb_port_default(self) -> int:
        if self.hub_service and self.hub_service.url and "MSB_PORT" not in os.environ:
            return urlparse(self.hub_service.url).port or self.msb_settings.port  # where the Hub's proxy sends requests
        return self.msb_settings.port

    @default("ip")
    def _msb_ip_default(self) -> str:
        if self.hub_service and self.hub_service.url and "MSB_HOST" not in os.environ:
            return urlparse(self.hub_service.url).hostname or self.msb_settings.host
        return self.msb_settings.host

    @default("base_url")
    def _msb_base_url_default(self) -> str:
        return self.hub_service.prefix if self.hub_service else "/"  # behind the Hub's proxy at /services/<name>/

    @default("port_retries")
    def _msb_port_retries_default(self) -> int:
        return 0  # clients are pointed at one port: fail rather than move

    @default("open_browser")
    def _msb_open_browser_default(self) -> bool:
        return False

    @default("no_browser_open_file")
    def _msb_no_browser_file_default(self) -> bool:
        return True

    @default("default_url")
    def _msb_default_url_default(self) -> str:
        return "/api/msb/stats"  # the only page here; there is no JupyterLab or file browser

    @default("allow_root")
    def _msb_allow_root_default(self) -> bool:
        return True  # kernels run in sandboxes, not as this process's user

    @default("allow_unauthenticated_access")
    def _msb_unauthenticated_default(self) -> bool:
        return False  # every endpoint needs the token, except /api/msb/health

    @default("terminals_enabled")
    def _msb_terminals_default(self) -> bool:
        return False

    sweep_on_start = Bool(True, help="Remove sandboxes a killed msb-kernels left behind, at start.").tag(config=True)
    shutdown_timeout = Integer(30, help="Seconds to wait for kernels to stop on SIGINT/SIGTERM.").tag(config=True)

    adopted: list[str] = []

    def initialize(self, argv: list[str] | None = None, **kwargs: Any) -> None:
        self.msb_settings = load_settings(self.config)  # a bad MSB_* value fails here, naming the variable
        open_files = raise_open_files()  # before anything opens: every kernel holds descriptors here (limits.py)
        self.hub_service = HubService.from_environment()
        people = self.hub_service is not None or bool(self.msb_settings.users_file)
        self.runtime_dir_lock = hold_runtime_dir(self.msb_settings.runtime_root())
        kwargs.setdefault("find_extensions", False)  # no JupyterLab, terminals or other server extensions
        super().initialize(argv, **kwargs)
        self.single_token, self.single_token_generated = self._single_token(people)
        # jupyter_server's pages print IdentityProvider.token for whoever is logged in: it holds none here. Every token
        # (the single one included) is checked by msb_kernels.identity.tokens, through MsbIdentityProvider.get_user.
        self.identity_provider.token = ""
        # Sandbox and pool messages go to this server's log, in its format and at its --log-level. traitlets leaves
        # the server's logger (and jupyter_server, tornado's) at DEBUG and filters in the handlers, so each debug
        # line (one per request) was built only to be dropped: the loggers take the handlers' lowest level.
        level = min((handler.level or logging.DEBUG for handler in self.log.handlers), default=logging.DEBUG)
        msb_log = logging.getLogger("msb_kernels")
        msb_log.handlers, msb_log.propagate = list(self.log.handlers), False
        for logger in (self.log, logging.getLogger("tornado"), msb_log):
            logger.setLevel(level)
        quiet_the_ping_unit_clash()
        self.log_limits(open_files)
        if not self.single_token and not people:
            raise ConfigError(
                "the token is empty, which would let anyone run code here; "
                "set MSB_TOKEN to a secret, or leave it unset to have one generated"
            )
        self.identity_provider.tokens = Tokens(
            self.single_token,
            Path(self.msb_settings.users_file) if self.msb_settings.users_file else None,
            self.hub_service,
            self.msb_settings.hub_auth_cache_seconds,
        )
        km = self.kernel_manager
        for name in ("capacity_memory_mib", "capacity_cpus", "cull_idle_timeout", "cull_interval", "cull_connected", "cull_busy"):
            getattr(km, name)  # read every MSB_* setting now, so a bad one stops the start, not the first kernel
        self.web_app.add_handlers(".*$", [(self.base_url.rstrip("/") + pattern, handler) for pattern, handler in gateway_handlers()])
        self.web_app.settings["msb_hub_service"] = self.hub_service
        use_json_not_found(self.web_app)
        from msb_kernels.gateway.mcp.mount import mount_mcp
        from msb_kernels.gateway.scrape import register, serve_metrics

        self.mcp_lifespan = mount_mcp(self)
        # Only what the gateway is for: kernels, kernelspecs, the caller's sessions, its own routes and /mcp.
        dropped = serve_only(self.web_app, {handler for _, handler in gateway_handlers()} | {AsgiHandler, JsonNotFoundHandler})
        self.log.debug("not served: %s", ", ".join(dropped))
        self.metrics_collector = register(km)  # beside jupyter_server's own, at /metrics behind the token
        if self.msb_settings.metrics_port:
            serve_metrics(self.msb_settings.metrics_host, self.msb_settings.metrics_port)

    def _single_token(self, people: bool) -> tuple[str | None, bool]:
        """The gateway's single token (its admin's) and whether it was generated here: MSB_TOKEN, else jupyter_server's
        own ways (--IdentityProvider.token, JUPYTER_TOKEN, JUPYTER_TOKEN_FILE), else the one jupyter_server generated,
        which the banner prints, where no users file or Hub gives people tokens of their own. None: no single token."""
        if self.msb_settings.token:
            return self.msb_settings.token, False
        configured, generated = self.identity_provider.token or None, self.identity_provider.token_generated
        if generated and people:
            return None, False  # every token is a person's; no generated admin token to leak in a log
        return configured, generated

    def log_limits(self, open_files: tuple[int, int, int]) -> None:
        """Say what the gateway lifted for MSB_MAX_SESSIONS, and what still stands in its way."""
        before, after, hard = open_files
        moved = f"raised from {before} to {after}" if after != before else f"{after}"
        self.log.info(
            "limits: open files (RLIMIT_NOFILE) %s (hard %s); ZeroMQ MAX_SOCKETS %d for MSB_MAX_SESSIONS=%d",
            moved,
            hard,
            self.kernel_manager.zmq_max_sockets,
            self.msb_settings.max_sessions,
        )
        advice = open_files_advice(self.msb_settings.max_sessions)
        if advice:
            self.log.warning("limits: %s", advice)

    def init_httpserver(self) -> None:
        """Adopt the kernels the last gateway left running before the port opens: a client reconnecting to one
        must never be told it does not exist."""
        self.adopted = self.io_loop.run_sync(self.kernel_manager.adopt_kernels)
        super().init_httpserver()
        self._refuse_kernel_networks()

    def _refuse_kernel_networks(self) -> None:
        """Where kernels could reach this server (its container is on their overlay), their connections are closed
        unread: no kernel has a reason to call its own gateway, and a token is not all that should stand between."""
        from msb_kernels.backends import get_backend

        networks = [ipaddress.ip_network(cidr) for cidr in get_backend(self.msb_settings).kernel_networks()]
        if not networks:
            return
        serve = self.http_server.handle_stream

        def handle_stream(stream: Any, address: Any) -> Any:
            peer = ipaddress.ip_address(address[0]) if isinstance(address, tuple) and address else None
            if peer is not None and any(peer in network for network in networks):
                self.log.warning("refused a connection from %s, on the kernels' network", peer)
                stream.close()
                return None
            return serve(stream, address)

        self.http_server.handle_stream = handle_stream
        self.log.info("connections from the kernels' network %s are refused", ", ".join(map(str, networks)))

    def init_signal(self) -> None:
        """SIGINT and SIGTERM both stop the server and every sandbox; no interactive confirmation."""
        signal.signal(signal.SIGINT, self.stop_on_signal)
        signal.signal(signal.SIGTERM, self.stop_on_signal)
        if hasattr(signal, "SIGUSR1"):
            signal.signal(signal.SIGUSR1, self.info_on_signal)

    def sweep_orphans(self) -> list[str]:
        """What the last msb-kernels process left and this one did not adopt goes (pooled kernels, dead sandboxes)."""
        from msb_kernels.backends import get_backend

        backend = get_backend(self.msb_settings)
        swept = self.io_loop.run_sync(lambda: backend.sweep_orphans(include_adoptable=True))
        if swept:
            self.log.warning("removed %d sandbox(es) a previous msb-kernels process left behind: %s", len(swept), ", ".join(swept))
        return swept

    def start_app(self) -> None:
        """ServerApp.start_app without its log lines: they speak of notebooks served from a local
        directory, a URL to paste into a browser and a second Ctrl-C, none of which holds here."""
        if self.sweep_on_start:
            self.sweep_orphans()
        JupyterApp.start(self)  # what ServerApp.start_app runs first (subcommands)
        self.write_server_info_file()
        print(self.banner(), flush=True)

    def running_server_info(self, kernel_count: bool = True) -> str:
        """What SIGUSR1 logs: this server, not jupyter_server's notebook directory."""
        with acting_as(SYSTEM):  # SIGUSR1's handler runs in whatever context it interrupted, perhaps a person's request
            count = f", {len(self.kernel_manager.list_kernel_ids())} kernels" if kernel_count else ""
        return f"msb-kernels {__version__} serving sandboxed kernels at {self.display_url}{count}"

    def backend_line(self) -> str:
        try:
            name, _ = choose_backend(self.msb_settings.backend)  # the log line above says why
        except MsbError as exc:
            return f"  sandboxes: none can start here: {exc.message} (run `msb-kernels doctor`)"
        return (
            f"  sandboxes: every kernel runs in a {name} sandbox (MSB_BACKEND={self.msb_settings.backend}; `msb-kernels doctor` says why)"
        )

    def banner(self) -> str:
        url = f"http://{self.ip if self.ip not in ('', '0.0.0.0') else '127.0.0.1'}:{self.port}{self.base_url.rstrip('/')}"
        lines = [
            f"msb-kernels serve: listening on {url}",
            self.backend_line(),
            *self.people_lines(),
            "  clients send it as the header  Authorization: token <token>",
            f"  JupyterLab: {jupyterlab_command(url)}",
            f"  stats: {url}/api/msb/stats   metrics: {url}/metrics   health (no token): {url}/api/msb/health",
            f"  MCP: {url}/mcp",
            self.stop_line(),
        ]
        if self.adopted:
            lines.insert(2, f"  adopted {len(self.adopted)} running kernel(s) from the previous msb-kernels serve")
        return "\n".join(lines)

    def people_lines(self) -> list[str]:
        """Who may use this gateway, and with which token: each person sees only the kernels they started."""
        token, lines = self.single_token, []
        if token:
            lines.append(f"  token: {token}" if self.single_token_generated else "  token: the one set in MSB_TOKEN (or config)")
        if self.msb_settings.users_file:
            lines.append(f"  people: the users file {self.msb_settings.users_file} (`msb-kernels users add NAME` gives a token)")
        if self.hub_service is not None:
            lines.append(
                f"  people: JupyterHub's tokens with the scope {self.hub_service.access_scope} (a person's server token, or one from /hub/token)"
            )
        return lines

    @property
    def keeps_kernels_at_stop(self) -> bool:
        """MSB_KEEP_KERNELS, where kernels can outlive the gateway at all (MSB_ADOPT_GRACE_SECONDS > 0)."""
        return self.msb_settings.keep_kernels and self.msb_settings.adopt_grace_seconds > 0

    def stop_line(self) -> str:
        grace = self.msb_settings.adopt_grace_seconds
        if self.keeps_kernels_at_stop:
            return f"  stop with Ctrl-C or SIGTERM: kernels keep running for {grace} s, for the next msb-kernels serve to adopt"
        survives = f"; after a crash they wait {grace} s to be adopted" if grace > 0 else ""
        return f"  stop with Ctrl-C or SIGTERM: every sandbox is stopped{survives}"

    async def after_start(self) -> None:  # compat.ServerAppHooks: before jupyter_server's _post_start
        # The system's work, and every timer started here runs on in this context: the culler, the pool, hibernation.
        set_acting(SYSTEM)
        if self.msb_settings.backend == "auto":  # the start probe now, in the background, so no session waits for it
            self._probe_task = asyncio.ensure_future(self._probe_backend())
        self.kernel_manager.initialize_culler()  # now: started by a request, its timer would act as that person
        self.kernel_manager.pool.fill()  # MSB_POOL_SIZE kernels start now, so the first sessions need not wait
        unavailable = self.kernel_manager.start_hibernation()
        if unavailable:
            self.log.warning(
                "MSB_HIBERNATE_AFTER_SECONDS=%d, but kernels cannot hibernate here: %s; idle kernels are culled as before",
                self.msb_settings.hibernate_after_seconds,
                unavailable,
            )
        if self.mcp_lifespan is not None:
            try:
                await self.mcp_lifespan.startup()
            except Exception as exc:
                self.log.error("MCP bridge failed to start: %s", exc)

    async def _probe_backend(self) -> None:
        """MSB_BACKEND=auto: which backend a kernel from the default kernelspec's interpreter starts in (msb_kernels.provisioning.probe)."""
        from msb_kernels.kernelspecs.choice import KernelChoice
        from msb_kernels.provisioning.probe import backend_for_start

        name = KernelChoice.of("python", self.msb_settings.default_flavor).kernel_name
        try:
            argv = self.kernel_spec_manager.get_kernel_spec(name).argv
            backend = await backend_for_start(self.msb_settings, argv, "python")
        except Exception as exc:  # logged, not raised: each start reports the same refusal to its client
            self.log.error("msb-kernels: no backend can start a kernel here: %s", getattr(exc, "message", exc))
            return
        self.log.info("msb-kernels: kernels start in the %s backend (it passed its start probe)", backend.name)

    async def before_cleanup(self) -> None:  # compat.ServerAppHooks: before jupyter_server's _cleanup
        # The stop is the system's. A stop signal schedules _cleanup in the context it interrupted (tornado's
        # add_callback_from_signal), which may be a person's request: then their kernels alone were listed and
        # stopped, and the others' sandboxes were left behind for the next start's sweep.
        set_acting(SYSTEM)
        if getattr(self, "mcp_lifespan", None) is not None:
            await self.mcp_lifespan.shutdown()

    async def cleanup_kernels(self) -> None:
        """Stop every kernel and its sandbox; kill what does not stop in time. With MSB_KEEP_KERNELS the sessions'
        kernels keep running, each held by its keeper for the next gateway, and only the pool's waiting ones stop."""
        import asyncio

        self.kernel_manager.stop_hibernation()
        await self.kernel_manager.pool.shutdown()
        if self.keeps_kernels_at_stop:
            # A hibernated kernel has no process for a keeper to hold: it wakes, to be kept with the others.
            await self.kernel_manager.wake_all(self.shutdown_timeout)
            kept = self.kernel_manager.keep_kernels()
            self.log.info(
                "left %d kernel(s) running for the next msb-kernels serve on %s (they stop in %d s if none adopts them)",
                kept,
                self.msb_settings.runtime_root(),
                self.msb_settings.adopt_grace_seconds,
            )
            return
        try:
            await asyncio.wait_for(super().cleanup_kernels(), self.shutdown_timeout)
        except Exception as exc:  # a timeout included
            self.log.warning("kernels did not all stop cleanly (%s); killing them", str(exc) or type(exc).__name__)
            try:
                await self.kernel_manager.shutdown_all(now=True)
            except Exception as again:  # the server must stop all the same; what is left, its next start sweeps
                self.log.error("kernels could not all be stopped: %s", str(again) or type(again).__name__)
