"""Each person's own part of the shared volume (MSB_SHARED_VOLUME_PATH), and how a directory becomes a person's.

A kernel started by a person of the users file or of JupyterHub mounts ``<shared volume>/<their key>`` at the guest
path, never the whole volume: two people's kernels never see each other's files. The key is the gateway's, never the
person's name (person_registry.py). The single token's person (one person, today's setup) and the system's pooled
kernels keep the whole volume, as before. The gateway's kernel manager writes the choice into the kernel's
StartRequest (``volume``, from the caller, never from the request), where every later start of the kernel finds it;
the provisioner mounts it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from msb_kernels.errors import SandboxError
from msb_kernels.identity.people import Person
from msb_kernels.identity.person_registry import Ids, PersonRegistry, Registered, legacy_slug

WHOLE_VOLUME = "."  # a StartRequest's volume: the whole shared volume
USER_PACKAGES_DIR = ".python"  # in a kernel's volume: the packages its person installs with `pip install --user`
MAX_DEPTH = 512  # directories deep that make_own walks: one descriptor open per level
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


def has_own_directory(person: Person | None) -> bool:
    """Whether a person's kernels mount their own directory of the volume: a person of the users file or the Hub."""
    return person is not None and person.source in ("users-file", "hub")


def own_volume(root: Path, person: Registered, registry: PersonRegistry) -> Path:
    """The person's directory of the volume at ``root``, ``<root>/<key>``: made on first use, theirs alone. As root it is
    0700 and their ids' (Registered.ids), whatever the volume's own owner and mode, so each sandbox shows it as its own
    user's (backends/core/idmap.py). Where an earlier version kept their files under their name
    (``legacy_slug``), that directory moves under the key and becomes theirs (``move_earlier``). Not as root, the
    sandboxes run as this process's own user, whose everything in the volume is: it is made with the volume's mode,
    and nothing is moved."""
    own = root / person.key
    if os.geteuid() != 0:
        own.mkdir(mode=0o700, exist_ok=True)
        os.chmod(own, root.stat().st_mode & 0o7777)
        return own
    with opened(root) as parent:
        move_earlier(parent, person.key, person, registry)
        with contextlib.suppress(FileExistsError):
            os.mkdir(person.key, 0o700, dir_fd=parent)
        st = os.stat(person.key, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxError(
                f"{own} is not a directory: {person.owner.name}'s volume cannot be shown", ["remove it; the gateway makes it anew"]
            )
        if (st.st_uid, st.st_gid, st.st_mode & 0o7777) != (person.ids.uid, person.ids.gid, 0o700):
            make_own(parent, person.key, person.ids)
    return own


def move_earlier(parent: int, name: str, person: Registered, registry: PersonRegistry) -> None:
    """Where ``name`` is not yet in the directory open at ``parent`` (the volume, the Lab roots' parent), the directory
    an earlier version kept the person's files under there (``legacy_slug``) moves to it, by name, so a link is never
    followed and one there is not moved; only one the registry says is theirs to take
    (PersonRegistry.left_by_an_earlier_version), and only as root: not as root, every file is the operator's, and
    nothing tells a person's old directory from the operator's."""
    legacy = legacy_slug(person.owner.name)
    if legacy == name or os.geteuid() != 0:
        return
    with contextlib.suppress(OSError):
        if _exists(name, parent):
            return
        found = os.stat(legacy, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(found.st_mode) and registry.left_by_an_earlier_version(found, person, legacy):
            os.rename(legacy, name, src_dir_fd=parent, dst_dir_fd=parent)


def _exists(name: str, directory: int) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def make_own(parent: int, name: str, ids: Ids) -> None:
    """``name`` in the directory open at ``parent``, and everything in it, made ``ids``' (the directory 0700), before
    any kernel of theirs shows it. Walked through descriptors opened O_NOFOLLOW|O_DIRECTORY one level at a time, so a
    link swapped in anywhere during the walk is changed itself, never followed; it stays on the directory's own
    filesystem (a mount inside is left as it is); a file with more than one link (which may be another's file, linked
    in) is left as it was."""
    top = os.open(name, _DIRECTORY, dir_fd=parent)
    stack: list[tuple[int, Iterator[str]]] = []
    try:
        device = os.fstat(top).st_dev
        os.fchown(top, ids.uid, ids.gid)
        os.fchmod(top, 0o700)
        stack.append((top, iter(os.listdir(top))))
        while stack:
            fd, names = stack[-1]
            entry = next(names, None)
            if entry is None:
                stack.pop()
                if fd != top:
                    os.close(fd)
                continue
            try:
                child = os.open(entry, _DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT, errno.ENXIO):
                    raise
                _give_entry(fd, entry, ids)
                continue
            if os.fstat(child).st_dev != device or len(stack) >= MAX_DEPTH:
                os.close(child)
                continue
            stack.append((child, iter(os.listdir(child))))
            os.fchown(child, ids.uid, ids.gid)
    finally:
        for fd, _ in stack:
            if fd != top:
                os.close(fd)
        os.close(top)


def _give_entry(directory: int, name: str, ids: Ids) -> None:
    """One entry that is not a directory, by name in an open directory, never followed (a link itself is changed)."""
    try:
        st = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return
        os.chown(name, ids.uid, ids.gid, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def opened(path: Path) -> Iterator[int]:
    """A descriptor of a directory the operator named (the volume, the Lab roots' parent), for the *at calls in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def docker_volume(base: str, volume: str) -> str:
    """The Docker named volume of a StartRequest's volume on a cluster (MSB_SHARED_VOLUME_NAME=base): base itself for
    the whole volume, ``base-<key>`` for a person's own (a key has only Docker's name characters and is distinct for
    distinct people: person_registry.person_key)."""
    return base if volume == WHOLE_VOLUME else f"{base}-{volume}"


def user_base(guest_volume: str, environment: str) -> str:
    """PYTHONUSERBASE of a kernel of environment whose volume the guest sees at guest_volume: where `pip install --user`
    puts a package, kept with the person's files. One per environment, since a package built against one
    environment's packages need not work with another's; Python's own layout below it (lib/pythonX.Y/site-packages)
    keeps each Python X.Y apart, so an environment's new Python never loads wheels built for the old one."""
    return f"{guest_volume.rstrip('/')}/{USER_PACKAGES_DIR}/{environment}"
