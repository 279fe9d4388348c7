"""The microsandbox backend: each kernel in its own microVM (PyPI ``microsandbox`` 0.7).

The host reaches a microVM only through TCP ports published on 127.0.0.1, so the
kernel's five ZMQ channels are published at the same numbers in the guest (from
the PortManager, MSB_PORT_RANGE) and the kernel binds 0.0.0.0 inside. The guest
sees the kernel's io dir (connection file, startup file) at /run/kernel, owned by its user.

    flavor            -> cpus, memory (MiB)
    template          -> image (MSB_PYTHON_IMAGE / MSB_NODE_IMAGE, built by `msb-kernels image build`)
    MSB_ALLOW_NETWORK -> outbound denied (default) or public internet only; inbound always allowed
                         (Network.none() would also close the published ports)
    shared volume     -> bind mount at its guest path
    labels            -> msb-kernels=1 plus owner pid/start/host, for the orphan sweep
    idle_timeout      -> off: Jupyter's culler is the one source of session timeouts

The kernel runs as a managed job (exec_detached), which outlives the exec handle,
and whose signals go to its process group in the guest: that is how SIGINT
(interrupt) crosses the VM boundary.

Whether this backend can run is ``msb doctor`` (exit 0) plus a smoke boot under
MSB_BOOT_TIMEOUT_SECONDS; both run in a subprocess, once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from msb_kernels.backends.core import iodir, keeping
from msb_kernels.backends.core.base import (
    SANDBOX_LABEL,
    Availability,
    Sandbox,
    SandboxBackend,
    SandboxRecord,
    SandboxSpec,
)
from msb_kernels.backends.core.keeping import KeeperLink, trusted_json
from msb_kernels.backends.core.ports import host_ports
from msb_kernels.backends.core.processes import owner_alive, process_start_time
from msb_kernels.backends.core.state import new_state, own_kept_sandbox, record_owner, with_keeper, write_state
from msb_kernels.backends.microsandbox.images import image_supports_curve
from msb_kernels.backends.microsandbox.msb_cli import run_doctor
from msb_kernels.backends.microsandbox.smoke import smoke_boot
from msb_kernels.backends.microsandbox.vm import GUEST_IO_DIR, create_kwargs, guest_argv, guest_env, record_from_handle, sandbox_name
from msb_kernels.environments.kernel_images import kernel_image, missing_image_advice
from msb_kernels.errors import BackendUnavailable, InvalidRequest, MsbError, SandboxError
from msb_kernels.images import GUEST_HOME, GUEST_USER, image_for
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("msb_kernels")

SWEEP_INTERVAL = 600.0  # seconds between orphan sweeps: often enough that a crashed owner's VMs do not linger

T = TypeVar("T")

# -- the sandbox -----------------------------------------------------------------


class MicrosandboxSandbox(Sandbox):
    def __init__(
        self, spec: SandboxSpec, backend: MicrosandboxBackend, vm: Any, job: Any, ports: list[int], keeper: KeeperLink | None = None
    ):
        super().__init__(spec)
        self.backend = backend
        self.vm = vm
        self.job = job
        self.keeper = keeper  # a gateway's kernel: the VM is detached, and its keeper counts its grace period
        self.ports = ports
        self.name = sandbox_name(spec.sandbox_id)
        self.exit_code: int | None = None
        self._killed_by_us = False
        self._lost = False
        self._memory_bytes: int | None = None
        self._metrics_task: asyncio.Task | None = None

    def _record_exit(self, code: int | None, *, lost: bool = False) -> int:
        if self.exit_code is None:
            self.exit_code = code if code is not None else -signal.SIGKILL
            self._lost = lost
        return self.exit_code

    async def poll(self) -> int | None:
        if self.exit_code is not None:
            return self.exit_code
        try:
            info = await asyncio.wait_for(self.job.inspect(), 10)
        except asyncio.TimeoutError:
            return None  # a slow agent is not a dead kernel
        except Exception:  # the VM or its agent is gone
            return self._record_exit(None, lost=True)
        if info.state in ("exited", "failed", "lost"):
            return self._record_exit(info.exit_code)
        return None

    async def wait(self) -> int | None:
        if self.exit_code is not None:
            return self.exit_code
        try:
            result = await self.job.wait()
        except Exception:
            return self._record_exit(None, lost=True)
        return self._record_exit(result.code)

    async def send_signal(self, signum: int) -> None:
        """Signals go to the kernel's process group inside the guest (SIGINT interrupts it)."""
        if self.exit_code is None:
            with contextlib.suppress(Exception):
                await self.job.signal(signum)

    async def kill(self) -> None:
        self._killed_by_us = True
        with contextlib.suppress(Exception):
            await self.job.kill()
        with contextlib.suppress(Exception):
            await self.vm.kill(timeout=10)

    async def terminate(self) -> None:
        await self.send_signal(signal.SIGTERM)

    def exit_reason(self) -> str | None:
        if self._killed_by_us or self.exit_code is None:
            return None
        if self._lost:
            return f"the microVM stopped under the kernel (crashed, or {self.spec.flavor.out_of_memory_message()})"
        # Nothing but the guest's OOM killer sends SIGKILL to the kernel when we did not.
        if self.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            return self.spec.flavor.out_of_memory_message()
        return None

    def memory_bytes(self) -> int | None:
        """The VM's memory use as last measured; each call schedules a fresh measurement (stats call this)."""
        with contextlib.suppress(RuntimeError):  # no running loop: keep the last value
            if self._metrics_task is None or self._metrics_task.done():
                self._metrics_task = asyncio.get_running_loop().create_task(self._measure())
        return self._memory_bytes

    async def _measure(self) -> None:
        with contextlib.suppress(Exception):
            self._memory_bytes = (await asyncio.wait_for(self.vm.metrics(), 10)).memory_bytes

    async def cleanup(self, keep_io_dir: bool = False) -> None:
        if self.exit_code is None:
            self._killed_by_us = True
        reason = self.exit_reason()
        if reason:
            log.warning("kernel %s: %s", self.sandbox_id, reason)
        await self.backend.destroy_vm(self.name, self.vm)
        if self.keeper is not None:
            self.keeper.release()
        self.backend.remove_state(self.sandbox_id, keep_io_dir=keep_io_dir)
        if not keep_io_dir:
            self.backend.release_ports(self.sandbox_id)

    def info(self) -> dict:
        try:
            image: str | None = kernel_image(self.backend.settings, self.spec.template, self.spec.environment)
        except InvalidRequest:  # its environment's record went since it started: the stats still answer
            image = None
        return {
            **super().info(),
            "backend": "microsandbox",
            "vm": self.name,
            "ports": self.ports,
            "image": image,
        }


# -- the backend -------------------------------------------------------------------


def _run_coroutine(factory: Callable[[], Awaitable[T]], timeout: float = 60) -> T:
    """Run SDK coroutines from sync code, also when an event loop already runs in this thread."""
    result: dict[str, Any] = {}

    async def run() -> T:
        return await asyncio.wait_for(factory(), timeout)  # the SDK needs a running loop when called

    def target() -> None:
        try:
            result["value"] = asyncio.run(run())
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if "error" in result:
        raise result["error"]
    if "value" not in result:
        raise TimeoutError(f"microsandbox did not answer within {timeout:.0f} s")
    return result["value"]


class MicrosandboxBackend(SandboxBackend):
    name = "microsandbox"
    auto_order = 10
    runs_images = True
    transports = ("tcp",)  # a VM has no ipc path to the host
    guest_io_dir = GUEST_IO_DIR
    guest_host_dir = GUEST_IO_DIR  # one directory: what the host writes, which the VM's ipykernel rewrites (vm.py)
    _availability: Availability | None = None

    def __init__(self, settings: MsbSettings):
        super().__init__(settings)
        self.root = settings.runtime_root() / "microvm"
        self.ports = host_ports(settings)
        self._curve: dict[str, bool] = {}
        self._sweeper: asyncio.Task | None = None

    # -- availability ----------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        if cls._availability is None:
            cls._availability = cls._probe(load_settings())
        return cls._availability

    @classmethod
    def _probe(cls, settings: MsbSettings) -> Availability:
        try:
            import microsandbox  # noqa: F401
        except ImportError:
            return Availability(False, "the microsandbox package is not installed (pip install 'microsandbox>=0.7,<0.8')")
        ok, reason, hints = run_doctor()
        if not ok:
            return Availability(False, f"msb doctor: {reason}" + (f" ({'; '.join(hints)})" if hints else ""))
        booted, why = smoke_boot(image_for(settings, "python"), settings.boot_timeout_seconds)
        if not booted:
            image = image_for(settings, "python")
            if "not cached" in why or "not found" in why.lower():
                why += f" (build the image: msb-kernels image build python, or set MSB_PYTHON_IMAGE; now {image})"
            return Availability(False, f"msb doctor passed but a smoke boot failed: {why}")
        return Availability(True, f"microVMs boot here ({why})")

    # -- ports, curve, stats -------------------------------------------------------

    @classmethod
    def doctor_lines(cls, settings: MsbSettings) -> list[str]:
        """msb doctor's verdict and hints, the kernel images, the ports and the network policy."""
        from msb_kernels.backends.microsandbox.images import image_present

        ok, reason, hints = run_doctor()
        lines = [f"msb doctor: {'ok' if ok else 'failed'} - {reason}", *(f"  hint: {hint}" for hint in hints)]
        try:
            for template in TEMPLATES:
                image = image_for(settings, template)
                lines.append(
                    f"microVM image {template}: {image} "
                    f"{'present' if image_present(image) else f'missing (msb-kernels image build {template})'}"
                )
        except MsbError as exc:
            lines.append(f"microVM images: cannot list them: {exc.message}")
        lines.append(
            f"microVM ports: {settings.port_range} (5 per kernel); outbound network: "
            f"{'public internet' if settings.allow_network else 'denied'}"
        )
        return lines

    def reserve_ports(self, sandbox_id: str) -> list[int]:
        return self.ports.allocate(sandbox_id)

    def release_ports(self, sandbox_id: str) -> None:
        self.ports.release(sandbox_id)

    async def supports_curve(self, template: str, environment: str | None = None) -> bool:
        """True when the kernel's image says (by label, set at build) its kernel speaks CurveZMQ."""
        image = kernel_image(self.settings, template, environment)
        if image not in self._curve:
            self._curve[image] = await image_supports_curve(image)
        return self._curve[image]

    def stats(self) -> dict:
        return {"ports": self.ports.stats()}

    # -- state on the host ------------------------------------------------------------

    def io_dir_for(self, sandbox_id: str) -> Path:
        io_dir = iodir.make_dirs(self.root, sandbox_id, bounded=False)
        os.chmod(self.root, 0o700)
        return io_dir

    def _write_state(self, spec: SandboxSpec, **more: Any) -> None:
        """state.json: the VM's owner is here, not only in its labels, which cannot change when a gateway adopts it."""
        record = new_state(self.name, spec, vm=sandbox_name(spec.sandbox_id), **more)
        write_state(self.root / spec.sandbox_id, record)

    def remove_state(self, sandbox_id: str, *, keep_io_dir: bool) -> None:
        state_dir = self.root / sandbox_id
        if keep_io_dir:
            with contextlib.suppress(FileNotFoundError):
                (state_dir / "state.json").unlink()
        else:
            shutil.rmtree(state_dir, ignore_errors=True)

    # -- create ----------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> MicrosandboxSandbox:
        availability = self.availability()
        if not availability.ok:
            raise BackendUnavailable(
                f"the microsandbox backend cannot run here: {availability.reason}",
                ["run `msb-kernels doctor`", "or set MSB_BACKEND=namespace"],
            )
        from microsandbox import Sandbox as VM

        self._ensure_sweeper()
        ports = self.ports.owned(spec.sandbox_id) or self.ports.allocate(spec.sandbox_id)
        kwargs = create_kwargs(spec, self.settings, ports)
        name = sandbox_name(spec.sandbox_id)
        self._write_state(spec)
        vm = None
        try:
            vm = await asyncio.wait_for(VM.create(name, **kwargs), self.settings.boot_timeout_seconds)
            argv = guest_argv(spec)
            job = await vm.exec_detached(argv[0], argv[1:], env=guest_env(spec), cwd=spec.working_dir or GUEST_HOME, user=GUEST_USER)
            keeper = await self._keep(spec, job, ports) if spec.adopt_grace > 0 else None
        except BaseException as exc:
            await self.destroy_vm(name, vm)
            self.remove_state(spec.sandbox_id, keep_io_dir=True)
            if isinstance(exc, asyncio.TimeoutError):
                raise SandboxError(
                    f"the microVM for kernel {spec.sandbox_id} did not boot within "
                    f"{self.settings.boot_timeout_seconds} s (MSB_BOOT_TIMEOUT_SECONDS)"
                ) from None
            if isinstance(exc, Exception):
                raise SandboxError(
                    f"cannot start the microVM for kernel {spec.sandbox_id}: {exc}",
                    [missing_image_advice(self.settings, spec.template, spec.environment), "run `msb-kernels doctor`"],
                ) from exc
            raise
        return MicrosandboxSandbox(spec, self, vm, job, ports, keeper)

    async def _keep(self, spec: SandboxSpec, job: Any, ports: list[int]) -> KeeperLink:
        """A gateway's kernel: a keeper holds its grace period (the VM is detached anyway), and state.json says
        what adoption needs: the kernel's job and ports."""
        state_dir = self.root / spec.sandbox_id
        keeper_pid, _ = await keeping.start_keeper(state_dir, spec.adopt_grace, sweep_env=self.settings_env())
        keeper = KeeperLink.own(state_dir, keeper_pid)
        self._write_state(spec, keeper_pid=keeper_pid, keeper_start=process_start_time(keeper_pid), job=job.id, ports=ports)
        return keeper

    async def adopt(self, spec: SandboxSpec) -> MicrosandboxSandbox:
        from microsandbox import Sandbox as VM

        state_dir = self.root / spec.sandbox_id
        record, keeper = own_kept_sandbox(self.name, state_dir, spec.sandbox_id)
        try:
            if not record.get("job"):
                raise SandboxError("its state names no kernel job")
            handle = await VM.get(record["vm"])
            vm = await asyncio.wait_for(handle.connect(), self.settings.boot_timeout_seconds)
            job = await vm.get_job(record["job"])
        except Exception as exc:
            keeper.close()
            raise SandboxError(f"cannot adopt microVM sandbox {spec.sandbox_id}: {exc}") from exc
        self._ensure_sweeper()
        self.ports.claim(spec.sandbox_id, record.get("ports") or [])
        record_owner(state_dir, record)
        sandbox = MicrosandboxSandbox(spec, self, vm, job, record.get("ports") or [], keeper)
        sandbox.created = record.get("created", sandbox.created)
        return sandbox

    async def destroy_vm(self, name: str, vm: Any = None) -> None:
        from microsandbox import Sandbox as VM

        if vm is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(vm.kill(timeout=10), 15)
        else:
            with contextlib.suppress(Exception):
                handle = await VM.get(name)
                await asyncio.wait_for(handle.kill(timeout=10), 15)
        with contextlib.suppress(Exception):
            await VM.remove(name)

    # -- orphans ------------------------------------------------------------------------

    def _ensure_sweeper(self) -> None:
        """Sweep orphans every SWEEP_INTERVAL seconds while this process runs kernels."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                await self.sweep_orphans()
            except Exception as exc:  # a failed sweep must not end the sweeps
                log.warning("orphan sweep failed: %s", exc)

    async def _vm_records(self) -> list[SandboxRecord]:
        from microsandbox import Sandbox as VM

        records = []
        cursor = None
        while True:
            page = await VM.list_with(labels={SANDBOX_LABEL: "1"}, cursor=cursor)
            for handle in page.sandboxes:
                records.append(record_from_handle(handle, self.name))
            cursor = page.next_cursor
            if not cursor:
                return records

    def _dir_records(self, seen: set[str]) -> list[SandboxRecord]:
        records = []
        for state_file in self.root.glob("*/state.json") if self.root.is_dir() else []:
            try:
                data = json.loads(state_file.read_text())
            except (OSError, ValueError):
                continue
            if data.get("sandbox_id") in seen:
                continue
            alive = owner_alive(data.get("owner_pid"), data.get("owner_start"))
            records.append(SandboxRecord(data["sandbox_id"], self.name, alive, False, data.get("created", 0.0), data))
        return records

    def _with_state(self, records: list[SandboxRecord]) -> list[SandboxRecord]:
        """A VM's owner as its state file says (an adopting gateway rewrites it; the labels are the first owner's),
        and whether a keeper holds it for the next gateway to adopt."""
        for record in records:
            state_dir = self.root / record.sandbox_id
            state, _ = trusted_json(state_dir / "state.json", private=False)
            if state is None or state.get("sandbox_id") != record.sandbox_id:
                continue
            record.details.update(
                owner_pid=state.get("owner_pid"), owner_start=state.get("owner_start"), keeper_pid=state.get("keeper_pid")
            )
            record.owner_alive = owner_alive(state.get("owner_pid"), state.get("owner_start"))
            with_keeper(record, state, state_dir)
        return records

    def list_sandboxes(self) -> list[SandboxRecord]:
        try:
            import microsandbox  # noqa: F401
        except ImportError:
            vms = []
        else:
            vms = _run_coroutine(self._vm_records, timeout=30)
        return self._with_state(vms) + self._dir_records({record.sandbox_id for record in vms})

    async def sweep_orphans(self, include_adoptable: bool = False) -> list[str]:
        """Stop and remove this host's labelled VMs whose owner is gone, and their state dirs.

        The first call (the provisioner's, at the first kernel start) also starts the sweeps every
        SWEEP_INTERVAL seconds for as long as this event loop runs."""
        self._ensure_sweeper()
        try:
            vms = await self._vm_records()
        except ImportError:
            vms = []
        except Exception as exc:  # a sweep that cannot list VMs must not stop a kernel from starting
            log.warning("cannot list microVM sandboxes for the orphan sweep: %s", exc)
            vms = []
        here = socket.gethostname()
        swept = []
        for record in self._with_state(vms) + self._dir_records({record.sandbox_id for record in vms}):
            if record.owner_alive or record.details.get("host", here) != here:
                continue
            if record.adoptable and not include_adoptable:
                continue
            if record.details.get("owner_pid") is None and record.running:
                continue  # started with no owner on purpose
            if "vm" in record.details:
                await self.destroy_vm(record.details["vm"])
            self.remove_state(record.sandbox_id, keep_io_dir=False)
            self.ports.release(record.sandbox_id)
            swept.append(record.sandbox_id)
        if swept:
            log.info("swept %d orphaned microVM sandbox(es): %s", len(swept), ", ".join(swept))
        return swept
