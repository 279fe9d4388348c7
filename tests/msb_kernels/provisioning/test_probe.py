"""The start probe: `doctor` says ok only after a real kernel answered, and auto passes over a backend that cannot start one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest

from msb_kernels.provisioning import probe
from tests.conftest import VENV_BIN
from tests.skips import needs_runsc

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def own_verdict_cache(tmp_path, monkeypatch):
    """Passes these probes keep (msb_kernels.provisioning.probe_verdicts) go to the test's own cache, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def doctor(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "msb-kernels"), "doctor"], capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_doctor_says_ok_only_after_a_kernel_started_and_answered():
    result = doctor(MSB_BACKEND="auto")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    namespace = lines.index(next(line for line in lines if line.startswith("backend namespace: ")))
    assert lines[namespace].startswith("backend namespace: ok - "), lines[namespace]
    assert lines[namespace + 1].startswith(
        f"  start: a kernel from {VENV_BIN / 'python'} started, ran ls and stat, and answered 1+1 in "
    ), lines[namespace + 1]


async def test_the_probe_runs_once_per_backend_and_interpreter_and_never_counts_as_a_session(monkeypatch):
    from msb_kernels.provisioning import registry

    monkeypatch.setenv("MSB_MAX_SESSIONS", "1")
    registry.default().session_kernel_ids.add("someone-elses-session")  # the limit is reached: a probe must not be refused for it
    try:
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        first = await probe.probe("namespace", argv)
        assert first.ok and first.seconds > 0, first
        assert await probe.probe("namespace", argv) is first  # kept for the process's life
    finally:
        registry.default().session_kernel_ids.discard("someone-elses-session")
        probe.forget()


@needs_runsc
def test_doctor_reports_a_backend_that_cannot_start_a_kernel_and_auto_skips_it(broken_runsc):
    result = doctor(**broken_runsc)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "backend gvisor: failed - gVisor (runsc version" in result.stdout, result.stdout
    assert "  start: a kernel from " in result.stdout and "could not start: " in result.stdout, result.stdout
    assert "  kernel stderr: " in result.stdout and "unknown platform: no-such-platform" in result.stdout, result.stdout
    assert "-> picked namespace: " in result.stdout and "gvisor: a kernel from" in result.stdout, result.stdout


@needs_runsc
def test_a_kernel_under_auto_starts_in_the_next_backend_when_the_first_cannot_start_one(broken_runsc, tmp_path):
    notebook = tmp_path / "which.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell("import json, os; print(json.dumps({'backend': os.environ['MSB_SANDBOX']}))")]
        ),
        notebook,
    )
    result = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "run", str(notebook)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **broken_runsc},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert seen == {"backend": "namespace"}
    assert result.stderr.count("the gvisor backend failed its start probe") == 1, result.stderr
