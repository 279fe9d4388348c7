"""How a kernel's state is reported: session status names and UTC times.

The gateway's ``/api/msb`` endpoints and the MCP bridge's get_sessions both report
kernels; both use these, so a client reads the same words and time format from either.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

# A Jupyter kernel's execution_state, as a session status.
SESSION_STATUS_OF_STATE = {
    "starting": "creating",
    "restarting": "creating",
    "autorestarting": "creating",
    "idle": "ready",
    "busy": "running",
    "dead": "error",
    "hibernated": "hibernated",  # checkpointed to disk (MSB_HIBERNATE_AFTER_SECONDS); the next request restores it
}


def session_status(execution_state: str | None) -> str:
    """The session status for a kernel's execution_state; a state not reported yet reads as ready."""
    return SESSION_STATUS_OF_STATE.get(execution_state or "", "ready")


def iso_utc(seconds: float | None) -> str | None:
    """An ISO 8601 UTC time ending in Z, as jupyter_server writes its own times."""
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def epoch_seconds(value: Any) -> float | None:
    """Seconds since the epoch from a number, a datetime or an ISO string (as kernel models give them); None if none."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None
