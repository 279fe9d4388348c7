"""What cgroups.py tells an operator about this host's cgroups (the limits themselves are tested per backend)."""

from __future__ import annotations

import subprocess

import pytest

from msb_kernels.backends.core import cgroups
from tests.conftest import VENV_BIN


def doctor() -> str:
    run = subprocess.run([str(VENV_BIN / "msb-kernels"), "doctor"], capture_output=True, text=True, timeout=120)
    return run.stdout


def test_doctor_says_when_rcu_grace_periods_slow_every_start():
    hierarchy, _ = cgroups.detect()
    if hierarchy is None or not cgroups.RCU_EXPEDITED.exists():
        pytest.skip("no cgroups for msb-kernels here, or no /sys/kernel/rcu_expedited: doctor has nothing to say of it")
    said = "start time: each kernel start waits out an RCU grace period" in doctor()
    assert said == (cgroups.RCU_EXPEDITED.read_text().strip() == "0")


@pytest.mark.parametrize(("setting", "noted"), [("0\n", True), ("1\n", False), (None, False)])
def test_the_start_time_note_follows_the_hosts_rcu_setting(tmp_path, monkeypatch, setting, noted):
    path = tmp_path / "rcu_expedited"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(cgroups, "RCU_EXPEDITED", path)
    hierarchy = cgroups.CgroupHierarchy(1, {"memory": tmp_path, "cpu": tmp_path, "pids": tmp_path})
    note = cgroups.start_speed_note(hierarchy)
    assert (note is not None) == noted
    if noted:
        assert "echo 1 > /sys/kernel/rcu_expedited" in note and "rcupdate.rcu_expedited=1" in note
    assert cgroups.start_speed_note(None) is None  # no cgroups joined, no grace period to wait for
