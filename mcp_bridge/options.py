"""How tool calls behave (waits, caps): the ``mcp_*`` settings of msb_kernels.settings.config, as one value.

The settings themselves (``MSB_MCP_*`` variables, ``c.MsbSettings.mcp_*``), their defaults
and their checks are defined once, in :class:`msb_kernels.settings.config.MsbSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from msb_kernels.settings.config import MsbSettings, load_settings


@dataclass(frozen=True)
class BridgeOptions:
    running_after_seconds: float  # a call returns status "running" (with an execution id) after this long
    default_timeout_seconds: float  # timeout of an execution that names none; then the kernel is interrupted
    max_timeout_seconds: float  # the largest timeout a caller may ask for
    max_output_chars: int  # output kept per execution; past it, truncated with a note
    max_code_chars: int  # largest code (or command line) accepted
    progress_interval_seconds: float  # progress notifications at least this often while code runs
    kept_executions: int  # finished executions kept per session for get_execution_output
    kernel_start_timeout_seconds: float  # seconds to wait for a kernel to start

    @classmethod
    def from_settings(cls, settings: MsbSettings | None = None, **overrides) -> BridgeOptions:
        settings = settings or load_settings()
        values = {field.name: getattr(settings, "mcp_" + field.name) for field in fields(cls)}
        return cls(**{**values, **overrides})
