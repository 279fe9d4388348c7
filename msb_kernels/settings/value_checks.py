"""The checks of single settings (msb_kernels.settings.config's _CHECKS): each takes a value and says what is wrong with it, or
None. Pure functions of the value, so the settings class stays the one list of settings."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from msb_kernels.errors import MsbError
from msb_kernels.kernelspecs.choice import parse_pool_sizes
from msb_kernels.kernelspecs.flavors import get_flavor

# Guest paths the sandbox itself needs; a shared volume may not shadow them.
RESERVED_GUEST_PATHS = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/run", "/tmp", "/home", "/sys")


def check_flavor(value: str) -> str | None:
    try:
        get_flavor(value)
    except MsbError:
        return "is not a flavor"
    return None


def _at_or_under(path: str, tops: tuple[str, ...]) -> bool:
    return any(path == top or path.startswith(top + "/") for top in tops)


def check_guest_path(value: str) -> str | None:
    path = PurePosixPath(value)
    if not path.is_absolute():
        return "is not an absolute path"
    if str(path) in RESERVED_GUEST_PATHS or _at_or_under(str(path), ("/proc", "/dev", "/sys", "/usr", "/etc", "/run")):
        return "would hide a directory the sandbox needs"
    return None


PERSON_FIELD = "{username}"  # in MSB_LAB_ROOT_PATH: each person's own root (labroot.py), as JupyterHub's notebook_dir
# Directories a Lab root may not be, nor lie under: the sandbox's own system, or a whole tree of homes.
_NOT_LAB_ROOTS = ("/", "/tmp", "/home", "/root", "/var", "/opt", "/srv", "/mnt", "/media")
_NOT_UNDER = ("/usr", "/etc", "/proc", "/dev", "/sys", "/run", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot")


def check_lab_root(value: str) -> str | None:
    if not os.path.isabs(value):
        return "is not an absolute path"
    rest = value.replace(PERSON_FIELD, "")
    if "{" in rest or "}" in rest:
        return "names a field other than {username}"
    if PERSON_FIELD in value:  # each person's own root (labroot.py): its shape, with the parent of a person's
        parent = os.path.realpath(os.path.dirname(value.replace(PERSON_FIELD, "someone")))
        if PERSON_FIELD in os.path.dirname(value) or not os.path.isdir(parent):
            return "must end in a person's directory, /{username}, inside an existing directory"
        if parent == "/" or _at_or_under(parent, _NOT_UNDER):
            return "would make a person's root in a system directory"
        return None
    path = os.path.realpath(value)
    if not os.path.isdir(path):
        return "is not an existing directory"
    if path in _NOT_LAB_ROOTS or _at_or_under(path, _NOT_UNDER):
        return "would show a system directory or every home in the sandboxes"
    return None


def check_shared_path(value: str) -> str | None:
    path = Path(value)
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    return None


# A Docker volume name the gateway may mount (backends/cluster/api_rules.py): of this project's, never another's.
VOLUME_NAME = re.compile(r"^msb-[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")


def check_volume_name(value: str) -> str | None:
    return None if VOLUME_NAME.match(value) else "is not a Docker volume name that starts with msb-"


def parse_port_range(value: str) -> tuple[int, int]:
    first, separator, last = str(value).strip().partition("-")
    if not separator:
        raise ValueError("is not a range FIRST-LAST")
    try:
        low, high = int(first), int(last)
    except ValueError:
        raise ValueError("is not a range of whole numbers") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError("is outside 1024-65535 or has FIRST > LAST")
    if high - low + 1 < 5:
        raise ValueError("holds fewer than 5 ports (one kernel needs 5)")
    return low, high


def check_port_range(value: str) -> str | None:
    try:
        parse_port_range(value)
    except ValueError as exc:
        return str(exc)
    return None


def check_image(value: str) -> str | None:
    return "is empty" if not value.strip() else None


def check_pool_size(value: str) -> str | None:
    try:
        parse_pool_sizes(value)
    except MsbError as exc:
        return "is not a pool size (" + exc.message.split(": ", 1)[-1].split(";")[0] + ")"
    return None


def check_environments_dir(value: str) -> str | None:
    if not os.path.isabs(value):
        return "is not an absolute path"
    if os.path.exists(value) and not os.path.isdir(value):
        return "is not a directory"
    return None


def check_host(value: str) -> str | None:
    return "is not a host name or address" if not value.strip() or any(c.isspace() or c in "/?#" for c in value) else None


def at_least(minimum: float) -> Callable[[Any], str | None]:
    return lambda v: f"is less than {minimum:g}" if v < minimum else None


def read_key(path: str) -> bytes:
    """A hibernation key (MSB_HIBERNATE_KEY_FILE): 32 bytes, raw or as 64 hex digits; ValueError says what is wrong."""
    data = Path(path).read_bytes()
    text = data.strip()
    if len(text) == 64 and all(c in b"0123456789abcdefABCDEF" for c in text):
        return bytes.fromhex(text.decode())
    if len(data) == 32:
        return data
    raise ValueError(f"holds {len(data)} bytes, not a 32-byte key")


def check_private_file(value: str) -> str | None:
    """A file only its owner reads and writes, as ssh wants its keys: a key, the users' powers, secrets. Another user
    who can read it holds what it guards, so its mode is refused, with the chmod that fixes it."""
    path = Path(value)
    if not path.is_file():
        return "does not exist" if not path.exists() else "is not a file"
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return f"has mode {mode:04o}, which lets other users read or change it (run chmod 600 {path})"
    return None


def check_key_file(value: str) -> str | None:
    """A hibernation key in a file no one else may read."""
    problem = check_private_file(value)
    if problem:
        return problem
    try:
        read_key(value)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    except ValueError as exc:
        return str(exc)
    return None


def check_users_file(value: str) -> str | None:
    """MSB_USERS_FILE: its admin flags are powers; its content is read by msb_kernels.identity.users_file, which
    names what is wrong inside."""
    return check_private_file(value)
