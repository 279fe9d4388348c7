"""/api/msb/stats: sessions, ports, memory and CPUs allocated, per flavor and utilization, each kernel, the pool, the
fork servers and keepers, recently stopped kernels, and the gateway's own footprint."""

from __future__ import annotations

from collections import Counter
from typing import Any

from jupyter_server.utils import ensure_async

from msb_kernels.gateway.host import gateway_process_stats, host_cpus
from msb_kernels.gateway.kernels.records import last_activity_of
from msb_kernels.identity.people import acting, may_see
from msb_kernels.jupyter.compat import connection_counts_of, kernels_of
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.observability.status import iso_utc, session_status
from msb_kernels.provisioning.provisioner import describe_kernel


class StatsMixin:
    """MsbKernelManager's stats."""

    def kernel_status(self, kernel_id: str) -> str:
        if kernel_id not in kernels_of(self):
            return "creating"
        return session_status(getattr(kernels_of(self)[kernel_id], "execution_state", "starting"))

    async def notebook_paths(self, session_manager: Any = None) -> dict[str, str]:
        """Each kernel's notebook, for stats and MCP's get_sessions alike.

        jupyter_server's session model decides: a session on this server names its kernel's
        notebook and follows renames (PATCH /api/sessions/{id}). A kernel with no session here
        has the JPY_SESSION_NAME its start request carried: JupyterLab with --gateway-url keeps
        its sessions in its own server and sends only that, once, at the start.
        """
        paths = {kernel_id: r.notebook_path for kernel_id, r in list(self.records.items()) if r.notebook_path}
        if session_manager is not None:
            for session in await ensure_async(session_manager.list_sessions()):
                kernel = session.get("kernel") or {}
                if kernel.get("id") and session.get("path"):
                    paths[kernel["id"]] = session["path"]
        return paths

    async def stats(self, session_manager: Any = None) -> dict:
        """Resource stats (sessions, ports, memory and CPUs allocated, per flavor, utilization), plus one entry per kernel."""
        paths = await self.notebook_paths(session_manager)
        memory, cpus = self.allocated()
        active = len(self.records)
        backend, backend_info = backend_stats(self.msb_settings)
        ports = port_stats(backend, backend_info)
        kernels = []
        person = acting()
        for kernel_id, record in list(self.records.items()):
            if not may_see(person, record.owner):
                continue  # another person's: not even its id (the totals above count it, naming nobody)
            km = kernels_of(self).get(kernel_id)
            sandbox = described.sandbox if (described := describe_kernel(km)) else None
            info = sandbox.info() if sandbox is not None else {}
            keeper = getattr(sandbox, "keeper", None)
            last = last_activity_of(km)
            memory_bytes = None
            if sandbox is not None and hasattr(sandbox, "memory_bytes"):
                try:
                    memory_bytes = sandbox.memory_bytes()
                except OSError:
                    memory_bytes = None
            kernels.append(
                {
                    "id": kernel_id,
                    "owner": record.owner.name if record.owner is not None else None,
                    "kernel_name": record.kernel_name,
                    "flavor": record.flavor.name,
                    "template": record.template,
                    "environment": described.environment if described is not None else None,
                    "backend": info.get("backend"),
                    "created": iso_utc(record.created),
                    "last_activity": iso_utc(last.timestamp()) if last is not None else None,
                    "status": self.kernel_status(kernel_id),
                    "execution_state": getattr(km, "execution_state", "starting") if km is not None else "starting",
                    "connections": connection_counts_of(self).get(kernel_id, 0),
                    "notebook_path": paths.get(kernel_id),
                    "cull_idle_timeout": self.effective_cull_timeout(kernel_id) if km is not None else None,
                    "memory_bytes": memory_bytes,
                    "keeper_pid": keeper.keeper_pid if keeper is not None else None,
                    "network": described.network if described is not None else None,
                    "egress": described.egress if described is not None else None,
                }
            )

        def percent(used: float, total: float) -> float:
            return round(100.0 * used / total, 1) if total else 0.0

        return {
            "active_sessions": active,
            "max_sessions": self.msb_settings.max_sessions,
            "allocated_ports": ports["allocated"],
            "available_ports": ports["available"],
            "ports": ports,
            "total_memory_mb": memory,
            "total_cpus": cpus,
            "capacity": {"memory_mb": self.capacity_memory_mib, "cpus": self.capacity_cpus},
            "available": {
                "memory_mb": max(0, self.capacity_memory_mib - memory),
                "cpus": None if self.capacity_cpus is None else max(0, self.capacity_cpus - cpus),
            },
            "flavor_counts": {name: sum(1 for r in list(self.records.values()) if r.flavor.name == name) for name in FLAVORS},
            "utilization": {
                "sessions": percent(active, self.msb_settings.max_sessions),
                "ports": percent(ports["allocated"], ports["allocated"] + ports["available"]),
                "memory": percent(memory, self.capacity_memory_mib),
                "cpus": percent(cpus, self.capacity_cpus or host_cpus()),  # unlimited: the share of the host's CPUs
            },
            "culling": {
                "idle_timeout": self.cull_idle_timeout,
                "interval": self.cull_interval,
                "connected": self.cull_connected,
                "busy": self.cull_busy,
            },
            "pool": self.pool.stats(),
            "hibernation": {**self.hibernation_stats(person), "images_bytes": backend_info.get("hibernation_images_bytes")},
            # Not sessions: the namespace backend's fork servers, one per Python environment (forkservers.py).
            "fork_servers": backend_info.get("fork_servers", []),
            # Not sessions either: the process that holds this runtime dir's kernels for adoption (keeper_program.py). A kill
            # of it ends every kernel it holds.
            "keepers": [
                {"pid": pid, "kernels": count}
                for pid, count in sorted(Counter(k["keeper_pid"] for k in kernels if k["keeper_pid"] is not None).items())
            ],
            "kernels": kernels,
            "recently_stopped": [
                {**stop, "owner": stop["owner"].name if stop.get("owner") else None}
                for stop in self.stopped
                if may_see(person, stop.get("owner"))
            ],
            "gateway": gateway_process_stats(),
        }


def backend_stats(settings: Any) -> tuple[Any, dict]:
    """The backend and what it says of itself; (None, {"note": why}) when there is none to ask."""
    try:
        from msb_kernels.backends import get_backend

        backend = get_backend(settings)
        return backend, backend.stats()
    except Exception as exc:  # stats must answer even when the backend cannot
        return None, {"note": f"no backend: {exc}"}


def port_stats(backend: Any, stats: dict) -> dict:
    """Host ports from the backend's stats: 5 per kernel over tcp (microVMs, MSB_TRANSPORT=tcp); none over ipc."""
    if backend is None:
        return {"allocated": 0, "available": 0, "note": stats["note"]}
    ports = dict(stats.get("ports") or {})
    if {"allocated", "available"} <= set(ports):
        return {**ports, "backend": backend.name}
    return {
        "allocated": 0,
        "available": 0,
        "backend": backend.name,
        "note": f"the {backend.name} backend talks to kernels over ZMQ ipc sockets, so it holds no TCP ports",
    }
