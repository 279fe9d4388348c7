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


def test_a_zombie_is_dead_but_a_process_whose_main_thread_exited_lives() -> None:
    """A killed owner its parent has not reaped shows Z and is dead (its keeper must not wait on it). A process whose
    main thread called pthread_exit while another thread runs shows Z too, yet lives: a sweep took its live kernel
    for a dead owner's (issue 58's hostile run)."""
    import signal
    import subprocess
    import sys
    import time

    from msb_kernels.backends.core.processes import process_alive, process_start_time

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]

    killed = subprocess.Popen(["sleep", "60"])
    threaded = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ctypes, threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\nctypes.CDLL(None).pthread_exit(None)",
        ]
    )
    try:
        started = {process.pid: process_start_time(process.pid) for process in (killed, threaded)}
        killed.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (state(killed.pid), state(threaded.pid)) != ("Z", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (state(killed.pid), state(threaded.pid)) == ("Z", "Z")
        assert not process_alive(killed.pid, started[killed.pid])
        assert process_alive(threaded.pid, started[threaded.pid])
    finally:
        for process in (killed, threaded):
            process.kill()
            process.wait()
