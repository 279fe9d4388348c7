"""A sandbox's state file, ``<runtime root>/<sandbox id>/state.json``: who owns the sandbox and which
host process holds it. The sweeps read it after a crash or a kill -9, when no live object remembers."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from msb_kernels.backends.core import iodir
from msb_kernels.backends.core.base import Sandbox, SandboxRecord, SandboxSpec
from msb_kernels.backends.core.keeping import ADOPTION_RECORD, KeeperLink, trusted_json
from msb_kernels.backends.core.processes import PidfdProcess, pid_namespace, pids_of_another_namespace, process_alive, process_start_time
from msb_kernels.errors import SandboxError

if TYPE_CHECKING:
    from msb_kernels.backends.core.cgroups import SandboxCgroup

log = logging.getLogger("msb_kernels")


def new_state(backend: str, spec: SandboxSpec, **more: object) -> dict:
    """What every backend's state.json starts with: the sandbox, its backend, flavor and template, and who owns it
    (owner_pid and its start time, so a reused pid is never taken for the owner), and the Python environment and
    interpreter it runs (for `msb-kernels env remove`). Called by each backend's create."""
    return {
        "sandbox_id": spec.sandbox_id,
        "backend": backend,
        "created": time.time(),
        "owner_pid": spec.owner_pid,
        "owner_start": process_start_time(spec.owner_pid) if spec.owner_pid else None,
        "pid_ns": pid_namespace(),  # the namespace its pids are of (processes.pids_of_another_namespace)
        "flavor": spec.flavor.name,
        "template": spec.template,
        "environment": spec.environment,
        "interpreter": spec.argv[0] if spec.argv else None,
        **more,
    }


def write_state(state_dir: Path, record: dict) -> None:
    """Replace the state file whole, so a reader never sees half of one."""
    temporary = state_dir / "state.json.tmp"
    temporary.write_text(json.dumps(record))
    temporary.replace(state_dir / "state.json")


def read_states(root: Path, backend: str) -> list[SandboxRecord]:
    """The sandboxes of one backend under root: ``owner_pid`` is the host process that owns each,
    ``init_pid`` the host process that is the sandbox, ``keeper_pid`` the keeper that holds it for its
    owner, if any (records without "backend" are the namespace backend's). A state file that a sandbox
    could have written (see keeping.trusted_json) is passed over."""
    records: list[SandboxRecord] = []
    if not root.is_dir():
        return records
    for state_file in root.glob("*/state.json"):
        data, problem = trusted_json(state_file, private=False)
        if data is None:
            if problem and "missing" not in problem:
                log.warning("ignoring sandbox state %s: %s", state_file, problem)
            continue
        if data.get("backend", "namespace") != backend or data.get("sandbox_id") != state_file.parent.name:
            continue  # another backend's sandbox in the same runtime dir
        record = SandboxRecord(
            data["sandbox_id"],
            backend,
            pids_of_another_namespace(data) or process_alive(data.get("owner_pid"), data.get("owner_start")),
            process_alive(data.get("init_pid"), data.get("init_start")),
            data.get("created", 0.0),
            data,
        )
        records.append(with_keeper(record, data, state_file.parent))
    return records


def unfinished_starts(root: Path, younger_than: float) -> list[Path]:
    """Sandbox directories under root (state dirs with their io/, which a start makes first) without a state file, made
    more than younger_than seconds ago: a start whose owner died before it wrote one. Called by the sweeps."""
    found = []
    for io_dir in root.glob(f"*/{iodir.IO_DIR}"):
        state_dir = io_dir.parent
        with contextlib.suppress(OSError):
            if not (state_dir / "state.json").exists() and time.time() - os.lstat(state_dir).st_mtime >= younger_than:
                found.append(state_dir)
    return found


def with_keeper(record: SandboxRecord, state: dict, state_dir: Path) -> SandboxRecord:
    """Fill in whether a keeper holds the sandbox, and so whether it is adoptable: the one rule for every backend."""
    record.keeper_alive = process_alive(state.get("keeper_pid"), state.get("keeper_start"))
    record.adoptable = not record.owner_alive and record.running and record.keeper_alive and (state_dir / ADOPTION_RECORD).is_file()
    return record


def own_kept_sandbox(backend: str, state_dir: Path, sandbox_id: str) -> tuple[dict, KeeperLink]:
    """The trusted state of the kept sandbox in state_dir, and this process's ownership of it through its keeper.

    Called by the backends' adopt; once the sandbox itself is reached, record_owner writes the new owner down."""
    record, problem = trusted_json(state_dir / "state.json", private=False)
    if record is None:
        raise SandboxError(f"cannot adopt sandbox {sandbox_id}: {problem}")
    if record.get("sandbox_id") != sandbox_id or record.get("backend", "namespace") != backend:
        raise SandboxError(f"cannot adopt sandbox {sandbox_id}: its state file names another sandbox or backend")
    return record, KeeperLink.own(state_dir, record.get("keeper_pid"))


def record_owner(state_dir: Path, record: dict) -> None:
    """This process owns the sandbox now: the sweeps go by the state file, not by who created the sandbox."""
    record.update(owner_pid=os.getpid(), owner_start=process_start_time(os.getpid()))
    write_state(state_dir, record)


def adopt_held_sandbox(backend: str, state_dir: Path, spec: SandboxSpec) -> tuple[dict, KeeperLink, PidfdProcess]:
    """Become the owner of the kept sandbox in state_dir: its trusted state, the link to its keeper, and its process
    (init for a namespace sandbox, runsc run for gVisor). Called by the namespace and gVisor backends' adopt."""
    record, keeper = own_kept_sandbox(backend, state_dir, spec.sandbox_id)
    try:
        if keeper.sandbox_pid != record.get("init_pid"):
            raise ProcessLookupError(f"its keeper holds pid {keeper.sandbox_pid}, not {record.get('init_pid')}")
        process = PidfdProcess(record["init_pid"], spec.io_dir, record.get("init_start"))
    except (ProcessLookupError, KeyError, TypeError) as exc:
        keeper.close()
        raise SandboxError(f"cannot adopt sandbox {spec.sandbox_id}: it has ended ({exc})") from None
    record_owner(state_dir, record)
    return record, keeper, process


def remove_state_dir(state_dir: Path, *, keep_io_dir: bool) -> None:
    """The sandbox's directories (iodir.remove), or (a restart reuses them) only its state file."""
    if keep_io_dir:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "state.json").unlink()
    else:
        iodir.remove(state_dir)


def take_orphans(records: list[SandboxRecord], *, include_adoptable: bool = False) -> list[SandboxRecord]:
    """The sandboxes whose owner is gone (or, owned by none, that no longer run), except those a keeper holds
    for the next gateway to adopt unless include_adoptable; a holder still running is killed first, so the
    caller only removes what is left (its keeper, if any, then exits)."""
    orphans = []
    for record in records:
        if record.owner_alive or (record.details.get("owner_pid") is None and record.running):
            continue
        if record.adoptable and not include_adoptable:
            continue
        if record.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.details["init_pid"], signal.SIGKILL)
        orphans.append(record)
    return orphans


def exit_status_reason(code: int) -> str:
    """A kernel's exit status (a Popen returncode: negative for a signal) in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"the kernel exited with status {code}"


class KernelStderr:
    """A sandbox's stderr, read by the host: each line goes to the debug log, never to the server's own
    output, where a kernel's tracebacks (a shutdown while busy, user code writing to fd 2) would read
    as the server's. The last lines are kept for whoever looks into a failure."""

    KEPT_LINES = 20

    def __init__(self, sandbox_id: str, fd: int):
        self.sandbox_id = sandbox_id
        self.fd = fd
        self.tail: deque[str] = deque(maxlen=self.KEPT_LINES)
        self._partial = b""
        os.set_blocking(fd, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        self._partial = self._partial[-4096:]
        for line in lines:
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            log.debug("kernel %s stderr: %s", self.sandbox_id, text)

    def last_lines(self) -> list[str]:
        """The kept lines, with what the kernel wrote last and the loop has not read yet (a kernel that died at once)."""
        if self.fd >= 0:
            self._read()
        partial = self._partial.decode(errors="replace").rstrip()
        return [*self.tail, *([partial] if partial else [])]

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(Exception):  # a loop already closed has no reader left to remove
                self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


class HostCgroupSandbox(Sandbox):
    """What the namespace and gVisor sandboxes share: a host cgroup (or none) for limits and memory, and
    why the kernel ended, latched at cleanup, because the cgroup that counted an OOM kill goes then and
    the bridge may ask after jupyter_client has restarted the kernel."""

    def __init__(self, spec: SandboxSpec, cgroup: SandboxCgroup | None):
        super().__init__(spec)
        self.cgroup = cgroup
        self.stopped_by_owner = False  # kill() or terminate(): a shutdown, not a death worth a reason
        self.stderr: KernelStderr | None = None  # set by the backend where the host reads the kernel's stderr
        self._final_exit_reason: str | None = None
        self._cleaned_up = False

    @abc.abstractmethod
    def ended_with(self) -> int | None:
        """The kernel's exit status once it has ended (a Popen returncode: negative for a signal), else None."""

    def exit_reason(self) -> str | None:
        if self._cleaned_up:
            return self._final_exit_reason
        if self.cgroup is not None and self.cgroup.oom_kills() > 0:
            return self.spec.flavor.out_of_memory_message()
        code = self.ended_with()
        if self.stopped_by_owner or not code:
            return None
        return exit_status_reason(code)

    def memory_bytes(self) -> int | None:
        return self.cgroup.memory_bytes() if self.cgroup else None

    def cpu_seconds(self) -> float | None:
        return self.cgroup.cpu_seconds() if self.cgroup else None

    def latch_exit_reason(self) -> None:
        """Called by cleanup once the kernel has ended and before its cgroup goes; logs the reason, if any."""
        reason = self._final_exit_reason = self.exit_reason()
        self._cleaned_up = True
        if reason:
            tail = self.stderr_tail()[-5:]
            log.warning("kernel %s: %s%s", self.sandbox_id, reason, "; its last stderr lines: " + " | ".join(tail) if tail else "")

    def stderr_tail(self) -> list[str]:
        return self.stderr.last_lines() if self.stderr is not None else []
