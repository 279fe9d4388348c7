"""The variables a session asks for its kernel: one deny list for every way they come (a start request to the
gateway, an MCP session's ``env``), and the marker that carries which names were asked for through a start request.

Why a marker: a start request's environment is the host's with the request's variables on top (jupyter_client's
way), and the provisioner passes a kernel only what differs from the host's, so that the host's tokens never reach
it. A variable asked for with the host's own value would be lost; the marker names what was asked for.
"""

from __future__ import annotations

import os
import re
from typing import Any

from msb_kernels.errors import InvalidRequest

REQUESTED_NAMES = "KERNEL_ENV_NAMES"  # in a start request's env: the names a session asked for, comma-separated
# What no session sets: the dynamic linker's and Python's start-up hooks (they run before the kernel's own code and
# can stop it from starting), the project's own MSB_* (what the kernel is told about its sandbox) and Jupyter's JPY_*.
DENIED_PREFIXES = ("LD_", "PYTHON", "MSB_", "JPY_")
MAX_VARIABLES = 64
MAX_VALUE_CHARS = 32 * 1024
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def check_env(env: Any, argument: str, *, kernel_variables: bool = False, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """env checked: a JSON object of names to strings, none denied. kernel_variables: KERNEL_* may be set (a start
    request's own channel); an MCP session sets those through its own arguments instead."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise InvalidRequest(f'{argument} must be an object of variable names to strings, e.g. {{"MY_SETTING": "1"}}')
    if len(env) > MAX_VARIABLES:
        raise InvalidRequest(f"{argument} sets {len(env)} variables, over the limit of {MAX_VARIABLES}")
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{argument}: {name!r} is not a variable name (letters, digits and _, not starting with a digit)")
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_VALUE_CHARS:
            raise InvalidRequest(f"{argument}: {name} must be a string without NUL, at most {MAX_VALUE_CHARS} characters")
        if name in allowed:
            checked[name] = value
            continue
        upper = name.upper()
        denied = next((prefix for prefix in DENIED_PREFIXES if upper.startswith(prefix)), None)
        if denied is None and upper.startswith("KERNEL_") and not kernel_variables:
            denied = "KERNEL_"
        if denied is not None:
            raise InvalidRequest(
                f"{argument}: {name} may not be set for a sandboxed kernel ({denied}* variables are the sandbox's own)",
                ["leave it out", "use flavor, network_allow and secrets for what KERNEL_* variables would set"]
                if denied == "KERNEL_"
                else ["leave it out; set what the kernel needs under another name"],
            )
        checked[name] = value
    return checked


def start_request_env(requested: dict[str, str]) -> dict[str, str]:
    """A start request's env for a session that asked for requested: the host's, the request's, and the marker."""
    names = [name for name in requested if not name.startswith("KERNEL_")]
    marker = {REQUESTED_NAMES: ",".join(names)} if names else {}
    return {**os.environ, **requested, **marker}


def requested_names(env: dict[str, str]) -> set[str]:
    """The names a start request's session asked for (the marker's), beside its KERNEL_* variables."""
    return {name for name in env.get(REQUESTED_NAMES, "").split(",") if name}


def requested_env(env: dict[str, str]) -> dict[str, str]:
    """The part of a start request's env that the request set: KERNEL_*, the marker and its names, the notebook's path
    (what an adopting gateway passes again, and the pool compares)."""
    names = requested_names(env) | {"JPY_SESSION_NAME"}
    return {name: value for name, value in env.items() if name.startswith("KERNEL_") or name in names}
