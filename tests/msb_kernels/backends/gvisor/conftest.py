"""Fixtures of the gVisor tests."""

from __future__ import annotations

import itertools
import secrets

import pytest

from tests.conftest import TEST_BASE

_runtime = itertools.count(1)


@pytest.fixture
def hibernating(monkeypatch):
    """gVisor kernels over its network stack, with an encryption key, in a runtime dir of their own."""
    key = TEST_BASE / f"hibernate-{next(_runtime)}.key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    runtime = TEST_BASE / f"hb{next(_runtime)}"
    for name, value in {
        "MSB_BACKEND": "gvisor",
        "MSB_HIBERNATE_AFTER_SECONDS": "60",
        "MSB_RUNTIME_DIR": str(runtime),
        "MSB_HIBERNATE_DIR": str(runtime / "images"),
        "MSB_HIBERNATE_KEY_FILE": str(key),
    }.items():
        monkeypatch.setenv(name, value)
    return runtime / "images"
