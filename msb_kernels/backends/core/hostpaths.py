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

SYSTEM_PYTHON = "/usr/bin/python3"  # the distribution's: what closed_note offers, where every user can run it
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


def closed_to_others(executable: str = sys.executable) -> Path | None:
    """The first directory on the way to an interpreter (its venv, the installation it runs) that other users cannot
    enter, or None. Under JupyterHub each person's server runs the venv's jupyterhub-singleuser as them: a venv made
    as root on pyenv's Python under /root (0700) failed for every person with "Permission denied" (issue 55).
    Called by `msb-kernels install` (which scripts/run runs) and `msb-kernels doctor`, which say what to do."""
    for path in interpreter_paths(executable):
        place = Path(path)
        for directory in [*reversed(place.parents), place]:
            try:
                if not os.stat(directory).st_mode & 0o001:
                    return directory
            except OSError:
                break
    return None


def closed_note(executable: str = sys.executable) -> str | None:
    """What to do when closed_to_others finds such a directory; None when every user can run the interpreter."""
    closed = closed_to_others(executable)
    if closed is None:
        return None
    venv = Path(executable).parent.parent
    system = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) and closed_to_others(SYSTEM_PYTHON) is None else "/path/to/python3.10+"
    return (
        f"this venv's Python ({os.path.realpath(executable)}) is under {closed}, which other users cannot enter: "
        f"under JupyterHub each person's server runs as them and cannot start it. For a team, make the venv from a "
        f"Python every user can run: rm -rf {venv} && PYTHON={system} {venv.parent}/scripts/run --install-only"
    )


# People's directories: an install under one shows its path, and so its person's name, in every sandbox.
PEOPLES_DIRS = ("/home", "/root")
TEAM_INSTALL = "/opt/msb-kernels"  # where docs/teams.md installs for a team: a path that names no one
# docs/teams.md's install command, word for word (tests/msb_kernels/backends/core/test_hostpaths.py checks both).
TEAM_INSTALL_COMMAND = (
    f"git clone <this repository> {TEAM_INSTALL} && cd {TEAM_INSTALL} && PYTHON={SYSTEM_PYTHON} ./scripts/run --install-only"
)


def shown_note(executable: str = sys.executable) -> str | None:
    """What every sandbox shows of this install that names a person, with what to do; None where nothing does.

    Each interpreter path is bound into every sandbox at its own path (read-only, nothing beside it): a venv in the
    operator's home showed /home/<operator> in each person's kernel (issue 55, point 10). Said by `msb-kernels
    install` (which scripts/run runs) and `msb-kernels doctor`."""
    shown = [path for path in binds_for(set(interpreter_paths(executable))) if any(under(path, place) for place in PEOPLES_DIRS)]
    if not shown:
        return None
    return (
        f"every sandbox shows {', '.join(shown)} (read-only, and nothing beside it), which names a person's home. "
        f"For a team, install where no person's name is, from a Python every user can run: {TEAM_INSTALL_COMMAND}"
    )
