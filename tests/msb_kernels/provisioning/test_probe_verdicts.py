"""Start probes' passes kept on disk: a new process starts no probe kernel while nothing that decides the pass changed,
a start that fails drops the pass, and a cache file that is not to be believed costs a probe, never a start.

Whether a probe kernel started is read from msb_kernels' own log line, written just before it starts one."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import nbformat
import pytest

from msb_kernels.backends import backend_classes, choose_backend
from msb_kernels.backends.gvisor import GVisorBackend, runsc
from msb_kernels.provisioning import probe, probe_verdicts
from msb_kernels.settings.config import load_settings
from tests.conftest import VENV_BIN
from tests.skips import needs_runsc

pytestmark = pytest.mark.slow

PROBED = "start probe of the "
KEPT = "passed its start probe for"
ARGV = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]


def start_verdicts(cache) -> list:
    """The start probes' verdicts in cache, beside which gVisor keeps its platform choice (gvisor-platform-*)."""
    return [path for path in cache.iterdir() if not path.name.startswith("gvisor-platform-")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty verdict cache of this test's own, and a process that has probed nothing yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MSB_BACKEND", "auto")
    probe.forget()
    yield tmp_path / "cache" / "msb-kernels" / "probes"
    probe.forget()


async def start_backend(caplog, **settings: str) -> tuple[str, bool]:
    """backend_for_start as a fresh process calls it: the backend picked, and whether a probe kernel started for it."""
    probe.forget()  # what a new process knows: only the disk
    caplog.clear()
    for name, value in settings.items():
        os.environ[name] = value
    try:
        with caplog.at_level(logging.INFO, logger="msb_kernels"):
            backend = await probe.backend_for_start(load_settings(), ARGV, "python")
    finally:
        for name in settings:
            del os.environ[name]
    return backend.name, PROBED in caplog.text


def verdict_path(**settings: str):
    os.environ.update(settings)
    try:
        loaded = load_settings()
        return probe_verdicts.path_for(probe_verdicts.key_for(backend_classes()[choose_backend("auto")[0]], ARGV, "python", loaded))
    finally:
        for name in settings:
            del os.environ[name]


def run_notebook(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`msb-kernels run` of a notebook that prints the backend its kernel runs in, as a batch job would."""
    notebook = tmp_path / "which.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; print('backend=' + os.environ['MSB_SANDBOX'])")]), notebook
    )
    return subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "--debug", "run", str(notebook), "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MSB_BACKEND": "auto", **env},
    )


def backend_of(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return next(line.split("=", 1)[1] for line in result.stdout.splitlines() if line.startswith("backend="))


def test_a_second_process_starts_no_probe_kernel(cache, tmp_path):
    first = run_notebook(tmp_path, {})
    second = run_notebook(tmp_path, {})
    assert backend_of(first) == backend_of(second) == choose_backend("auto")[0]
    assert PROBED in first.stderr and KEPT not in first.stderr, first.stderr[-3000:]
    assert PROBED not in second.stderr and KEPT in second.stderr, second.stderr[-3000:]
    [kept] = start_verdicts(cache)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(cache.stat().st_mode) == 0o700
    verdict = json.loads(kept.read_text())
    assert (
        verdict["ok"] is True and verdict["key"]["argv"][0] == str(VENV_BIN / "python") and verdict["key"]["kernel"] == os.uname().release
    )


async def test_a_changed_setting_probes_again(cache, caplog):
    picked = choose_backend("auto")[0]
    assert await start_backend(caplog) == (picked, True)
    assert await start_backend(caplog) == (picked, False)
    assert await start_backend(caplog, MSB_MAX_PROCESSES="200") == (picked, True)  # another key: proven for it
    assert await start_backend(caplog, MSB_MAX_PROCESSES="200") == (picked, False)
    assert await start_backend(caplog, MSB_MAX_SESSIONS="3") == (picked, False)  # how many sessions decides no start
    assert len(start_verdicts(cache)) == 2


@needs_runsc
async def test_another_runsc_of_the_same_version_probes_again(cache, caplog, runsc_wrapper, monkeypatch):
    assert await start_backend(caplog) == ("gvisor", True)
    assert await start_backend(caplog) == ("gvisor", False)
    monkeypatch.setenv("MSB_RUNSC", runsc_wrapper.env["MSB_RUNSC"])
    runsc.forget()
    GVisorBackend._availability = None
    try:
        assert await start_backend(caplog) == ("gvisor", True)
    finally:
        monkeypatch.undo()
        runsc.forget()
        GVisorBackend._availability = None


@needs_runsc
def test_a_failed_start_drops_the_pass_and_the_next_start_probes(cache, tmp_path, runsc_wrapper):
    proven = run_notebook(tmp_path, runsc_wrapper.env)
    assert backend_of(proven) == "gvisor" and PROBED in proven.stderr
    [kept] = start_verdicts(cache)
    runsc_wrapper.break_it()  # what the key cannot see: a runsc.toml, a module gone
    failed = run_notebook(tmp_path, runsc_wrapper.env)
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert KEPT in failed.stderr and PROBED not in failed.stderr, failed.stderr[-3000:]
    assert "failed to start in the gvisor backend, which had passed its start probe" in failed.stderr, failed.stderr[-3000:]
    assert not kept.exists()
    again = run_notebook(tmp_path, runsc_wrapper.env)
    assert backend_of(again) == "namespace"
    assert "start probe of the gvisor backend" in again.stderr and "the gvisor backend failed its start probe" in again.stderr
    assert [path.name.split("-")[0] for path in start_verdicts(cache)] == ["namespace"]  # only passes are kept


async def test_a_corrupt_verdict_is_probed_over(cache, caplog):
    picked, _ = await start_backend(caplog)
    path = verdict_path()
    path.write_bytes(b"\x00{not json")
    assert await start_backend(caplog) == (picked, True)
    assert json.loads(path.read_text())["ok"] is True
    assert await start_backend(caplog) == (picked, False)


def _foreign_file(path):
    os.chown(path, 65534, 65534)


def _readable_file(path):
    path.chmod(0o644)


def _shared_directory(path):
    os.chown(path.parent, 65534, 65534)
    path.parent.chmod(0o777)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user can be made only as root")
@pytest.mark.parametrize("spoil", [_foreign_file, _readable_file, _shared_directory], ids=["foreign-file", "mode-0644", "foreign-dir"])
async def test_a_verdict_not_ours_alone_is_not_believed(cache, caplog, spoil):
    picked, _ = await start_backend(caplog)
    path = verdict_path()
    spoil(path)
    assert await start_backend(caplog) == (picked, True)
    assert "ignoring the probe verdict" in caplog.text
