"""The ``msb-kernels`` commands an operator runs by hand: list, sweep and demo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN
from tests.kernel_helpers import OWNER_SCRIPT
from tests.parallel import ALONE

CLI = str(VENV_BIN / "msb-kernels")


@pytest.fixture
def own_runtime_dir():
    """A runtime dir of this test's alone (short: kernel sockets live there), so list shows only its sandboxes."""
    path = Path(tempfile.mkdtemp(prefix="msbc-", dir="/tmp"))
    yield {**os.environ, "MSB_RUNTIME_DIR": str(path)}
    shutil.rmtree(path, ignore_errors=True)


def msb(env: dict, *args: str) -> str:
    result = subprocess.run([CLI, *args], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return result.stdout


@pytest.mark.slow
@ALONE  # any other start on the host would sweep the dead sandbox this test waits to see listed
def test_list_tells_owned_from_dead_and_sweep_removes_only_what_no_one_owns(own_runtime_dir):
    env = own_runtime_dir
    assert msb(env, "list").strip() == "no sandboxes"
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, "hold"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        state_dir = Path(json.loads(owner.stdout.readline())["state_dir"])
        sandbox_id = state_dir.name
        (line,) = msb(env, "list").splitlines()
        assert line.split() == [sandbox_id, "namespace", "small", "running", "owned", "by", "pid", str(owner.pid)]
        assert msb(env, "sweep").strip() == "removed 0 orphaned sandbox(es)"  # its owner lives: hands off
        assert msb(env, "list").split()[3:5] == ["running", "owned"]
        # A crash of its keeper and its owner both (a dead owner alone: the keeper sweeps it at once): the sandbox
        # dies with its keeper's lifeline, and its files wait for a sweep.
        os.kill(json.loads((state_dir / "state.json").read_text())["keeper_pid"], signal.SIGKILL)
    finally:
        owner.kill()  # SIGKILL: the owner cleans nothing up
        owner.wait()
    deadline = time.monotonic() + 30
    while "dead" not in (listing := msb(env, "list")):
        assert time.monotonic() < deadline, listing
        time.sleep(0.2)
    assert listing.split()[0] == sandbox_id
    assert msb(env, "sweep").strip() == f"removed 1 orphaned sandbox(es): {sandbox_id}"
    assert msb(env, "list").strip() == "no sandboxes"


@pytest.mark.slow
def test_demo_runs_the_bundled_notebook_in_a_sandbox(own_runtime_dir):
    out = msb(own_runtime_dir, "demo")
    assert "running " in out and "in kernel msb-python-small" in out
    assert "state survives between cells: 42" in out and "[+ image/png]" in out
    assert "done in " in out


@pytest.mark.parametrize("command", [["doctor"], ["run", "notebooks/hello.ipynb"], ["install"]])
def test_cli_reports_a_bad_setting_without_a_traceback(command, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MSB_DEFAULT_FLAVOR": "tiny", "MSB_RUNTIME_DIR": str(tmp_path / "rt")}
    result = subprocess.run([sys.executable, "-m", "msb_kernels.cli", *command], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert (
        "msb-kernels: error: MSB_DEFAULT_FLAVOR (c.MsbSettings.default_flavor)='tiny' is not a flavor; use one of small, medium, large"
        in result.stderr
    )
