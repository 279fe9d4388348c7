"""Which live kernels use an environment: what each sandbox's state records at its start (``environment``)."""

from __future__ import annotations

import logging

from msb_kernels.backends import backend_classes, get_backend
from msb_kernels.settings.config import MsbSettings

log = logging.getLogger("msb_kernels")


def kernels_using(name: str, settings: MsbSettings) -> list[str]:
    """ "<kernel id> (<backend>)" of every running sandbox on this host whose kernel started from the environment."""
    using = []
    for backend, cls in backend_classes().items():
        if not cls.availability().ok:
            continue
        try:
            records = get_backend(settings, backend).list_sandboxes()
        except Exception as exc:  # a cluster the host cannot reach now has no kernel of this host's to protect
            log.debug("environments: cannot list the %s backend's sandboxes: %s", backend, exc)
            continue
        using += [f"{r.sandbox_id} ({backend})" for r in records if r.running and r.details.get("environment") == name]
    return sorted(using)
