"""Hibernation images: where ``runsc checkpoint`` writes a kernel's sandbox, sealed and counted, and what may stop it.

One directory per kernel under MSB_HIBERNATE_DIR (0700, the gateway's user only), holding runsc's image. With
MSB_HIBERNATE_KEY_FILE the image is sealed once runsc has written it: AES-256-GCM in chunks (SEALED), the plain file
removed; a restore opens it again beside the sealed one, and removes it as soon as runsc has read it. runsc's restore
needs a regular file (it refuses a pipe: "file cannot be empty"), and its checkpoint creates the file itself
(O_EXCL), so the plain image lies on the private disk for the seconds that each of those takes, never longer.

What runsc (release 20221219) cannot save ends a checkpoint and the sandbox with it, so the gateway asks first
(blocking_sockets): a TCP endpoint that is connected, or that epoll watches, panics its save. What the sandbox's own
relays listen on is known to be saveable (they poll); any other TCP or UDP socket is a reason not to hibernate.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import struct
from pathlib import Path

from msb_kernels.errors import HibernationRefused

IMAGE = "checkpoint.img"  # runsc's name for it, in --image-path
SEALED = "checkpoint.sealed"
MAGIC = b"MSB-HIBERNATE-AESGCM 1\n"
CHUNK = 4 << 20
RECORD = struct.Struct("!IB")  # a sealed chunk: its length, and 1 for the last one
NONCE_PREFIX = 8
TCP_STATES = {
    "01": "connected",
    "02": "connecting",
    "03": "connecting",
    "04": "closing",
    "05": "closing",
    "06": "closing",
    "07": "closed",
    "08": "closing",
    "09": "closing",
    "0A": "listening",
    "0B": "closing",
}


class ImageStore:
    """MSB_HIBERNATE_DIR: each hibernated kernel's image, its seal, and the disk budget they share."""

    def __init__(self, root: Path, key: bytes | None = None, budget_bytes: int | None = None):
        self.root = root
        self.key = key
        self.budget_bytes = budget_bytes

    def directory(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def prepare(self, sandbox_id: str) -> Path:
        """An empty directory for runsc to write the image into, private to this user."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        directory = self.directory(sandbox_id)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(mode=0o700)
        return directory

    def size(self, sandbox_id: str) -> int:
        total = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory(sandbox_id)):
                total += entry.stat(follow_symlinks=False).st_size
        return total

    def used(self) -> int:
        """Bytes every image here takes (the budget counts them all, whichever gateway wrote them)."""
        try:
            return sum(self.size(entry.name) for entry in os.scandir(self.root) if entry.is_dir(follow_symlinks=False))
        except OSError:
            return 0

    def check_room(self, sandbox_id: str, estimate: int) -> None:
        """HibernationRefused (the kernel runs on) when an image of about estimate bytes would pass MSB_HIBERNATE_DISK_MIB."""
        if self.budget_bytes is None:
            return
        used = self.used() - self.size(sandbox_id)
        if used + estimate > self.budget_bytes:
            raise HibernationRefused(
                f"no room to hibernate: MSB_HIBERNATE_DISK_MIB={self.budget_bytes >> 20} and the images there take "
                f"{used >> 20} MiB, with this kernel's up to {estimate >> 20} MiB more",
                ["raise MSB_HIBERNATE_DISK_MIB", "or shut down sessions you no longer need; the kernel keeps running meanwhile"],
            )

    def seal(self, sandbox_id: str) -> int:
        """Encrypt the image runsc wrote (when there is a key) and remove the plain one; the bytes it now takes. The image
        is written out and dropped from the page cache, which would otherwise hold its size in memory, charged to the
        sandbox's cgroup (runsc's Sentry wrote it): hibernation is there to free that memory."""
        directory = self.directory(sandbox_id)
        image = directory / IMAGE
        if self.key is not None:
            seal_file(self.key, image, directory / SEALED)
            image.unlink()
            image = directory / SEALED
        _drop_from_cache(image)
        return self.size(sandbox_id)

    def open_for_restore(self, sandbox_id: str) -> Path:
        """The directory to restore from, its plain image opened from the sealed one where there is a key (remove()
        deletes both once runsc has read it)."""
        directory = self.directory(sandbox_id)
        if self.key is not None and (directory / SEALED).exists():
            open_file(self.key, directory / SEALED, directory / IMAGE)
        return directory

    def remove(self, sandbox_id: str) -> None:
        shutil.rmtree(self.directory(sandbox_id), ignore_errors=True)

    def leftovers(self) -> list[str]:
        try:
            return [entry.name for entry in os.scandir(self.root) if entry.is_dir(follow_symlinks=False)]
        except OSError:
            return []


def _drop_from_cache(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def seal_file(key: bytes, source: Path, target: Path) -> None:
    """source encrypted into target: MAGIC, a random nonce prefix, then each chunk as RECORD and AES-GCM output. The
    chunk's number and whether it is the last are in its nonce and associated data, so chunks cannot be reordered,
    dropped or cut off without the open failing."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher, prefix = AESGCM(key), os.urandom(NONCE_PREFIX)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(source, "rb") as plain, os.fdopen(fd, "wb") as out:
        out.write(MAGIC + prefix)
        index, chunk = 0, plain.read(CHUNK)
        while True:
            following = plain.read(CHUNK)
            last = not following
            sealed = cipher.encrypt(_nonce(prefix, index), chunk, _associated(index, last))
            out.write(RECORD.pack(len(sealed), last) + sealed)
            if last:
                break
            index, chunk = index + 1, following


def open_file(key: bytes, source: Path, target: Path) -> None:
    """The inverse of seal_file; ValueError when the file is not what seal_file wrote with this key."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher = AESGCM(key)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(source, "rb") as sealed, os.fdopen(fd, "wb") as out:
        head = sealed.read(len(MAGIC) + NONCE_PREFIX)
        if not head.startswith(MAGIC) or len(head) != len(MAGIC) + NONCE_PREFIX:
            raise ValueError(f"{source} is not a sealed hibernation image")
        prefix, index = head[len(MAGIC) :], 0
        while True:
            record = sealed.read(RECORD.size)
            if len(record) != RECORD.size:
                raise ValueError(f"{source} ends before its last chunk")
            length, last = RECORD.unpack(record)
            try:
                out.write(cipher.decrypt(_nonce(prefix, index), sealed.read(length), _associated(index, bool(last))))
            except InvalidTag:
                raise ValueError(f"{source} does not open with MSB_HIBERNATE_KEY_FILE's key, or was changed") from None
            if last:
                return
            index += 1


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + index.to_bytes(4, "big")


def _associated(index: int, last: bool) -> bytes:
    return index.to_bytes(8, "big") + (b"\x01" if last else b"\x00")


def blocking_sockets(proc_net: dict[str, str], saveable: set[tuple[str, str, int]]) -> list[str]:
    """What would stop a checkpoint, from the sandbox's /proc/net/{tcp,tcp6,udp,udp6} (name -> text): every socket but
    those in saveable, as (protocol, address, port) of a relay's listener. One line each, for the log and the stats."""
    found = []
    for name, text in proc_net.items():
        protocol = name.rstrip("6")
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4 or ":" not in fields[1]:
                continue
            address, port = _endpoint(fields[1])
            state = TCP_STATES.get(fields[3].upper(), fields[3]) if protocol == "tcp" else "open"
            if state == "closed":
                continue
            # A relay's listener saves (it polls); a connection accepted on its port does not.
            listening = state == "listening" or protocol == "udp"
            if listening and ((protocol, address, port) in saveable or (protocol, "0.0.0.0", port) in saveable):
                continue
            if state == "listening" or protocol == "udp":
                found.append(f"{protocol} {state} on {address}:{port}")
            else:
                remote = ":".join(map(str, _endpoint(fields[2])))
                found.append(f"tcp {state} {address}:{port} to {remote}")
    return found


def _endpoint(text: str) -> tuple[str, int]:
    """/proc/net's "0100007F:1F90" as ("127.0.0.1", 8080): the address in the host's byte order, in hex."""
    raw, port = text.split(":")
    packed = bytes.fromhex(raw)
    if len(packed) == 4:
        address = str(ipaddress.IPv4Address(packed[::-1]))
    else:
        address = str(ipaddress.IPv6Address(b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))))
    return address, int(port, 16)
