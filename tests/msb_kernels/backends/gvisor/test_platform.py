"""gVisor's platform: measured on this host and the fastest kept where MSB_RUNSC_PLATFORM is empty, as set otherwise,
and what a kernel's runsc actually runs under."""

from __future__ import annotations

from pathlib import Path

import pytest

from msb_kernels.backends.gvisor import platform, runsc
from tests.conftest import TEST_BASE
from tests.kernel_helpers import execute
from tests.skips import needs_runsc

pytestmark = [pytest.mark.slow, needs_runsc]


@pytest.fixture(autouse=True)
def gvisor(monkeypatch, tmp_path):
    monkeypatch.setenv("MSB_BACKEND", "gvisor")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # measured here, not read from the suite's cache
    platform.forget()
    yield
    platform.forget()


def runsc_flags(km) -> list[str]:
    """The global flags of the runsc that runs km's sandbox, from its process's own command line."""
    argv = Path(f"/proc/{km.provisioner.sandbox.process.pid}/cmdline").read_bytes().split(b"\0")
    words = [word.decode() for word in argv if word]
    return words[words.index(next(word for word in words if word.endswith("runsc"))) :]


async def test_with_no_platform_set_the_measured_fastest_runs_the_kernels_and_is_kept(start_kernel):
    choice = platform.chosen("")
    times = {name: value for name, value in choice.measured.items() if isinstance(value, float)}
    assert choice.chosen_by == "measured on this host" and {"systrap", "ptrace"} <= set(times), choice
    fastest = min(times, key=times.__getitem__)
    assert choice.name == fastest or (choice.name == "systrap" and times["systrap"] * 0.95 <= times[fastest]), choice
    assert "import ipykernel.kernelapp" in choice.describe() and f"platform {choice.name}" in choice.describe()
    platform.forget()  # a new process: reads the choice kept on disk, measures nothing
    kept = platform.chosen("")
    assert kept.name == choice.name and kept.kept_in and Path(kept.kept_in).stat().st_mode & 0o077 == 0, kept
    km, kc = await start_kernel()
    assert f"--platform={choice.name}" in runsc_flags(km)
    assert (await execute(kc, "!ls / | wc -l")).stdout.strip() != "0"


async def test_a_platform_set_is_used_unmeasured(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_RUNSC_PLATFORM", "ptrace")
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(TEST_BASE / "platform-set"))  # a backend of its own: settings are read once
    assert platform.chosen("ptrace").measured == {}
    km, kc = await start_kernel()
    assert "--platform=ptrace" in runsc_flags(km)
    assert (await execute(kc, "1+1")).result == "2"


def test_a_platform_this_runsc_lacks_is_reported_and_never_chosen():
    measured = platform.measure(runsc.runsc_path(), ["nonesuch", "ptrace"])
    assert isinstance(measured["ptrace"], float), measured
    assert measured["nonesuch"].startswith("did not run ("), measured
