"""Environments made by the tests: offline wheels (tests/msb_kernels/environments/wheels.py), a store of their own,
and kernelspecs written where the suite's Jupyter finds them (its JUPYTER_PATH's prefix)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TEST_BASE
from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, offline_wheels
from tests.swarm import SwarmSite, built_archive

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


@dataclass
class SwarmKernels:
    """probe's image on both nodes of the session's swarm, and where a process of the test reaches its kernels."""

    site: SwarmSite
    there: list[str]  # the command prefix that runs a program on the kernels' overlay (SwarmSite.on_network)
    build_output: str
    build_seconds: float

    def env(self, host: EnvHost) -> dict[str, str]:
        return {**host.env, "MSB_BACKEND": "swarm", "DOCKER_HOST": self.site.docker_host}


@pytest.fixture(scope="session")
def probe_on_swarm(swarm_site, probe_env) -> Iterator[SwarmKernels]:
    """`msb-kernels image build python --env probe` from the suite's kernel image archive, as an operator builds it for
    nodes without a registry (--engine none --save-archive, then `docker load` on each node): once per session."""
    archive = TEST_BASE / "probe-image.tar"
    began = time.monotonic()
    built = probe_env.cli(
        "image", "build", "python", "--env", "probe", "--engine", "none",
        "--from-archive", str(built_archive("python")), "--save-archive", str(archive), timeout=600,
    )  # fmt: skip
    seconds = time.monotonic() - began
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    try:
        swarm_site.load_on_every_node(archive)
        loaded = time.monotonic() - began - seconds
        print(
            f"\nprobe's image: built {seconds:.0f} s, {archive.stat().st_size >> 20} MiB, loaded on two nodes {loaded:.0f} s",
            file=sys.stderr,
        )
        with swarm_site.on_network(f"msbt-env-{uuid.uuid4().hex[:8]}") as there:
            yield SwarmKernels(swarm_site, there, built.stdout, seconds)
    finally:
        archive.unlink(missing_ok=True)
