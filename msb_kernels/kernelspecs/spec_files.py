"""Kernelspecs: msb-<template>-<flavor> (and msb-<environment>-python-<flavor>), each selecting the sandbox provisioner."""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from msb_kernels.kernelspecs.choice import DEFAULT_ENVIRONMENT, KernelChoice
from msb_kernels.kernelspecs.flavors import FLAVORS, Flavor
from msb_kernels.kernelspecs.templates import TEMPLATES, Template, install_tslab
from msb_kernels.settings.config import MsbSettings

PROVISIONER_NAME = "msb-sandbox"
# JupyterLab's settings beside the kernelspecs (overrides.d in Lab's app dir, read where Lab runs from this prefix): a
# notebook without kernel metadata, as tools and scripts write them, starts the server's default kernel (the gateway's
# sandboxed Python). Without it Lab asks, preselecting the first kernel by display name: a large Node one.
LAB_SETTINGS = {"@jupyterlab/notebook-extension:tracker": {"autoStartDefaultKernel": True}}


def kernelspec(
    template: Template, flavor: Flavor, settings: MsbSettings, environment: str | None = None, python: str | None = None
) -> dict:
    """environment, python: an environment's name and interpreter (msb_kernels.environments); None for the default one."""
    sandbox = f"{environment}, sandbox, {flavor.name}" if environment else f"sandbox, {flavor.name}"
    argv = template.argv()
    config = {"flavor": flavor.name, "template": template.name}
    if environment:
        argv[0] = python or argv[0]
        config["environment"] = environment
    return {
        "argv": argv,
        "display_name": f"{template.display_name} ({sandbox})",
        "language": template.language,
        "interrupt_mode": "signal",
        "env": {},
        "metadata": {
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": config},
            "cull_idle_timeout": settings.session_timeout_seconds,
            # The timeout install wrote: a gateway tells it from a deliberate per-kernelspec override.
            "msb": {
                "flavor": flavor.name,
                "cpus": flavor.cpus,
                "memory_mib": flavor.memory_mib,
                "template": template.name,
                "environment": environment or DEFAULT_ENVIRONMENT,
                # The installing interpreter's, for the default environment: list_environments shows it.
                **({"python_version": platform.python_version()} if template.name == "python" and not environment else {}),
                "installed_cull_idle_timeout": settings.session_timeout_seconds,
            },
            "debugger": False,
            # ipykernel >= 7.4 speaks CurveZMQ; the provisioner turns it on for kernels reached over TCP (microVMs).
            **({"supported_encryption": "curve"} if template.speaks_curve else {}),
        },
    }


LOGO_SIZES = (32, 64)  # the logo-WxH.png files Jupyter frontends ask a kernelspec for


def _logo_dir() -> Path | None:
    try:
        import ipykernel

        resources = Path(ipykernel.__file__).parent / "resources"
        return resources if resources.is_dir() else None
    except ImportError:
        return None


def draw_logo(text: str, size: int, path: Path) -> None:
    """A green hexagon with ``text`` on it, drawn here (Pillow comes with matplotlib) rather than copied."""
    from PIL import Image, ImageDraw, ImageFont

    scale = 4  # drawn large and scaled down, for smooth edges
    side = size * scale
    image = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    middle, radius = side / 2, side / 2 - scale
    hexagon = [
        (middle + radius * dx, middle + radius * dy)
        for dx, dy in ((0, -1), (0.866, -0.5), (0.866, 0.5), (0, 1), (-0.866, 0.5), (-0.866, -0.5))
    ]
    draw.polygon(hexagon, fill=(83, 158, 67, 255))
    font = ImageFont.load_default(size=int(side * 0.42))
    draw.text((middle, middle), text, fill=(255, 255, 255, 255), font=font, anchor="mm")
    image.resize((size, size), Image.LANCZOS).save(path, format="PNG")


def _write_logos(template: Template, directory: Path) -> None:
    if template.logo_text:
        for size in LOGO_SIZES:
            draw_logo(template.logo_text, size, directory / f"logo-{size}x{size}.png")
        return
    logos = _logo_dir()
    for logo in logos.glob("logo-*.png") if logos else []:
        shutil.copy(logo, directory)


def install(settings: MsbSettings, prefix: str | None = None, user: bool = False, node: bool = True) -> list[str]:
    """Write every kernelspec this host can run (the Python ones only, without node); return lines that say what happened."""
    manager = KernelSpecManager()
    report = []
    templates = ["python"]
    if node:
        report.append(install_tslab())
        if TEMPLATES["node"].unavailable_reason() is None:
            templates.append("node")
    for template_name in templates:
        template = TEMPLATES[template_name]
        for flavor in FLAVORS.values():
            report.append(write_kernelspec(manager, KernelChoice(template, flavor), kernelspec(template, flavor, settings), prefix, user))
    if not user:
        report.append(install_lab_settings(Path(prefix or sys.prefix)))
    return report


def install_lab_settings(prefix: Path) -> str:
    """LAB_SETTINGS, as defaults of JupyterLab's run from this prefix (a person's own settings still win)."""
    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / "msb-kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LAB_SETTINGS, indent=1) + "\n")
    return f"installed JupyterLab's settings (a notebook without kernel metadata starts the default kernel) -> {path}"


def write_kernelspec(manager: KernelSpecManager, choice: KernelChoice, spec: dict, prefix: str | None, user: bool) -> str:
    """Install one kernelspec with its logos where install puts them; the line that says so."""
    with tempfile.TemporaryDirectory() as staging:
        (Path(staging) / "kernel.json").write_text(json.dumps(spec, indent=1))
        _write_logos(choice.template, Path(staging))
        destination = manager.install_kernel_spec(staging, choice.kernel_name, user=user, prefix=None if user else (prefix or sys.prefix))
    return f"installed {choice.kernel_name}: {spec['display_name']} -> {destination}"
