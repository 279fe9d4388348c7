"""Backends and the factory that picks one.

``namespace`` (namespace.py) runs everywhere Linux namespaces work; ``microsandbox``
(microsandbox.py) boots a microVM per kernel where the host can. ``auto`` prefers
the microVM and falls back to namespaces, and says why.
"""

from __future__ import annotations

import logging

from msb_kernels.backends.base import Availability, Sandbox, SandboxBackend, SandboxSpec
from msb_kernels.config import MsbSettings
from msb_kernels.errors import BackendUnavailable

log = logging.getLogger("msb_kernels")

__all__ = ["Availability", "Sandbox", "SandboxBackend", "SandboxSpec", "backend_classes", "choose_backend", "get_backend"]

_instances: dict[tuple[str, str], SandboxBackend] = {}


def backend_classes() -> dict[str, type[SandboxBackend]]:
    from msb_kernels.backends.namespace import NamespaceBackend

    classes: dict[str, type[SandboxBackend]] = {"namespace": NamespaceBackend}
    try:
        from msb_kernels.backends.microsandbox import MicrosandboxBackend
    except ImportError:
        pass
    else:
        classes["microsandbox"] = MicrosandboxBackend
    return classes


def choose_backend(requested: str) -> tuple[str, str]:
    """The backend to use for MSB_BACKEND=requested, and why. Raises BackendUnavailable."""
    classes = backend_classes()
    if requested != "auto":
        if requested not in classes:
            raise BackendUnavailable(f"MSB_BACKEND={requested}: that backend is not installed",
                                     ["pip install 'msb-kernels[microsandbox]'", "or set MSB_BACKEND=namespace"])
        availability = classes[requested].availability()
        if not availability.ok:
            raise BackendUnavailable(f"MSB_BACKEND={requested} cannot run on this host: {availability.reason}",
                                     ["run `msb-kernels doctor` for details", "or set MSB_BACKEND=auto"])
        return requested, f"MSB_BACKEND={requested}: {availability.reason}"
    reasons = []
    for name in ("microsandbox", "namespace"):
        if name not in classes:
            reasons.append(f"{name}: not installed")
            continue
        availability = classes[name].availability()
        if availability.ok:
            because = f" ({'; '.join(reasons)})" if reasons else ""
            return name, f"picked {name}: {availability.reason}{because}"
        reasons.append(f"{name}: {availability.reason}")
    raise BackendUnavailable("no sandbox backend works on this host: " + "; ".join(reasons), ["run `msb-kernels doctor`"])


def get_backend(settings: MsbSettings) -> SandboxBackend:
    """One backend instance per (choice, runtime dir) in this process; logs the choice once."""
    name, why = choose_backend(settings.backend)
    key = (name, str(settings.runtime_root()))
    if key not in _instances:
        log.info("msb-kernels backend: %s", why)
        for warning in backend_classes()[name].availability().warnings:
            log.warning("msb-kernels: %s", warning)
        _instances[key] = backend_classes()[name](settings)
    return _instances[key]
