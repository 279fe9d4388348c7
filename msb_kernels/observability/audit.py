"""The audit trail: one structured log line per start, execution, stop, MCP tool call and refusal.

Each line is ``audit {json}`` on the ``msb_kernels.observability.audit`` logger (the gateway's log, at INFO; an operator routes it by
that name), with the person, the kernel, the client and the outcome. Of the code itself only its length and SHA-256
are logged: code and commands carry data and secrets the log must not keep (the kernel has them; the log is read by
whoever operates the host), while the digest still ties a line to a notebook cell or an assistant's call that the
person can show.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from msb_kernels.identity.people import acting, acting_client

log = logging.getLogger("msb_kernels.observability.audit")


def code_fields(code: str | None) -> dict[str, Any]:
    if code is None:
        return {}
    return {"code_chars": len(code), "code_sha256": hashlib.sha256(code.encode(errors="replace")).hexdigest()}


def record(event: str, outcome: str, kernel: str | None = None, *, person: str | None = None, **details: Any) -> None:
    """Write one line. ``person`` defaults to the caller: ``system`` for the gateway's own work, ``nobody`` where no
    one acts (which the kernel manager refuses)."""
    if not log.isEnabledFor(logging.INFO):
        return
    caller = acting()
    line = {
        "ts": round(time.time(), 3),
        "event": event,
        "person": person if person is not None else (caller.name if caller is not None else "nobody"),
        "kernel": kernel,
        "client": acting_client(),
        "outcome": outcome,
        **{k: v for k, v in details.items() if v is not None},
    }
    log.info("audit %s", json.dumps(line, default=str, sort_keys=False))
