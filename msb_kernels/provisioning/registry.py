"""The sandboxes a kernel manager runs, and which of them count as sessions: one SandboxRegistry per manager.

The gateway's kernel manager (gateway/kernels/manager.py) owns one (its ``sandbox_registry``) and hands it down: its
provisioners reach it through their kernel manager's parent (``registry_of``), its pool and the MCP bridge's sessions
through the manager. Whatever runs with no such manager (nbclient, papermill, jupyter console, msb-mcp on its own,
the start probe) shares the process's ``default()`` one.

Who fills what: the provisioner adds and removes live sandboxes and claims and releases sessions as it starts and stops
sandboxes (the gateway's kernel manager claims a start's session first, as it reserves the kernel's id); the warm pool
marks the kernels that wait for a session; the start probe marks its own kernels; the gateway's adoption names the
kernels it is adopting, with their records, for their provisioners to take over. The session limit (MSB_MAX_SESSIONS)
reads it, and nothing else counts sessions: ``sessions_counted`` is the one count.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from msb_kernels.provisioning.limits import check_session_limit


class SandboxRegistry:
    """One kernel manager's sandboxes and the kernels it counts, and who hears of kernels that move or go."""

    def __init__(self) -> None:
        # Sandboxes it runs, by kernel id (sessions and waiting pooled kernels): each a backends.core.base.Sandbox.
        self.live_sandboxes: dict[str, Any] = {}
        # Kernels waiting in a warm pool (msb_kernels.provisioning.pool): no one's session yet, so not counted unless configured.
        self.pooled_kernel_ids: set[str] = set()
        self.pool_counts_as_sessions = False  # MSB_POOL_COUNTS_AS_SESSIONS: the gateway's manager sets it
        # The kernels MSB_MAX_SESSIONS counts: claimed by claim_session before a start or a handout from the
        # pool, released when the kernel stops for good.
        self.session_kernel_ids: set[str] = set()
        # Kernels of the start probe (msb_kernels.provisioning.probe): a check of a backend, never a session.
        self.probe_kernel_ids: set[str] = set()
        # Kernels the gateway is adopting from the one before it, with their adoption records: their provisioner
        # takes over the running sandbox instead of creating one.
        self.adoptions: dict[str, dict] = {}
        # Called with a kernel id when its kernel is reached at a new address (a cluster backend's kernel restarted as a
        # new task): the gateway moves its activity watch and its WebSockets' channels to it.
        self.kernel_moved_listeners: list[Callable[[str], None]] = []
        # Called with a kernel id when the gateway's kernel manager has removed it for good (a shutdown, a cull, a death
        # it does not restart): what others keep per kernel (the MCP bridge's sessions and executions) goes with it.
        self.kernel_removed_listeners: list[Callable[[str], None]] = []
        _registries.add(self)

    def sessions_counted(self) -> int:
        """The one count MSB_MAX_SESSIONS holds: sessions, and waiting pooled kernels where they count as sessions."""
        return len(self.session_kernel_ids) + (len(self.pooled_kernel_ids) if self.pool_counts_as_sessions else 0)

    def claim_session(self, kernel_id: str, max_sessions: int, suggestions: list[str] | None = None) -> None:
        """Count ``kernel_id`` as a session, or raise ResourceLimitExceeded. A pooled kernel that counted already moves
        from the pool's count to the sessions' without a check.

        The check and the claim happen with no await between them, so concurrent starts cannot
        all pass the check before any of them counts.
        """
        if kernel_id in self.session_kernel_ids:
            return
        if not (self.pool_counts_as_sessions and kernel_id in self.pooled_kernel_ids):
            check_session_limit(self.sessions_counted(), max_sessions, suggestions)
        self.session_kernel_ids.add(kernel_id)

    def count_session(self, kernel_id: str) -> None:
        """Count a kernel that runs already (an adopted one), whatever the limit says now."""
        self.session_kernel_ids.add(kernel_id)

    def release_session(self, kernel_id: str) -> None:
        """The kernel stopped for good, or its start failed: it no longer counts."""
        self.session_kernel_ids.discard(kernel_id)


_registries: weakref.WeakSet[SandboxRegistry] = weakref.WeakSet()
_default: SandboxRegistry | None = None


def default() -> SandboxRegistry:
    """The process's registry, for kernels started with no manager that owns one."""
    global _default
    if _default is None:
        _default = SandboxRegistry()
    return _default


def registry_of(manager: Any) -> SandboxRegistry:
    """The registry a (multi-)kernel manager owns (its ``sandbox_registry``), else the process's default()."""
    owned = getattr(manager, "sandbox_registry", None)
    return owned if isinstance(owned, SandboxRegistry) else default()


def runs_in_this_process(kernel_id: str) -> bool:
    """Whether any registry of this process holds a live sandbox for ``kernel_id``: a backend's sweep (one backend
    object serves every manager of the process) must not remove it."""
    return any(kernel_id in registry.live_sandboxes for registry in list(_registries))


def live_in_this_process() -> set[str]:
    """The kernel ids of every live sandbox this process runs: a sweep reads no state of theirs (1,000 of them took
    235 ms of a start's sweep)."""
    return {kernel_id for registry in list(_registries) for kernel_id in list(registry.live_sandboxes)}
