"""The code the host hands a kernel to run (msb_kernels/kernelspecs/kernel_code.py), run by the interpreters it meets."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from msb_kernels.kernelspecs import kernel_code
from tests.msb_kernels.environments.wheels import PROBE_PACKAGE, PROBE_VALUE, probe_wheel

DEBIAN_PYTHON = Path("/usr/bin/python3")
MARKED = sorted(Path("/usr/lib").glob("python3*/EXTERNALLY-MANAGED"))


@pytest.mark.skipif(not MARKED, reason="no distribution Python marked EXTERNALLY-MANAGED (PEP 668) here: Debian 12+'s python3 has one")
def test_pip_install_user_works_on_a_venv_of_debians_own_python(tmp_path: Path) -> None:
    """`%pip install --user` runs pip through PYTHON_PIP_RUNNER, which hides the kernel's venv so that pip installs into
    the person's own base. On a venv of Debian's Python, the Python docs/teams.md prescribes, pip then read Debian's
    EXTERNALLY-MANAGED and refused: "error: externally-managed-environment" (issue 55, point 4)."""
    venv = tmp_path / "venv"
    made = subprocess.run([str(DEBIAN_PYTHON), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"{DEBIAN_PYTHON} -m venv failed (apt-get install python3-venv): {made.stderr.strip()[-300:]}")
    runner = tmp_path / "pip_runner.py"
    runner.write_text(kernel_code.PYTHON_PIP_RUNNER)
    wheel = probe_wheel(tmp_path)
    base = tmp_path / "person"
    env = {"PATH": os.environ["PATH"], "PYTHONUSERBASE": str(base), "HOME": str(tmp_path)}
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, str(runner), "install", "--user", "--no-index", str(wheel)], env=env, capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert "externally-managed" not in installed.stderr
    found = subprocess.run(
        [python, "-c", f"import site, sys; sys.path.insert(0, site.getusersitepackages()); import {PROBE_PACKAGE} as p; print(p.VALUE)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.stdout.strip() == str(PROBE_VALUE), found.stderr[-1000:]
    assert not list((venv / "lib").glob(f"python3*/site-packages/{PROBE_PACKAGE}")), "installed into the venv, not the person's base"
