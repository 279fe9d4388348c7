"""Host paths a kernel needs inside its sandbox, shown read-only at the same path.

A kernel's interpreter can live anywhere a user put it: a venv in a home directory or under /tmp,
pyenv, conda, /opt, a symlinked checkout. Sandboxes mount their own filesystems over /tmp, /home
and /run, so each of these paths is bound on top of that filesystem, after it is mounted: the
interpreter stays visible at the same path, and nothing else of the host's under its parent does.
Both the namespace and the gVisor backend take their list of binds from here.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

from msb_kernels.backends.core.guest import SYSTEM_DIRS

# Bound whole (or a symlink into one that is), so nothing under them needs a bind of its own.
WHOLE_DIRS = tuple(f"/{name}" for name in SYSTEM_DIRS)


def interpreter_paths(executable: str = sys.executable) -> list[str]:
    """The directories an interpreter needs: its prefix (a venv, as called), the prefix its symlinks lead to,
    and the installation a venv's pyvenv.cfg points at."""
    if not os.path.isabs(executable):  # a bare name in a kernelspec: what PATH finds, as the sandbox's PATH would
        executable = shutil.which(executable) or ""
        if not executable:
            return []
    prefix = Path(executable).parent.parent
    paths = {str(prefix), str(Path(os.path.realpath(executable)).parent.parent)}
    if executable == os.path.abspath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    config = prefix / "pyvenv.cfg"
    if config.is_file():
        for line in config.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                home = Path(value.strip())
                paths |= {str(home.parent), str(Path(os.path.realpath(home)).parent)}
    return sorted(paths)


@functools.cache
def own_interpreter_paths() -> tuple[str, ...]:
    """This process's interpreter's paths, which the sandboxes' init runs: read once, they cannot change under it."""
    return tuple(interpreter_paths(sys.executable))


def under(path: str, parent: str) -> bool:
    """Whether path is parent or lies below it (as strings of normalized paths: no resolving here)."""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def binds_for(paths: list[str] | set[str]) -> list[str]:
    """The binds that show every path in paths: existing ones only, none under a system directory bound whole,
    none under another of the list (it shows already), sorted so that a parent is mounted before a child."""
    wanted = sorted({os.path.normpath(p) for p in paths if p and os.path.isabs(p) and os.path.exists(p)})
    binds: list[str] = []
    for path in wanted:
        if path == "/" or any(under(path, whole) for whole in WHOLE_DIRS) or any(under(path, done) for done in binds):
            continue
        binds.append(path)
    return binds
