"""Sandbox processes on the host: the OOM killer's first choice, before the gateway and the host's services."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ
from tests.conftest import host_pids
from tests.kernel_helpers import execute
from tests.skips import needs_runsc

PROTECT = """
try:
    with open('/proc/self/oom_score_adj', 'w') as score:
        score.write('-1000')
except OSError as e:
    print(type(e).__name__)
"""


def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


@pytest.mark.parametrize("backend", ["namespace", pytest.param("gvisor", marks=needs_runsc)])
async def test_every_sandbox_process_is_the_oom_killers_first_choice_and_cannot_make_itself_immune(
    backend, start_kernel, monkeypatch
) -> None:
    monkeypatch.setenv("MSB_BACKEND", backend)
    ours = oom_score_adj(os.getpid())
    km, kc = await start_kernel()
    pids = host_pids(km)
    assert len(pids) >= 2, "the sandbox's init and its kernel (gVisor: its sentry and gofer) are host processes"
    assert {pid: oom_score_adj(pid) for pid in pids} == dict.fromkeys(pids, SANDBOX_OOM_SCORE_ADJ)
    assert oom_score_adj(os.getpid()) == ours, "the host side kept its own score"

    # Immune to the OOM killer (-1000), a kernel would have it end the gateway or the host's services instead.
    protect = await execute(kc, PROTECT)
    if backend == "namespace":
        assert protect.stdout.strip() == "PermissionError", protect.stdout
    scores = {pid: oom_score_adj(pid) for pid in host_pids(km)}
    assert min(scores.values()) >= 0, scores
