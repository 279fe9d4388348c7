"""Disks no live sandbox holds, found by the scratch dir that every runtime dir's sandboxes share (issue 58).

A sandbox's state is in its own runtime dir, but the disk images of every runtime dir's sandboxes are in one scratch
dir (MSB_SCRATCH_DIR). A sweep that reads only its own runtime dir's state files missed what another gateway or a
script left: a 2 GiB image still mounted in the state dir of a runtime dir no one runs any more. Here the scratch dir
itself is read: each image, the loop devices it backs, where the host has them mounted, and whether its sandbox still
lives by its state file, whichever runtime dir that is in: the state dir of the mount, or the one the image's link
names (scratch.state_dir_of; a namespace sandbox mounts its disk in its own mount namespace, where the host sees none).

Called by the namespace and gVisor backends' sweeps (at each gateway's or kernel's start) and `msb-kernels doctor`
(which lists them; with --clean, removes them); the gateway's scrape reads their sizes.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.backends.core import cgroups, iodir, scratch
from msb_kernels.backends.core.keeping import trusted_json
from msb_kernels.backends.core.processes import pids_of_another_namespace, process_alive
from msb_kernels.backends.core.scratch import DISK_DIR, IMAGE_SUFFIX, state_dir_of
from msb_kernels.errors import SandboxError
from msb_kernels.observability import metrics

# runsc's own records of a gVisor sandbox, in its --root beside the state dirs (gvisor/backend.py): what `runsc delete`
# removes. A sweep from another runtime dir removes them by name: the runsc that wrote them may be no one's now.
RUNSC_RECORDS = ("runsc/{id}_sandbox:{id}.state", "runsc/{id}_sandbox:{id}.lock", "runsc/runsc-{id}.sock")
STARTS_WITHIN = 300.0  # seconds: an image younger than this, or a state dir without its state file, may be a start's


@dataclass(frozen=True)
class Disk:
    """One image in the scratch dir, and what of the host holds it."""

    image: Path
    allocated: int  # bytes of the host's disk it holds (the whole flavor's disk where reserved)
    mounts: tuple[Path, ...]  # where the host has it mounted: a gVisor sandbox's <state dir>/disk
    attached: bool  # a loop device is backed by it (a namespace sandbox's is mounted in its own mount namespace only)
    why: str | None  # why no sandbox holds it; None: one does, or may (a start in progress)
    state_dir: Path | None = None  # its sandbox's, by the image's link (scratch.state_dir_of), where that was read

    @property
    def left(self) -> bool:
        return self.why is not None


def _host_mounts() -> dict[str, list[Path]]:
    """Each mounted device (its mountinfo source) and where this mount namespace has it."""
    mounted: dict[str, list[Path]] = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mountinfo:
        for line in mountinfo:
            fields = line.split(" ")
            source = fields[fields.index("-") + 2] if "-" in fields else ""
            mounted.setdefault(source, []).append(Path(iodir.unescape_mount_path(fields[4])))
    return mounted


def _sandbox_gone(state_dir: Path, younger_than: float, held: bool = True) -> str | None:
    """Why the sandbox of state_dir no longer lives (its owner, its process and its keeper all gone; or no state
    file past the time a start takes); None where it may. held: something of the host's still holds its disk (a
    loop device, a mount); where nothing does, the sandbox is gone whoever its pids were."""
    state, problem = trusted_json(state_dir / "state.json", private=False)
    try:
        age = time.time() - os.lstat(state_dir).st_mtime
    except OSError:
        return f"{state_dir} is gone"
    if state is None:
        return None if age < younger_than else f"{state_dir} has no state file ({problem}) after {age:.0f} s"
    if pids_of_another_namespace(state):  # its pids name nothing here: only the host's hold on its disk tells
        if held or age < younger_than:
            return None
        return f"no loop device holds its disk, {age:.0f} s on, and its owner ran in another pid namespace"
    for who in ("owner", "init", "keeper"):
        if process_alive(state.get(f"{who}_pid"), state.get(f"{who}_start")):
            return None
    return f"the sandbox of {state_dir} is gone: its owner, its process and its keeper have all ended"


def disks(scratch_root: Path, younger_than: float, live: Collection[str] = ()) -> list[Disk]:
    """Every image in scratch_root. One made less than younger_than seconds ago may belong to a start in progress.
    live: sandbox ids the caller holds (a gateway's scrape), whose state is not read: 1,000 gVisor kernels' state
    files and /proc entries took 200 ms of every scrape on the event loop."""
    if not scratch_root.is_dir() or scratch.root_problem(scratch_root) is not None:
        return []  # nothing in a directory that is not this user's alone is taken for an image of ours
    loops, mounted = scratch.loop_devices(), _host_mounts()
    # The loop device names its backing file by its real path, whatever spelling MSB_SCRATCH_DIR has (a link).
    real_root = os.path.realpath(scratch_root)
    found = []
    with os.scandir(scratch_root) as entries:
        named = sorted((entry.name, entry) for entry in entries if entry.name.endswith(IMAGE_SUFFIX))
    for name, entry in named:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            continue  # not an image of ours: a loop device's backing file is a regular file, made by this user
        image = scratch_root / name
        devices = loops.get(os.path.join(real_root, name), [])
        mounts = tuple(point for device in devices for point in mounted.get(device, []))
        why: str | None = None
        state_dir = None
        if name.removesuffix(IMAGE_SUFFIX) in live:
            pass
        elif not devices and (state_dir := state_dir_of(image)) is not None:  # its sandbox, by its own state
            gone = not os.path.lexists(state_dir)
            why = f"its state dir {state_dir} is gone" if gone else _sandbox_gone(state_dir, younger_than, held=False)
        elif not devices:
            age = time.time() - info.st_mtime
            why = None if age < younger_than else f"no loop device holds it, {age:.0f} s after it was made"
        elif mounts:  # the host's own mount: a gVisor sandbox's, alive only while that sandbox is
            reasons = [_sandbox_gone(point.parent, younger_than) for point in mounts]
            why = None if None in reasons else "; ".join(reason for reason in reasons if reason)
        found.append(Disk(image, info.st_blocks * 512, mounts, bool(devices), why, state_dir))
    return found


def remove(disk: Disk) -> None:
    """Detach disk's mounts, remove the state dirs they are in or its link names (their sandboxes are gone), and
    delete its image."""
    for point in disk.mounts:
        with contextlib.suppress(SandboxError):
            iodir.detach(point)
        if point.name == DISK_DIR and _is_state_dir(point.parent):  # a sandbox's state dir, never another place
            remove_dead_state_dir(point.parent)
    if disk.state_dir is not None and not disk.mounts and _is_state_dir(disk.state_dir):
        remove_dead_state_dir(disk.state_dir)
    scratch.remove_image(disk.image)


def remove_dead_state_dir(state_dir: Path) -> None:
    """A gone sandbox's state dir, each mount below it detached first, its cgroups (by its state file: a sweep
    from another runtime dir left them for good), and runsc's records of it beside."""
    state, _ = trusted_json(state_dir / "state.json", private=False)
    if state is not None and state.get("cgroup") and state.get("sandbox_id") == state_dir.name:
        hierarchy, _ = cgroups.detect()
        if hierarchy is not None:
            cgroups.SandboxCgroup(hierarchy, state_dir.name).destroy(timeout=0)
    iodir.remove(state_dir)
    for record in RUNSC_RECORDS:
        with contextlib.suppress(OSError):
            os.unlink(state_dir.parent / record.format(id=state_dir.name))


def _is_state_dir(path: Path) -> bool:
    """A sandbox's state dir: a directory of this user's (not a link) with the io dir every start makes first."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and (path / iodir.IO_DIR).is_dir()


def sweep(scratch_root: Path, younger_than: float, live: Collection[str] = ()) -> list[Disk]:
    """Remove every image of scratch_root no live sandbox holds, whichever runtime dir it came from; what was.
    live: as disks() takes it."""
    swept = []
    for disk in disks(scratch_root, younger_than, live):
        if disk.left:
            try:
                remove(disk)
            except (OSError, SandboxError):  # what cannot go stays for the next sweep; never a start's failure
                continue
            metrics.SCRATCH_SWEPT_BYTES.inc(disk.allocated)
            swept.append(disk)
    return swept


def dead_io_dirs(younger_than: float, live: Collection[str] = ()) -> list[tuple[Path, str]]:
    """State dirs, in any runtime dir, whose io tmpfs (iodir.IO_SOURCE) the host still mounts while their sandbox is
    gone, with why: a start killed before its state file, a sandbox without a disk whose owner and keeper died.
    live: as disks() takes it."""
    found = []
    for point in _host_mounts().get(iodir.IO_SOURCE, []):
        state_dir = point.parent
        if point.name != iodir.IO_DIR or state_dir.name in live or not _is_state_dir(state_dir):
            continue
        if (why := _sandbox_gone(state_dir, younger_than)) is not None:
            found.append((state_dir, why))
    return found


def sweep_io_dirs(younger_than: float, live: Collection[str] = ()) -> list[Path]:
    """Remove what dead_io_dirs finds, each mount below it detached first; the state dirs that went."""
    swept = []
    for state_dir, _ in dead_io_dirs(younger_than, live):
        with contextlib.suppress(OSError, SandboxError):  # what cannot go stays for the next sweep
            remove_dead_state_dir(state_dir)
            swept.append(state_dir)
    return swept


def used_bytes(disk: Disk, runtime_root: Path) -> int | None:
    """Bytes written inside a disk: where the host mounts it (gVisor's), or, for a namespace sandbox of runtime_root,
    which mounts it in its own mount namespace, through its init's root (/proc/<pid>/root/tmp); None elsewhere."""
    places = list(disk.mounts)
    if disk.attached and not places:
        state, _ = trusted_json(runtime_root / disk.image.name.removesuffix(IMAGE_SUFFIX) / "state.json", private=False)
        if state is not None and process_alive(state.get("init_pid"), state.get("init_start")):
            places.append(Path(f"/proc/{state['init_pid']}/root/tmp"))
    for point in places:
        with contextlib.suppress(OSError):
            stats = os.statvfs(point)
            return (stats.f_blocks - stats.f_bfree) * stats.f_frsize
    return None
