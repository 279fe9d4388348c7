"""Shared fixtures: an isolated runtime/kernelspec environment and real sandboxed kernels."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from jupyter_client.manager import AsyncKernelManager

from tests import parallel, skips

# swarm_site: one two-node swarm per session, for whichever tests need it; parallel: the suite on both cores
pytest_plugins = ["tests.swarm", "tests.parallel"]

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def copy_checkout(to: Path) -> None:
    """What a clone of this checkout would hold, with what is being tested: every file git tracks or would track
    (``git ls-files -co --exclude-standard``), copied under ``to``."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)


def _isolate_environment() -> Path:
    """Point every msb and Jupyter directory at a fresh temp dir before anything reads them."""
    for name in list(os.environ):
        if name.startswith("MSB_") and not name.startswith("MSB_TESTS_"):  # the suite's own switches stay
            del os.environ[name]
    # Short path: ZMQ ipc socket paths must fit in 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="msbt-", dir="/tmp"))
    os.environ["MSB_RUNTIME_DIR"] = str(base / "rt")
    os.environ["MSB_SCRATCH_DIR"] = str(base / "scratch")
    os.environ["MSB_STATE_DIR"] = str(base / "state")  # the person registry: one per run, as one per host
    # The namespace sandbox unless a test asks for another: with runsc installed, auto would pick gVisor.
    os.environ["MSB_BACKEND"] = "namespace"
    # Tests that count sandboxes must not see pool kernels; the pool's own tests turn it on.
    os.environ["MSB_POOL_SIZE"] = "0"
    os.environ["JUPYTER_RUNTIME_DIR"] = str(base / "jr")
    os.environ["JUPYTER_DATA_DIR"] = str(base / "data")
    os.environ["JUPYTER_CONFIG_DIR"] = str(base / "config")
    os.environ["JUPYTER_PATH"] = str(base / "prefix" / "share" / "jupyter")
    os.environ["IPYTHONDIR"] = str(base / "ipython")
    os.environ["JUPYTER_PLATFORM_DIRS"] = "1"
    os.environ["PATH"] = f"{VENV_BIN}:{os.environ.get('PATH', '')}"
    return base


TEST_BASE = _isolate_environment()
DEFAULT_SCRATCH = Path("/var/tmp/msb-kernels")  # MSB_SCRATCH_DIR's default, where the README's commands put disks
_BEGAN = pytest.StashKey[float]()


def make_persons(volume: Path) -> Path:
    """A whole shared volume made a person's, as docs/teams.md tells an operator to (its owner's files are each
    sandbox's own; root's they only read). Not as root, the sandboxes run as this user, whose the volume is already."""
    if os.geteuid() == 0:
        os.chown(volume, 1_000_999_999, 1_000_999_999)
    return volume


def venv_environment(venv: Path) -> dict[str, str]:
    """The environment a user of a venv made elsewhere runs msb-kernels in: none of the suite's kernelspecs
    (JUPYTER_PATH) or modules (PYTHONPATH), and that venv's bin first on PATH."""
    env = {name: value for name, value in os.environ.items() if name not in ("JUPYTER_PATH", "PYTHONPATH")}
    return {**env, "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under MSB_TESTS_STRICT_SKIPS, a skip that tests/skips.py does not expect fails the test."""
    report = yield
    if report.skipped and skips.strict() and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if skips.unexpected(reason):
            report.outcome = "failed"
            report.longrepr = (
                f"skipped on a host where it must run (MSB_TESTS_STRICT_SKIPS): {reason}\n"
                "fix what made it skip, or list the reason in tests/skips.py EXPECTED_SKIPS with why"
            )
    return report


@pytest.fixture(autouse=True)
def _no_kernels_outlive_their_test() -> Iterator[None]:
    yield
    gateways = sys.modules.get("tests.msb_kernels.gateway.conftest")  # loaded by any test that launched one
    if gateways is not None:
        gateways.end_kernels_left_behind()


@pytest.fixture(scope="session", autouse=True)
def installed_kernelspecs(request: pytest.FixtureRequest) -> Path:
    """The msb kernelspecs, installed once into the isolated prefix (as `msb-kernels install` does)."""
    from msb_kernels.kernelspecs.spec_files import install
    from msb_kernels.settings.config import load_settings

    install(load_settings(), prefix=str(TEST_BASE / "prefix"))
    began = time.time()
    yield TEST_BASE / "prefix" / "share" / "jupyter" / "kernels"
    if parallel.hand_to_controller(request.config, TEST_BASE):
        return  # checked and removed at the run's end, with the other workers' (pytest_sessionfinish)
    assert not (left := _images_left_behind(Path(os.environ["MSB_SCRATCH_DIR"]), began)), f"the suite left disk images behind: {left}"
    if not os.environ.get("MSB_TESTS_KEEP_BASE"):
        shutil.rmtree(TEST_BASE, ignore_errors=True)


def _images_left_behind(root: Path, began: float) -> list[str]:
    """The suite's end (issue 58): the disk images of its kernels still in root, a scratch dir, once their keepers'
    sweeps have run (a few seconds)."""
    from msb_kernels.backends.core.scratch import IMAGE_SUFFIX

    def left() -> list[str]:
        found = []
        for image in root.glob(f"*{IMAGE_SUFFIX}") if root.is_dir() else []:
            with contextlib.suppress(OSError):
                if image.stat().st_mtime >= began:
                    found.append(str(image))
        return found

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    return left()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_BEGAN] = time.time()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The suite's end: the default scratch dir, which a test of the README's commands uses, and each worker's own hold
    no image of this run's kernels. Checked where the run began, once every worker is done (a worker that finished
    first is no end: the other may still use the default one, and the serial run's end came later for every test)."""
    if getattr(session.config, "workerinput", None) is not None or _BEGAN not in session.stash:
        return
    bases = parallel.worker_bases()
    left = [
        image
        for root in (DEFAULT_SCRATCH, *(base / "scratch" for base in bases))
        for image in _images_left_behind(root, session.stash[_BEGAN])
    ]
    if bases and not os.environ.get("MSB_TESTS_KEEP_BASE"):
        for base in (*bases, TEST_BASE):  # the controller's own too: it ran no test, so no fixture removes it
            shutil.rmtree(base, ignore_errors=True)
    if left:
        session.config.get_terminal_writer().line(f"FAILED: the suite left disk images behind: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def runtime_root() -> Path:
    return Path(os.environ["MSB_RUNTIME_DIR"])


class KernelFactory:
    """Starts real sandboxed kernels and shuts every one down at the end of the test."""

    def __init__(self) -> None:
        self.started: list[tuple[AsyncKernelManager, object]] = []

    async def __call__(self, kernel_name: str = "msb-python-small", env: dict | None = None, **kwargs):
        km = AsyncKernelManager(kernel_name=kernel_name)
        await km.start_kernel(env={**os.environ, **(env or {})}, **kwargs)
        kc = km.client()
        kc.start_channels()
        self.started.append((km, kc))
        await kc.wait_for_ready(timeout=60)
        return km, kc

    async def close(self) -> None:
        for km, kc in self.started:
            kc.stop_channels()
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)


@pytest.fixture
async def start_kernel() -> AsyncIterator[Callable]:
    factory = KernelFactory()
    yield factory
    await factory.close()


@pytest.fixture(scope="module")
async def shared_kernel() -> AsyncIterator[tuple[AsyncKernelManager, object]]:
    """One small Python kernel for tests that only read state, to keep the suite fast."""
    factory = KernelFactory()
    yield await factory()
    await factory.close()


def host_pids(km: AsyncKernelManager) -> set[int]:
    """Host pids of every process in the kernel's sandbox (from its cgroup)."""
    sandbox = km.provisioner.sandbox
    return sandbox.cgroup.pids() if sandbox.cgroup else {sandbox.init_pid}


@pytest.fixture(scope="session")
def upstream() -> AsyncIterator[object]:
    """A web host, a package index (pip's and npm's) and a DNS server in a test-made network namespace
    (tests/upstreams.py): where the egress proxy's tests send kernels."""
    from tests.upstreams import Upstream, UpstreamUnavailable, serve_npm_package, serve_package

    host = Upstream(TEST_BASE / "upstream")
    try:
        host.start()
    except UpstreamUnavailable as exc:
        pytest.skip(f"no upstream host for the egress tests: {exc}")
    serve_package(host)
    host.npm_registry = serve_npm_package(host)
    yield host
    host.stop()


@contextlib.contextmanager
def soft_open_files(limit: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE set to limit for the block (children started in it inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard open-file limit here ({hard}) is below the {limit} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
