"""Kernelspecs: msb-<template>-<flavor>, each selecting the sandbox provisioner."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from msb_kernels.config import MsbSettings
from msb_kernels.flavors import FLAVORS, Flavor
from msb_kernels.templates import TEMPLATES, Template, install_tslab

PROVISIONER_NAME = "msb-sandbox"


def kernel_name(template: str, flavor: str) -> str:
    return f"msb-{template}-{flavor}"


def kernelspec(template: Template, flavor: Flavor, settings: MsbSettings) -> dict:
    sandbox = f"sandbox, {flavor.name}"
    return {
        "argv": template.argv(),
        "display_name": f"{template.display_name} ({sandbox})",
        "language": template.language,
        "interrupt_mode": "signal",
        "env": {},
        "metadata": {
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {"flavor": flavor.name, "template": template.name}},
            "cull_idle_timeout": settings.session_timeout_seconds,
            # The timeout install wrote: a gateway tells it from a deliberate per-kernelspec override.
            "msb": {"flavor": flavor.name, "cpus": flavor.cpus, "memory_mib": flavor.memory_mib, "template": template.name,
                    "installed_cull_idle_timeout": settings.session_timeout_seconds},
            "debugger": False,
            # ipykernel >= 7.4 speaks CurveZMQ; the provisioner turns it on for kernels reached over TCP (microVMs).
            **({"supported_encryption": "curve"} if template.name == "python" else {}),
        },
    }


def _logo_dir() -> Path | None:
    try:
        import ipykernel

        resources = Path(ipykernel.__file__).parent / "resources"
        return resources if resources.is_dir() else None
    except ImportError:
        return None


def install(settings: MsbSettings, prefix: str | None = None, user: bool = False) -> list[str]:
    """Write every kernelspec this host can run; return lines that say what happened."""
    manager = KernelSpecManager()
    report = []
    node_note = install_tslab()
    templates = ["python"]
    if TEMPLATES["node"].unavailable_reason() is None:
        templates.append("node")
    report.append(node_note if "node" in templates else f"{node_note}")
    for template_name in templates:
        template = TEMPLATES[template_name]
        for flavor in FLAVORS.values():
            name = kernel_name(template_name, flavor.name)
            with tempfile.TemporaryDirectory() as staging:
                (Path(staging) / "kernel.json").write_text(json.dumps(kernelspec(template, flavor, settings), indent=1))
                logos = _logo_dir() if template_name == "python" else None
                for logo in (logos.glob("logo-*.png") if logos else []):
                    shutil.copy(logo, staging)
                destination = manager.install_kernel_spec(staging, name, user=user, prefix=None if user else (prefix or sys.prefix))
            report.append(f"installed {name}: {kernelspec(template, flavor, settings)['display_name']} -> {destination}")
    return report
