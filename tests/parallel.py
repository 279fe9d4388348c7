"""The suite on both cores: pytest-xdist (``scripts/test`` passes ``-n 2``), with three rules.

Groups. A group's tests run in one worker, in order, and by default a group is a module: a module's tests run in one
worker, so its module and package fixtures (a Hub, a gateway, a Lab in a browser)
start once. Modules that share something host-wide share a group, so the two workers never make it at once:
:data:`SWARM` (a two-node swarm: its engines take free address pools and names as they find them) and
:data:`HOST_USERS` (useradd and userdel of fixed names, and the Hub's PAM logins). The groups known to be longest go
first (:data:`LONGEST`), so that neither worker is left alone with one at the end. xdist's own ``loadgroup`` cannot say
this under pytest 9 (it renames node ids through an attribute pytest 9 no longer reads), so :class:`GroupScheduling`
is xdist's module-at-a-time scheduling with these groups for its scopes: the workers write them at collection.

Alone. A test marked ``alone`` measures what the other worker's load would change (a latency, a CPU share, a deadline
of a few seconds), or waits on leftovers that any other start on the host would sweep first. It runs while no other
test does. Every other test holds a lock file shared; an ``alone`` test holds
it exclusively, after a turnstile that a stream of shared holders cannot hold it out of.

Unit. A test marked ``unit`` starts no process (``-m unit`` runs that tier in seconds): one whose body tries fails,
saying which, since a unit test that quietly starts a kernel is not one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SWARM = pytest.mark.xdist_group("swarm")
HOST_USERS = pytest.mark.xdist_group("host-users")
ALONE = pytest.mark.alone
UNIT = pytest.mark.unit

# Groups (a module's path, or a shared group's name) by their time in a fresh clone's run on the 2-vCPU host, longest
# first: `pytest --junitxml` summed per group (seconds, 2026-12-08). The rest follow in collection order.
LONGEST = (
    "swarm",  # 529
    "host-users",  # 300
    "tests/bench/test_harness.py",  # 184
    "tests/msb_kernels/gateway/kernels/test_hibernation.py",  # 161
    "tests/msb_kernels/backends/test_contract.py",  # 154
    "tests/msb_kernels/backends/gvisor/test_backend.py",  # 138
    "tests/msb_kernels/gateway/test_attack_battery.py",  # 134
    "tests/msb_kernels/provisioning/test_probe_verdicts.py",  # 120
    "tests/msb_kernels/gateway/test_jupyterlab_browser.py",  # 116
    "tests/msb_kernels/gateway/test_hub.py",  # 108
)
_LOCK_DIR = "MSB_TESTS_LOCK_DIR"  # the controller's, inherited by its workers
_MADE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: measures what another test's load would change; runs with no other test")
    config.addinivalue_line("markers", "unit: starts no process (the `-m unit` tier)")
    if getattr(config, "workerinput", None) is None and (config.getoption("numprocesses", None) or 0):
        os.environ[_LOCK_DIR] = config.stash[_MADE] = tempfile.mkdtemp(prefix="msbt-xdist-")


def pytest_unconfigure(config: pytest.Config) -> None:
    # Only the run that made it: a pytest a test runs (the swarm's, in a container) inherits the variable too.
    if (made := config.stash.get(_MADE, None)) is not None:
        shutil.rmtree(made, ignore_errors=True)


def _worker_lock_dir(config: pytest.Config) -> Path | None:
    """In a worker of a parallel run, the controller's dir of shared files; None elsewhere (a pytest a test runs
    inherits the variable, not the worker's input)."""
    if getattr(config, "workerinput", None) is None or not os.environ.get(_LOCK_DIR):
        return None
    return Path(os.environ[_LOCK_DIR])


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _module(item: pytest.Item) -> str:
    return _module_of(item.nodeid)


def _named_group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return marker.args[0] if marker.args else marker.kwargs["name"]
    return SWARM.args[0] if "swarm_site" in item.fixturenames else None


def _shared_packages(item: pytest.Item) -> set[str]:
    """The packages whose package fixtures, or session fixtures of a package's conftest, this test uses: such a fixture
    is built once per worker, and the modules that use it may rely on their order (environments' ``probe_env``)."""
    found = set()
    for definitions in item._fixtureinfo.name2fixturedefs.values():  # pytest has no public reader of a closure's scopes
        for definition in definitions:
            # tests/conftest.py's (baseid "tests") and plugins' ("") are every test's: one per worker, no order
            if definition.scope == "package" or (definition.scope == "session" and "/" in definition.baseid):
                found.add(definition.baseid)
    return found


def _groups(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """Each test's group: its module's, joined with every module it shares a named group or a package's fixture with.
    A joined group is called by its name (``swarm``) if it has one, else by its first module or package."""
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    def join(one: str, other: str) -> None:
        a, b = find(one), find(other)
        if a != b:
            keep, drop = sorted((a, b), key=lambda name: (name.startswith("tests"), name))  # a name beats a path
            parent[drop] = keep

    for item in items:
        module = _module(item)
        find(module)
        if (named := _named_group(item)) is not None:
            join(module, named)
        for package in _shared_packages(item):
            join(module, package)
    return {item: find(_module(item)) for item in items}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = _groups(items)
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(groups[item], index)

    def rank(item: pytest.Item) -> tuple[int, int]:
        group = groups[item]
        return (LONGEST.index(group) if group in LONGEST else len(LONGEST), first[group])

    items.sort(key=rank)  # stable: a group's tests keep their order, and stay together
    if (shared := _worker_lock_dir(config)) is not None:
        written = shared / f"groups-{config.workerinput['workerid']}.json"
        written.with_suffix(".tmp").write_text(json.dumps({item.nodeid: groups[item] for item in items}))
        written.with_suffix(".tmp").rename(written)  # every worker collects the same; the scheduler reads one whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, with this suite's groups for scopes, in the order collection left them."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first called once every worker has collected, and so written its groups
                (written, *_) = sorted(Path(os.environ[_LOCK_DIR]).glob("groups-*.json"))
                self.groups = json.loads(written.read_text())
            return self.groups.get(nodeid) or _module_of(nodeid)

    config.option.loadscopereorder = False  # collection ordered the groups, longest first
    return GroupScheduling(config, log)


def hand_to_controller(config: pytest.Config, base: Path) -> bool:
    """In a worker: leave this worker's test dir for the run's end to check and remove (worker_bases); False elsewhere."""
    if (shared := _worker_lock_dir(config)) is None:
        return False
    (shared / f"base-{config.workerinput['workerid']}").write_text(str(base))
    return True


def worker_bases() -> list[Path]:
    """The test dirs the workers left (hand_to_controller), read where the run began once they are done."""
    if not os.environ.get(_LOCK_DIR):
        return []
    return [Path(left.read_text()) for left in sorted(Path(os.environ[_LOCK_DIR]).glob("base-*"))]


@contextlib.contextmanager
def _turn(directory: Path, exclusive: bool) -> Iterator[None]:
    with open(directory / "turnstile", "a") as turnstile, open(directory / "running", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # an alone test waiting here holds every later test out
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{item.nodeid} is marked unit, and unit tests start no process")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve"):
            patch.setattr(os, name, refuse)
        yield


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's: a wait for the lock is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    shared = _worker_lock_dir(item.config)
    alone = item.get_closest_marker("alone") is not None
    with _turn(shared, exclusive=alone) if shared is not None else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """A unit test's body, with every way to start a process refused (its fixtures may start what they share)."""
    with _no_processes(item) if item.get_closest_marker("unit") is not None else contextlib.nullcontext():
        return (yield)
