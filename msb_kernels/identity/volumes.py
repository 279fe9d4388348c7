"""Each person's own part of the shared volume (MSB_SHARED_VOLUME_PATH).

A kernel started by a person of the users file or of JupyterHub mounts ``<shared volume>/<their name>`` at the guest
path, never the whole volume: two people's kernels never see each other's files. The single token's person (one
person, today's setup) and the system's pooled kernels keep the whole volume, as before. The gateway's kernel manager
writes the choice into the kernel's StartRequest (``volume``, from the caller, never from the request), where every
later start of the kernel finds it; the provisioner mounts it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
from pathlib import Path

from msb_kernels.identity.people import Person

WHOLE_VOLUME = "."  # a StartRequest's volume: the whole shared volume
# Host ids for people without a host account of their own: above any login's (60000 at most), below the namespace
# sandboxes' (backends/namespace/uids.py), and used by no process.
PERSON_IDS = range(1_000_000_000, 1_001_000_000)
# A uid below this is the system's (login.defs' UID_MIN): a directory of such an owner is never shown as a sandbox's
# (backends/core/idmap.py), or the sandbox could make files of root (or of a daemon) on the host.
FIRST_PERSON_UID = 1000
LAST_LOGIN_UID = 60000  # login.defs' UID_MAX: above it are accounts such as nobody (65534), never a person's
DOCKER_NAME_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
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
    volume, or its person's own, made on first use (``_make_own``)."""
    if root is None or volume is None:
        return None
    if volume == WHOLE_VOLUME:
        return root
    own = own_directory(root, volume)
    if own.resolve().parent != root.resolve():  # a slug is one path component (Person.slug); refuse anything else
        raise ValueError(f"volume={volume!r} is not one directory name")
    if not own.is_dir() or (os.geteuid() == 0 and own.lstat().st_uid == 0):
        make_own(root, own)
    return own


def make_own(root: Path, own: Path) -> None:
    """A person's directory of the volume (or of a Lab root's parent: labroot.py), theirs alone. As root it is made 0700 and owned by the person's host uid
    (``person_ids``), whatever the volume's own owner and mode, so each sandbox shows it as its own user's
    (backends/core/idmap.py): everything any of the person's kernels writes there is theirs on the host. One an
    earlier version made as the volume's owner (root), with what its sandboxes wrote inside, becomes the person's,
    without following a link. Not as root, the sandboxes run as this process's own user: the directory is made with
    the volume's mode."""
    if os.geteuid() != 0:
        own.mkdir(mode=0o700, exist_ok=True)
        os.chmod(own, root.stat().st_mode & 0o7777)
        return
    uid, gid = person_ids(root, own.name)
    own.mkdir(mode=0o700, exist_ok=True)
    if own.is_symlink() or not own.is_dir():
        raise ValueError(f"{own} is not a directory")
    for _, directories, files, fd in os.fwalk(own, follow_symlinks=False):
        for name in (*directories, *files):
            os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
    os.chown(own, uid, gid, follow_symlinks=False)
    os.chmod(own, 0o700)


def person_ids(root: Path, slug: str) -> tuple[int, int]:
    """The host uid and gid a person's files are kept as: their host account's where one of that name is a login's
    (FIRST_PERSON_UID to LAST_LOGIN_UID: under JupyterHub's LocalProcessSpawner, the person's own), else one of PERSON_IDS that no
    other directory of the volume is owned by, kept from then on as the owner of their directory."""
    with contextlib.suppress(KeyError):
        account = pwd.getpwnam(slug)
        if FIRST_PERSON_UID <= account.pw_uid <= LAST_LOGIN_UID and account.pw_gid != 0:
            return account.pw_uid, account.pw_gid
    with contextlib.suppress(FileNotFoundError):
        if (kept := own_directory(root, slug).lstat().st_uid) in PERSON_IDS:
            return kept, kept
    taken = {entry.stat(follow_symlinks=False).st_uid for entry in os.scandir(root)}
    uid = next(candidate for candidate in PERSON_IDS if candidate not in taken)
    return uid, uid


def docker_volume(base: str, volume: str) -> str:
    """The Docker named volume of a StartRequest's volume on a cluster (MSB_SHARED_VOLUME_NAME=base): base itself for
    the whole volume, ``base-<name>`` for a person's own; ``base--<slug in hex>`` where the slug holds a character
    Docker's names lack (Person.slug escapes as %XX), which no plain one can be (it starts with a letter or digit), so
    no two people share one."""
    if volume == WHOLE_VOLUME:
        return base
    return f"{base}-{volume}" if DOCKER_NAME_CHARS.match(volume) else f"{base}--{volume.encode().hex()}"


def user_base(guest_volume: str, environment: str) -> str:
    """PYTHONUSERBASE of a kernel of environment whose volume the guest sees at guest_volume: where `pip install --user`
    puts a package, kept with the person's files. One per environment, since a package built against one
    environment's packages need not work with another's; Python's own layout below it (lib/pythonX.Y/site-packages)
    keeps each Python X.Y apart, so an environment's new Python never loads wheels built for the old one."""
    return f"{guest_volume.rstrip('/')}/{USER_PACKAGES_DIR}/{environment}"
