"""``msb-kernels serve``: its arguments and handler. Light to import: jupyter_server loads only when it runs."""

from __future__ import annotations

import argparse
import os
from typing import Any

from msb_kernels.errors import ConfigError

DEFAULT_PORT = 8765


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``msb-kernels serve`` to the CLI's subparsers."""
    p = sub.add_parser("serve", help="serve sandboxed kernels to JupyterLab (--gateway-url) and MCP clients",
                       description="Start the kernel gateway: Jupyter kernel, kernelspec and session APIs, "
                                   "/api/msb/stats, and the MCP bridge at /mcp. Settings also come from MSB_* variables.")
    p.add_argument("--host", help="address to listen on (MSB_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help=f"TCP port (MSB_PORT, default {DEFAULT_PORT})")
    p.add_argument("--token-file", help="read the token from this file (else MSB_TOKEN, else one is generated)")
    p.add_argument("--capacity-memory-mib", type=int, help="memory all kernels' flavors may add up to (MSB_CAPACITY_MEMORY_MIB)")
    p.add_argument("--capacity-cpus", type=int, help="CPUs all kernels' flavors may add up to (MSB_CAPACITY_CPUS)")
    p.add_argument("--cull-interval", type=int, help="seconds between idle checks (MSB_CULL_INTERVAL_SECONDS, default 60)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARN", "ERROR", "CRITICAL"])
    p.set_defaults(func=cmd_serve)
    return p


def _config_from_args(args: argparse.Namespace):
    from traitlets.config import Config

    config = Config()
    if args.host:
        config.MsbGatewayApp.ip = args.host
    if args.port is not None:
        if not 1 <= args.port <= 65535:
            raise ConfigError(f"--port {args.port} is out of range; use a TCP port from 1 to 65535")
        config.MsbGatewayApp.port = args.port
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty; put the token in it")
        config.IdentityProvider.token = token
    for trait in ("capacity_memory_mib", "capacity_cpus", "cull_interval"):  # MsbKernelManager traits of the same name
        value = getattr(args, trait)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{trait.replace('_', '-')} {value} is less than 1; use a whole number >= 1")
            config.MsbKernelManager[trait] = value
    config.MsbGatewayApp.log_level = args.log_level
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from msb_kernels.config import load_settings
    from msb_kernels.gateway.app import MsbGatewayApp, default_host, default_port

    load_settings()  # MSB_* errors before anything starts
    default_port(), default_host()
    os.environ.pop("JUPYTER_GATEWAY_URL", None)  # this server runs kernels; it does not forward to another gateway
    app = MsbGatewayApp(config=_config_from_args(args))
    app.initialize([])
    app.start()
    return 0
