"""``msb-mcp``: the MCP server for desktop assistants.

* ``msb-mcp`` - stdio, standalone: starts its own sandboxed kernels in this process
  (installing the kernelspecs on first use) and stops every one of them on exit.
* ``msb-mcp --gateway URL --token T`` - stdio, attached to a running ``msb-kernels serve``,
  so the assistant shares sessions with notebook users.
* ``msb-mcp --http HOST:PORT --token T`` - streamable HTTP, standalone (the gateway mounts
  the same app at /mcp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

from mcp_bridge.gateway_sessions import GatewayKernelSessions
from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.options import BridgeOptions
from mcp_bridge.sessions import KernelSessions
from msb_kernels.errors import MsbError
from msb_kernels.identity.people import local_person
from msb_kernels.jupyter import slow_imports
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("mcp_bridge")


def ensure_kernelspecs(settings: MsbSettings) -> None:
    """Zero setup: install the msb kernelspecs into this environment when they are missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("msb-python-small")
    except NoSuchKernel:
        from msb_kernels.kernelspecs.spec_files import install

        for line in install(settings):
            print(f"msb-mcp: {line}", file=sys.stderr)


async def cull_idle(sessions: KernelSessions, bridge, timeout: int) -> None:
    """Stop the sessions this process started once they sat idle for MSB_SESSION_TIMEOUT_SECONDS."""
    while True:
        await asyncio.sleep(min(60.0, max(1.0, timeout / 4)))
        now = time.time()
        for info in await sessions.list():
            if info.started_by != "mcp":
                continue
            runs = bridge.runs_of(info.id)
            busy = runs is not None and runs.lock.locked()
            if not busy and now - (info.last_accessed or now) > timeout:
                log.info("stopping session %s: idle for more than %d s", info.id, timeout)
                with contextlib.suppress(MsbError):
                    await sessions.stop(info.id)
                sessions.forget(info.id)  # stopped, or gone meanwhile


async def serve(args: argparse.Namespace) -> int:
    from mcp_bridge.server import build_server
    from mcp_bridge.supervisor import bridge_of

    settings = load_settings()
    options = BridgeOptions.from_settings(settings)
    if args.gateway:
        sessions: KernelSessions = GatewayKernelSessions(args.gateway, args.token, start_timeout=options.kernel_start_timeout_seconds)
    else:
        ensure_kernelspecs(settings)
        sessions = ManagedKernelSessions(start_timeout=options.kernel_start_timeout_seconds)
        sessions.kernel_manager.pool.fill()  # the first execute_code then gets a kernel that is already running

    loop = asyncio.get_running_loop()
    stopping = False
    bridge = None
    culler = None

    async def stop_and_exit() -> None:
        # The stdio transport reads stdin in a thread that a cancel cannot interrupt, so a signal
        # stops the kernels right here and then ends the process.
        nonlocal stopping
        if stopping:
            return
        stopping = True
        if culler is not None:
            culler.cancel()
        with contextlib.suppress(Exception):
            if bridge is not None:
                await bridge.close()
            await sessions.close()
        os._exit(0)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, lambda: asyncio.ensure_future(stop_and_exit()))

    try:
        if args.http:
            import uvicorn

            from mcp_bridge.http import asgi_app

            host, _, port = args.http.rpartition(":")
            host = host or "127.0.0.1"
            hosts = [f"{host}:{port}", f"{host}:*", "localhost:*", "127.0.0.1:*", "[::1]:*"]
            origins = [f"http://{host}:{port}", "http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*"]
            app = asgi_app(sessions, args.token or "", hosts, origins, settings, options)
            bridge = app.bridge
            if settings.session_timeout_seconds and not args.gateway:
                culler = asyncio.create_task(cull_idle(sessions, bridge, settings.session_timeout_seconds))
            config = uvicorn.Config(app, host=host, port=int(port), log_level="warning", lifespan="on")
            server = uvicorn.Server(config)
            server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
            print(f"msb-mcp: serving MCP over HTTP at http://{host}:{port}/", file=sys.stderr, flush=True)
            await server.serve()
        else:
            # Over stdio the one caller is the desktop's user, who owns this process's kernels (or, --gateway, sends
            # the gateway's token, which says who they are there).
            mcp_server = build_server(sessions, settings, options, local_caller=local_person())
            bridge = bridge_of(mcp_server)
            if settings.session_timeout_seconds and not args.gateway:
                culler = asyncio.create_task(cull_idle(sessions, bridge, settings.session_timeout_seconds))
            try:
                await mcp_server.run_stdio_async()
            finally:
                await bridge.close()
    except asyncio.CancelledError:
        pass
    finally:
        if not stopping:
            stopping = True
            if culler is not None:
                culler.cancel()
            await sessions.close()  # stops every kernel this process started
    return 0


def main(argv: list[str] | None = None) -> int:
    slow_imports.defer()
    parser = argparse.ArgumentParser(prog="msb-mcp", description="MCP server over sandboxed, stateful Jupyter kernels")
    parser.add_argument(
        "--gateway",
        metavar="URL",
        default=os.environ.get("MSB_GATEWAY_URL"),
        help="attach to a running `msb-kernels serve` gateway instead of starting kernels here",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("MSB_GATEWAY_TOKEN") or os.environ.get("MSB_MCP_TOKEN"),
        help="the gateway's token (or, with --http, the bearer token clients must send)",
    )
    parser.add_argument(
        "--lab-url",
        metavar="URL",
        help="the JupyterLab server (run with --gateway-url) whose notebooks the notebook tools edit (MSB_LAB_URL)",
    )
    parser.add_argument("--lab-token", metavar="TOKEN", help="that JupyterLab's token (MSB_LAB_TOKEN)")
    parser.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP instead of stdio (needs --token)")
    parser.add_argument("--log-level", default=os.environ.get("MSB_MCP_LOG_LEVEL", "WARNING"))
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(), format="msb-mcp %(levelname)s %(name)s: %(message)s")
    for flag, name in ((args.lab_url, "MSB_LAB_URL"), (args.lab_token, "MSB_LAB_TOKEN")):
        if flag:
            os.environ[name] = flag  # one place reads and checks settings: msb_kernels.settings.config
    if args.http and not args.token:
        print("msb-mcp: --http needs --token (clients send it as `Authorization: Bearer <token>`)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args))
    except MsbError as exc:
        print(exc.report("msb-mcp"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
