"""The error classes, one definition for the whole project.

Each error carries a user-facing message and suggestions for what to do next, so
the CLI, the gateway and the MCP bridge can all report it without a traceback.
The names follow the design's error classes.
"""

from __future__ import annotations


class MsbError(Exception):
    """Base class: a message a user can act on, plus suggestions."""

    error_type = "SystemError"
    default_suggestions: tuple[str, ...] = ()

    def __init__(self, message: str, suggestions: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.suggestions = list(suggestions) if suggestions is not None else list(self.default_suggestions)

    def to_dict(self) -> dict:
        return {"type": self.error_type, "message": self.message, "suggestions": self.suggestions}

    def __str__(self) -> str:
        return self.message


class ConfigError(MsbError):
    """A setting has a bad value; raised at start, before anything runs."""

    error_type = "InvalidRequest"


class InvalidRequest(MsbError):
    error_type = "InvalidRequest"


class SessionNotFound(MsbError):
    error_type = "SessionNotFound"
    default_suggestions = ("omit session_id to get a new session", "list live sessions with get_sessions")


class ResourceLimitExceeded(MsbError):
    error_type = "ResourceLimitExceeded"
    default_suggestions = ("stop a session you no longer need", "pick a smaller flavor")


class SandboxError(MsbError):
    """The sandbox or the infrastructure under it failed (the design's SystemError)."""

    error_type = "SystemError"


class BackendUnavailable(SandboxError):
    """The chosen backend cannot run on this host; the message says why."""
