"""A sandbox's directories on the host, and the one way the host touches what a sandbox can write.

Under the sandbox's state directory (``<runtime>/<backend>/<id>``, the host's alone):

- ``host/``: what the host writes for the kernel (its connection file, startup file and helpers, the egress proxy's
  socket and CA bundle), shown to the sandbox read-only at its backend's ``guest_host_dir``. The sandbox writes nothing
  there, so nothing the host writes can be swapped for a link.
- ``io/``: the sandbox's own, read-write at ``guest_io_dir``: its kernel binds its ipc sockets there and its reaper
  writes ``exit_status``. As root it is a tmpfs of its own, IO_DIR_MIB in size, charged to the sandbox's memory: a
  kernel that fills it fills only it, never the host's /run.
- ``channels/``: the host's names for the kernel's sockets (``kernel-<port>``), links to descriptors this process
  pinned (pin_channels); what jupyter_client and jupyter_server connect to.

Why: the kernel's own code can replace anything in io/ (a link to a host file or to another sandbox's socket
through /proc, a FIFO, a directory, a huge file). So the host never follows, blocks on, or connects by path through
io/. It reads a file there only from a directory descriptor it opened itself, with O_NOFOLLOW|O_NONBLOCK, a regular
file of bounded size (read_guest_file); it connects to a socket there only through a descriptor it pinned once the
kernel had bound it, after checking that it is a socket of the sandbox's own uid (pin_channels): a name swapped later
is never followed, and another sandbox's socket never passes the check; and it removes what a dead sandbox left
there with unlinkat on that descriptor (clear), while no sandbox runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from msb_kernels.errors import SandboxError

HOST_DIR, IO_DIR, CHANNELS_DIR = "host", "io", "channels"
GUEST_HOST_DIR = "/run/msb"  # where a sandbox sees host/, read-only (a backend's guest_host_dir)
EXIT_STATUS = "exit_status"  # written by the sandbox's reaper in io/: the kernel's status, as a Popen returncode
IO_DIR_MIB = 8  # as root, io/ is a tmpfs of this size
IO_SOURCE = "msb-io"  # that tmpfs's mount source: how a sweep from any runtime dir finds one (leftovers.dead_io_dirs)
GUEST_FILE_LIMIT = 64  # bytes the host reads of a file the sandbox wrote (exit_status)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MNT_DETACH, UMOUNT_NOFOLLOW = 2, 4, 8, 2, 8

_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger(__name__)
_KINDS = {stat.S_IFLNK: "a link", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFREG: "a file"}


def host_dir(io_dir: Path) -> Path:
    return io_dir.parent / HOST_DIR


def channels_dir(io_dir: Path) -> Path:
    return io_dir.parent / CHANNELS_DIR


def make_dirs(root: Path, sandbox_id: str, *, bounded: bool) -> Path:
    """The sandbox's state directory with its host/, io/ and channels/; returns io/. bounded (as root): io/ is a tmpfs
    of IO_DIR_MIB, mounted once (a restart finds it mounted). Made if missing; the owners and modes are the host's
    until ``open_to`` gives io/ to the sandbox's user."""
    state = root / sandbox_id
    for directory in (state, state / HOST_DIR, state / IO_DIR, state / CHANNELS_DIR):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for directory in (state, state / CHANNELS_DIR):
        os.chmod(directory, 0o700)
    io = state / IO_DIR
    if bounded and not os.path.ismount(io):
        options = f"size={IO_DIR_MIB}m,mode=0700,nr_inodes=4096".encode()
        if _libc.mount(IO_SOURCE.encode(), str(io).encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options) != 0:
            code = ctypes.get_errno()
            raise SandboxError(f"cannot mount the io directory of sandbox {sandbox_id} ({io}): {os.strerror(code)}")
    return io


def open_to(io_dir: Path, uid: int, gid: int) -> None:
    """io/ is the sandbox's user's to write (uid, gid: the host ids its files are made with); host/ and what the host
    wrote there are theirs to read. Changed through descriptors of the directories themselves (which only the host can
    replace) and, in host/, of what the host made there."""
    for name, mode, owner in ((IO_DIR, 0o700, uid), (HOST_DIR, 0o750, 0)):
        fd = os.open(io_dir.parent / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.geteuid() == 0:
                os.fchown(fd, owner, gid)
                if name == HOST_DIR:
                    for entry in os.listdir(fd):
                        os.chown(entry, 0, gid, dir_fd=fd, follow_symlinks=False)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def write_host_file(io_dir: Path, name: str, data: bytes | str, mode: int = 0o640) -> Path:
    """A file the host writes for the kernel, in host/ (readable by the sandbox's group, written by the host alone)."""
    directory = host_dir(io_dir)
    path = directory / name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        if os.geteuid() == 0:
            os.fchown(handle.fileno(), 0, os.stat(directory).st_gid)
        os.fchmod(handle.fileno(), mode)
        handle.write(data.encode() if isinstance(data, str) else data)
    return path


def _open_io(io_dir: Path) -> int:
    """A descriptor of io/ itself, opened through the state directory, which only the host can change."""
    return os.open(io_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_guest_file(io_dir: Path, name: str, limit: int = GUEST_FILE_LIMIT) -> bytes | None:
    """What the sandbox wrote to io/<name>: a regular file of at most limit bytes, else None. Never follows a link,
    never blocks on a FIFO, never reads past limit."""
    try:
        directory = _open_io(io_dir)
    except OSError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=directory)
    except OSError:
        return None
    finally:
        os.close(directory)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size > limit:
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)


def bound_socket(io_dir: Path, name: str, uid: int | None = None) -> bool:
    """Whether io/<name> is a socket (not a link to one): the kernel has bound it. uid: and it is that uid's by now
    (gVisor's gofer makes a host socket as root, then gives it to the sandbox's user: pin_channels checks the owner)."""
    try:
        directory = _open_io(io_dir)
    except OSError:
        return False
    try:
        found = os.stat(name, dir_fd=directory, follow_symlinks=False)
        return stat.S_ISSOCK(found.st_mode) and (uid is None or found.st_uid == uid)
    except OSError:
        return False
    finally:
        os.close(directory)


def unsaveable(io_dir: Path, held: tuple[str, ...] = (EXIT_STATUS,)) -> list[str]:
    """What in io/ a checkpoint of the sandbox cannot carry (gVisor saves the files of its host mounts): anything but
    regular files, and a file the sandbox's own init holds open (held) that the kernel removed or replaced."""
    try:
        directory = _open_io(io_dir)
    except OSError:
        return ["its io directory is gone"]
    found = []
    try:
        names = os.listdir(directory)
        for name in sorted(names):
            try:
                mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                found.append(f"{name} ({_KINDS.get(stat.S_IFMT(mode), 'a socket')})")
        found += [f"no {name} (removed while its init holds it)" for name in held if name not in names]
    finally:
        os.close(directory)
    return found


def clear(io_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what a sandbox left in io/ (links, FIFOs, directories, sockets, files), through a descriptor of io/ and
    never following anything; called while no sandbox runs there (before a start or a restart)."""
    try:
        directory = _open_io(io_dir)
    except FileNotFoundError:
        return
    try:
        for name in os.listdir(directory):
            if name in keep:
                continue
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=directory)
                else:
                    os.unlink(name, dir_fd=directory)
            except FileNotFoundError:
                pass
    finally:
        os.close(directory)


@dataclass
class ChannelPins:
    """Descriptors of a kernel's bound sockets, held while it runs, and their names in channels/ (links to them through
    /proc/self/fd, which resolve in this process only: jupyter_client's and jupyter_server's ZeroMQ sockets here)."""

    channels: Path
    fds: dict[int, int] = field(default_factory=dict)  # port -> O_PATH descriptor of the socket the kernel bound

    def close(self) -> None:
        for port, fd in list(self.fds.items()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.channels / f"kernel-{port}")
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def pin_channels(io_dir: Path, names: dict[int, str], uid: int | None) -> ChannelPins:
    """Pin the kernel's sockets (names: port -> the name it bound in io/): each must be a socket, not a link, made by
    the sandbox's uid (None: not checked, where the host cannot tell); SandboxError names the first that is not. The
    host connects to channels/kernel-<port>, which reaches the pinned socket whatever io/ holds by then."""
    pins = ChannelPins(channels_dir(io_dir))
    directory = _open_io(io_dir)
    try:
        for port, name in names.items():
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            except OSError as exc:
                pins.close()
                raise SandboxError(f"the kernel's channel {name} is not there ({exc.strerror})") from None
            pins.fds[port] = fd
            found = os.fstat(fd)
            # Made in io/ itself (a hard link from elsewhere would be of another device, as a bind mount's is).
            foreign = found.st_dev != os.fstat(directory).st_dev
            if not stat.S_ISSOCK(found.st_mode) or foreign or (uid is not None and found.st_uid != uid):
                what = _KINDS.get(stat.S_IFMT(found.st_mode), "not a socket")
                if stat.S_ISSOCK(found.st_mode):
                    what = "a socket made elsewhere" if foreign else f"a socket of uid {found.st_uid}, not the sandbox's {uid}"
                pins.close()
                raise SandboxError(
                    f"the kernel's channel {name} is {what}, not a socket its sandbox bound: refused, as the host never "
                    "connects through what a sandbox can swap"
                )
        for port, fd in pins.fds.items():
            link = pins.channels / f"kernel-{port}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            os.symlink(f"/proc/self/fd/{fd}", link)
    finally:
        os.close(directory)
    return pins


def detach(mountpoint: Path, what: str = "") -> bool:
    """Lazily unmount what is mounted at mountpoint (umount2 with MNT_DETACH): a process still inside does not keep it,
    and nothing under it is walked. False when nothing was mounted there; SandboxError when it cannot be detached.
    umount2 itself tells: os.path.ismount misses a bind mount of the same filesystem (an idmapped shared volume)."""
    if _libc.umount2(str(mountpoint).encode(), MNT_DETACH | UMOUNT_NOFOLLOW) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
        return False
    raise SandboxError(f"cannot unmount {what + ' ' if what else ''}{mountpoint}: {os.strerror(ctypes.get_errno())}")


def unescape_mount_path(field: str) -> str:
    """A mountinfo path field as the path: space, tab, newline and backslash are written there as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(directory: Path) -> list[Path]:
    """What this process's mount namespace has mounted at or below directory, deepest first."""
    top = os.path.realpath(directory)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mountinfo:
        for line in mountinfo:
            point = unescape_mount_path(line.split(" ")[4])
            if point == top or point.startswith(top + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda path: len(path.parts), reverse=True)


def remove(state_dir: Path) -> None:
    """The sandbox's directories, each mount below them detached first (io/'s tmpfs, gVisor's disk and its idmapped
    shared volume), so the removal never walks into a mount: left mounted, a person's volume would go with the
    sandbox. Where a mount cannot be detached, the directories stay, and the log says which."""
    for mountpoint in mounts_under(state_dir):
        with contextlib.suppress(SandboxError):  # said below, with what is left
            detach(mountpoint)
    if remaining := mounts_under(state_dir):
        log.warning("left %s in place: %s is still mounted (umount -l it, then remove the directory)", state_dir, remaining[0])
        return
    shutil.rmtree(state_dir, ignore_errors=True)
