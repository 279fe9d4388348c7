"""The suite's own rule for skips (tests/skips.py) holds where .ci/run turns it on."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import skips
from tests.conftest import REPO

PROGRAM = (
    "import shutil, tests.conftest as c, tests.skips as s; print(s.strict(), 'MSB_BACKEND_X' in c.os.environ); shutil.rmtree(c.TEST_BASE)"
)


def test_the_environments_isolation_keeps_the_strict_skips_switch():
    """conftest drops every MSB_* setting of the caller's, so no host setting leaks into a test; it dropped
    MSB_TESTS_STRICT_SKIPS too, and CI's unexpected skips passed as skips."""
    env = {**os.environ, "MSB_TESTS_STRICT_SKIPS": "1", "MSB_BACKEND_X": "leaks"}
    run = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == ["True", "False"], run.stdout + run.stderr


def test_an_unlisted_reason_is_unexpected_and_a_listed_one_is_not():
    assert skips.unexpected("cgroups were not detected")
    assert not skips.unexpected("microsandbox backend cannot run on this host: msb doctor: CPU virtualization is not available")
