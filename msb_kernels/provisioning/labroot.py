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

import contextlib
import os
import pwd
import stat
from pathlib import Path

from msb_kernels.backends.core import hostpaths
from msb_kernels.backends.core.base import HostDirectory
from msb_kernels.backends.core.guest import SYSTEM_DIRS
from msb_kernels.errors import ConfigError
from msb_kernels.identity.person_registry import Registered
from msb_kernels.identity.volumes import make_own, move_earlier, opened
from msb_kernels.provisioning.person_places import lab_roots_parent, people_of
from msb_kernels.settings.config import MsbSettings
from msb_kernels.settings.value_checks import PERSON_FIELD


def root_path(settings: MsbSettings, person: Registered | None) -> Path | None:
    """Where the Lab root of a kernel is, by whose kernel it is (person_places.whose): a person's own where
    MSB_LAB_ROOT_PATH names {username} (their name there, as JupyterHub's notebook_dir has it); the one root for the
    host's own user's kernels (person None); else none. Whether it exists, and is theirs, is root_of's business."""
    template = settings.lab_root_path
    if not template:
        return None
    if PERSON_FIELD not in template:
        return settings.lab_root if person is None else None
    parent, name = lab_roots_parent(settings), None if person is None else person.directory_name
    return None if parent is None or name is None else parent / name


def root_of(settings: MsbSettings, person: Registered | None) -> Path | None:
    """The Lab root a kernel's sandbox shows (root_path); None where there is none. A person's is shown only where it
    is theirs: the gateway made it for them (on first use, 0700, as their ids), or it belongs to their own ids (their
    login's, where MSB_HOST_ACCOUNTS declares their names logins). Anything else (another account's home, root's
    directory, a link) refuses the start, naming the setting: nothing is ever shown as it is."""
    root = root_path(settings, person)
    if person is None:
        return root if root is not None and root.is_dir() else None
    if root is None:
        if PERSON_FIELD in (settings.lab_root_path or ""):
            raise _not_theirs(settings, person, f"their name {person.owner.name!r} cannot be a directory name")
        return None
    with opened(root.parent) as parent:
        try:
            st = os.stat(root.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            st = _made_or_moved(settings, root, parent, person)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise _not_theirs(settings, person, f"{root} is not a directory of theirs (a link or a file)")
        # Not as root, every sandbox runs as this process's user, and so is what it makes for anyone.
        theirs = person.ids.uid if os.geteuid() == 0 else os.geteuid()
        if st.st_uid != theirs:
            if not (theirs == person.ids.uid and people_of(settings).left_by_an_earlier_version(st, person, root.name)):
                raise _not_theirs(settings, person, f"{root} belongs to {_account(st.st_uid)}, not to them")
            make_own(parent, root.name, person.ids)
    return root


def _made_or_moved(settings: MsbSettings, root: Path, parent: int, person: Registered) -> os.stat_result:
    """A person's Lab root made theirs: the one an earlier version made for them under their escaped name, moved here
    (by name, never following a link; only one that is theirs to take, so no one else's is ever moved), or a new one,
    0700, as their ids."""
    move_earlier(parent, root.name, person, people_of(settings))
    with contextlib.suppress(FileExistsError):
        os.mkdir(root.name, 0o700, dir_fd=parent)
        if os.geteuid() == 0:
            make_own(parent, root.name, person.ids)
    return os.stat(root.name, dir_fd=parent, follow_symlinks=False)


def _account(uid: int) -> str:
    try:
        return f"the host account {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}, someone else"


def _not_theirs(settings: MsbSettings, person: Registered, why: str) -> ConfigError:
    owner = person.owner
    return ConfigError(
        f"MSB_LAB_ROOT_PATH={settings.lab_root_path} would show {owner.source} person {owner.name!r} a Lab root that "
        f"is not theirs: {why}. Nothing of it is shown, and no kernel of theirs starts",
        [
            "where this source's names are this host's logins (JupyterHub with LocalProcessSpawner), set "
            "MSB_HOST_ACCOUNTS to it, so that a login's home is its person's",
            "else point MSB_LAB_ROOT_PATH at a directory only the gateway makes people's roots in (such as /srv/labs/{username})",
        ],
    )


def lab_directories(settings: MsbSettings, person: Registered | None) -> list[HostDirectory]:
    """The host directories a kernel's sandbox shows: its Lab root (root_of), a person's own read-write, the one root
    read-only unless MSB_LAB_ROOT_WRITABLE."""
    root = root_of(settings, person)
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


def working_dir(settings: MsbSettings, requested: str | None, person: Registered | None) -> str | None:
    """The notebook's directory (a StartRequest's working_dir) as the kernel's working directory, when its sandbox
    shows it (inside root_path: a directory there exists, so its root does); else None (its home). Makes nothing: the
    pool asks it of every start."""
    if not requested:
        return None
    root = root_path(settings, person)
    if root is None:
        return None
    path = os.path.realpath(requested)
    return path if hostpaths.under(path, str(root)) and os.path.isdir(path) else None


def hand_out_places(settings: MsbSettings) -> list[str]:
    """Where a pooled kernel's hand-out may show a Lab root (core/handout.py): the directory each person's root is made
    in, or the one root. A pooled sandbox shows an empty directory there from its start, in which the hand-out makes
    and mounts the taker's; none that is / or a system directory, which it would hide (those hand-outs fail, and the
    start is a fresh one)."""
    place = lab_roots_parent(settings) if PERSON_FIELD in (settings.lab_root_path or "") else settings.lab_root
    if place is None or place.parent == place or (len(place.parts) == 2 and place.name in (*SYSTEM_DIRS, "etc", "proc", "dev", "run")):
        return []
    return [str(place)]
