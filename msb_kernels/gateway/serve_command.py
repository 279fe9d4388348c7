"""``msb-kernels serve``: its arguments and handler. Light to import: jupyter_server loads only when it runs."""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

from msb_kernels.errors import ConfigError


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``msb-kernels serve`` to the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="serve sandboxed kernels to JupyterLab (--gateway-url) and MCP clients",
        description="Start the kernel gateway: Jupyter kernel, kernelspec and session APIs, "
        "/api/msb/stats, and the MCP bridge at /mcp. Settings also come from MSB_* variables.",
    )
    p.add_argument("--host", help="address to listen on (MSB_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (MSB_PORT, default 8765)")
    p.add_argument("--token-file", help="read the token from this file (else MSB_TOKEN, else one is generated)")
    p.add_argument("--capacity-memory-mib", type=int, help="memory all kernels' flavors may add up to (MSB_CAPACITY_MEMORY_MIB)")
    p.add_argument("--capacity-cpus", type=int, help="CPUs all kernels' flavors may add up to (MSB_CAPACITY_CPUS)")
    p.add_argument("--cull-interval", type=int, help="seconds between idle checks (MSB_CULL_INTERVAL_SECONDS, default 60)")
    p.add_argument(
        "--keep-kernels",
        action="store_true",
        default=None,
        help="at a clean stop, leave the kernels running for the next serve on this runtime dir (MSB_KEEP_KERNELS)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARN", "ERROR", "CRITICAL"])
    p.set_defaults(func=cmd_serve)
    return p


def _config_from_args(args: argparse.Namespace):
    """Flags become MsbSettings config, checked there like the MSB_* variables they stand for."""
    from traitlets.config import Config

    config = Config()
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                config.MsbSettings.token = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not config.MsbSettings.token:
            raise ConfigError(f"--token-file {args.token_file} is empty; put the token in it")
    for name, trait in (
        ("host", "host"),
        ("port", "port"),
        ("capacity_memory_mib", "capacity_memory_mib"),
        ("capacity_cpus", "capacity_cpus"),
        ("cull_interval", "cull_interval_seconds"),
        ("keep_kernels", "keep_kernels"),
    ):
        if getattr(args, name) is not None:
            config.MsbSettings[trait] = getattr(args, name)
    config.MsbGatewayApp.log_level = args.log_level
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from msb_kernels.gateway.app import MsbGatewayApp
    from msb_kernels.settings.config import load_settings

    config = _config_from_args(args)
    load_settings(config)  # a bad MSB_* value or flag stops here, before anything starts
    os.environ.pop("JUPYTER_GATEWAY_URL", None)  # this server runs kernels; it does not forward to another gateway
    app = MsbGatewayApp(config=config)
    app.initialize([])
    app.start()
    # Stopped: every kernel is shut down (or kept, for adoption) and the log flushed. What is left is the
    # interpreter's own teardown, whose cycle collections over the gateway's heap took 2.9 to 4.0 s under JupyterHub
    # (py-spy: gc_collect_main), which the Hub waits out before it stops anyone's server. Frozen objects are never
    # collected, so the process exits at once; atexit handlers still run.
    gc.freeze()
    return 0
