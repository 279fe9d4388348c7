"""The error classes, one definition for the whole project.

Each error carries a user-facing message and suggestions for what to do next, so
the CLI, the gateway and the MCP bridge can all report it without a traceback.
The type names are the ones MCP clients and the gateway's JSON errors carry.
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

    def report(self, program: str) -> str:
        """The error as a command prints it: the message, then what to try."""
        return "\n".join([f"{program}: error: {self.message}", *(f"  try: {s}" for s in self.suggestions)])


class ConfigError(MsbError):
    """A setting has a bad value; raised at start, before anything runs."""

    error_type = "InvalidRequest"


class InvalidRequest(MsbError):
    error_type = "InvalidRequest"


class NoSuchKernelspec(InvalidRequest):
    """A start named a kernelspec that does not exist, or does not run in a sandbox (the gateway answers 404)."""


class SessionNotFound(MsbError):
    error_type = "SessionNotFound"
    default_suggestions = ("omit session_id to get a new session", "list live sessions with get_sessions")


class ResourceLimitExceeded(MsbError):
    error_type = "ResourceLimitExceeded"
    default_suggestions = ("stop a session you no longer need", "pick a smaller flavor")

    def __init__(self, message: str, suggestions: list[str] | None = None, limit: str | None = None):
        super().__init__(message, suggestions)
        self.limit = limit  # which limit: max_sessions, capacity_memory, capacity_cpus


class SandboxError(MsbError):
    """The sandbox or the infrastructure under it failed (type SystemError)."""

    error_type = "SystemError"


class NobodyActing(MsbError):
    """Work that reached the kernel manager with nobody acting for it (no person, not the system): refused, since a
    path that forgets to say who it acts for must fail, not act as an admin. A defect, never a client's mistake."""

    error_type = "SystemError"


class HibernationRefused(MsbError):
    """A kernel was not hibernated and runs on as it was; the message says why (the gateway logs and counts it)."""

    error_type = "SystemError"


class BackendUnavailable(SandboxError):
    """The chosen backend cannot run on this host; the message says why."""


class CompilationError(MsbError):
    """The code did not compile (Python SyntaxError/IndentationError, JavaScript SyntaxError); nothing ran."""

    error_type = "CompilationError"
    default_suggestions = ("fix the syntax error at the line and column shown, then run the code again",)


class CodeRuntimeError(MsbError):
    """The code raised an exception while it ran, or a command exited with a nonzero status (type RuntimeError)."""

    error_type = "RuntimeError"
    default_suggestions = ("read the traceback in stderr, fix the code, and run it again; the session keeps its state",)


class ExecutionTimeout(MsbError):
    """An execution ran past its timeout; the kernel was interrupted, not restarted."""

    error_type = "ExecutionTimeout"
    default_suggestions = ("pass a larger timeout (seconds)", "split the work into smaller steps; variables defined before are kept")


def error_types() -> list[str]:
    """Every error type a user can see, for schemas that list them (subclasses defined anywhere count)."""
    found: set[str] = set()
    pending: list[type[MsbError]] = [MsbError]
    while pending:
        cls = pending.pop()
        found.add(cls.error_type)
        pending.extend(cls.__subclasses__())
    return sorted(found)


ERROR_CLASSES: dict[str, type[MsbError]] = {
    cls.error_type: cls
    for cls in (SandboxError, InvalidRequest, SessionNotFound, ResourceLimitExceeded, CompilationError, CodeRuntimeError, ExecutionTimeout)
}


def message_with_advice(message: str, suggestions: list[str]) -> str:
    """The message with its suggestions appended, for clients that show only one string."""
    return message + (f" (try: {'; '.join(suggestions)})" if suggestions else "")


def error_from_body(body: object) -> MsbError | None:
    """The error an msb gateway's HTTP error body describes (see MsbHTTPError), or None for any other body."""
    if not isinstance(body, dict) or body.get("type") not in ERROR_CLASSES or not isinstance(body.get("message"), str):
        return None
    suggestions = [str(s) for s in body.get("suggestions") or [] if isinstance(s, str)]
    message = body["message"]
    advice = message_with_advice("", suggestions)
    if advice and message.endswith(advice):
        message = message[: -len(advice)]
    return ERROR_CLASSES[body["type"]](message, suggestions)
