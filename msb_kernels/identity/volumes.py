"""Each person's own part of the shared volume (MSB_SHARED_VOLUME_PATH).

A kernel started by a person of the users file or of JupyterHub mounts ``<shared volume>/<their name>`` at the guest
path, never the whole volume: two people's kernels never see each other's files. The single token's person (one
person, today's setup) and the system's pooled kernels keep the whole volume, as before. The gateway's kernel manager
writes the choice into the kernel's StartRequest (``volume``, from the caller, never from the request), where every
later start of the kernel finds it; the provisioner mounts it.
"""

from __future__ import annotations

import os
from pathlib import Path

from msb_kernels.identity.people import Person

WHOLE_VOLUME = "."  # a StartRequest's volume: the whole shared volume
USER_PACKAGES_DIR = ".python"  # in a kernel's volume: the packages its person installs with `pip install --user`


def has_own_directory(person: Person | None) -> bool:
    """Whether a person's kernels mount their own directory of the volume: a person of the users file or the Hub."""
    return person is not None and person.source in ("users-file", "hub")


def volume_of(person: Person) -> str:
    """The part of the shared volume a person's kernels mount (a StartRequest's volume): their own directory, or the
    whole volume for the single token's person, the desktop's one user and the system (the pool)."""
    return person.slug if has_own_directory(person) else WHOLE_VOLUME


def own_directory(root: Path, slug: str) -> Path:
    """A person's directory of the volume at ``root`` (``slug`` is Person.slug: one path component)."""
    return root / slug


def volume_for(root: Path | None, volume: str | None) -> Path | None:
    """The host directory a kernel mounts as its shared volume (``volume``: its StartRequest's): none, the whole
    volume, or its person's own, made on first use with the volume's own owner and mode (so the sandbox's user may
    write there as in the volume itself)."""
    if root is None or volume is None:
        return None
    if volume == WHOLE_VOLUME:
        return root
    own = own_directory(root, volume)
    if own.resolve().parent != root.resolve():  # a slug is one path component (Person.slug); refuse anything else
        raise ValueError(f"volume={volume!r} is not one directory name")
    if not own.is_dir():
        st = root.stat()
        own.mkdir(mode=0o700, exist_ok=True)
        os.chmod(own, st.st_mode & 0o7777)
        if os.geteuid() == 0:
            os.chown(own, st.st_uid, st.st_gid)
    return own


def user_base(guest_volume: str, environment: str) -> str:
    """PYTHONUSERBASE of a kernel of environment whose volume the guest sees at guest_volume: where `pip install --user`
    puts a package, kept with the person's files. One per environment, since a package built against one
    environment's packages need not work with another's; Python's own layout below it (lib/pythonX.Y/site-packages)
    keeps each Python X.Y apart, so an environment's new Python never loads wheels built for the old one."""
    return f"{guest_volume.rstrip('/')}/{USER_PACKAGES_DIR}/{environment}"
