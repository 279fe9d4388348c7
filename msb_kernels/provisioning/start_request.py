"""What one kernel start asks for: a typed StartRequest, one per kernel, that every later start of it uses again.

Who builds one:
- the gateway, from a client's ``POST /api/kernels`` body (``from_variables``: the Jupyter kernel gateway's ``env``
  object, KERNEL_* names and the client's own variables) or a session's path, and from the caller's identity, which
  alone sets the owner and the volume (MsbKernelManager.start_kernel);
- the MCP bridge, from a tool's arguments (mcp_bridge.arguments.NewSession);
- the warm pool, for the system's waiting kernels (msb_kernels.provisioning.pool);
- a local jupyter_client start (nbclient, papermill, jupyter console), from the KERNEL_* variables of the environment
  its caller passes (``for_local_start``): that caller is the host's own user.

Where it lives: jupyter_client keeps a start's keyword arguments for every later start of the same kernel (a restart,
an auto-restart after the kernel's death), so the request rides there as ``start_request``; the gateway's record of the
kernel holds the same object, persists it for adoption (``to_record``), and hands it to a pooled kernel's restarts when
it hands the kernel out. The provisioner reads nothing else: the gateway's own environment is never part of a start,
and a kernel's variables are what its sandbox needs plus ``env``.

Why typed: a start request that rode in environment variables was the gateway's whole environment with the request on
top, and a marker told the kernel's variables from the gateway's. A client could set the marker, and name the admin
token. Here no field holds anything of the gateway's, and every field is checked where the request is made.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import Owner
from msb_kernels.identity.volumes import WHOLE_VOLUME

START_REQUEST = "start_request"  # the keyword argument of jupyter_client's start_kernel that carries one
# The Jupyter kernel gateway's names in a start request's env, each read into its own field.
FLAVOR = "KERNEL_FLAVOR"
NETWORK_ALLOW = "KERNEL_NETWORK_ALLOW"
SECRETS = "KERNEL_SECRETS"
ARGUMENTS = "KERNEL_NETWORK_ARGUMENTS"  # "network_allow,secrets": what a client called the two, for its errors
WORKING_DIR = "KERNEL_WORKING_DIR"  # JupyterLab's gateway client: the notebook's directory, on the client's host
NOTEBOOK = "JPY_SESSION_NAME"  # the notebook's path; the kernel sees it too (ipykernel's __session__)
# Read and dropped: how long the client waits for the start is the client's business.
IGNORED = ("KERNEL_LAUNCH_TIMEOUT",)
# A local start's caller is the host's own user: their locale and time zone are theirs to give their kernel.
LOCAL_SETTINGS = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")
# Variables that describe the client, not the sandbox: a fresh kernel gets them, a pooled one serves without them.
DESCRIPTIVE = ("KERNEL_USERNAME", *LOCAL_SETTINGS)

# What no session sets: the dynamic linker's and Python's start-up hooks (they run before the kernel's own code and
# can stop it from starting), the project's own MSB_* (what the kernel is told about its sandbox) and Jupyter's JPY_*.
DENIED_PREFIXES = ("LD_", "PYTHON", "MSB_", "JPY_")
# And what the sandbox sets for its kernel to run at all: a session's HOME="" left its kernel dying at every start.
SANDBOX_NAMES = ("HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "PATH", "NODE_OPTIONS")
MAX_VARIABLES = 64
MAX_VALUE_CHARS = 32 * 1024
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def check_env(env: Any, argument: str, *, kernel_variables: bool = False) -> dict[str, str]:
    """env checked: a JSON object of names to strings, none denied. kernel_variables: KERNEL_* may be set (a start
    request's own channel); an MCP session sets those through its own arguments instead."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise InvalidRequest(f'{argument} must be an object of variable names to strings, e.g. {{"MY_SETTING": "1"}}')
    if len(env) > MAX_VARIABLES:
        raise InvalidRequest(f"{argument} sets {len(env)} variables, over the limit of {MAX_VARIABLES}")
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{argument}: {name!r} is not a variable name (letters, digits and _, not starting with a digit)")
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_VALUE_CHARS:
            raise InvalidRequest(f"{argument}: {name} must be a string without NUL, at most {MAX_VALUE_CHARS} characters")
        upper = name.upper()
        if name in SANDBOX_NAMES:
            raise InvalidRequest(
                f"{argument}: {name} may not be set for a sandboxed kernel: the sandbox sets it for its kernel to run",
                ["leave it out", f"change it inside the kernel (os.environ[{name!r}]) if the code needs another value"],
            )
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


def _text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or "\0" in value or len(value) > MAX_VALUE_CHARS:
        raise InvalidRequest(f"{name} must be a string without NUL, at most {MAX_VALUE_CHARS} characters")
    return value


@dataclass(frozen=True)
class StartRequest:
    """One kernel start, checked when it is made: a request that exists is one the provisioner may run."""

    flavor: str | None = None  # small, medium or large; None: the kernelspec's (the gateway fills in what it chose)
    environment: str | None = None  # the Python environment the kernelspec runs (msb_kernels.environments); None: default
    env: Mapping[str, str] = field(default_factory=dict)  # the session's own variables, through the deny list
    network_allow: str | None = None  # rules narrowing the operator's list (msb_kernels.egress), or "none"
    secrets: str | None = None  # JSON declarations (msb_kernels.egress.secrets)
    argument_names: tuple[str, str] = (NETWORK_ALLOW, SECRETS)  # what the client called the two, for its errors
    owner: Owner | None = None  # whose kernel it is: set by the gateway from the caller, never from the request
    volume: str | None = None  # which part of MSB_SHARED_VOLUME_PATH it mounts: WHOLE_VOLUME, a person's directory, none
    working_dir: str | None = None  # a host path under MSB_LAB_ROOT_PATH (JupyterLab's KERNEL_WORKING_DIR)
    notebook_path: str | None = None  # the notebook it runs for (JPY_SESSION_NAME)
    # The warm pool's own start: on a backend that hands out, a sandbox with nothing of anyone's and empty slots, shown
    # its taker's volume and Lab root when the pool hands it out (SandboxSpec.handout); elsewhere the volume above.
    for_pool: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(check_env(dict(self.env), "env", kernel_variables=True)))
        for name in ("flavor", "environment", "network_allow", "secrets", "working_dir", "notebook_path"):
            _text(getattr(self, name), name)
        names = self.argument_names
        if not (isinstance(names, tuple) and len(names) == 2 and all(isinstance(n, str) and n.isidentifier() for n in names)):
            raise InvalidRequest("argument_names must be two identifiers")
        if self.owner is not None and not isinstance(self.owner, Owner):
            raise InvalidRequest("owner must be an Owner")
        if self.volume is not None and (
            not isinstance(self.volume, str) or "/" in self.volume or "\0" in self.volume or self.volume in ("", "..")
        ):
            raise InvalidRequest(f"volume={self.volume!r} is not one directory name of the shared volume")

    # -- made from variables -------------------------------------------------------------------

    @classmethod
    def from_variables(cls, variables: Any, *, argument: str = "env") -> StartRequest:
        """A start request's ``env`` object (the Jupyter kernel gateway's, as JupyterLab sends it): KERNEL_FLAVOR,
        KERNEL_NETWORK_ALLOW, KERNEL_SECRETS, KERNEL_WORKING_DIR and JPY_SESSION_NAME each into its field, every other
        name checked by the deny list into the session's own variables. Nothing else is ever read."""
        if variables is not None and not isinstance(variables, Mapping):
            raise InvalidRequest(
                f"{argument} must be a JSON object of strings", [f'send "{argument}": {{"KERNEL_FLAVOR": "medium"}}, or none']
            )
        given = {str(k): v if isinstance(v, str) else str(v) for k, v in (variables or {}).items()}
        fields: dict[str, Any] = {
            "flavor": given.pop(FLAVOR, None) or None,
            "network_allow": given.pop(NETWORK_ALLOW, None),
            "secrets": given.pop(SECRETS, None) or None,
            "working_dir": given.pop(WORKING_DIR, None) or None,
            "notebook_path": given.pop(NOTEBOOK, None) or None,
        }
        names = given.pop(ARGUMENTS, "").split(",")
        if len(names) == 2 and all(name.isidentifier() for name in names):
            fields["argument_names"] = (names[0], names[1])
        for name in IGNORED:
            given.pop(name, None)
        return cls(env=check_env(given, argument, kernel_variables=True), **fields)

    @classmethod
    def for_local_start(cls, environment: Mapping[str, str] | None) -> StartRequest:
        """What a local jupyter_client start asks for (nbclient, papermill, jupyter console): the KERNEL_* variables,
        JPY_SESSION_NAME, the locale and the time zone of the environment its caller passed (jupyter_client's default
        is the process's own), nothing else of it. Its caller is the host's own user: the whole shared volume is
        theirs."""
        chosen = {k: v for k, v in (environment or {}).items() if k.startswith("KERNEL_") or k in (NOTEBOOK, *LOCAL_SETTINGS)}
        return replace(cls.from_variables(chosen), volume=WHOLE_VOLUME)

    def wire_env(self) -> dict[str, str]:
        """The ``env`` of a ``POST /api/kernels`` that asks a remote gateway for this start (from_variables' inverse,
        less what the gateway decides: the owner and the volume)."""
        wire = dict(self.env)
        for name, value in (
            (FLAVOR, self.flavor),
            (NETWORK_ALLOW, self.network_allow),
            (SECRETS, self.secrets),
            (WORKING_DIR, self.working_dir),
            (NOTEBOOK, self.notebook_path),
        ):
            if value is not None:
                wire[name] = value
        if self.argument_names != (NETWORK_ALLOW, SECRETS):
            wire[ARGUMENTS] = ",".join(self.argument_names)
        return wire

    # -- what it makes of a kernel ---------------------------------------------------------------

    def kernel_variables(self) -> dict[str, str]:
        """The variables the kernel gets from its request (beside what its sandbox sets): the session's own, and the
        notebook's path where ipykernel reads it."""
        return {**self.env, **({NOTEBOOK: self.notebook_path} if self.notebook_path else {})}

    def sandbox_shape(self, shared_volume: bool) -> tuple:
        """What makes two starts of one kernelspec the same sandbox (the pool hands a waiting kernel only to a request
        of its shape): the session's variables (less those that only describe the client), its network, and its part
        of the shared volume where the host has one. Not who asks, nor the notebook; the flavor and the working
        directory the pool checks against the kernelspec and the Lab root."""
        variables = tuple(sorted((k, v) for k, v in self.env.items() if k not in DESCRIPTIVE))
        return (variables, self.network_allow, self.secrets, self.volume if shared_volume else None)

    def for_caller(self, owner: Owner | None, volume: str | None) -> StartRequest:
        """This request as the gateway runs it for a caller: their owner and volume, whatever the request said."""
        return replace(self, owner=owner, volume=volume)

    # -- kept for adoption ---------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return {
            "flavor": self.flavor,
            "environment": self.environment,
            "env": dict(self.env),
            "network_allow": self.network_allow,
            "secrets": self.secrets,
            "argument_names": list(self.argument_names),
            "owner": self.owner.to_record() if self.owner is not None else None,
            "volume": self.volume,
            "working_dir": self.working_dir,
            "notebook_path": self.notebook_path,
        }

    @classmethod
    def from_record(cls, record: Any) -> StartRequest:
        """A request as to_record wrote it, checked again (the record is root's, but a request is checked wherever it
        is made); InvalidRequest names what does not fit."""
        if not isinstance(record, dict):
            raise InvalidRequest("the start request is not an object")
        owner = Owner.from_record(record.get("owner"))
        if record.get("owner") is not None and owner is None:
            raise InvalidRequest(f"the start request's owner {record.get('owner')!r} is not a source and a name")
        names = record.get("argument_names") or [NETWORK_ALLOW, SECRETS]
        return cls(
            flavor=record.get("flavor"),
            environment=record.get("environment"),
            env=record.get("env") or {},
            network_allow=record.get("network_allow"),
            secrets=record.get("secrets"),
            argument_names=tuple(names) if isinstance(names, list) else names,
            owner=owner,
            volume=record.get("volume"),
            working_dir=record.get("working_dir"),
            notebook_path=record.get("notebook_path"),
        )

    def __repr__(self) -> str:
        """Never the secrets' values, nor the variables' (they carry data): names only."""
        return (
            f"StartRequest(flavor={self.flavor!r}, environment={self.environment!r}, env={sorted(self.env)!r}, "
            f"network_allow={self.network_allow!r}, secrets={sorted(json.loads(self.secrets)) if self._secrets_json() else None!r}, "
            f"owner={self.owner!r}, volume={self.volume!r}, working_dir={self.working_dir!r}, notebook_path={self.notebook_path!r})"
        )

    def _secrets_json(self) -> bool:
        try:
            return isinstance(json.loads(self.secrets or "null"), dict)
        except ValueError:
            return False
