"""Kernels from wherever a user put their venv: a home directory, /tmp, a symlink; on every backend here.

The sandboxes mount their own /tmp and /home, so an interpreter there must be bound on top of those
mounts, read-only at the same path, and nothing else of the host's beside it may show. CI's own
checkout path is not special: these tests place one venv (a hard-linked copy of the suite's) in each
spot and run `msb-kernels demo` and a probe notebook from it, as a user of that venv would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import nbformat
import pytest

from msb_kernels.backends.core import hostpaths
from tests.conftest import REPO, VENV_BIN, venv_environment
from tests.skips import every_builtin_backend, needs_runsc

SECRET = "host-secret-beside-the-venv"
PROBE_CELL = """
import json, os, sys
parent = os.path.dirname(sys.prefix)
try:
    secret = open(os.path.join(parent, "secret.txt")).read()
except OSError as exc:
    secret = type(exc).__name__
print(json.dumps({"executable": sys.executable, "prefix": sys.prefix, "beside": sorted(os.listdir(parent)), "secret": secret,
                  "uid": os.getuid(), "backend": os.environ.get("MSB_SANDBOX")}))
"""


def test_binds_skip_what_a_system_dir_or_a_parent_already_shows(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    binds = hostpaths.binds_for([str(venv / "lib"), str(venv), "/usr/lib", "/usr", str(tmp_path / "missing"), "relative/path"])
    assert binds == [str(venv)]


def test_a_venvs_paths_include_the_installation_it_points_at(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    paths = hostpaths.interpreter_paths(str(venv / "bin" / "python"))
    assert str(venv) in paths
    base = os.path.realpath(sys.base_prefix)
    assert any(base == p or base.startswith(p + "/") for p in paths), (paths, base)
    assert hostpaths.interpreter_paths("no-such-interpreter-anywhere") == []


OTHER_PYTHONS = sorted(
    p
    for p in Path("/root/.pyenv/versions").glob("3.*/bin/python3")
    if os.access("/root", os.X_OK) and p.resolve().parent.parent != Path(sys.base_prefix).resolve()
)


@pytest.mark.skipif(not OTHER_PYTHONS, reason="no second Python installation (pyenv's under /root/.pyenv) on this host")
def test_a_venv_of_another_base_python_shows_that_installation(tmp_path):
    """An environment's venv made from a Python that is not the gateway's: its own base is bound, not the gateway's."""
    base = OTHER_PYTHONS[-1]
    venv = tmp_path / "other"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    paths = hostpaths.interpreter_paths(str(venv / "bin" / "python"))
    other = str(base.resolve().parent.parent)
    assert str(venv) in paths and any(other == p or other.startswith(p + "/") for p in paths), (paths, other)
    assert not any(p == sys.prefix for p in paths), "the gateway's own venv is no part of another environment"


def test_a_conda_like_prefix_is_its_own_paths(tmp_path):
    """/opt/<env>/bin/python with its stdlib beside it: the prefix is shown whole, and nothing above it."""
    prefix = tmp_path / "opt" / "data"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib" / "python3.11").mkdir(parents=True)
    (prefix / "bin" / "python3.11").write_bytes(b"")
    (prefix / "bin" / "python").symlink_to("python3.11")
    assert hostpaths.interpreter_paths(str(prefix / "bin" / "python")) == [str(prefix)]


def _place(source: Path, destination: Path) -> None:
    """A copy of a venv at destination: its files hard-linked (a copy where they cannot be), so it costs a second."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    linked = subprocess.run(["cp", "-al", str(source), str(destination)], capture_output=True, text=True)
    if linked.returncode != 0:
        shutil.rmtree(destination, ignore_errors=True)
        shutil.copytree(source, destination, symlinks=True)
    (destination.parent / "secret.txt").write_text(SECRET)


@pytest.fixture(scope="module")
def user_venvs():
    """The suite's venv in three places users keep theirs: under /tmp, in a home directory, and a symlink to it."""
    source = Path(sys.prefix)
    token = uuid.uuid4().hex[:8]
    tmp_base = Path(tempfile.mkdtemp(prefix="msbt-place-", dir="/tmp"))
    home = Path(f"/home/msbt-{token}")
    try:
        _place(source, tmp_base / "project" / ".venv")
        _place(source, home / "msb" / ".venv")
        (home / "linked").mkdir()
        (home / "linked" / ".venv").symlink_to(tmp_base / "project" / ".venv")
        (home / "linked" / "secret.txt").write_text(SECRET)
    except OSError as exc:
        shutil.rmtree(tmp_base, ignore_errors=True)
        pytest.skip(f"cannot place a venv under /tmp and /home here: {exc}")
    yield {"tmp": tmp_base / "project" / ".venv", "home": home / "msb" / ".venv", "symlink": home / "linked" / ".venv"}
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(tmp_base, ignore_errors=True)


def _install(venv: Path, env: dict) -> None:
    """msb-kernels' kernelspecs into that venv, as its user installs them."""
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "msb_kernels.cli", "install"], env=env, capture_output=True, timeout=120, check=True
    )


def _run(venv: Path, backend: str, *args: str) -> subprocess.CompletedProcess:
    """msb-kernels from that venv, as its user runs it: its own kernelspecs (installed into it), nothing of the suite's."""
    env = {**venv_environment(venv), "MSB_BACKEND": backend, "MSB_RUNTIME_DIR": tempfile.mkdtemp(prefix="msbt-rt-", dir="/tmp")}
    try:
        _install(venv, env)
        return subprocess.run(
            [str(venv / "bin" / "python"), "-m", "msb_kernels.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=venv.parent,
        )
    finally:
        shutil.rmtree(env["MSB_RUNTIME_DIR"], ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("place", ["tmp", "home", "symlink"])
@pytest.mark.parametrize("backend", every_builtin_backend())
def test_a_kernel_starts_from_a_venv_where_users_keep_it_and_sees_nothing_beside_it(backend, place, user_venvs, tmp_path):
    venv = user_venvs[place]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(PROBE_CELL), nbformat.v4.new_code_cell("x = 41\nx + 1")])
    nbformat.write(notebook, tmp_path / "probe.ipynb")
    os.chmod(tmp_path, 0o755)
    result = _run(venv, backend, "run", str(tmp_path / "probe.ipynb"), "--timeout", "120")
    assert result.returncode == 0, f"{backend} from {venv}: {result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    line = next(text for text in result.stdout.splitlines() if text.startswith("{"))
    seen = json.loads(line)
    assert seen["prefix"] == str(venv) and seen["executable"] == str(venv / "bin" / "python"), seen
    assert seen["backend"] == backend and seen["uid"] == 1000, seen
    assert seen["secret"] in ("FileNotFoundError", "PermissionError"), seen  # the host's files beside the venv stay out
    assert seen["beside"] == [".venv"], seen
    assert "\n42" in result.stdout


@pytest.mark.slow
def test_the_demo_runs_from_a_venv_in_tmp_and_in_a_home_directory_with_auto(user_venvs):
    """What a new user runs first, with MSB_BACKEND=auto: on a runsc host that is gVisor. Both places at once (each
    run's start probe waits on a gVisor start, not on a CPU)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as runs:
        results = dict(zip(("tmp", "home"), runs.map(lambda place: _run(user_venvs[place], "auto", "demo"), ("tmp", "home")), strict=True))
    for place, result in results.items():
        assert result.returncode == 0, f"{place}: {result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        assert "state survives between cells: 42" in result.stdout and "done in" in result.stdout, place
        assert "Traceback" not in result.stderr and "failed its start probe" not in result.stderr, (place, result.stderr[-2000:])


@pytest.mark.slow
@needs_runsc
async def test_a_kernel_hibernates_and_wakes_from_a_venv_in_tmp_and_in_a_home_directory(user_venvs):
    """A checkpoint holds the sandbox's mounts, the venv's bind over the sandbox's own /tmp or /home among them, and
    runsc restore must find them again. A gateway from each place at once, run from that venv as its user runs it; a
    notebook's WebSocket stays open across the sleep."""
    import asyncio

    from tests.msb_kernels.gateway.conftest import KernelSocket, launch_gateway, wait_until

    async def sleep_and_wake(place: str) -> None:
        venv = user_venvs[place]
        _install(venv, venv_environment(venv))
        runtime = Path(tempfile.mkdtemp(prefix="msbt-hb-", dir="/tmp"))
        settings = {"MSB_BACKEND": "gvisor", "MSB_HIBERNATE_AFTER_SECONDS": "2", "MSB_HIBERNATE_DIR": str(runtime / "images")}
        gateway = await launch_gateway(settings, runtime_dir=runtime / "rt", venv=venv)
        try:
            kernel_id = await gateway.start_kernel()
            notebook = await KernelSocket.open(gateway, kernel_id)
            assert (await notebook.execute("import sys; x = 41; sys.prefix")).result == repr(str(venv))

            async def hibernated() -> bool:
                (entry,) = [k for k in (await gateway.stats())["kernels"] if k["id"] == kernel_id]
                return entry["execution_state"] == "hibernated"

            await wait_until(hibernated, 30, f"the kernel from {place} to hibernate")
            assert (await notebook.execute("x + 1", timeout=60)).result == "42", gateway.log()[-3000:]
            notebook.connection.close()
        finally:
            gateway.stop()
            shutil.rmtree(runtime, ignore_errors=True)

    await asyncio.gather(sleep_and_wake("tmp"), sleep_and_wake("home"))


def test_a_venv_under_a_directory_others_cannot_enter_is_named_with_what_to_do() -> None:
    """A venv made as root on a Python under /root (0700) is one no person's server can run under JupyterHub (issue
    55, point 1): `msb-kernels install`, which scripts/run runs, and doctor name the closed directory and the command."""
    if not os.path.exists(hostpaths.SYSTEM_PYTHON) or hostpaths.closed_to_others(hostpaths.SYSTEM_PYTHON) is not None:
        pytest.skip(f"no {hostpaths.SYSTEM_PYTHON} that every user can run here, to make a venv of")
    outer = Path(tempfile.mkdtemp(prefix="msbt-closed-", dir="/tmp"))
    try:
        outer.chmod(0o755)
        closed = outer / "root-only"
        (closed / "venv" / "bin").mkdir(parents=True)
        closed.chmod(0o700)
        python = closed / "venv" / "bin" / "python"
        python.symlink_to(hostpaths.SYSTEM_PYTHON)
        assert hostpaths.closed_to_others(str(python)) == closed
        note = hostpaths.closed_note(str(python))
        assert note and str(closed) in note and f"rm -rf {closed / 'venv'} && PYTHON=" in note and "scripts/run --install-only" in note
        closed.chmod(0o755)
        assert hostpaths.closed_to_others(str(python)) is None and hostpaths.closed_note(str(python)) is None
    finally:
        shutil.rmtree(outer)
    ran = subprocess.run([str(VENV_BIN / "msb-kernels"), "install", "--prefix", str(outer)], capture_output=True, text=True, timeout=120)
    shutil.rmtree(outer, ignore_errors=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    suite = hostpaths.closed_to_others(str(VENV_BIN / "python"))
    assert ("note: this venv's Python" in ran.stderr) == (suite is not None and os.geteuid() == 0), ran.stderr[-2000:]


def test_an_install_in_a_persons_home_is_named_with_where_a_team_installs() -> None:
    """Every interpreter path is bound into every sandbox at its own path: a venv in the operator's home showed
    /home/<operator> in each person's kernel (issue 55, point 10). `msb-kernels install` (as root) and doctor say so,
    with the install docs/teams.md gives a team; an install under /opt names no one and is not flagged."""
    if not os.path.exists(hostpaths.SYSTEM_PYTHON) or hostpaths.closed_to_others(hostpaths.SYSTEM_PYTHON) is not None:
        pytest.skip(f"no {hostpaths.SYSTEM_PYTHON} that every user can run here, to make a venv of")
    token = uuid.uuid4().hex[:8]
    places = {"home": Path(f"/home/msbt-{token}"), "opt": Path(f"/opt/msbt-{token}")}
    try:
        for place in places.values():
            (place / "msb-kernels" / ".venv" / "bin").mkdir(parents=True)
            (place / "msb-kernels" / ".venv" / "bin" / "python").symlink_to(hostpaths.SYSTEM_PYTHON)
        note = hostpaths.shown_note(str(places["home"] / "msb-kernels" / ".venv" / "bin" / "python"))
        assert note and f"every sandbox shows {places['home'] / 'msb-kernels' / '.venv'} " in note, note
        command = f"git clone <this repository> /opt/msb-kernels && cd /opt/msb-kernels && PYTHON={hostpaths.SYSTEM_PYTHON} ./scripts/run"
        assert note.endswith(f"{command} --install-only") and hostpaths.TEAM_INSTALL_COMMAND in (REPO / "docs" / "teams.md").read_text()
        assert hostpaths.shown_note(str(places["opt"] / "msb-kernels" / ".venv" / "bin" / "python")) is None
    finally:
        for place in places.values():
            shutil.rmtree(place, ignore_errors=True)
    doctor = subprocess.run([str(VENV_BIN / "msb-kernels"), "doctor"], capture_output=True, text=True, timeout=300)
    shown = hostpaths.shown_note(str(VENV_BIN / "python"))
    assert f"  in sandboxes: {shown or 'no path of it names a person'}" in doctor.stdout, doctor.stdout[-3000:]
