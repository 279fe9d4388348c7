"""Memory figures: an idle gateway session's sandbox and its keeper's share, and the host memory and PSS/USS of many
live sessions (with the fork servers' PSS beside them)."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

from bench.environment import available_mib
from bench.kernels import descendants, kernel_memory, pss_bytes, uss_bytes

MSB = "msb-python-small"
MiB = 1024 * 1024


def fork_servers() -> list[dict]:
    """The fork servers of this process's backend for the run's runtime dir."""
    from msb_kernels.backends import get_backend
    from msb_kernels.settings.config import load_settings

    return get_backend(load_settings()).stats().get("fork_servers", [])


async def gateway_session_pss(gateway: Any, runtime_dir: Path, kernel_id: str, more: int = 9) -> dict:
    """PSS and USS of an idle gateway session's sandbox, and what it costs the keeper that holds it for adoption. The
    gateway holds one session here, so the fork server's shared pages weigh on its PSS as they would not with many.
    The keeper is one process for all of a gateway's sessions: a session's share of it is what one more session adds
    to its USS, measured from 1 to 1 + more sessions."""
    import json

    await asyncio.sleep(2)  # idle
    state = json.loads((runtime_dir / kernel_id / "state.json").read_text())
    pids = descendants(state["init_pid"])
    keeper = state.get("keeper_pid")
    figures = {
        "sandbox_mib": sum(pss_bytes(pid) for pid in pids) / MiB,
        "sandbox_uss_mib": sum(uss_bytes(pid) for pid in pids) / MiB,
        "forked": bool(state.get("forked")),
        "keeper_uss_mib": 0.0,
        "keeper_per_session_mib": 0.0,
    }
    if keeper is None:
        return figures
    alone = uss_bytes(keeper) / MiB
    extra = [(await gateway.request("POST", "/api/kernels", {"name": MSB}))["id"] for _ in range(more)]
    try:
        await asyncio.sleep(2)
        keepers = {json.loads((runtime_dir / kid / "state.json").read_text()).get("keeper_pid") for kid in extra}
        held = uss_bytes(keeper) / MiB
    finally:
        for kid in extra:
            await gateway.request("DELETE", f"/api/kernels/{kid}")
    figures.update(
        keeper_uss_mib=alone,
        keeper_pss_mib=pss_bytes(keeper) / MiB,
        keeper_shared=keepers == {keeper},
        keeper_sessions=1 + more,
        keeper_uss_held_mib=held,
        keeper_per_session_mib=max(0.0, held - alone) / more,
    )
    return figures


def memory_at_scale(managers: list[Any], available_before_mib: float, sample: int = 20) -> dict:
    """With every session live: the host memory they took, per session, and the PSS and USS of a sample of them."""
    per_session = [(m["pss"] / MiB, m["uss"] / MiB) for m in map(kernel_memory, managers[:sample])]
    return {
        "sessions": len(managers),
        "sampled": len(per_session),
        "pss_mib_median": statistics.median(p for p, _ in per_session) if per_session else 0.0,
        "uss_mib_median": statistics.median(u for _, u in per_session) if per_session else 0.0,
        "host_mib_per_session": (available_before_mib - available_mib()) / max(1, len(managers)),
        "fork_servers_pss_mib": sum(pss_bytes(server["pid"]) for server in fork_servers()) / MiB,
    }
