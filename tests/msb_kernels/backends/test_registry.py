"""The backend registry: every backend, the built-in ones included, is an entry point, and the contract suite
takes its variants from what is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from msb_kernels.backends import backend_classes
from tests.conftest import REPO

TOY = REPO / "tests" / "data" / "toy_backend"


def test_the_built_in_backends_are_entry_points_of_this_package():
    registered = {point.name: point.value for point in entry_points(group="msb_kernels.backends")}
    assert {name: registered.get(name) for name in ("namespace", "gvisor", "microsandbox")} == {
        "namespace": "msb_kernels.backends.namespace.backend:NamespaceBackend",
        "gvisor": "msb_kernels.backends.gvisor.backend:GVisorBackend",
        "microsandbox": "msb_kernels.backends.microsandbox.backend:MicrosandboxBackend",
    }
    assert list(backend_classes()) == sorted(backend_classes(), key=lambda name: backend_classes()[name].auto_order)


@pytest.mark.slow
def test_a_backend_installed_from_another_package_is_tested_by_the_contract_suite():
    """tests/data/toy_backend: one module and one entry point. Installed (on the path), the contract suite picks it up."""
    env = {**os.environ, "PYTHONPATH": f"{TOY}{os.pathsep}{REPO}", "MSB_TESTS_STRICT_SKIPS": "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "toy",
            "-rA",
            str(REPO / "tests" / "msb_kernels" / "backends" / "test_contract.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    ran = [line for line in result.stdout.splitlines() if line.startswith("PASSED") and "[toy]" in line]
    assert len(ran) >= 8, result.stdout[-4000:]
    assert "test_the_kernel_runs_in_the_requested_backend[toy]" in result.stdout
