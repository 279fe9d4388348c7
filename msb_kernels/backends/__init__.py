"""The backend registry, and the factory that picks one.

Every backend is an entry point in the ``msb_kernels.backends`` group, the built-in ones included
(pyproject.toml): ``namespace`` (namespace/) runs everywhere Linux namespaces work; ``gvisor`` (gvisor/)
puts gVisor's application kernel between the code and the host where runsc is installed; ``microsandbox``
(microsandbox/) boots a microVM per kernel where the host can. ``auto`` takes the first that can run here in
``auto_order`` (the microVM first), and says why; msb_kernels.provisioning.probe makes sure a kernel starts in it.
"""

from __future__ import annotations

import functools
import importlib
import logging

from msb_kernels.backends.core.base import Availability, Sandbox, SandboxBackend, SandboxSpec
from msb_kernels.errors import BackendUnavailable
from msb_kernels.settings.config import MsbSettings, backend_locations

log = logging.getLogger("msb_kernels")

__all__ = ["Availability", "Sandbox", "SandboxBackend", "SandboxSpec", "backend_classes", "choose_backend", "get_backend"]

_instances: dict[tuple[str, str, str], SandboxBackend] = {}


@functools.cache
def backend_classes() -> dict[str, type[SandboxBackend]]:
    """Every backend that loads here, by name, strongest boundary first (``auto_order``).

    Backends are the built-in ones and the ``msb_kernels.backends`` entry points, so a new one
    is a module and an entry point. One whose module cannot be imported is left out;
    ``unloadable_backends`` says why, and choose_backend and `msb-kernels doctor` report it.
    """
    classes = []
    for name, location in backend_locations().items():
        module, _, attribute = location.partition(":")
        try:
            classes.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError) as exc:
            unloadable_backends[name] = f"cannot be imported from {location}: {exc}"
    return {cls.name: cls for cls in sorted(classes, key=lambda cls: cls.auto_order)}


unloadable_backends: dict[str, str] = {}


def choose_backend(requested: str, skip: dict[str, str] | None = None) -> tuple[str, str]:
    """The backend to use for MSB_BACKEND=requested, and why. Raises BackendUnavailable.

    auto passes over the backends in skip (name -> why: their start probe failed in this process)."""
    classes = backend_classes()
    if requested != "auto":
        if requested not in classes:
            why = unloadable_backends.get(requested, "it is not installed")
            raise BackendUnavailable(
                f"MSB_BACKEND={requested}: that backend {why}",
                ["reinstall msb-kernels (the first command of the README)", "or set MSB_BACKEND to one of: auto, " + ", ".join(classes)],
            )
        availability = classes[requested].availability()
        if not availability.ok:
            raise BackendUnavailable(
                f"MSB_BACKEND={requested} cannot run on this host: {availability.reason}",
                ["run `msb-kernels doctor` for details", "or set MSB_BACKEND=auto"],
            )
        return requested, f"MSB_BACKEND={requested}: {availability.reason}"
    reasons = [f"{name}: {why}" for name, why in unloadable_backends.items()]
    for name, cls in classes.items():
        if skip and name in skip:
            reasons.append(f"{name}: {skip[name]}")
            continue
        availability = cls.availability()
        if availability.ok:
            because = f" ({'; '.join(reasons)})" if reasons else ""
            return name, f"picked {name}: {availability.reason}{because}"
        reasons.append(f"{name}: {availability.reason}")
    raise BackendUnavailable("no sandbox backend works on this host: " + "; ".join(reasons), ["run `msb-kernels doctor`"])


def get_backend(settings: MsbSettings, name: str | None = None) -> SandboxBackend:
    """One backend instance per (choice, runtime dir, transport) in this process; logs the choice once.

    name: the backend MSB_BACKEND=auto settled on after its start probe (msb_kernels.provisioning.probe)."""
    name, why = (name, f"picked {name}: it passed its start probe") if name else choose_backend(settings.backend)
    key = (name, str(settings.runtime_root()), backend_classes()[name].transport_for(settings))
    if key not in _instances:
        log.info("msb-kernels backend: %s", why)
        for warning in backend_classes()[name].availability().warnings:
            log.warning("msb-kernels: %s", warning)
        _instances[key] = backend_classes()[name](settings)
    return _instances[key]
