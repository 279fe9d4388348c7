"""Settings: environment variables first, Jupyter (traitlets) config on top.

Every setting has one trait here. Its default comes from an ``MSB_*`` variable, and
``c.MsbSettings.<name>`` in a Jupyter config file (``msb_kernels_config.py`` or
``.json`` on the Jupyter config path, or the config of the app that starts the
kernel) overrides it, the way ``JUPYTER_TOKEN`` and ``c.ServerApp.token`` relate.
A bad value raises ConfigError naming the variable and the accepted values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from traitlets import Bool, Int, Unicode
from traitlets.config import Config, Configurable

from msb_kernels.errors import ConfigError, MsbError
from msb_kernels.flavors import FLAVORS, get_flavor

BACKENDS = ("auto", "namespace", "microsandbox")
# Guest paths the sandbox itself needs; a shared volume may not shadow them.
RESERVED_GUEST_PATHS = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/run", "/tmp", "/home", "/sys")


def _env_name(trait_name: str) -> str:
    return "MSB_" + trait_name.upper()


class MsbSettings(Configurable):
    """Settings shared by the provisioner, the gateway and the MCP bridge."""

    default_flavor = Unicode("small", help="Flavor for kernels that do not ask for one: small, medium or large.").tag(config=True)
    session_timeout_seconds = Int(1800, help="Idle seconds before a kernel is culled (0 = never).").tag(config=True)
    max_sessions = Int(10, help="Most sandboxed kernels one msb-kernels process runs at once.").tag(config=True)
    shared_volume_path = Unicode(None, allow_none=True, help="Host directory mounted into every sandbox (unset = none).").tag(config=True)
    shared_volume_guest_path = Unicode("/shared", help="Where the shared volume appears inside the sandbox.").tag(config=True)
    backend = Unicode("auto", help="Sandbox backend: auto, namespace or microsandbox.").tag(config=True)
    max_processes = Int(256, help="Most processes (and threads) one sandbox may hold; contains fork bombs.").tag(config=True)
    runtime_dir = Unicode(None, allow_none=True, help="Host directory for sandbox state and kernel sockets.").tag(config=True)
    require_limits = Bool(False, help="Refuse to start a sandbox whose flavor limits cannot all be enforced with cgroups.").tag(config=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        configured = set(self.config.get(type(self).__name__, {}))
        for name in self.trait_names(config=True):
            if name not in configured and _env_name(name) in os.environ:
                self._assign(name, os.environ[_env_name(name)], from_env=True)
        for name in self.trait_names(config=True):
            self._check(name, getattr(self, name))

    # -- parsing and checking -------------------------------------------------

    def _where(self, name: str) -> str:
        return f"{_env_name(name)} (c.{type(self).__name__}.{name})"

    def _assign(self, name: str, raw: str, *, from_env: bool) -> None:
        trait = self.traits()[name]
        value: Any = raw
        if isinstance(trait, Int):
            try:
                value = int(raw.strip())
            except ValueError:
                raise ConfigError(f"{self._where(name)}={raw!r} is not a whole number; {_ACCEPTED[name]}") from None
        elif isinstance(trait, Bool):
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", ""):
                raise ConfigError(f"{self._where(name)}={raw!r} is not a boolean; use true or false")
            value = lowered in ("1", "true", "yes")
        elif raw.strip() == "" and trait.allow_none:
            value = None
        setattr(self, name, value)

    def _check(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None or value is None:
            return
        problem = check(value)
        if problem:
            raise ConfigError(f"{self._where(name)}={value!r} {problem}; {_ACCEPTED[name]}")

    # -- derived values -------------------------------------------------------

    @property
    def shared_volume(self) -> Path | None:
        return Path(self.shared_volume_path).resolve() if self.shared_volume_path else None

    def runtime_root(self) -> Path:
        """Where sandbox state and sockets live on the host (short, for AF_UNIX's 108-byte limit)."""
        if self.runtime_dir:
            return Path(self.runtime_dir)
        if os.geteuid() == 0:
            return Path("/run/msb-kernels")
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.access(xdg, os.W_OK):
            return Path(xdg) / "msb-kernels"
        return Path(f"/tmp/msb-kernels-{os.geteuid()}")


def _check_flavor(value: str) -> str | None:
    try:
        get_flavor(value)
    except MsbError:
        return "is not a flavor"
    return None


def _check_guest_path(value: str) -> str | None:
    path = PurePosixPath(value)
    if not path.is_absolute():
        return "is not an absolute path"
    if str(path) in RESERVED_GUEST_PATHS or any(str(path).startswith(p + "/") for p in ("/proc", "/dev", "/sys", "/usr", "/etc", "/run")):
        return "would hide a directory the sandbox needs"
    return None


def _check_shared_path(value: str) -> str | None:
    path = Path(value)
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    return None


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "default_flavor": _check_flavor,
    "session_timeout_seconds": lambda v: "is negative" if v < 0 else None,
    "max_sessions": lambda v: "is less than 1" if v < 1 else None,
    "max_processes": lambda v: "is less than 16" if v < 16 else None,
    "backend": lambda v: None if v in BACKENDS else "is not a backend",
    "shared_volume_path": _check_shared_path,
    "shared_volume_guest_path": _check_guest_path,
}

_ACCEPTED: dict[str, str] = {
    "default_flavor": f"use one of {', '.join(FLAVORS)}",
    "session_timeout_seconds": "use a whole number of seconds >= 0 (0 never culls)",
    "max_sessions": "use a whole number >= 1",
    "max_processes": "use a whole number >= 16",
    "backend": f"use one of {', '.join(BACKENDS)}",
    "shared_volume_path": "create the directory first, or unset the variable for no shared volume",
    "shared_volume_guest_path": "use an absolute path such as /shared, outside /usr, /etc, /proc, /dev, /run, /tmp and /home",
    "runtime_dir": "use a writable directory with a short path",
    "require_limits": "use true or false",
}


def load_settings(parent_config: Config | None = None) -> MsbSettings:
    """Build settings from the environment, Jupyter config files and an app's config.

    Raises ConfigError on any bad value, naming the variable and what it accepts.
    """
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    merged = Config()
    for directory in reversed(jupyter_config_path()):
        for loader_class, filename in ((JSONFileConfigLoader, "msb_kernels_config.json"), (PyFileConfigLoader, "msb_kernels_config.py")):
            if os.path.isfile(os.path.join(directory, filename)):
                try:
                    merged.merge(loader_class(filename, path=directory).load_config())
                except Exception as exc:  # a broken config file is a config error, not a crash
                    raise ConfigError(f"cannot read {os.path.join(directory, filename)}: {exc}") from None
    if parent_config is not None:
        merged.merge(parent_config)
    return MsbSettings(config=merged)
