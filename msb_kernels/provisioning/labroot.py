"""JupyterLab's root in the sandboxes (MSB_LAB_ROOT_PATH): whose it is, what is shown, how, and where a notebook's
kernel starts.

Where JupyterLab and the gateway share a host, a kernel started for ``project/analysis.ipynb`` should open
``project/data.csv`` as it would without a sandbox. JupyterLab's gateway client sends the notebook's directory as
``KERNEL_WORKING_DIR``, a host path; with the Lab root shown at the same path inside the sandbox, that path is the
kernel's working directory too.

Whose root a kernel sees follows whose kernel it is (its StartRequest's volume, which the gateway sets from the
caller): with ``{username}`` in the setting (``/home/{username}``, as JupyterHub's ``Spawner.notebook_dir`` writes it),
each person's kernels see that person's own server root, read-write, and nobody else's; a root without it is one Lab's,
the host's own user's, shown only to their kernels (the single token's, a local start's, the pool's), never to a person
of the users file or the Hub. A root whose owner is a person is shown as the sandbox user's own (core/idmap.py): what a
kernel writes there is its owner's, and their Lab shows, opens and edits it.
"""

from __future__ import annotations

import os
from pathlib import Path

from msb_kernels.backends.core import hostpaths
from msb_kernels.backends.core.base import HostDirectory
from msb_kernels.backends.core.guest import SYSTEM_DIRS
from msb_kernels.errors import ConfigError
from msb_kernels.identity.volumes import WHOLE_VOLUME, make_own
from msb_kernels.settings.config import MsbSettings
from msb_kernels.settings.value_checks import PERSON_FIELD


def root_path(settings: MsbSettings, volume: str | None) -> Path | None:
    """Where the Lab root of a kernel is, by its StartRequest's volume (whose kernel it is): a person's own where
    MSB_LAB_ROOT_PATH names {username}; the one root for the host's own user's kernels (volume: the whole volume, or
    none asked); else none. Whether it exists yet is root_of's business."""
    template = settings.lab_root_path
    if not template:
        return None
    mine = volume in (None, WHOLE_VOLUME)
    if PERSON_FIELD not in template:
        return settings.lab_root if mine else None
    return None if mine else Path(template.replace(PERSON_FIELD, volume)).resolve()  # as the one root is


def root_of(settings: MsbSettings, volume: str | None) -> Path | None:
    """The Lab root a kernel's sandbox shows (root_path), a person's made theirs on first use (as their volume
    directory is: identity/volumes.py); None where there is none."""
    root = root_path(settings, volume)
    if root is None:
        return None
    if not root.is_dir() and root.parent.is_dir():
        make_own(root.parent, root)
    return root if root.is_dir() else None


def lab_directories(settings: MsbSettings, volume: str | None) -> list[HostDirectory]:
    """The host directories a kernel's sandbox shows: its Lab root (root_of), a person's own read-write, the one root
    read-only unless MSB_LAB_ROOT_WRITABLE."""
    root = root_of(settings, volume)
    if root is None:
        return []
    for inner, name in ((settings.runtime_root(), "MSB_RUNTIME_DIR"), (settings.scratch_root(), "MSB_SCRATCH_DIR")):
        inner_path = os.path.realpath(inner)
        if hostpaths.under(inner_path, str(root)):
            raise ConfigError(
                f"MSB_LAB_ROOT_PATH={settings.lab_root_path} holds {name} ({inner_path}): every sandbox would see the others' sockets and disks",
                [f"move {name} out of JupyterLab's root, or show a narrower directory"],
            )
    return [HostDirectory(str(root), settings.lab_root_writable or PERSON_FIELD in settings.lab_root_path)]


def working_dir(settings: MsbSettings, requested: str | None, volume: str | None) -> str | None:
    """The notebook's directory (a StartRequest's working_dir) as the kernel's working directory, when its sandbox
    shows it (inside root_path: a directory there exists, so its root does); else None (its home). Makes nothing: the
    pool asks it of every start."""
    if not requested:
        return None
    root = root_path(settings, volume)
    if root is None:
        return None
    path = os.path.realpath(requested)
    return path if hostpaths.under(path, str(root)) and os.path.isdir(path) else None


def hand_out_places(settings: MsbSettings) -> list[str]:
    """Where a pooled kernel's hand-out may show a Lab root (core/handout.py): the directory each person's root is made
    in, or the one root. A pooled sandbox shows an empty directory there from its start, in which the hand-out makes
    and mounts the taker's; none that is / or a system directory, which it would hide (those hand-outs fail, and the
    start is a fresh one)."""
    template = settings.lab_root_path
    if not template:
        return []
    place = Path(template.replace(PERSON_FIELD, "_")).resolve().parent if PERSON_FIELD in template else settings.lab_root
    if place is None or place.parent == place or (len(place.parts) == 2 and place.name in (*SYSTEM_DIRS, "etc", "proc", "dev", "run")):
        return []
    return [str(place)]
