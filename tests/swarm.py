"""A real two-node Docker Swarm (tests/engines.py), with the images `msb-kernels image build` makes: the session's one
swarm (a plugin of tests/conftest.py), for the swarm backend's tests and the environments' kernels on it.

The kernel image and the gateway image are built by the CLI, as an operator builds them, and loaded with `docker load`
on the nodes that need them (both nodes: the kernel image; the manager: the gateway). Building them costs about a
minute and a half here, so the archives are kept in ~/.cache/msb-kernels/test-images under a key of every file that
goes into them: a changed image builder, template or package is built again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, TEST_BASE, VENV_BIN

KERNEL_IMAGE = "msb-kernels/python:latest"
GATEWAY_IMAGE = "msb-kernels/gateway:latest"
NETWORK = "msb-kernels"
IMAGE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "msb-kernels" / "test-images"


def swarm_missing() -> str | None:
    """Why a live swarm cannot be had here, or None."""
    if os.geteuid() != 0:
        return "the swarm tests start private Docker engines, which needs root (run the tests as root)"
    for program, package in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")):
        if shutil.which(program) is None and not Path(f"/usr/sbin/{program}").exists():
            return f"{program} is not installed (apt-get install {package}; scripts/test installs it where it runs as root)"
    return None


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _package_files(*names: str) -> list[Path]:
    return [p for name in names for p in (REPO / name).rglob("*.py") if "__pycache__" not in p.parts] + [REPO / "pyproject.toml"]


def built_archive(kind: str) -> Path:
    """The Docker-save archive of the kernel ("python") or gateway image, built with the CLI unless cached."""
    if kind == "python":
        key = _digest([*(REPO / "msb_kernels" / "images").glob("*.py"), REPO / "msb_kernels" / "kernelspecs" / "templates.py"])
    else:
        key = _digest(_package_files("msb_kernels", "mcp_bridge")) + "-" + built_archive("python").stem
    archive = IMAGE_CACHE / f"{kind}-{key}.tar"
    if archive.exists():
        return archive
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    command = [str(VENV_BIN / "msb-kernels"), "image", "build", kind, "--engine", "none", "--save-archive", str(partial)]
    if kind == "gateway":
        command += ["--from-archive", str(built_archive("python"))]
    else:
        command += ["--tag", KERNEL_IMAGE]
    result = subprocess.run(command, capture_output=True, text=True, cwd=TEST_BASE)
    assert result.returncode == 0, f"msb-kernels image build {kind} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    partial.rename(archive)
    for stale in IMAGE_CACHE.glob(f"{kind}-*.tar"):  # one per kind is enough
        if stale != archive:
            stale.unlink(missing_ok=True)
    return archive


@dataclass
class SwarmSite:
    """The swarm, its images loaded, and how a process of ours reaches it."""

    swarm: object  # tests.engines.TwoNodeSwarm
    docker_host: str

    def client(self):
        return self.swarm.client()

    def env(self, **more: str) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.docker_host, **more}

    @contextlib.contextmanager
    def on_network(self, name: str) -> Iterator[list[str]]:
        """Where a process of ours reaches kernels, as the gateway's container does: the network namespace of a container
        on the kernels' overlay. Yields the command prefix that runs a program there (its files stay this host's)."""
        anchor = self.client().containers.run(KERNEL_IMAGE, ["sleep", "infinity"], network=NETWORK, detach=True, name=name)
        try:
            anchor.reload()
            yield ["nsenter", f"--net=/proc/{anchor.attrs['State']['Pid']}/ns/net"]
        finally:
            anchor.remove(force=True)

    def load_on_every_node(self, archive: Path) -> None:
        """`docker load` on both nodes at once, as an operator gives each node an image without a registry."""
        with ThreadPoolExecutor(2) as loads:
            list(loads.map(lambda engine: engine.load(archive), [self.swarm.manager, self.swarm.worker]))

    def docker(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        """The docker CLI that ships with the engine (Debian's 20.10), as an operator runs it against the manager."""
        return subprocess.run(
            ["/usr/bin/docker", "-H", self.docker_host, *args], capture_output=True, text=True, env=self.env(**env), timeout=timeout
        )


@pytest.fixture(scope="session")
def swarm_site() -> Iterator[SwarmSite]:
    reason = swarm_missing()
    if reason:
        pytest.skip(f"swarm backend cannot be tested live here: {reason}")
    from tests.engines import EngineUnavailable, TwoNodeSwarm

    began = time.monotonic()
    kernel_archive, gateway_archive = built_archive("python"), built_archive("gateway")
    built = time.monotonic()
    swarm = TwoNodeSwarm(TEST_BASE)
    try:
        swarm.start()
    except EngineUnavailable as exc:
        pytest.fail(f"a two-node swarm could not be made on this host: {exc}")
    try:
        with ThreadPoolExecutor(3) as loads:  # what an operator does on each node, at once
            list(
                loads.map(
                    lambda pair: pair[0].load(pair[1]),
                    [(swarm.manager, kernel_archive), (swarm.worker, kernel_archive), (swarm.manager, gateway_archive)],
                )
            )
        client = swarm.client()
        client.networks.create(NETWORK, driver="overlay", internal=True, attachable=True)  # as the README has the operator do
        print(
            f"\nswarm: images {built - began:.0f} s, two nodes {swarm.timings.get('start_s', 0):.1f} s, "
            f"loaded {time.monotonic() - built:.0f} s",
            file=sys.stderr,
        )
        yield SwarmSite(swarm, swarm.manager.url)
    finally:
        with contextlib.suppress(Exception):
            swarm.stop()
