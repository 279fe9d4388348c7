"""`msb-kernels env`'s refusals: each names the argument and what to do, and leaves the store and the kernelspecs as
they were. Real interpreters (pyenv's old ones where the host has them), a real pip, no kernels."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from msb_kernels.errors import InvalidRequest
from tests.msb_kernels.environments.conftest import SUITE_PREFIX, EnvHost

OLD_PYTHONS = sorted(Path("/root/.pyenv/versions").glob("3.[5-8].*/bin/python")) if os.access("/root", os.X_OK) else []


def _refused(host: EnvHost, *args: str) -> str:
    """The command fails with a clear error (no traceback), and nothing was written."""
    before = host.store_text()
    specs_before = set(KernelSpecManager().find_kernel_specs())
    result = host.env_cli(*args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stderr.startswith("msb-kernels: error: "), result.stderr
    assert host.store_text() == before
    assert set(KernelSpecManager().find_kernel_specs()) == specs_before
    return result.stderr


def test_names_are_lowercase_letters_digits_and_dashes_and_not_taken(env_host):
    for name in ("Data", "data_science", "_data", "data-", "a" * 41, "data.1"):
        assert "NAME" in _refused(env_host, "add", name, "--python", sys.executable), name
    for name in ("python", "node", "small", "large", "default", "python3"):
        assert "is a template, a flavor or the default" in _refused(env_host, "add", name, "--python", sys.executable), name


def test_a_name_that_clashes_with_an_installed_kernelspec_is_refused(env_host, tmp_path):
    spec = tmp_path / "clash"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({"argv": ["python", "-m", "ipykernel_launcher"], "display_name": "R", "language": "R"}))
    manager = KernelSpecManager()
    installed = manager.install_kernel_spec(str(spec), "clashing", prefix=str(Path(os.environ["JUPYTER_PATH"]).parent.parent))
    try:
        error = _refused(env_host, "add", "clashing", "--python", sys.executable)
        assert "clashes with the installed kernelspec clashing" in error and "jupyter kernelspec remove clashing" in error
    finally:
        manager.remove_kernel_spec("clashing")
    assert installed


def test_an_interpreter_that_is_missing_a_directory_or_not_executable_is_refused(env_host, tmp_path):
    assert "--python /no/such/python: no such file" in _refused(env_host, "add", "data", "--python", "/no/such/python")
    assert "is a directory" in _refused(env_host, "add", "data", "--python", str(tmp_path))
    plain = tmp_path / "python"
    plain.write_text("#!/bin/sh\n")
    error = _refused(env_host, "add", "data", "--python", str(plain))
    assert "is not executable" in error and f"chmod +x {plain}" in error


def test_a_broken_interpreter_is_refused_in_its_own_words(env_host, tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'error while loading shared libraries: libpython3.11.so.1.0' >&2\nexit 127\n")
    broken.chmod(0o755)
    error = _refused(env_host, "add", "data", "--python", str(broken))
    assert "is not a working Python interpreter: error while loading shared libraries: libpython3.11.so.1.0" in error


def test_an_interpreter_without_ipykernel_is_refused_with_the_pip_command(env_host, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    error = _refused(env_host, "add", "data", "--python", str(venv / "bin" / "python"))
    assert f"ipykernel is not installed in it: run `{venv}/bin/python -m pip install ipykernel` first" in error


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python older than 3.9 on this host (pyenv's under /root/.pyenv)")
def test_a_python_too_old_is_refused_by_its_version():
    host = EnvHost(Path(os.environ["MSB_RUNTIME_DIR"]).parent / "envs-old")
    error = _refused(host, "add", "data", "--python", str(OLD_PYTHONS[0]))
    assert "is too old: sandboxed kernels need Python 3.9 or newer" in error


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_a_requirements_file_that_does_not_resolve_gives_pips_reason_and_leaves_nothing(env_host, tmp_path, wheels, installer):
    if installer == "pip":  # a host without uv on PATH: the new venv's own pip
        env_host.path = "/usr/local/bin:/usr/bin:/bin"
        assert shutil.which("uv", path=env_host.path) is None
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("msbenvprobe\nno-such-package-anywhere==1.0\n")
    error = _refused(env_host, "create", "data", "-r", str(requirements), "--wheels", str(wheels))
    # pip's "ERROR:" lines, or uv's "error:" and "cause:" (uv where it is on PATH, as in this venv): their reason only
    assert re.search(rf"installing the requirements with {installer} failed: (ERROR|error): ", error), error
    assert "no-such-package-anywhere" in error and "Collecting" not in error and "Using Python" not in error, error
    assert not (env_host.directory / "data").exists()  # no half-made venv
    assert "-r /no/such/file: no such file" in _refused(env_host, "create", "data", "-r", "/no/such/file")
    assert "--wheels /no/such/dir: no such directory" in _refused(
        env_host, "create", "data", "-r", str(requirements), "--wheels", "/no/such/dir"
    )


def test_unknown_environments_are_named_with_the_registered_ones(env_host):
    for command in ("remove", "check"):
        error = _refused(env_host, command, "nope")
        assert "NAME 'nope': no such environment (registered: none yet)" in error
    listed = env_host.cli("env", "list")
    assert listed.returncode == 0 and "no environments" in listed.stdout


def test_an_image_build_refuses_another_template_an_unknown_name_and_an_interpreter_a_kernel_would_not_see(env_host, tmp_path):
    """`msb-kernels image build python --env NAME`'s refusals, before it reads an image: no traceback, nothing recorded."""
    venv = tmp_path / "venv"  # under /tmp, where a Swarm kernel's container mounts a tmpfs of its own
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "ipykernel").is_dir())
    next((venv / "lib").glob("python3.*")).joinpath("site-packages", "suite.pth").write_text(f"{site}\n")
    assert env_host.env_cli("add", "intmp", "--python", str(venv / "bin" / "python")).returncode == 0
    try:
        before = env_host.store_text()
        for args, words in (
            (("node", "--env", "intmp"), "--env intmp: an environment's image is built offline from this host's interpreter"),
            (("python", "--env", "nope"), "--env 'nope': no such environment (registered: intmp)"),
            (
                ("python", "--env", "intmp", "--from-archive", str(tmp_path / "absent.tar")),
                f"its interpreter needs {venv}/bin/python, under /tmp",
            ),
        ):
            result = env_host.cli("image", "build", *args, "--engine", "none", "--save-archive", str(tmp_path / "out.tar"))
            assert result.returncode == 2 and words in result.stderr, (args, result.stderr)
            assert "Traceback" not in result.stderr and result.stderr.startswith("msb-kernels: error: "), result.stderr
        assert env_host.store_text() == before and not (tmp_path / "out.tar").exists()
    finally:
        env_host.cli("env", "remove", "intmp")


def test_install_rewrites_every_registered_environments_kernelspecs(env_host):
    """An interpreter that has ipykernel (the suite's own) added, its kernelspec lost, and `msb-kernels install` again."""
    added = env_host.env_cli("add", "again", "--python", sys.executable)
    assert added.returncode == 0, added.stderr
    try:
        assert "again" in (env_host.store_text() or "")
        assert "NAME 'again': an environment of that name exists" in _refused(env_host, "add", "again", "--python", sys.executable)
        kernels = Path(os.environ["JUPYTER_PATH"]) / "kernels"
        spec = json.loads((kernels / "msb-again-python-medium" / "kernel.json").read_text())
        assert spec["display_name"] == "Python 3 (again, sandbox, medium)" and spec["argv"][0] == sys.executable
        shutil.rmtree(kernels / "msb-again-python-medium")
        installed = env_host.cli("install", "--prefix", str(SUITE_PREFIX))
        assert installed.returncode == 0, installed.stderr
        assert "installed msb-again-python-medium: Python 3 (again, sandbox, medium)" in installed.stdout
        assert (kernels / "msb-again-python-medium" / "kernel.json").is_file()
    finally:
        removed = env_host.cli("env", "remove", "again")
    assert removed.returncode == 0 and not list(kernels.glob("msb-again-*")), removed.stderr
    assert Path(sys.executable).exists(), "remove deleted an interpreter it did not create"


def test_check_reports_a_kernel_that_cannot_start_a_broken_interpreter_and_one_without_ipykernel(env_host, tmp_path, monkeypatch):
    """An interpreter that worked when added, then: one whose kernel cannot start in a sandbox (a wrapper that needs a
    host file beside its prefix, which no sandbox shows), one that broke, one that lost ipykernel; each in its own words."""
    prefix = tmp_path / "wrapped"
    (prefix / "bin").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    python = prefix / "bin" / "python"
    needed = tmp_path / "licence.key"
    needed.write_text("host only")
    python.write_text(f'#!/bin/sh\n[ -e {needed} ] || {{ echo "cannot read {needed}" >&2; exit 3; }}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    added = env_host.env_cli("add", "wrapped", "--python", str(python))
    assert added.returncode == 0, added.stderr
    # A namespace fork server runs its interpreter on the host, where the file is: each kernel its own, in its sandbox.
    monkeypatch.setenv("MSB_FORK_KERNELS", "false")
    try:
        checked = env_host.cli("env", "check", "wrapped")
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "wrapped: Python 3." in checked.stdout and "namespace: failed: a kernel from " in checked.stdout, checked.stdout
        assert f"kernel stderr: cannot read {needed}" in checked.stdout, checked.stdout  # the kernel's own words

        python.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding: failed to get the Python codec' >&2\nexit 1\n")
        checked = env_host.cli("env", "check", "wrapped")
        assert checked.returncode == 1 and "wrapped: broken: " in checked.stdout, checked.stdout
        assert "Fatal Python error: init_fs_encoding: failed to get the Python codec" in checked.stdout, checked.stdout

        # Repaired, with a package more (on a PYTHONPATH the wrapper keeps, -E or not): check records what it holds now,
        # in the store and in its kernelspecs.
        site = tmp_path / "extra"
        (site / "aaamsbextra-2.0.dist-info").mkdir(parents=True)
        (site / "aaamsbextra-2.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: aaamsbextra\nVersion: 2.0\n")
        python.write_text(
            '#!/bin/bash\nargs=(); for a in "$@"; do [ "$a" = -E ] || args+=("$a"); done\n'
            f'PYTHONPATH={site} exec {sys.executable} "${{args[@]}}"\n'
        )
        env_host.cli("env", "check", "wrapped")
        assert "aaamsbextra 2.0" in env_host.cli("env", "list").stdout
        spec = json.loads((Path(os.environ["JUPYTER_PATH"]) / "kernels" / "msb-wrapped-python-small" / "kernel.json").read_text())
        assert "aaamsbextra 2.0" in spec["metadata"]["msb"]["packages"], spec["metadata"]["msb"]

        bare = tmp_path / "bare"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
        python.write_text(f'#!/bin/sh\nexec {bare}/bin/python "$@"\n')
        checked = env_host.cli("env", "check")
        assert checked.returncode == 1 and "wrapped: ipykernel is not installed in it" in checked.stdout, checked.stdout
    finally:
        removed = env_host.cli("env", "remove", "wrapped")
    assert removed.returncode == 0, removed.stderr


async def test_a_kernel_of_an_environment_whose_interpreter_is_gone_is_refused_before_a_sandbox_starts(env_host, tmp_path):
    python = tmp_path / "gone" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    assert env_host.env_cli("add", "gone", "--python", str(python)).returncode == 0
    try:
        python.unlink()
        km = AsyncKernelManager(kernel_name="msb-gone-python-small")
        with pytest.raises(InvalidRequest, match=f"environment gone: its interpreter {python} is gone or not executable"):
            await km.start_kernel()
    finally:
        assert env_host.cli("env", "remove", "gone").returncode == 0


def test_adds_at_once_keep_every_environment(env_host):
    """The store is changed under a lock and replaced whole: four `env add`s at once leave four environments."""
    names = [f"at-once-{n}" for n in range(4)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "msb_kernels.cli", "env", "add", name, "--python", sys.executable, "--prefix", str(SUITE_PREFIX)],
            env=env_host.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name in names
    ]
    try:
        assert [p.wait(120) for p in processes] == [0] * 4, [p.stderr.read() for p in processes]
        stored = json.loads(env_host.store_text() or "{}")
        assert sorted(e["name"] for e in stored["environments"]) == names and stored["format"] == 1
        assert not [p for p in env_host.directory.iterdir() if p.name.startswith(".environments-")]  # no temporary file left
    finally:
        for name in names:
            env_host.cli("env", "remove", name)
