"""Which runsc runs gVisor kernels, and what release it is.

Debian 12's runsc (0.0~20221219) fails coreutils' ``statx`` with EINVAL, so ``ls /`` and ``stat`` fail in every kernel.
Debian 13's (0.0~20240729, one static binary) runs them. The README's commands install that binary into this
environment (``scripts/install-runsc``, into OWN_RUNSC), and it is used before the host's own. Where it is absent (a
host without apt, a user without root) the host's runsc is used, and the start probe, which runs ``ls`` and ``stat``
(msb_kernels.provisioning.probe), decides whether ``auto`` may pick it; ``msb-kernels doctor`` names the fix when it may not.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

OWN_RUNSC = Path(sys.prefix) / "share" / "msb-kernels" / "gvisor" / "runsc"
# The first release whose ptrace and systrap platforms run coreutils' statx (Debian 13's; Debian 12's is 20221219).
FIRST_GOOD_RELEASE = "20240729"
INSTALL_HINT = (
    "run ./scripts/run as root, which installs Debian 13's runsc (0.0~20240729) into "
    f"{OWN_RUNSC.parent}, or set MSB_RUNSC to a runsc from https://gvisor.dev/docs/user_guide/install/"
)
_HOST_PLACES = ("/usr/bin/runsc", "/usr/local/bin/runsc", "/usr/sbin/runsc")


@dataclass(frozen=True)
class Runsc:
    """One runsc binary: where it is, what it says it is, and where it was found."""

    path: str
    version: str  # the first line of --version, e.g. "runsc version 0.0~20240729.0"
    found_by: str  # "MSB_RUNSC", "this environment's own" or "the host's"

    @property
    def release(self) -> str | None:
        """The release date, YYYYMMDD, of a Debian or upstream build; None for a version this cannot read."""
        match = re.search(r"(?:~|release-)(\d{8})", self.version)
        return match.group(1) if match else None

    @property
    def known_old(self) -> bool:
        """A release older than the first that runs coreutils' statx: `ls /` will fail in its kernels."""
        return self.release is not None and self.release < FIRST_GOOD_RELEASE

    def describe(self) -> str:
        return f"{self.version or 'runsc'} at {self.path}, {self.found_by}"


def _chosen_path() -> tuple[str | None, str]:
    from msb_kernels.settings.config import load_settings

    named = load_settings().runsc
    if named:
        return named, "MSB_RUNSC"
    if os.access(OWN_RUNSC, os.X_OK):
        return str(OWN_RUNSC), "this environment's own"
    return shutil.which("runsc") or next((p for p in _HOST_PLACES if os.access(p, os.X_OK)), None), "the host's"


@functools.cache
def runsc_path() -> str | None:
    """The runsc binary this process runs: MSB_RUNSC, else this environment's own, else the host's; None: none."""
    return _chosen_path()[0]


@functools.cache
def current() -> Runsc | None:
    """runsc_path() with its version; raises OSError or SubprocessError when it does not run."""
    path, found_by = _chosen_path()
    if path is None:
        return None
    said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    return Runsc(path, said.split("\n")[0].strip(), found_by)


def forget() -> None:
    """Look again (a test that names another runsc, an operator's repaired host)."""
    runsc_path.cache_clear()
    current.cache_clear()
