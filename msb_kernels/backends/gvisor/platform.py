"""Which gVisor platform (how the Sentry traps the kernel's system calls) runs this host's kernels, chosen by measuring.

A kernel's start is mostly Python importing ipykernel under the platform (bench/runsc.py: the sandbox boots in
0.16-0.21 s, the imports take 0.9-1.2 s), and which platform does that faster depends on the host: systrap is
runsc's default since 2023 and wins where traps are cheap; kvm needs /dev/kvm and hardware virtualization. So with
MSB_RUNSC_PLATFORM empty the backend times that very import under each platform this runsc offers, once, and keeps
the fastest where it beats systrap by more than the few percent that runs differ by (on this project's 2-core VMs,
systrap 1.27-1.47 s against ptrace 1.39-1.49 s: systrap kept). The choice is kept on disk beside the start probe's
verdicts (msb_kernels.provisioning.probe_verdicts), keyed by the runsc binary, the interpreter and the host's boot, so a new
process does not pay the measurement (about 7 s) again. MSB_RUNSC_PLATFORM set is used as is, unmeasured.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from msb_kernels.backends.gvisor.runsc import runsc_path
from msb_kernels.provisioning import probe_verdicts

CANDIDATES = ("systrap", "ptrace", "kvm")
DEFAULT = "systrap"  # runsc's own default since 2023
MARGIN = 0.05  # another platform replaces the default only where it is this much faster: runs differ by a few percent
ROUNDS = 2  # each platform's time is the fastest of its runs, after one warm-up run that fills the page cache
# What a kernel's start spends most of its time on, under the platform; plain Python where ipykernel is not importable.
IMPORT_CODE = "import ipykernel.kernelapp"
MEASURE_TIMEOUT_SECONDS = 30.0  # a platform that hangs (kvm without hardware support) is dropped, not waited on
_lock = threading.Lock()


@dataclass(frozen=True)
class PlatformChoice:
    """The platform kernels start under, why, and what each candidate measured (seconds, or why it did not run)."""

    name: str
    chosen_by: str  # "MSB_RUNSC_PLATFORM", "measured on this host", or "runsc's own default"
    measured: dict[str, float | str] = field(default_factory=dict)
    kept_in: str | None = None  # a choice read from disk, measured by an earlier process

    def flags(self) -> list[str]:
        """runsc's global flag for this choice; none for runsc's own default."""
        return [f"--platform={self.name}"] if self.chosen_by != "runsc's own default" else []

    def describe(self) -> str:
        """One line for doctor and the start log."""
        if not self.measured:
            return f"platform {self.name} ({self.chosen_by})"
        figures = ", ".join(
            f"{name} {value:.2f} s" if isinstance(value, float) else f"{name}: {value}" for name, value in self.measured.items()
        )
        kept = f", kept in {self.kept_in}" if self.kept_in else ""
        return f"platform {self.name} ({self.chosen_by}: `{IMPORT_CODE}` took {figures}{kept})"


def offered() -> list[str]:
    """The platforms worth timing here. kvm only where /dev/kvm opens and the CPU shows vmx or svm: this project's VMs
    have a /dev/kvm that creates VMs and vCPUs, yet without those flags runsc's kvm platform hangs (timed out at 60 s)."""
    return [name for name in CANDIDATES if name != "kvm" or (os.access("/dev/kvm", os.R_OK | os.W_OK) and _hardware_virtualization())]


def _hardware_virtualization() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and {"vmx", "svm"} & set(line.split()) for line in cpuinfo)
    except OSError:
        return False


def chosen(platform_setting: str) -> PlatformChoice:
    """The platform for kernels of this process (MSB_RUNSC_PLATFORM, else measured once and kept). Called by the gVisor
    backend before a start (in a thread: measuring takes seconds) and by doctor. Thread-safe; measures at most once."""
    if platform_setting:
        return PlatformChoice(platform_setting, "MSB_RUNSC_PLATFORM")
    with _lock:
        return _measured_or_kept()


def forget() -> None:
    """Choose again (a test, or a runsc replaced under a running process)."""
    _measured_or_kept.cache_clear()


@functools.cache
def _measured_or_kept() -> PlatformChoice:
    binary = runsc_path()
    if binary is None:
        return PlatformChoice("systrap", "runsc's own default")
    key = _key(binary)
    kept = probe_verdicts.load(key)
    if kept is not None and kept.get("found", {}).get("platform") in CANDIDATES:
        found = kept["found"]
        return PlatformChoice(
            found["platform"], "measured on this host", dict(found.get("measured", {})), str(probe_verdicts.path_for(key))
        )
    measured = measure(binary, offered())
    times = {name: value for name, value in measured.items() if isinstance(value, float)}
    if not times:  # none ran: leave the choice to runsc, whose own start will then say what is wrong
        return PlatformChoice("systrap", "runsc's own default", measured)
    fastest = min(times, key=times.__getitem__)
    if DEFAULT in times and times[fastest] > times[DEFAULT] * (1 - MARGIN):
        fastest = DEFAULT  # within the noise of one run: keep runsc's own default, the platform gVisor tests most
    # fastest first, those that did not run last: so doctor prints them, measured now or read back from disk
    figures = {name: measured[name] for name in sorted(times, key=times.__getitem__)}
    figures.update((name, value) for name, value in measured.items() if name not in times)
    probe_verdicts.save(key, sum(times.values()), found={"platform": fastest, "measured": figures})
    return PlatformChoice(fastest, "measured on this host", figures)


def measure(binary: str, platforms: list[str]) -> dict[str, float | str]:
    """Seconds of IMPORT_CODE under `runsc do` (the host's root, read-only, no network) per platform, the faster of
    ROUNDS, or why that platform did not run (an old runsc has no systrap; kvm without hardware support fails)."""
    code = IMPORT_CODE if _importable("ipykernel") else "import json, asyncio"
    argv = [sys.executable, "-c", code]
    state = tempfile.mkdtemp(prefix="msb-runsc-platform-")
    results: dict[str, float | str] = {}
    try:
        runs: dict[str, list[float]] = {}
        for round_ in range(ROUNDS + 1):  # alternating, so the host's load in one moment is not one platform's
            for platform in platforms:
                if isinstance(results.get(platform), str):
                    continue
                try:
                    seconds = _do(binary, state, platform, argv)
                except (OSError, subprocess.SubprocessError) as exc:
                    results[platform] = _why(exc)  # an old runsc has no systrap; a hang is dropped at the timeout
                    continue
                if round_ or platform != platforms[0]:  # the very first run fills the page cache: not counted
                    runs.setdefault(platform, []).append(seconds)
                    results[platform] = min(runs[platform])
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return results


def _do(binary: str, state: str, platform: str, argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(
        [binary, f"--root={state}", "--network=none", f"--platform={platform}", "do", *argv],
        check=True,
        capture_output=True,
        timeout=MEASURE_TIMEOUT_SECONDS,
        cwd="/",
    )
    return round(time.perf_counter() - started, 3)


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        said = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"did not run ({said[-1][-160:] if said else f'exit {exc.returncode}'})"
    return f"did not run ({exc})"


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _key(binary: str) -> dict:
    return {
        "format": probe_verdicts.FORMAT,
        "backend": "gvisor-platform",
        "runsc": probe_verdicts.file_identity(binary),
        "interpreter": probe_verdicts.file_identity(sys.executable),
        "offered": offered(),
        "kernel": os.uname().release,
        "boot": probe_verdicts.boot_id(),
        "cpus": os.cpu_count(),
        "user": os.geteuid(),
    }
