"""Settings of the MCP bridge itself (waits, caps), read from ``MSB_MCP_*`` variables.

The sandbox settings (flavors, session limits, shared volume) stay in
:mod:`msb_kernels.config`; these only shape how tool calls behave.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from msb_kernels.errors import ConfigError


@dataclass(frozen=True)
class BridgeOptions:
    # A call returns status "running" (with an execution id) after this many seconds.
    running_after_seconds: float = 50.0
    # Timeout of an execution that names none; past it the kernel is interrupted.
    default_timeout_seconds: float = 300.0
    # The largest timeout a caller may ask for.
    max_timeout_seconds: float = 86400.0
    # Characters of stdout+stderr kept per execution; past it output is truncated with a note.
    max_output_chars: int = 200_000
    # Largest code (or command line) accepted, in characters.
    max_code_chars: int = 1_000_000
    # Progress notifications go out at least this often while code runs (seconds, at most 10).
    progress_interval_seconds: float = 5.0
    # Finished executions kept per session for get_execution_output.
    kept_executions: int = 16
    # Seconds to wait for a kernel to start.
    kernel_start_timeout_seconds: float = 60.0

    @classmethod
    def from_env(cls, **overrides) -> BridgeOptions:
        values = {}
        for field in fields(cls):
            variable = "MSB_MCP_" + field.name.upper()
            raw = os.environ.get(variable)
            if raw is None or raw.strip() == "":
                continue
            kind = int if field.type in ("int", int) else float
            try:
                value = kind(raw.strip())
            except ValueError:
                raise ConfigError(f"{variable}={raw!r} is not a number; use a positive {'whole ' if kind is int else ''}number") from None
            if value <= 0:
                raise ConfigError(f"{variable}={raw!r} must be greater than 0")
            values[field.name] = value
        values.update(overrides)
        options = cls(**values)
        if options.progress_interval_seconds > 10:
            raise ConfigError("MSB_MCP_PROGRESS_INTERVAL_SECONDS must be at most 10 (clients expect a sign of life every 10 s)")
        return options
