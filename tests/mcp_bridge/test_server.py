"""build_server as a library call: what it leaves of the embedding process."""

from __future__ import annotations

import subprocess

from tests.conftest import VENV_BIN

BUILD_AND_REPORT = """
import logging
from mcp_bridge.local_sessions import ManagedKernelSessions
from mcp_bridge.server import build_server
from msb_kernels.identity.people import local_person
root = logging.getLogger()
before = (root.level, list(root.handlers))
build_server(ManagedKernelSessions(), local_caller=local_person())
print(before == (root.level, list(root.handlers)), logging.getLevelName(root.level), root.handlers)
"""


def test_building_the_server_leaves_the_processes_logging_alone():
    # MCPServer() runs logging.basicConfig(INFO) with a rich handler; an application that embeds the bridge
    # (and the bench's client, which times HTTP calls) would then log every request it makes. A subprocess:
    # pytest's own handlers on the root logger would turn basicConfig into a no-op here.
    printed = subprocess.run([str(VENV_BIN / "python"), "-c", BUILD_AND_REPORT], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.split()[:2] == ["True", "WARNING"], printed.stdout
