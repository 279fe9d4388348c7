"""Each person's own part of the shared volume (MSB_SHARED_VOLUME_PATH).

A kernel started by a person of the users file or of JupyterHub mounts ``<shared volume>/<their name>`` at the guest
path, never the whole volume: two people's kernels never see each other's files. The single token's person (one
person, today's setup) and the system's pooled kernels keep the whole volume, as before. The gateway's kernel manager
names the directory in a start-only variable the client cannot set (MSB_* is denied to start requests); the
provisioner mounts it.
"""

from __future__ import annotations

import os
from pathlib import Path

from msb_kernels.identity.people import Person

VOLUME_OWNER_ENV = "MSB_VOLUME_OWNER"  # a start request's, set by the gateway only; never the kernel's
USER_PACKAGES_DIR = ".python"  # in a kernel's volume: the packages its person installs with `pip install --user`


def has_own_directory(person: Person | None) -> bool:
    return person is not None and person.source != "token"


def own_directory(root: Path, slug: str) -> Path:
    """A person's directory of the volume at ``root`` (``slug`` is Person.slug: one path component)."""
    return root / slug


def volume_for(root: Path | None, env: dict[str, str]) -> Path | None:
    """The host directory a kernel mounts as its shared volume: its person's own, made on first use with the
    volume's own owner and mode (so the sandbox's user may write there as in the volume itself)."""
    if root is None:
        return None
    slug = env.get(VOLUME_OWNER_ENV)
    if not slug:
        return root
    own = own_directory(root, slug)
    if own.resolve().parent != root.resolve():  # a slug is one path component (Person.slug); refuse anything else
        raise ValueError(f"{VOLUME_OWNER_ENV}={slug!r} is not one directory name")
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
