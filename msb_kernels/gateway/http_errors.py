"""The one place an MsbError becomes an HTTP answer: its status, and a JSON body with its message, type,
suggestions and the limit it names (MsbErrorsMixin, which every handler of the gateway takes first). Everything below
the handlers raises MsbError."""

from __future__ import annotations

import json
from typing import Any

from tornado import web
from tornado.httputil import responses

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


class MsbErrorsMixin:
    """Where an error becomes its HTTP answer, for every handler the gateway serves: a JSON body, never a page (whose
    template prints the token) nor a traceback. An MsbError from below (the kernel manager, the provisioner) carries
    its type, suggestions and limit."""

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        error = msb_error_in(value)
        if error is None:
            super().log_exception(typ, value, tb)  # type: ignore[misc]
            return
        answer = MsbHTTPError(error)
        self.log.warning("%s %s: %d %s", self.request.method, self.request.uri, answer.status_code, error.message)  # type: ignore[attr-defined]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        error = msb_error_in(exc)
        if error is not None:
            answer = MsbHTTPError(error)
            self.set_status(answer.status_code)
            payload = answer.payload
        elif isinstance(exc, web.HTTPError):
            payload = {"message": (exc.log_message % exc.args if exc.args else exc.log_message) or exc.reason or responses.get(status_code)}
            payload["reason"] = exc.reason
        else:
            payload = {"message": responses.get(status_code, "Unknown HTTP Error") if exc is None else "Unhandled error", "reason": None}
        self.clear_header("Content-Disposition")  # type: ignore[attr-defined]
        self.set_header("Content-Type", "application/json")  # type: ignore[attr-defined]
        self.finish(json.dumps(payload))  # type: ignore[attr-defined]
