"""Nothing left behind (issue 58): a dead owner's sandboxes take their disks, mounts, io dirs and state with them,
however the owner died, with no later start to sweep them.

The owner is what users run: a script that starts kernels with jupyter_client's KernelManager, as nbclient and
papermill do, in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager

from msb_kernels.backends.core import cgroups, leftovers, scratch
from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.core.state import write_state
from msb_kernels.errors import SandboxError
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.provisioning.provisioner import DISK_SWEEP_EVERY
from tests.conftest import VENV_BIN
from tests.msb_kernels.gateway.conftest import KernelSocket, gateway_factory, wait_until  # noqa: F401 (a fixture)
from tests.parallel import ALONE
from tests.skips import needs_runsc

# Any start on the host sweeps what dead sandboxes left, whichever runtime dir: another test's start would take what
# these tests leave for theirs to sweep, or sweep what one of these waits to see.
pytestmark = ALONE
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]

OWNER = """
import asyncio, sys
from jupyter_client.manager import AsyncKernelManager

async def main():
    managers = []
    for _ in range(2):
        manager = AsyncKernelManager(kernel_name="msb-python-small")
        await manager.start_kernel()
        managers.append(manager)
    print(" ".join(manager.kernel_id for manager in managers), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed before it shut its kernels down")
    if sys.argv[1] == "stop":
        for manager in managers:
            await manager.shutdown_kernel(now=True)
        return
    await asyncio.sleep(600)

asyncio.run(main())
"""


def named_under(top: Path, match: Callable[[str], bool], *, inside: bool = False) -> list[Path]:
    """Paths under top whose name matches (inside: looking into those too), never into a mount (a sandbox's disk).
    os.walk, not Path.rglob: the keeper removes these directories while a test looks, and rglob raised
    FileNotFoundError on one it had listed (a fresh-clone run)."""
    found = []
    for folder, folders, files in os.walk(top):
        named = [name for name in (*folders, *files) if match(name)]
        found += [Path(folder) / name for name in named]
        folders[:] = [f for f in folders if (inside or f not in named) and not os.path.ismount(os.path.join(folder, f))]
    return found


def states_under(runtime: Path) -> set[Path]:
    return set(named_under(runtime, lambda name: name == "state.json", inside=True))


def left_of(kernel_ids: list[str], runtime: Path | None = None) -> list[str]:
    """What of these kernels' sandboxes is still on the host: state or io dirs (in runtime, the suite's runtime dir by
    default), disk images, mounts, loop devices."""
    runtime, scratch_root = runtime or Path(os.environ["MSB_RUNTIME_DIR"]), Path(os.environ["MSB_SCRATCH_DIR"])
    found = []
    for kernel_id in kernel_ids:
        found += [f"directory {path}" for path in named_under(runtime, lambda name, k=kernel_id: k in name)]
        found += [f"image {path}" for path in scratch_root.glob(f"{kernel_id}*")]
        found += [f"loop device backed by {image}" for image in scratch.attached_images() if kernel_id in image]
        with open("/proc/self/mountinfo") as mountinfo:
            found += [f"mount {line.split()[4]}" for line in mountinfo if kernel_id in line.split()[4]]
    return found


def owner_options(backend: str) -> dict:
    """How the tests run OWNER: in a session of its own (killed whole), its two kernel ids on its stdout."""
    return {
        "env": {**os.environ, "MSB_BACKEND": backend},
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
        "start_new_session": True,
    }


async def kernels_of_owner(owner: subprocess.Popen) -> list[str]:
    line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 120)
    kernel_ids = line.split()
    assert len(kernel_ids) == 2, owner.stderr.read() if owner.poll() is not None else line
    return kernel_ids


@pytest.mark.parametrize("death", ["kill -9", "raise"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_dead_scripts_kernels_leave_no_disk_mount_or_state(backend: str, death: str) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "raise" if death == "raise" else "wait"], **owner_options(backend))
    try:
        kernel_ids = await kernels_of_owner(owner)
        await dies_and_leaves_nothing(owner, kernel_ids, kill=death == "kill -9")
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()


async def dies_and_leaves_nothing(owner: subprocess.Popen, kernel_ids: list[str], kill: bool) -> None:
    """owner ends (killed with kill -9, or by itself); within seconds, with no new start, the keeper has ended each
    sandbox of kernel_ids and swept what it left."""
    if kill:
        held = left_of(kernel_ids)  # what the owner's death must take with it
        assert held and (scratch.unavailable_reason() is not None or any(item.startswith("image") for item in held)), held
        os.kill(owner.pid, signal.SIGKILL)
    await asyncio.to_thread(owner.wait, 60)
    await wait_until(lambda: not left_of(kernel_ids), 60, f"the sandboxes of {kernel_ids} to be swept")


needs_disk = pytest.mark.skipif(
    scratch.unavailable_reason() is not None, reason=f"disk-backed scratch is unavailable here: {scratch.unavailable_reason()}"
)
TEN_MINUTES_AGO = time.time() - 600


async def mounted_disk(runtime: Path, sandbox_id: str, owner: subprocess.Popen | None = None, state: bool = True) -> Path:
    """A gVisor sandbox's disk as its backend makes it (an image in the shared scratch dir, mounted by the host at
    <state dir>/disk), in another runtime dir, with a state file naming owner as owner and process (or none)."""
    state_dir = runtime / "gvisor" / sandbox_id
    state_dir.mkdir(mode=0o700, parents=True)
    (state_dir / "io").mkdir(mode=0o700)
    image = scratch.image_path(Path(os.environ["MSB_SCRATCH_DIR"]), sandbox_id)
    scratch.reserve_image(image, FLAVORS["small"], reserve=False)
    await scratch.format_image(image)
    await scratch.mount_image(image, state_dir / "disk")
    if state:
        pid = owner.pid if owner else None
        started = process_start_time(pid) if owner else None
        write_state(
            state_dir,
            {
                "sandbox_id": sandbox_id,
                "backend": "gvisor",
                "owner_pid": pid,
                "owner_start": started,
                "init_pid": pid,
                "init_start": started,
            },
        )
    return state_dir


def mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as mountinfo:
        return any(line.split()[4] == str(path) for line in mountinfo)


@needs_disk
async def test_any_start_sweeps_every_runtime_dirs_dead_disks_and_no_live_one(tmp_path: Path) -> None:
    """The disks of three sandboxes of another runtime dir (another gateway's, on this host), all mounted: one whose
    start failed part way (no state file, 10 minutes on), one whose owner and process are gone, one whose owner
    lives; and two loose images, 10 minutes old and new. A kernel's start in this runtime dir (a process's first
    start sweeps) removes the dead two and the old image, mounts and state dirs too, and nothing of the live one."""
    elsewhere = Path(tempfile.mkdtemp(prefix="msbt-else-", dir="/tmp"))
    scratch_root = Path(os.environ["MSB_SCRATCH_DIR"])
    gone = subprocess.Popen(["sleep", "60"])
    alive = subprocess.Popen(["sleep", "600"])
    try:
        failed_start = await mounted_disk(elsewhere, "leftover-failed-start", state=False)
        os.utime(failed_start, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
        dead = await mounted_disk(elsewhere, "leftover-dead-owner", owner=gone)
        live = await mounted_disk(elsewhere, "live-other-gateway", owner=alive)
        gone.kill()
        gone.wait()
        old, young = scratch_root / f"loose-old{scratch.IMAGE_SUFFIX}", scratch_root / f"loose-young{scratch.IMAGE_SUFFIX}"
        for image in (old, young):
            scratch.reserve_image(image, FLAVORS["small"], reserve=False)
        os.utime(old, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))

        listed = {disk.image.name: disk for disk in leftovers.disks(scratch_root, leftovers.STARTS_WITHIN)}
        assert {name for name, disk in listed.items() if disk.left} >= {
            f"leftover-failed-start{scratch.IMAGE_SUFFIX}",
            f"leftover-dead-owner{scratch.IMAGE_SUFFIX}",
            old.name,
        }
        assert not listed[f"live-other-gateway{scratch.IMAGE_SUFFIX}"].left and not listed[young.name].left

        owner = subprocess.run(
            [sys.executable, "-c", OWNER, "stop"],
            env={**os.environ, "MSB_BACKEND": "namespace"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert owner.returncode == 0, owner.stderr[-2000:]

        for state_dir in (failed_start, dead):
            assert not mounted(state_dir / "disk") and not state_dir.exists(), state_dir
            assert not scratch.image_path(scratch_root, state_dir.name).exists()
        assert not old.exists() and young.exists()
        assert mounted(live / "disk") and scratch.image_path(scratch_root, live.name).exists(), "a live sandbox's disk was swept"
    finally:
        for process in (gone, alive):
            process.kill()
            process.wait()
        made = ("leftover-failed-start", "leftover-dead-owner", "live-other-gateway", "loose-old", "loose-young")
        for disk in leftovers.disks(scratch_root, 0):
            if disk.image.name.removesuffix(scratch.IMAGE_SUFFIX) in made:
                leftovers.remove(disk)
        shutil.rmtree(elsewhere, ignore_errors=True)


def _fail(what: str):
    def failing(*args, **kwargs):
        raise SandboxError(f"{what} failed (made to, by the test)")

    return failing


async def _mount_then_fail(image: Path, mountpoint: Path) -> None:
    await REAL_MOUNT(image, mountpoint)
    raise SandboxError("the mount failed after it was made (made to, by the test)")


REAL_MOUNT = scratch.mount_image
# Each step of a start, made to fail: (the backend, the step) -> what to replace, and with what.
STEPS = {
    ("gvisor", "the disk"): ("msb_kernels.backends.core.scratch.reserve_image", _fail("the disk")),
    ("gvisor", "the mount"): ("msb_kernels.backends.core.scratch.mount_image", _mount_then_fail),
    ("gvisor", "the io directory"): ("msb_kernels.backends.core.iodir.open_to", _fail("the io directory")),
    ("gvisor", "the bundle"): ("msb_kernels.backends.gvisor.backend.write_bundle", _fail("the bundle")),
    ("gvisor", "the boot"): ("msb_kernels.backends.gvisor.backend.runsc_path", lambda: "/bin/false"),
    ("namespace", "the disk"): ("msb_kernels.backends.core.scratch.reserve_image", _fail("the disk")),
    ("namespace", "the format"): ("msb_kernels.backends.core.scratch.mkfs_path", lambda: "/bin/false"),
    ("namespace", "the io directory"): ("msb_kernels.backends.core.iodir.open_to", _fail("the io directory")),
    ("namespace", "the boot"): ("msb_kernels.backends.namespace.backend.LAUNCHER", "/nonexistent/init_program.py"),
}


@needs_disk
@pytest.mark.parametrize(("backend", "step"), [pytest.param(*key, marks=[needs_runsc] if key[0] == "gvisor" else []) for key in STEPS])
async def test_a_start_that_fails_at_any_step_leaves_nothing(backend: str, step: str, monkeypatch) -> None:
    """A kernel's start made to fail at each of its steps, through jupyter_client as nbclient starts one (and shuts
    down what did start, when it never answers): nothing of it is left, its disk and mount included, with no state
    file to find them by."""
    target, replacement = STEPS[(backend, step)]
    monkeypatch.setattr(target, replacement)
    monkeypatch.setenv("MSB_BACKEND", backend)
    monkeypatch.setenv("MSB_FORK_KERNELS", "false")  # the boot: the launcher, not a fork server, starts init
    kernel_id = f"failing-{backend}-{step.split()[-1]}-{os.getpid()}"
    manager = AsyncKernelManager(kernel_name="msb-python-small")
    client = None
    # The step's own error; for the boot, the backend's, the keeper's or jupyter_client's, by who sees it end first.
    with pytest.raises(Exception, match="made to, by the test|died before replying|keeper|runsc exited|launcher|formatted|mkfs"):
        try:
            await manager.start_kernel(kernel_id=kernel_id)
            client = manager.client()
            client.start_channels()
            await client.wait_for_ready(timeout=60)
        finally:
            if client is not None:
                client.stop_channels()
            if manager.has_kernel:
                await manager.shutdown_kernel(now=True)
    assert left_of([kernel_id]) == []


@needs_disk
async def test_doctor_lists_the_disks_no_sandbox_holds_and_clean_removes_them() -> None:
    """`msb-kernels doctor` names each image that no live sandbox holds, from any runtime dir, with its size and why;
    `--clean` removes it, its mount and state dir, and leaves a live sandbox's disk alone."""
    elsewhere = Path(tempfile.mkdtemp(prefix="msbt-else-", dir="/tmp"))
    alive = subprocess.Popen(["sleep", "600"])
    try:
        dead = await mounted_disk(elsewhere, "doctor-dead", state=False)
        os.utime(dead, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
        live = await mounted_disk(elsewhere, "doctor-live", owner=alive)
        doctor = subprocess.run(
            [str(VENV_BIN / "msb-kernels"), "doctor", "--clean"],
            env={**os.environ, "MSB_BACKEND": "namespace"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert f"left behind: {scratch.image_path(Path(os.environ['MSB_SCRATCH_DIR']), 'doctor-dead')}" in doctor.stdout, doctor.stdout
        assert "has no state file" in doctor.stdout and "doctor-live" not in doctor.stdout
        assert "-> removed" in doctor.stdout and "MiB" in doctor.stdout
        assert not dead.exists() and not mounted(dead / "disk")
        assert mounted(live / "disk")
    finally:
        alive.kill()
        alive.wait()
        for disk in leftovers.disks(Path(os.environ["MSB_SCRATCH_DIR"]), 0):
            if disk.image.name.startswith("doctor-"):
                leftovers.remove(disk)
        shutil.rmtree(elsewhere, ignore_errors=True)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_papermill_run_killed_mid_cell_leaves_nothing(backend: str, tmp_path: Path) -> None:
    """papermill, as a batch user runs it, killed with kill -9 while its notebook's cell runs: within seconds, with no
    new start, nothing of its kernel's sandbox is left."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(600)")])
    notebook.metadata["kernelspec"] = {"name": "msb-python-small", "display_name": "Python (small)", "language": "python"}
    nbformat.write(notebook, tmp_path / "in.ipynb")
    runtime = Path(os.environ["MSB_RUNTIME_DIR"])
    before = states_under(runtime)
    run = subprocess.Popen(
        [str(VENV_BIN / "papermill"), str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb")],
        env={**os.environ, "MSB_BACKEND": backend},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        await wait_until(lambda: states_under(runtime) - before, 120, "papermill's kernel to start")
        kernel_ids = [path.parent.name for path in states_under(runtime) - before]
        await asyncio.sleep(2)  # its cell runs
        assert run.poll() is None
        await dies_and_leaves_nothing(run, kernel_ids, kill=True)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


@needs_disk
async def test_the_sweep_holds_to_what_is_a_disk_and_who_lives(tmp_path: Path) -> None:
    """What a hostile-tenant run found: a scratch dir named through a link saw no loop device behind a live image, and
    swept it; a directory named like an image broke every start; a killed owner that its parent had not reaped yet
    counted as alive, so its keeper's sweep left its sandbox."""
    from msb_kernels.backends.core.processes import process_alive

    scratch_root = Path(os.environ["MSB_SCRATCH_DIR"])
    elsewhere = Path(tempfile.mkdtemp(prefix="msbt-else-", dir="/tmp"))
    link = tmp_path / "scratch-link"
    link.symlink_to(scratch_root)
    bogus = scratch_root / f"a-directory{scratch.IMAGE_SUFFIX}"
    bogus.mkdir(parents=True)
    os.utime(bogus, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    attached = None
    try:
        # A namespace sandbox's disk: a loop device holds it, and the host mounts it nowhere.
        image = scratch_root / f"attached-live{scratch.IMAGE_SUFFIX}"
        scratch.reserve_image(image, FLAVORS["small"], reserve=False)
        os.utime(image, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
        attached = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True).stdout.strip()
        seen = {disk.image.name: disk for disk in leftovers.disks(link, leftovers.STARTS_WITHIN)}
        assert seen[image.name].attached and not seen[image.name].left, "a live disk, seen through a link, taken for left"
        assert bogus.name not in seen
        assert leftovers.sweep(link, leftovers.STARTS_WITHIN) == [] and image.exists() and bogus.is_dir()

        zombie = subprocess.Popen(["true"])
        started = process_start_time(zombie.pid)
        await wait_until(lambda: open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 10, "a zombie")
        assert not process_alive(zombie.pid, started), "a killed process not yet reaped counted as alive"
        zombie.wait()
    finally:
        if attached:
            subprocess.run(["losetup", "-d", attached], check=False)
        for path in (scratch_root / f"attached-live{scratch.IMAGE_SUFFIX}",):
            path.unlink(missing_ok=True)
        bogus.rmdir()
        shutil.rmtree(elsewhere, ignore_errors=True)


async def test_a_start_its_owner_died_in_before_its_state_file_is_swept(runtime_root: Path) -> None:
    """A start makes its state dir and io/ first; an owner killed before the state file was written left them, which
    no sweep found (it read state files only). Past the time a start takes, the next sweep removes them."""
    from msb_kernels.backends import get_backend
    from msb_kernels.settings.config import load_settings

    backend = get_backend(load_settings())
    io_dir = backend.io_dir_for("died-mid-start")
    os.utime(io_dir.parent, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    young = backend.io_dir_for("starting-now")
    try:
        assert "died-mid-start" in await backend.sweep_orphans()
        assert not io_dir.parent.exists() and young.exists()
    finally:
        from msb_kernels.backends.core import iodir

        iodir.remove(young.parent)


@needs_disk
async def test_a_start_killed_before_its_state_file_in_another_runtime_dir_is_swept_by_any_start(tmp_path: Path) -> None:
    """A start in another runtime dir, its owner killed before the state file: its state dir and io tmpfs stayed
    until a start in that same runtime dir (issue 58's hostile run). A sweep from any runtime dir finds the io tmpfs
    by its mount source, and removes it and its state dir once past the time a start takes; a young one stays."""
    from msb_kernels.backends import get_backend
    from msb_kernels.backends.core import iodir
    from msb_kernels.settings.config import load_settings

    elsewhere = Path(tempfile.mkdtemp(prefix="msbt-else-", dir="/tmp"))
    dead = iodir.make_dirs(elsewhere, "killed-mid-start", bounded=True)
    young = iodir.make_dirs(elsewhere, "starting-elsewhere", bounded=True)
    os.utime(dead.parent, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    try:
        assert os.path.ismount(dead) and os.path.ismount(young)
        swept = await get_backend(load_settings()).sweep_leftovers()
        assert "killed-mid-start" in swept and not dead.parent.exists()
        assert os.path.ismount(young), "a start in progress lost its io dir"
    finally:
        iodir.remove(elsewhere / "killed-mid-start")
        iodir.remove(young.parent)
        shutil.rmtree(elsewhere, ignore_errors=True)


def processes_naming(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


@needs_disk
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_gateway_killed_with_its_keeper_is_swept_by_another_gateways_next_start(backend: str, gateway_factory) -> None:
    """Two gateways on one host, with runtime dirs of their own and one scratch dir. One is killed with kill -9 and
    its keeper with it (as the OOM killer or `systemctl kill -s KILL` would): its sandboxes die, their disks stay.
    The other gateway, running since before, sweeps them at its next start, and its own live kernel keeps its disk
    and what it wrote there."""
    dying = await gateway_factory(extra_env={"MSB_BACKEND": backend})
    dead_ids = [await dying.start_kernel() for _ in range(2)]
    other = await gateway_factory(extra_env={"MSB_BACKEND": backend})
    live_id = await other.start_kernel()
    started = time.monotonic()
    live = await KernelSocket.open(other, live_id)
    try:
        wrote = await live.execute("open('/tmp/kept.txt', 'w').write('still here')")
        assert wrote.error is None, wrote.error

        killed = [dying.process.pid, *processes_naming(f"{dying.runtime_dir}/keepers.sock")]
        assert len(killed) == 2, killed
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        dying.process.wait(10)
        held = await wait_until(lambda: left_of(dead_ids, dying.runtime_dir), 10, "the dead gateway's leftovers")
        assert any(item.startswith("image") for item in held), held

        await asyncio.sleep(max(0.0, DISK_SWEEP_EVERY - (time.monotonic() - started)))  # the other gateway's next sweep is due
        await other.start_kernel()
        hierarchy, _ = cgroups.detect()
        if hierarchy is not None:  # their cgroups too, which no later sweep of the dead runtime dir could find
            kept = [path for kernel_id in dead_ids for path in cgroups.SandboxCgroup(hierarchy, kernel_id).paths.values() if path.exists()]
            assert kept == [], kept
        left = left_of(dead_ids, dying.runtime_dir)
        assert left == [], "\n".join(left)
        read = await live.execute("print(open('/tmp/kept.txt').read())")
        assert read.stdout.strip() == "still here", (read.stdout, read.error)
        assert scratch.image_path(Path(os.environ["MSB_SCRATCH_DIR"]), live_id).exists()
    finally:
        live.connection.close()


def disks_of(runtime: Path) -> list[str]:
    """The scratch dir's images whose sandbox's state dir is in runtime (by the link beside each image)."""
    return [
        str(disk.image)
        for disk in leftovers.disks(Path(os.environ["MSB_SCRATCH_DIR"]), 0)
        if disk.state_dir and disk.state_dir.parent == runtime
    ]


@needs_disk
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_keeper_killed_while_starts_hand_it_sandboxes_fails_them_fast_and_leaves_nothing(backend: str, gateway_factory) -> None:
    """The keeper killed with kill -9 as a start hands it its sandbox, at three moments: each start answers within
    seconds, with its kernel or an error that says what to do; the next start works (a fresh keeper); and once the
    gateway's kernels are shut down, none of their disks is left."""
    gateway = await gateway_factory(extra_env={"MSB_BACKEND": backend, "MSB_POOL_SIZE": "0"})
    await gateway.start_kernel()
    for delay in (0.0, 0.03, 0.1):
        began = time.monotonic()
        start = asyncio.create_task(gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, timeout=120))
        await asyncio.sleep(delay)
        for pid in processes_naming(f"{gateway.runtime_dir}/keepers.sock"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        answer = await start
        took = time.monotonic() - began
        assert took < 15, f"a start waited {took:.0f} s after its keeper was killed"
        assert answer.code == 201 or (answer.code >= 400 and answer.json.get("suggestions")), (answer.code, answer.body)
        assert (await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}, timeout=120)).code == 201
    for kernel in (await gateway.request("GET", "/api/kernels")).json:  # some restarting: the keeper took theirs
        stopped = await gateway.request("DELETE", f"/api/kernels/{kernel['id']}", timeout=90)
        assert stopped.code == 204, (stopped.code, stopped.body)
    with contextlib.suppress(AssertionError):
        await wait_until(lambda: not disks_of(gateway.runtime_dir), 30, "the disks of the gateway's kernels to go")
    assert disks_of(gateway.runtime_dir) == [], [disk for disk in leftovers.disks(Path(os.environ["MSB_SCRATCH_DIR"]), 0)]


async def test_a_scratch_dir_others_can_write_is_refused_and_nothing_in_it_is_swept(tmp_path: Path, monkeypatch) -> None:
    """An operator's MSB_SCRATCH_DIR that other users write (a shared 1777 dir, /var/tmp itself): doctor deleted a
    stranger's hour-old `vm.img` there and chmodded the dir 0700, and a local user's FIFO named state.json behind an
    image's link hung every start, doctor and sweep (issue 58's hostile run). Now nothing there is read, swept or
    chmodded; a start is refused, naming the setting."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    stranger = shared / f"vm{scratch.IMAGE_SUFFIX}"
    stranger.write_bytes(b"a stranger's disk")
    os.utime(stranger, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    fifo_dir = tmp_path / "evil" / "aaaa"
    (fifo_dir / "io").mkdir(parents=True)
    os.mkfifo(fifo_dir / "state.json")
    (shared / f"aaaa{scratch.IMAGE_SUFFIX}").write_bytes(b"")
    (shared / f"aaaa{scratch.STATE_LINK_SUFFIX}").symlink_to(fifo_dir)
    env = {**os.environ, "MSB_SCRATCH_DIR": str(shared), "MSB_BACKEND": "namespace"}
    doctor = subprocess.run([str(VENV_BIN / "msb-kernels"), "doctor", "--clean"], env=env, capture_output=True, text=True, timeout=120)
    assert f"MSB_SCRATCH_DIR={shared} is writable by other users" in doctor.stdout, doctor.stdout[-3000:]
    assert stranger.exists() and fifo_dir.exists() and shared.stat().st_mode & 0o7777 == 0o1777
    assert leftovers.disks(shared, 0) == []
    monkeypatch.setenv("MSB_SCRATCH_DIR", str(shared))
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    runtime = Path(tempfile.mkdtemp(prefix="msbt-rt-", dir="/tmp"))  # a backend of its own, made with these settings
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(runtime))
    manager = AsyncKernelManager(kernel_name="msb-python-small")
    try:
        with pytest.raises(Exception, match="MSB_SCRATCH_DIR=.* is writable by other users"):
            await asyncio.wait_for(manager.start_kernel(), 60)
    finally:
        if manager.has_kernel:
            await manager.shutdown_kernel(now=True)
        shutil.rmtree(runtime, ignore_errors=True)
    assert stranger.exists() and shared.stat().st_mode & 0o7777 == 0o1777


@needs_disk
async def test_a_fifo_behind_an_images_link_never_blocks_a_sweep(tmp_path: Path) -> None:
    """A FIFO at the state file an image's link leads to is read without blocking: the image counts as no live
    sandbox's (its state cannot be trusted), and the sweep returns at once."""
    scratch_root = Path(os.environ["MSB_SCRATCH_DIR"])
    state_dir = tmp_path / "fifo-state"
    (state_dir / "io").mkdir(parents=True)
    os.mkfifo(state_dir / "state.json")
    os.utime(state_dir, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    image = scratch.image_path(scratch_root, state_dir.name)
    scratch.reserve_image(image, FLAVORS["small"], reserve=False, state_dir=state_dir)
    try:
        swept = await asyncio.wait_for(asyncio.to_thread(leftovers.sweep, scratch_root, leftovers.STARTS_WITHIN), 10)
        assert image.name in [disk.image.name for disk in swept] and not image.exists()
    finally:
        scratch.remove_image(image)


@needs_disk
async def test_an_owner_in_another_pid_namespace_keeps_its_kernels_until_they_are_gone() -> None:
    """A script in its own pid namespace (`unshare -p`, as in a container) records pids the host reads as other
    processes or none: a sweep from the host killed its live kernel (issue 58's hostile run). Its sandboxes are
    never judged by those pids; once its namespace ends and no loop device holds a disk, they are swept."""
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is missing (apt-get install util-linux)")
    # A runtime dir of its own, as a container's is: a keeper of the host's pid namespace cannot hold its sandboxes.
    runtime = Path(tempfile.mkdtemp(prefix="msbt-ns-", dir="/tmp"))
    options = owner_options("namespace")
    options["env"]["MSB_RUNTIME_DIR"] = str(runtime)
    owner = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", OWNER, "wait"], **options)
    kernel_ids: list[str] = []
    try:
        kernel_ids = await kernels_of_owner(owner)
        held = left_of(kernel_ids, runtime)
        swept = subprocess.run(
            [str(VENV_BIN / "msb-kernels"), "sweep"],
            env={**os.environ, "MSB_BACKEND": "namespace", "MSB_RUNTIME_DIR": str(runtime)},  # its records, read from the host
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert swept.returncode == 0, swept.stderr[-2000:]
        assert leftovers.sweep(Path(os.environ["MSB_SCRATCH_DIR"]), 0) == []
        assert left_of(kernel_ids, runtime) == held, "a sweep from the host took a live kernel of an owner in another pid namespace"
        os.killpg(owner.pid, signal.SIGKILL)  # its namespace's init: every process in it goes, keeper and sandboxes too
        owner.wait(30)
        scratch_root = Path(os.environ["MSB_SCRATCH_DIR"])
        await wait_until(
            lambda: not [image for image in scratch.attached_images() if any(k in image for k in kernel_ids)],
            30,
            "the loop devices to let go",
        )
        leftovers.sweep(scratch_root, 0)
        assert left_of(kernel_ids, runtime) == []
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
        for disk in leftovers.disks(Path(os.environ["MSB_SCRATCH_DIR"]), 0):
            if any(k in disk.image.name for k in kernel_ids):
                leftovers.remove(disk)
        shutil.rmtree(runtime, ignore_errors=True)


async def test_a_scratch_dir_reached_through_another_users_link_is_refused(tmp_path: Path) -> None:
    """The default scratch dir, /var/tmp/msb-kernels, lies in a 1777 directory. Another user's link there, to a
    root-owned directory of their choosing, made root's sweep delete the `*.img` files in it (issue 58's hostile
    run). A scratch dir reached through a link that is neither this user's nor root's is refused; nothing is read."""
    shared = tmp_path / "vartmp"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    precious = victim / f"precious{scratch.IMAGE_SUFFIX}"
    precious.write_bytes(b"root's own")
    os.utime(precious, (TEN_MINUTES_AGO, TEN_MINUTES_AGO))
    link = shared / "msb-kernels"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)  # made by another user (nobody)
    assert f"is reached through {link}, a link of uid 65534's" in (scratch.root_problem(link) or "")
    env = {**os.environ, "MSB_SCRATCH_DIR": str(link), "MSB_BACKEND": "namespace"}
    for command in (["sweep"], ["doctor", "--clean"]):
        subprocess.run([str(VENV_BIN / "msb-kernels"), *command], env=env, capture_output=True, text=True, timeout=120)
        assert precious.exists(), f"`msb-kernels {' '.join(command)}` deleted an image through another user's link"
    assert leftovers.disks(link, 0) == []
