"""What the gateway knows of each kernel it runs: its Allocation (flavor, template, notebook, the start request's
variables), and the sandbox side of its kernel manager."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from msb_kernels.errors import InvalidRequest
from msb_kernels.flavors import Flavor
from msb_kernels.provisioner import SandboxDescription, SandboxProvisioner
from msb_kernels.session_env import check_env

# Variables a start request may set beside KERNEL_* and its own: the notebook path for stats (a JPY_* name).
ALLOWED_START_ENV = ("JPY_SESSION_NAME",)


def start_env(requested: Any) -> dict[str, str]:
    """The environment a start request gives its kernel, checked against the deny list (session_env)."""
    if requested is not None and not isinstance(requested, dict):
        raise InvalidRequest("env must be a JSON object of strings", ['send "env": {"KERNEL_FLAVOR": "medium"}, or no env'])
    return check_env(
        {str(k): v if isinstance(v, str) else str(v) for k, v in (requested or {}).items()},
        "env",
        kernel_variables=True,
        allowed=ALLOWED_START_ENV,
    )


@dataclass
class Allocation:
    """What one kernel holds: counted against the limits from its start request until it stops."""

    kernel_id: str
    kernel_name: str
    flavor: Flavor
    template: str
    created: float = field(default_factory=time.time)
    notebook_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # what its start request set (start_env), for an adopting gateway
    owner: str | None = None  # the person who started it (msb_kernels.identity); None: the system's


def describe(km: Any) -> SandboxDescription | None:
    """The sandbox side of a kernel manager; None before its provisioner exists or for a kernel not in a sandbox."""
    provisioner = getattr(km, "provisioner", None)
    return provisioner.describe() if isinstance(provisioner, SandboxProvisioner) else None


def sandbox_of(km: Any) -> Any:
    """The kernel's Sandbox (msb_kernels.backends.core.base); None where describe() has none."""
    described = describe(km)
    return described.sandbox if described is not None else None


def backend_of(sandbox: Any) -> str:
    """The backend a sandbox_of() runs on, as metrics label it: "none" for a kernel not in a sandbox."""
    return (sandbox.info().get("backend") if sandbox is not None else None) or "none"
