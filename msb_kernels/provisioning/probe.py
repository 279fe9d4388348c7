"""The start probe: a backend is usable only once a real kernel has started in it, run ``ls`` and ``stat``, and answered ``1+1``.

A look at the host (runsc installed, namespaces allowed) cannot see every way a start fails: a
sandbox that cannot show the kernel's interpreter, a runtime too old for the host's kernel. So
``MSB_BACKEND=auto`` starts one small kernel in the backend it would pick, from the interpreter
the kernelspec names, before the first real start of that interpreter in this process. A backend
whose probe fails is never picked in this process; auto falls back to the next and logs why, once.

Results are kept per (backend, interpreter) for the process's life: a gateway pays once, at start
(its warm pool's first start, or its own warm-up), never per kernel. A pass is also kept on disk
(msb_kernels.provisioning.probe_verdicts), keyed by all that decides it, so a batch of short processes (papermill,
nbclient) pays it once, not per run. A start that fails in a backend distrusts its pass, here and on
disk (``distrust``): the next start proves the backend again. `msb-kernels doctor` runs the same probe
on every backend the host allows, always afresh, prints what it found and keeps or drops the pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from traitlets.config import Config

from msb_kernels.backends import SandboxBackend, backend_classes, choose_backend, get_backend
from msb_kernels.errors import ConfigError
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.provisioning import probe_verdicts, registry
from msb_kernels.provisioning.start_request import START_REQUEST, StartRequest
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("msb_kernels")

PROBE_TIMEOUT_SECONDS = 90.0  # a first gVisor start on a busy host takes seconds; a dead one answers at once
# Beyond 1+1, the everyday shell commands a runtime can break (a runsc whose statx fails breaks `ls` and `stat`),
# where the sandbox has them; the reply's error names the command and what it printed.
PROBE_CODE = {
    "python": """\
import shutil as _s, subprocess as _p
for _argv in (["ls", "-la", "/"], ["stat", "/tmp"]):
    if _s.which(_argv[0]):
        _r = _p.run(_argv, capture_output=True, text=True, timeout=30)
        if _r.returncode:
            raise OSError(f"`{' '.join(_argv)}` exited {_r.returncode}: {_r.stderr.strip()[-300:]}")
1+1""",
    "node": "1+1",
}


@dataclass(frozen=True)
class StartProbe:
    """What one probe start found."""

    backend: str
    interpreter: str
    ok: bool
    seconds: float
    error: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    kept_in: str | None = None  # a pass read from disk (probe_verdicts), not proven in this process

    def summary(self) -> str:
        """One line for doctor and the log."""
        if self.ok:
            kept = f" (kept in {self.kept_in})" if self.kept_in else ""
            return f"a kernel from {self.interpreter} started, ran ls and stat, and answered 1+1 in {self.seconds:.2f} s{kept}"
        return f"a kernel from {self.interpreter} could not start: {self.error}"


_results: dict[tuple[str, str, str | None], StartProbe] = {}  # (backend, interpreter, environment)
_running: dict[tuple[str, str, str | None], asyncio.Task] = {}


def failed_backends(interpreter: str) -> dict[str, str]:
    """Backends whose probe failed in this process for this interpreter, with why."""
    return {name: result.summary() for (name, path, _), result in _results.items() if path == interpreter and not result.ok}


async def probe(
    backend: str, argv: list[str], template: str = "python", settings: MsbSettings | None = None, environment: str | None = None
) -> StartProbe:
    """The probe of backend for the interpreter argv[0], run once per process (concurrent callers share it).
    environment: the environment argv[0] is, which a backend that runs images runs in that environment's image.

    Never reads a verdict kept on disk (doctor's answer is its own start); keeps a pass there, drops a failure's."""
    key = (backend, argv[0], environment)
    if key in _results:
        return _results[key]
    task = _running.get(key)
    if task is None:
        task = _running[key] = asyncio.ensure_future(_start_once(backend, argv, template, settings, environment))
    try:
        result = await asyncio.shield(task)
    finally:
        if task.done():
            _running.pop(key, None)
    _results[key] = result
    verdict_key = probe_verdicts.key_for(backend_classes()[backend], argv, template, settings or load_settings(), environment)
    if result.ok:
        probe_verdicts.save(verdict_key, result.seconds)
    else:
        probe_verdicts.drop(verdict_key)
        tail = " | ".join(result.stderr_tail[-5:])
        log.warning(
            "msb-kernels: the %s backend failed its start probe: %s%s",
            backend,
            result.summary(),
            f"; the kernel's last stderr lines: {tail}" if tail else "",
        )
    return result


async def backend_for_start(settings: MsbSettings, argv: list[str], template: str) -> SandboxBackend:
    """The backend a kernel from argv[0] starts in: MSB_BACKEND as set, or for auto the first whose probe passed.

    Called by the provisioner's pre_launch. Raises BackendUnavailable when every backend failed."""
    if settings.backend != "auto":
        return get_backend(settings)
    while True:
        failed = failed_backends(argv[0])
        name, _ = choose_backend("auto", skip=failed)
        if (await _kept(name, argv, template, settings) or await probe(name, argv, template, settings)).ok:
            return get_backend(settings, name)


async def _kept(backend: str, argv: list[str], template: str, settings: MsbSettings) -> StartProbe | None:
    """This process's result, else a pass kept on disk by an earlier process; None: probe."""
    key = (backend, argv[0], None)
    if key in _results:
        return _results[key]
    verdict_key = probe_verdicts.key_for(backend_classes()[backend], argv, template, settings)
    verdict = probe_verdicts.load(verdict_key)
    if verdict is None:
        return None
    path = probe_verdicts.path_for(verdict_key)
    log.info("msb-kernels: the %s backend passed its start probe for %s before (kept in %s): not probed again", backend, argv[0], path)
    _results[key] = StartProbe(backend, argv[0], True, float(verdict.get("seconds") or 0), kept_in=str(path))
    return _results[key]


def distrust(backend: str, argv: list[str], template: str, settings: MsbSettings) -> None:
    """A kernel failed to start in backend: forget its pass, here and on disk, so the next start proves it again."""
    known = _results.pop((backend, argv[0], None), None)
    dropped = probe_verdicts.drop(probe_verdicts.key_for(backend_classes()[backend], argv, template, settings))
    if (known is not None and known.ok) or dropped:
        log.warning(
            "msb-kernels: a kernel from %s failed to start in the %s backend, which had passed its start probe; "
            "the next start probes it again",
            argv[0],
            backend,
        )


async def _start_once(
    backend: str, argv: list[str], template: str, settings: MsbSettings | None, environment: str | None = None
) -> StartProbe:
    """One small kernel of template from argv, in backend, through jupyter_client as every client starts one."""
    from msb_kernels.kernelspecs.choice import KernelChoice
    from msb_kernels.kernelspecs.flavors import FLAVORS
    from msb_kernels.kernelspecs.spec_files import kernelspec

    await backend_classes()[backend].prepare(settings or load_settings())
    started = time.monotonic()
    log.info("msb-kernels: start probe of the %s backend: a small kernel from %s", backend, argv[0])
    choice = KernelChoice(TEMPLATES[template], FLAVORS["small"], environment)
    config = Config({"MsbSettings": {"backend": backend}})
    if settings is not None and settings.runtime_dir:
        config.MsbSettings.runtime_dir = settings.runtime_dir
    kernel_id = str(uuid.uuid4())
    with tempfile.TemporaryDirectory(prefix="msb-probe-") as specs:
        spec = kernelspec(
            choice.template, choice.flavor, settings or MsbSettings(config=config), environment, argv[0] if environment else None
        )
        spec["argv"] = list(argv)
        (Path(specs) / choice.kernel_name).mkdir()
        (Path(specs) / choice.kernel_name / "kernel.json").write_text(json.dumps(spec))
        km = AsyncKernelManager(kernel_name=choice.kernel_name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[specs]), config=config)
        registry.default().probe_kernel_ids.add(kernel_id)  # km has no manager: its provisioner reads default()
        client = None
        error: str | None = None
        tail: list[str] = []
        try:
            await km.start_kernel(kernel_id=kernel_id, **{START_REQUEST: StartRequest()})  # nothing of anyone's
            client = km.client()
            client.start_channels()
            await client.wait_for_ready(timeout=PROBE_TIMEOUT_SECONDS)
            reply = await client.execute_interactive(
                PROBE_CODE.get(template, "1+1"), timeout=PROBE_TIMEOUT_SECONDS, store_history=False, output_hook=lambda message: None
            )
            if reply["content"].get("status") != "ok":
                error = f"its first cell failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}"
        except ConfigError:
            raise  # a setting this backend cannot honour (MSB_TRANSPORT=tcp on gVisor): the user's to fix, not a finding
        except (asyncio.TimeoutError, TimeoutError):
            error = f"no answer within {PROBE_TIMEOUT_SECONDS:.0f} s"
        except Exception as exc:  # whatever the start raised is the finding
            error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        finally:
            sandbox = getattr(km.provisioner, "sandbox", None)
            if sandbox is not None:
                if error is not None:
                    await asyncio.sleep(0.05)  # the kernel's last words, still in the pipe
                tail = sandbox.stderr_tail()
                exit_reason = sandbox.exit_reason() if await sandbox.poll() is not None else None
                if error is not None and exit_reason:
                    error = f"{error} ({exit_reason})"
            if client is not None:
                client.stop_channels()
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)
            registry.default().probe_kernel_ids.discard(kernel_id)
    if error is not None:
        hint = backend_classes()[backend].probe_hint(error)
        error = f"{error}; {hint}" if hint else error
    return StartProbe(backend, argv[0], error is None, time.monotonic() - started, error, tail)


def forget() -> None:
    """Drop every kept result (tests; a host whose backend was repaired)."""
    _results.clear()
