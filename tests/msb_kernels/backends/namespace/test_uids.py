"""Host uids for root's namespace sandboxes: never one a live claim or a host process holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.namespace import uids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a host uid per sandbox is how msb-kernels runs as root")
# Far above the uids the suite's own live sandboxes are handed (the lowest free from SANDBOX_UID_BASE + 1): CI once
# ran this beside a session's kernel running as SANDBOX_UID_BASE + 2, which this file's claims took for a taken uid.
BASE = uids.SANDBOX_UID_BASE + 900_000


@pytest.fixture
def claims(tmp_path, monkeypatch):
    """A claims directory and a uid range of this test's own, so the host's live sandboxes neither disturb it nor are disturbed."""
    assert not {uid for uid in uids._uids_running() if BASE <= uid < BASE + 10}, "a host process runs in the test's uid range"
    monkeypatch.setattr(uids, "HOST_UIDS_DIR", tmp_path / "uids")
    monkeypatch.setattr(uids, "SANDBOX_UID_BASE", BASE)
    uids.HOST_UIDS_DIR.mkdir(mode=0o700)
    return uids.HOST_UIDS_DIR


def hold(claims, uid: int, pid: int) -> None:
    start = process_start_time(pid) if pid else None
    (claims / str(uid)).write_text(json.dumps({"sandbox_id": f"held-{uid}", "pid": pid, "start": start}))


def test_a_claimed_uid_and_one_a_process_runs_as_are_skipped(claims) -> None:
    hold(claims, BASE + 1, os.getpid())
    runner = subprocess.Popen([sys.executable, "-c", f"import os, time; os.setgid({BASE}); os.setuid({BASE + 2}); time.sleep(60)"])
    try:
        for _ in range(100):  # until the child has dropped to that uid
            if os.stat(f"/proc/{runner.pid}").st_uid == BASE + 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert uids.claim("mine") == BASE + 3
        assert json.loads((claims / str(BASE + 3)).read_text())["sandbox_id"] == "mine"
    finally:
        runner.kill()
        runner.wait()


def test_a_dead_holders_claim_is_taken_back_once_no_uid_is_unclaimed(claims, monkeypatch) -> None:
    monkeypatch.setattr(uids, "MAX_SANDBOXES", 4)  # uids BASE+1 .. BASE+3
    dead = subprocess.Popen(["true"])
    dead.wait()
    hold(claims, BASE + 1, os.getpid())
    hold(claims, BASE + 2, dead.pid)
    hold(claims, BASE + 3, os.getpid())
    assert uids.claim("mine") == BASE + 2
    hold(claims, BASE + 2, os.getpid())
    with pytest.raises(uids.SandboxError, match="no free host uid"):
        uids.claim("one too many")
