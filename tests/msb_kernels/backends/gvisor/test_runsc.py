"""Which runsc runs gVisor kernels: this environment's own (Debian 13's, installed by the README's commands) before the
host's, and a runsc that cannot run `ls` is refused by the start probe, with the fix named."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from msb_kernels.backends.gvisor import runsc
from tests.conftest import REPO, VENV_BIN
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, needs_runsc]

HOST_RUNSC = "/usr/bin/runsc"  # the distribution's, which ./scripts/test installs with apt as the host's own


def doctor(tmp_path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MSB_BACKEND": "auto", "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    return subprocess.run([str(VENV_BIN / "msb-kernels"), "doctor"], capture_output=True, text=True, timeout=300, env=env)


def version_of(path: str) -> runsc.Runsc:
    said = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    return runsc.Runsc(path, said.splitlines()[0], "test")


def test_the_environments_own_runsc_is_used_and_runs_ls_in_its_kernels(tmp_path):
    assert os.access(runsc.OWN_RUNSC, os.X_OK), f"./scripts/test (as root) installs {runsc.OWN_RUNSC}; run it again"
    own = version_of(str(runsc.OWN_RUNSC))
    assert own.release is not None and own.release >= runsc.FIRST_GOOD_RELEASE, own
    lines = doctor(tmp_path).stdout.splitlines()
    gvisor = next(i for i, line in enumerate(lines) if line.startswith("backend gvisor: "))
    assert lines[gvisor].startswith(f"backend gvisor: ok - gVisor (runsc version 0.0~{own.release}"), lines[gvisor]
    assert f"at {runsc.OWN_RUNSC}, this environment's own" in lines[gvisor], lines[gvisor]
    assert "started, ran ls and stat, and answered 1+1" in lines[gvisor + 1], lines[gvisor + 1]
    # and the platform it chose, with what it measured (a fresh cache: measured by this doctor's own probe)
    assert any(line.startswith(f"gvisor: runsc version 0.0~{own.release}") for line in lines), lines
    chosen = next(line for line in lines if line.startswith("gvisor: platform "))
    assert "(measured on this host: `import ipykernel.kernelapp` took " in chosen and "ptrace " in chosen, chosen


@pytest.mark.skipif(not os.access(HOST_RUNSC, os.X_OK), reason=f"no host runsc at {HOST_RUNSC} to hold to the probe")
def test_the_hosts_runsc_is_picked_by_auto_only_if_ls_and_stat_run_in_its_kernels(tmp_path):
    """Debian 12's runsc fails coreutils' statx; a host whose runsc is newer passes. Either way the probe, not the
    version, decides, and a failure names the runsc and the fix."""
    host = version_of(HOST_RUNSC)
    result = doctor(tmp_path, MSB_RUNSC=HOST_RUNSC)
    lines = result.stdout.splitlines()
    gvisor = next(i for i, line in enumerate(lines) if line.startswith("backend gvisor: "))
    picked = next(line for line in lines if line.startswith("-> picked "))
    if host.known_old:
        assert lines[gvisor].startswith("backend gvisor: failed - "), lines[gvisor]
        start = lines[gvisor + 1]
        assert "`ls -la /` exited 2: ls: cannot access '/': Invalid argument" in start, start
        assert f"this is {host.version} at {HOST_RUNSC}, MSB_RUNSC, older than {runsc.FIRST_GOOD_RELEASE}" in start, start
        assert "run ./scripts/run as root, which installs Debian 13's runsc" in start, start
        assert picked.startswith("-> picked namespace: "), picked
    else:
        assert lines[gvisor].startswith("backend gvisor: ok - "), lines[gvisor]
        assert picked.startswith("-> picked gvisor: "), picked


def test_the_installer_keeps_a_good_runsc_and_refuses_an_older_suites(tmp_path):
    own = runsc.OWN_RUNSC
    before = own.stat()
    started = time.monotonic()
    again = subprocess.run(["bash", str(REPO / "scripts" / "install-runsc"), str(own.parent)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == again.stderr == "", again
    assert time.monotonic() - started < 5 and own.stat().st_mtime_ns == before.st_mtime_ns  # kept, not fetched again
    older = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-runsc"), str(tmp_path / "gvisor")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MSB_RUNSC_SUITE": "bookworm"},
    )
    assert older.returncode == 1, older
    assert "bookworm has runsc release '20221219', older than 20240729: not installed" in older.stderr, older.stderr
    assert not (tmp_path / "gvisor" / "runsc").exists()
