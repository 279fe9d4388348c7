"""Disk for a sandbox's /tmp and home: an ext4 image of the flavor's disk size, on storage, not memory.

The image is reserved in full with fallocate when the sandbox is made, so sandboxes can
never fill the host's disk: either the space is there at start or the start fails. With
MSB_DISK_RESERVE=false the image is sparse instead: each sandbox is still capped at its
flavor's disk, a start needs that much free, but sandboxes together can outgrow the host.

- Namespace: the sandbox's init attaches it to a loop device with autoclear and mounts it in the
  sandbox's own mount namespace, so the device lets go when the last sandbox process is gone.
- gVisor: the host mounts it (mount_image) in the sandbox's state directory, and runsc's gofer serves
  its tmp/ and home/ as the kernel's /tmp and home. The kernel never touches the image's blocks, only
  files through the gofer, so the host's ext4 driver alone writes its metadata. It stays mounted while
  the kernel hibernates, so a woken kernel finds its files; the host detaches it (iodir.detach) at removal.

Either way the host then deletes the file. Where that cannot work (no root, no loop
devices, no mkfs.ext4) /tmp and home share a RAM tmpfs instead (see memory_scratch_note).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import os
import shutil
import stat
from pathlib import Path

from msb_kernels.errors import SandboxError
from msb_kernels.kernelspecs.flavors import FLAVORS, Flavor

SYSTEM_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
IMAGE_SUFFIX = ".img"
STATE_LINK_SUFFIX = ".state"  # beside an image: a link to its sandbox's state dir, in whichever runtime dir that is
DISK_DIR = "disk"  # in a gVisor sandbox's state dir: the host's mount of its disk
# No journal (the disk is thrown away with the sandbox); no reserved blocks (all of it is the user's); no room kept
# for growing it, which it never does (^resize_inode: mkfs of a 4 GiB disk in 6 ms instead of 15);
# nodiscard: mke2fs would otherwise punch holes in the reservation.
MKFS_OPTIONS = ("-q", "-F", "-O", "^has_journal,^resize_inode", "-m", "0", "-E", "nodiscard,lazy_itable_init=1")


def host_headroom_bytes(total: int) -> int:
    """Disk a sandbox start never takes: 5% of the filesystem, at least 1 GiB, so the host (its logs,
    its other services) can still write when sandboxes have reserved all they may."""
    return max(1 << 30, total // 20)


def mkfs_path() -> str | None:
    return shutil.which("mkfs.ext4", path=SYSTEM_PATH)


def unavailable_reason() -> str | None:
    """Why this host cannot give sandboxes disk-backed scratch, or None when it can."""
    if os.geteuid() != 0:
        return "loop-mounted disk images need root (msb-kernels is not running as root)"
    if not os.path.exists("/dev/loop-control"):
        return "this host has no loop devices (/dev/loop-control is missing; modprobe loop)"
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2] if part.isdigit())
    if release < (5, 8):
        return f"attaching a disk image needs Linux >= 5.8 (LOOP_CONFIGURE); this is {os.uname().release}"
    if mkfs_path() is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    with open("/proc/filesystems") as filesystems:
        if not any(line.split()[-1] == "ext4" for line in filesystems if line.strip()):
            return "the host kernel has no ext4 support"
    return None


def disk_note(scratch_root: Path) -> str:
    return (
        f"/tmp and /home/sandbox share an ext4 disk of the flavor's size, reserved in {scratch_root} "
        "when the kernel starts and deleted when it stops; a write past it fails with ENOSPC"
    )


def memory_scratch_note(reason: str) -> str:
    sizes = ", ".join(f"{f.name} {f.memory_scratch_mib} MiB" for f in FLAVORS.values())
    return (
        f"/tmp and /home/sandbox are RAM (tmpfs), not disk, because {reason}: they share half the flavor's memory "
        f"({sizes}); a write past it fails with ENOSPC"
    )


def root_problem(scratch_root: Path) -> str | None:
    """Why scratch_root is not ours alone (None where it is): a directory of this user's that no one else may write.
    Another user's, or one others write (/var/tmp itself, a shared 1777 dir), could be handed links, FIFOs and files
    named like images, which a sweep would read or delete. Called by reserve_image and the sweeps (leftovers.py)."""
    # Each link on the way must be this user's or root's: the default, /var/tmp/msb-kernels, lies in a 1777 directory,
    # where another user's link made root sweep (delete) the images of a directory of their choosing.
    place = Path("/")
    for part in Path(os.path.abspath(scratch_root)).parts[1:]:
        place = place / part
        try:
            link = os.lstat(place)
        except OSError:
            break  # what is missing is checked below, once made
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
            return f"is reached through {place}, a link of uid {link.st_uid}'s"
        if stat.S_ISLNK(link.st_mode):
            place = Path(os.path.realpath(place))
    try:
        info = os.stat(scratch_root)  # through a link of ours: a scratch dir may be named through one
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"
    if info.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def image_path(scratch_root: Path, sandbox_id: str) -> Path:
    return scratch_root / f"{sandbox_id}{IMAGE_SUFFIX}"


def reserve_image(path: Path, flavor: Flavor, reserve: bool = True, state_dir: Path | None = None) -> None:
    """The disk's file, of the flavor's size: its blocks reserved (fallocate), or sparse once the host has the room.
    Called by the namespace and gVisor backends. state_dir: the sandbox's, linked beside the image (state_dir_of), so
    a sweep from any runtime dir finds whether that sandbox lives, and its state dir to remove once it is gone."""
    try:
        # Made 0700 when missing (never chmodded after: a link swapped in would hand the chmod to its target); an
        # operator's directory keeps its mode, and root_problem below says what is wrong with it.
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SandboxError(
            f"cannot create the sandbox's disk in MSB_SCRATCH_DIR={path.parent}: {exc.strerror}",
            ["set MSB_SCRATCH_DIR to a writable directory on a disk"],
        ) from None
    if (problem := root_problem(path.parent)) is not None:
        raise SandboxError(
            f"MSB_SCRATCH_DIR={path.parent} {problem}: the sandboxes' disks are not put where another user can reach them",
            [f"set MSB_SCRATCH_DIR to a directory of uid {os.geteuid()}'s, mode 0700 (it is made so when missing)"],
        )
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        if state_dir is not None:
            link = path.with_suffix(STATE_LINK_SUFFIX)
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            os.symlink(state_dir.absolute(), link)
    except OSError as exc:
        raise SandboxError(
            f"cannot create the sandbox's disk in MSB_SCRATCH_DIR={path.parent}: {exc.strerror}",
            ["set MSB_SCRATCH_DIR to a writable directory on a disk"],
        ) from None
    advice = ["free disk space there", "or set MSB_SCRATCH_DIR to a directory on a larger disk", "or pick a smaller flavor"]
    try:  # no await from the check to the reservation: starts in this process cannot both pass the check
        usage = shutil.disk_usage(path.parent)
        headroom = host_headroom_bytes(usage.total)
        if usage.free - flavor.disk_bytes < headroom:
            raise OSError(errno.ENOSPC, f"{usage.free >> 20} MiB free, and the host keeps {headroom >> 20} MiB of it for itself")
        if reserve:
            os.posix_fallocate(fd, 0, flavor.disk_bytes)
        else:
            os.ftruncate(fd, flavor.disk_bytes)
    except OSError as exc:
        remove_image(path)
        raise SandboxError(
            f"cannot reserve the {flavor.disk_mib} MiB disk of flavor {flavor.name} in {path.parent}: {exc.strerror}", advice
        ) from None
    finally:
        os.close(fd)


async def format_image(path: Path) -> None:
    """An empty ext4 on the reserved file; the file is removed if that fails."""
    mkfs = await asyncio.create_subprocess_exec(
        mkfs_path() or "mkfs.ext4",
        *MKFS_OPTIONS,
        str(path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={"PATH": SYSTEM_PATH},
    )
    output, _ = await mkfs.communicate()
    if mkfs.returncode != 0:
        remove_image(path)
        raise SandboxError(
            f"mkfs.ext4 could not format the sandbox's disk: {output.decode(errors='replace').strip()[-300:]}",
            ["run `msb-kernels doctor` to check this host"],
        )


class Formatting:
    """A sandbox's disk formatted while its root is built: init reads one byte from ready_fd (b"1", or EOF if mkfs
    failed) before it mounts the disk, so the format costs a start only what the root's other mounts do not cover."""

    def __init__(self, path: Path):
        self.ready_fd, self._ready_write = os.pipe()
        self.task = asyncio.ensure_future(format_image(path))
        self.task.add_done_callback(self._tell_init)

    def _tell_init(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            os.write(self._ready_write, b"1")
        os.close(self._ready_write)

    async def finish(self) -> None:
        """mkfs's own error, where it failed; the host's copy of ready_fd is closed either way."""
        try:
            await self.task
        finally:
            self.close()

    def failure(self) -> BaseException | None:
        return self.task.exception() if self.task.done() and not self.task.cancelled() else None

    def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


async def mount_image(image: Path, mountpoint: Path) -> None:
    """The host's mount of a formatted image (gVisor): loop-attached with autoclear, so the device goes with the
    mount; nosuid and nodev, since the files are the sandbox's to make."""
    mountpoint.mkdir(mode=0o700, exist_ok=True)
    mount = await asyncio.create_subprocess_exec(
        "mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", str(image), str(mountpoint),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": SYSTEM_PATH},
    )  # fmt: skip
    output, _ = await mount.communicate()
    if mount.returncode != 0:
        raise SandboxError(
            f"cannot mount the sandbox's disk: {output.decode(errors='replace').strip()[-300:]}",
            ["run `msb-kernels doctor` to check this host"],
        )


def remove_image(path: Path) -> None:
    """The image, and the link to its state dir beside it."""
    for name in (path, path.with_suffix(STATE_LINK_SUFFIX)):
        with contextlib.suppress(FileNotFoundError):
            name.unlink()


def state_dir_of(image: Path) -> Path | None:
    """The state dir reserve_image linked beside image: an absolute path whose name is the image's sandbox id, or
    None (no link: an image of an earlier version, or one whose link is not ours)."""
    try:
        target = Path(os.readlink(image.with_suffix(STATE_LINK_SUFFIX)))
    except OSError:
        return None
    return target if target.is_absolute() and target.name == image.name.removesuffix(IMAGE_SUFFIX) else None


def loop_devices() -> dict[str, list[str]]:
    """Each file that backs a loop device now (a live sandbox's disk), and its devices (/dev/loopN)."""
    backed: dict[str, list[str]] = {}
    for backing_file in glob.glob("/sys/block/loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            path = Path(backing_file).read_text().strip().removesuffix(" (deleted)")
            backed.setdefault(path, []).append("/dev/" + Path(backing_file).parent.parent.name)
    return backed


def attached_images() -> set[str]:
    """Files that back a loop device now (a live sandbox's disk)."""
    return set(loop_devices())
