"""A person's host directory shown to a sandbox's user as its own: an idmapped bind mount (Linux 5.12+).

Why: each sandbox runs as a host uid of its own (a namespace sandbox one per sandbox, gVisor's guest user 1000), so
what a kernel wrote into a person's volume belonged to that one sandbox, and nothing of the person's was their kernel's
to write. An idmapped mount (mount_setattr(2) with MOUNT_ATTR_IDMAP) shows the files of the directory's owner as the
sandbox user's, and what the sandbox's user makes there lands on disk as the owner's. So every kernel of a person reads
and writes everything their earlier kernels wrote, and on the host all of it has one owner, the person's, whichever
sandbox wrote it. Only the mount is mapped: the sandbox keeps its own uid for its processes and its disk, and the
files of any other owner show as the overflow id (nobody), readable as their mode allows others, never writable.

The mount is nosuid and nodev, and it is a clone of the directory alone (no mounts below it come along).

Callers: the namespace backend, which hands the detached mount to the sandbox's init to attach in the sandbox's own
mount namespace (it goes when the sandbox goes); the gVisor backend, which attaches it in the sandbox's state directory
for runsc's gofer to serve, and detaches it when the sandbox is removed.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from dataclasses import dataclass

from msb_kernels.errors import SandboxError
from msb_kernels.identity.person_registry import FIRST_PERSON_UID

# The same numbers on every architecture: these calls came after the syscall tables were unified (Linux 5.2, 5.12).
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
AT_FDCWD, AT_EMPTY_PATH, AT_NO_AUTOMOUNT, AT_SYMLINK_NOFOLLOW = -100, 0x1000, 0x800, 0x100
MOVE_MOUNT_F_EMPTY_PATH = 4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x1, 0x2, 0x4, 0x100000

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Owner:
    """Whose files a directory holds on disk: what the sandbox's user writes there becomes theirs."""

    uid: int
    gid: int


def owner_of(path: str) -> Owner | None:
    """The directory's owner where its files may be shown as a sandbox's own: a person's uid, never the system's
    (root's, a daemon's); None otherwise, and the directory is shown as it is."""
    st = os.stat(path)
    return Owner(st.st_uid, st.st_gid) if st.st_uid >= FIRST_PERSON_UID and st.st_gid != 0 else None


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def _user_namespace(uid_map: str, gid_map: str) -> int:
    """A descriptor of a fresh user namespace with these maps (inside, outside, count lines): a helper (util-linux's
    unshare, then sh) unshares it and says so, this process, root over it, writes its maps and opens it, and the helper
    ends; the namespace lives on in the descriptor. Spawned, not forked: a fork copies this process's page tables,
    43 ms for a gateway of 400 MiB, on the event loop of every start that shows a person's directory."""
    helper = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", "echo ready && read done"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert helper.stdin is not None and helper.stdout is not None
    try:
        if helper.stdout.readline() != b"ready\n":
            raise OSError("the helper could not unshare a user namespace")
        for name, text in (("uid_map", uid_map), ("setgroups", "deny"), ("gid_map", gid_map)):
            with open(f"/proc/{helper.pid}/{name}", "w") as file:
                file.write(text)
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.stdout.close()
        helper.wait()


def _clone(path: str, flags: int, userns: int = 0) -> int:
    """open_tree(2) of the directory alone, detached, with mount_setattr(2)'s ``flags`` (and ``userns``'s idmap)."""
    tree = _check(
        _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_NO_AUTOMOUNT | AT_SYMLINK_NOFOLLOW),
        "open_tree",
    )
    try:
        attributes = struct.pack("QQQQ", flags, 0, 0, userns)
        _check(_libc.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, attributes, len(attributes)), "mount_setattr")
    except BaseException:
        os.close(tree)
        raise
    return tree


def detached(path: str, owner: Owner, seen_as: Owner, *, readonly: bool = False, keep_root: bool = False) -> int:
    """A descriptor of a detached clone of the directory at path, where owner's files are seen_as's (and what seen_as
    makes is owner's); readonly: nothing is written through it; keep_root: root's stay root's too (runsc's gofer makes
    a file as root, then hands it over).
    Attach it with ``attach``; closing the descriptor of a mount never attached drops it. SandboxError when the host
    or the directory's filesystem has no idmapped mounts."""
    lines = [(owner.uid, seen_as.uid), *([(0, 0)] if keep_root else [])]
    groups = [(owner.gid, seen_as.gid), *([(0, 0)] if keep_root else [])]
    try:
        userns = _user_namespace(
            "".join(f"{inside} {outside} 1\n" for inside, outside in lines),
            "".join(f"{inside} {outside} 1\n" for inside, outside in groups),
        )
        try:
            return _clone(path, MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if readonly else 0), userns)
        finally:
            os.close(userns)
    except OSError as exc:
        raise SandboxError(
            f"cannot show {path} to the sandbox as its owner's ({exc.strerror or exc})",
            ["keep the shared volume on a filesystem with idmapped mounts (ext4, xfs, btrfs; tmpfs from Linux 6.3)"],
        ) from None


def shown_as(path: str, seen_as: Owner, *, readonly: bool = False, keep_root: bool = False) -> int | None:
    """``detached`` for a directory a sandbox shows, where its owner is a person (``owner_of``); None where it is shown
    as it is."""
    owner = owner_of(path)
    return detached(path, owner, seen_as, readonly=readonly, keep_root=keep_root) if owner else None


def cloned(path: str, *, readonly: bool = False) -> int:
    """A descriptor of a detached clone of the directory at path, as it is (no idmap), nosuid and nodev; ``attach`` it.
    SandboxError where it cannot be cloned."""
    try:
        return _clone(path, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if readonly else 0))
    except OSError as exc:
        raise SandboxError(f"cannot show {path} to the sandbox ({exc.strerror or exc})") from None


def attach(tree: int, target: str) -> None:
    """Attach a detached mount (``detached``'s) at target, in this process's mount namespace."""
    _check(_libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"move_mount to {target}")
