"""A pooled sandbox's placeholders and slots, where a person's directories are mounted when the pool hands it to them.

Why: a pooled kernel is started before anyone asks for it, so it can hold nothing of anyone's; a person's kernel
shows their volume and their Lab root. Without a hand-out the pool served no person, and under JupyterHub every new
session paid a cold start: 2.2 s on gVisor, where a hand-out with the person's directories takes 0.15 to 0.25 s
(bench/people_pool.py).

gVisor: a sandbox started for the pool gets a slot directory in its state dir, bound onto itself as a *shared*
mount, which the sandbox's runtime serves at ``GUEST_SLOTS``. A mount made under it later on the host propagates to
the runtime's own mount namespace (runsc's gofer keeps the host's mounts as its slaves), and so into the sandbox. At
hand-out the host attaches each of the person's directories under the slot (idmapped as theirs, core/idmap.py), and
``GUEST_MOUNT`` binds each at its guest path inside the sandbox, as the guest's root, then detaches the slots' own
mount: the kernel sees the person's directories where a fresh start would have shown them, and no slot.

A hand-out comes before the kernel has run anyone's code (the pool's invariant): nothing in the sandbox is a taker's
yet, so the host's helper and the guest's root walk only what the sandbox's own start made. The namespace backend's
hand-out needs no slots: a helper of the host's enters the sandbox's mount namespace and attaches the mounts there
(``ATTACH_IN_NAMESPACE``). Both make the guest paths in placeholders (SandboxSpec.placeholders), as the root is
read-only.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from msb_kernels.backends.core import idmap

if TYPE_CHECKING:
    from msb_kernels.backends.core.base import HostDirectory, SharedVolume

SLOTS_DIR = "slots"  # in a pooled sandbox's state dir
GUEST_SLOTS = "/run/msb-slots"  # where the sandbox sees it, until its hand-out detaches it

MS_BIND, MS_SHARED = 0x1000, 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    source_bytes = source.encode() if source is not None else None
    if _libc.mount(source_bytes, target.encode(), None, flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source or ''} on {target}: {os.strerror(error)}")


def open_slots(state_dir: Path) -> Path:
    """The sandbox's slot directory, made (root's, 0700) and bound onto itself as a shared mount, before its runtime
    starts: what is mounted below it from now on reaches the sandbox."""
    slots = state_dir / SLOTS_DIR
    slots.mkdir(mode=0o700, exist_ok=True)
    _mount(str(slots), str(slots), MS_BIND)
    _mount(None, str(slots), MS_SHARED)
    return slots


def detached_trees(
    shared_volume: SharedVolume | None, host_directories: list[HostDirectory], seen_as: idmap.Owner, *, keep_root: bool = False
) -> list[tuple[int, str, bool]]:
    """A detached mount of the volume and of each directory, as ``seen_as``'s where its owner is a person (idmapped),
    else as it is, with where the guest sees it and whether it may write there: (descriptor, guest path, writable). In
    the order a fresh start mounts them (core/base.SandboxSpec): a Lab root, then the volume. The caller closes them."""
    shown = [(d.path, d.path, d.writable) for d in host_directories if os.path.isdir(d.path)]
    if shared_volume is not None and shared_volume.host_path is not None:
        shown.append((str(shared_volume.host_path), shared_volume.guest_path, True))
    trees: list[tuple[int, str, bool]] = []
    try:
        for host_path, guest_path, writable in shown:
            tree = idmap.shown_as(host_path, seen_as, readonly=not writable, keep_root=keep_root)
            trees.append((tree if tree is not None else idmap.cloned(host_path, readonly=not writable), guest_path, writable))
    except BaseException:
        for tree, _, _ in trees:
            os.close(tree)
        raise
    return trees


def fill_slots(slots: Path, shared_volume: SharedVolume | None, host_directories: list[HostDirectory], seen_as: idmap.Owner) -> list[list]:
    """Attach each of ``detached_trees`` under the slots (gVisor: its gofer makes root's files first, so root's stay
    root's); the arguments of ``GUEST_MOUNT``: [guest slot, guest path, writable], one per directory."""
    mounts = []
    trees = detached_trees(shared_volume, host_directories, seen_as, keep_root=True)
    try:
        for number, (tree, guest_path, writable) in enumerate(trees):
            target = slots / str(number)
            target.mkdir(mode=0o700, exist_ok=True)
            idmap.attach(tree, str(target))
            mounts.append([f"{GUEST_SLOTS}/{number}", guest_path, writable])
    finally:
        for tree, _, _ in trees:
            os.close(tree)
    return mounts


# Run inside the sandbox as its root, with CAP_SYS_ADMIN, by the sandbox's own interpreter (-I -S): argv[1] is
# fill_slots' list. Each guest path is made (0755, root's) where missing, for a Lab root such as /home/alice.
GUEST_MOUNT = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MNT_DETACH = 1, 32, 4096, 2

def call(result, what):
    if result != 0:
        error = ctypes.get_errno()
        sys.exit(f"{what}: {os.strerror(error)}")

for slot, guest, writable in json.loads(sys.argv[1]):
    os.makedirs(guest, mode=0o755, exist_ok=True)
    call(libc.mount(slot.encode(), guest.encode(), None, MS_BIND, None), f"bind {slot} at {guest}")
    if not writable:
        call(libc.mount(None, guest.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), f"read-only {guest}")
call(libc.umount2(sys.argv[2].encode(), MNT_DETACH), f"detach {sys.argv[2]}")
os.rmdir(sys.argv[2])  # its mount point, in /run's tmpfs: not even the name is left
"""


def guest_mount_argv(python: str, mounts: list[list]) -> list[str]:
    """The command that runs GUEST_MOUNT for these mounts inside the sandbox, with its interpreter."""
    return [python, "-I", "-S", "-c", GUEST_MOUNT, json.dumps(mounts), GUEST_SLOTS]


# Run on the host by a fresh interpreter (-I -S, one thread: setns into a mount namespace needs that), as root, with
# the sandbox's mount namespace and the detached mounts as inherited descriptors: argv[1] is the namespace's,
# argv[2] [[descriptor, guest path], ...]. Each guest path is made (0755) where missing, in a placeholder's tmpfs.
ATTACH_IN_NAMESPACE = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, SYS_MOVE_MOUNT, AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH = 0x20000, 429, -100, 4

def call(result, what):
    if result != 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")

call(libc.setns(int(sys.argv[1]), CLONE_NEWNS), "setns")
os.chdir("/")
for tree, guest in json.loads(sys.argv[2]):
    os.makedirs(guest, mode=0o755, exist_ok=True)
    call(libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, guest.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"attach {guest}")
"""
