"""Fixtures shared by the tests of msb_kernels' own modules."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from msb_kernels.backends.gvisor.runsc import runsc_path


@dataclass
class RunscWrapper:
    """runsc as a host can have it break: it answers --version as the real one does, but while ``broken`` exists
    its every sandbox fails to start (a platform this build does not have, as a wrong runsc.toml would give)."""

    bin_dir: Path
    broken: Path

    @property
    def env(self) -> dict[str, str]:
        return {"MSB_RUNSC": str(self.bin_dir / "runsc"), "MSB_BACKEND": "auto"}

    def break_it(self) -> None:
        self.broken.touch()


@pytest.fixture
def runsc_wrapper(tmp_path) -> RunscWrapper:
    runsc = runsc_path() or "/usr/bin/runsc"
    wrapper = RunscWrapper(tmp_path / "bin", tmp_path / "runsc-broken")
    wrapper.bin_dir.mkdir()
    script = wrapper.bin_dir / "runsc"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --version ] && exec {runsc} "$@"
        if [ -e {wrapper.broken} ]; then  # a platform runsc lacks, in place of any the backend names
            for arg; do shift; case "$arg" in --platform=*) ;; *) set -- "$@" "$arg" ;; esac; done
            exec {runsc} --platform=no-such-platform "$@"
        fi
        exec {runsc} "$@"
        """)
    )
    script.chmod(0o755)
    os.chmod(tmp_path, 0o755)
    return wrapper


@pytest.fixture
def broken_runsc(runsc_wrapper) -> dict[str, str]:
    """The environment of a process whose runsc cannot start a sandbox."""
    runsc_wrapper.break_it()
    return runsc_wrapper.env
