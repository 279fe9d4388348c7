"""The one place an MsbError becomes an HTTP answer: its status, and a JSON body with its message, type,
suggestions and the limit it names. Used by the handlers only; everything below them raises MsbError."""

from __future__ import annotations

from typing import Any

from tornado import web

from msb_kernels.errors import (
    BackendUnavailable,
    ConfigError,
    InvalidRequest,
    MsbError,
    NoSuchKernelspec,
    ResourceLimitExceeded,
    SandboxError,
    SessionNotFound,
    message_with_advice,
)

# HTTP status for each error class. A start past a limit answers 429 (documented in the README).
STATUS_FOR = {
    ResourceLimitExceeded: 429,
    NoSuchKernelspec: 404,
    InvalidRequest: 400,
    ConfigError: 400,
    SessionNotFound: 404,
    BackendUnavailable: 503,
    SandboxError: 500,
}


class MsbHTTPError(web.HTTPError):
    """An HTTP error whose JSON body carries the MsbError's message, type, suggestions and limit."""

    def __init__(self, error: MsbError):
        status = next((code for cls, code in STATUS_FOR.items() if isinstance(error, cls)), 500)
        super().__init__(status, "%s", error.message)
        self.error = error
        self.payload: dict[str, Any] = {
            **error.to_dict(),
            # "message" and "reason" are what jupyter_server's GatewayClient passes on: the advice goes in too.
            "message": message_with_advice(error.message, error.suggestions),
            "reason": error.error_type,
        }
        limit = getattr(error, "limit", None)
        if limit:
            self.payload["limit"] = limit


def msb_error_in(exc: BaseException | None) -> MsbError | None:
    """The MsbError an exception is or was raised from (jupyter_server may wrap what the kernel manager raised)."""
    while exc is not None:
        if isinstance(exc, MsbHTTPError):
            return exc.error
        if isinstance(exc, MsbError):
            return exc
        exc = exc.__cause__
    return None
