"""What a test may skip for, and the rule that a skip on CI's host is a failure unless listed here.

A feature check that breaks (cgroups not detected, node not found after ``msb-kernels install``,
a gateway that does not start) must not quietly turn its tests into skips on a host that has
the feature. With ``MSB_TESTS_STRICT_SKIPS=1`` (``.ci/run`` sets it) any skip whose reason is
not in :data:`EXPECTED_SKIPS` is reported as a failure. On other machines skips stay skips,
each with its reason, because a developer's laptop may lack chromium or root.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from msb_kernels.backends.core import cgroups
from msb_kernels.backends.gvisor import GVisorBackend
from msb_kernels.kernelspecs.templates import TEMPLATES

# reason pattern -> why CI's host (2 cores, paravirtual KVM, root, cgroups v1, no internet) lacks it
EXPECTED_SKIPS: dict[str, str] = {
    r"microsandbox backend cannot run on this host: .*(virtualization|KVM|kvm)": "microVMs cannot boot: KVM here has no vmx/svm",
    r"the microsandbox backend's python kernel does not speak CurveZMQ": "only a booted microVM image is checked for CurveZMQ",
    r"microVMs boot on this host": "the no-boot checks are skipped only where microVMs do boot",
    r"unprivileged sandboxes get no network on this host: /dev/net/tun is mode 0600": "some of these machines keep /dev/net/tun root-only; the test checks the clear refusal before it skips",
    r"gvisor backend cannot run on this host: runsc is not installed": "the test command installs runsc with apt where it can; a host whose apt lacks it skips the gVisor half",
    r"the host's package indexes are .*none is a network service": "CI's pip index is a local file mirror, which no sandbox can reach over a network",
}


def strict() -> bool:
    return os.environ.get("MSB_TESTS_STRICT_SKIPS", "") not in ("", "0", "false")


def unexpected(reason: str) -> bool:
    return not any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS)


_cgroup_hierarchy, _cgroup_note = cgroups.detect()
needs_cgroups = pytest.mark.skipif(_cgroup_hierarchy is None, reason=f"flavor limits need cgroups: {_cgroup_note}")

_node_reason = TEMPLATES["node"].unavailable_reason()
needs_node = pytest.mark.skipif(_node_reason is not None, reason=f"node kernels unavailable: {_node_reason}")

_gvisor = GVisorBackend.availability()
needs_runsc = pytest.mark.skipif(not _gvisor.ok, reason=f"gvisor backend cannot run on this host: {_gvisor.reason}")

# JupyterHub in front of the gateway (tests/hub.py): not expected to skip on CI, where scripts/test installs both.
_HUB_PREFIX = Path(sys.prefix) / "share" / "msb-kernels"
CHP = _HUB_PREFIX / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"


def hub_unavailable() -> str | None:
    """Why a JupyterHub cannot run here, with how to fix it; None where it can."""
    if importlib.util.find_spec("jupyterhub") is None:
        return "jupyterhub is not installed: run ./scripts/test (or pip install -e '.[test]')"
    if not os.access(CHP, os.X_OK):
        return "configurable-http-proxy is not installed: run ./scripts/test (npm needed)"
    if shutil.which("node") is None:
        return "configurable-http-proxy needs node, which is not on PATH: install Node.js >= 20"
    return None


needs_hub = pytest.mark.skipif(hub_unavailable() is not None, reason=f"no JupyterHub here: {hub_unavailable()}")


def every_builtin_backend() -> list:
    """pytest params for the built-in backends: those that cannot run here skip, with the backend's own reason (for the
    microVM, `msb doctor`'s), which EXPECTED_SKIPS knows."""
    from msb_kernels.backends import backend_classes

    params = []
    for name in ("namespace", "gvisor", "microsandbox"):
        cls = backend_classes().get(name)
        availability = cls.availability() if cls else None
        ok = availability is not None and availability.ok
        why = availability.reason if availability else "not installed"
        params.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name} backend cannot run on this host: {why}")))
    return params
