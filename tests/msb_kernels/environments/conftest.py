"""Environments made by the tests: offline wheels (tests/msb_kernels/environments/wheels.py), a store of their own,
and kernelspecs written where the suite's Jupyter finds them (its JUPYTER_PATH's prefix)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TEST_BASE
from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, offline_wheels

SUITE_PREFIX = TEST_BASE / "prefix"  # where the suite's kernelspecs are (JUPYTER_PATH)


@dataclass
class EnvHost:
    """An environments directory of its own, and `msb-kernels` run as an operator runs it, against it."""

    directory: Path
    created_output: str = ""  # what `env create` printed
    freeze_before: str = ""  # the suite's venv, as `pip freeze` listed it before the environment was made
    path: str | None = None  # PATH for its commands; None: the suite's (whose venv has uv)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "MSB_ENVIRONMENTS_DIR": str(self.directory), **({"PATH": self.path} if self.path else {})}

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "msb_kernels.cli", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def env_cli(self, command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`msb-kernels env COMMAND ...`, its kernelspecs where the suite's are."""
        prefix = ["--prefix", str(SUITE_PREFIX)] if command in ("add", "create") else []
        return self.cli("env", command, *args, *prefix, timeout=timeout)

    def store_text(self) -> str | None:
        path = self.directory / "environments.json"
        return path.read_text() if path.exists() else None


@pytest.fixture(scope="session")
def wheels() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="msbt-wheels-", dir="/tmp"))
    yield offline_wheels(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def env_host(tmp_path) -> EnvHost:
    return EnvHost(tmp_path / "environments")


@pytest.fixture(scope="session")
def probe_env(wheels) -> Iterator[EnvHost]:
    """`env create probe -r req.txt --wheels DIR`: a venv in a home directory (where the sandbox mounts its own /home),
    holding msbenvprobe, which the suite's own venv lacks."""
    home = Path(f"/home/msbt-env-{uuid.uuid4().hex[:8]}")
    try:
        home.mkdir(mode=0o755)
    except OSError as exc:
        pytest.skip(f"cannot make a home directory here: {exc}")
    host = EnvHost(home / "environments")
    freeze = [sys.executable, "-m", "pip", "freeze", "--all"]
    host.freeze_before = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    requirements = home / "requirements.txt"
    requirements.write_text(PROBE_PACKAGE + "\n")
    created = host.env_cli("create", "probe", "-r", str(requirements), "--wheels", str(wheels))
    assert created.returncode == 0, created.stdout + created.stderr
    host.created_output = created.stdout
    yield host
    host.cli("env", "remove", "probe")
    shutil.rmtree(home, ignore_errors=True)
