"""The sandboxes this process runs, and which of them count as sessions.

The provisioner fills it as it starts and stops sandboxes; the warm pool marks the kernels that wait
for a session; the session limit (MSB_MAX_SESSIONS) and the gateway read it.
"""

from __future__ import annotations

from collections.abc import Callable

from msb_kernels.backends.core.base import Sandbox
from msb_kernels.errors import ResourceLimitExceeded

# Sandboxes this process runs, by kernel id (sessions and waiting pooled kernels).
live_sandboxes: dict[str, Sandbox] = {}
# Kernels waiting in a warm pool (msb_kernels.pool): no one's session yet, so not counted unless configured.
pooled_kernel_ids: set[str] = set()
# The kernels MSB_MAX_SESSIONS counts: claimed by claim_session before a start or a handout from the
# pool, released when the kernel stops for good.
session_kernel_ids: set[str] = set()
# Kernels of the start probe (msb_kernels.probe): a check of a backend, never a session.
probe_kernel_ids: set[str] = set()
# Kernels the gateway is adopting from the one before it, with their adoption records: their provisioner
# takes over the running sandbox instead of creating one.
adoptions: dict[str, dict] = {}
# Called with a kernel id when its kernel is reached at a new address (a cluster backend's kernel restarted as a new
# task): the gateway moves its activity watch and its WebSockets' channels to it.
kernel_moved_listeners: list[Callable[[str], None]] = []
# Called with a kernel id when the gateway's kernel manager has removed it for good (a shutdown, a cull, a death it
# does not restart): what others keep per kernel (the MCP bridge's sessions and executions) goes with it.
kernel_removed_listeners: list[Callable[[str], None]] = []


def check_session_limit(active: int, max_sessions: int, suggestions: list[str] | None = None) -> None:
    """Raise ResourceLimitExceeded when ``active`` sessions leave no room for one more: the one MSB_MAX_SESSIONS rule."""
    if active >= max_sessions:
        raise ResourceLimitExceeded(
            f"session limit reached: {active} of MSB_MAX_SESSIONS={max_sessions} sandboxed kernels run", suggestions
        )


def claim_session(kernel_id: str, max_sessions: int) -> None:
    """Count ``kernel_id`` as a session, or raise ResourceLimitExceeded.

    The check and the claim happen with no await between them, so concurrent starts cannot
    all pass the check before any of them counts.
    """
    if kernel_id not in session_kernel_ids:
        check_session_limit(len(session_kernel_ids), max_sessions)
        session_kernel_ids.add(kernel_id)
