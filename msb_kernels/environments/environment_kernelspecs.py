"""An environment's kernelspecs, msb-<env>-python-<flavor>: written where `msb-kernels install` writes the default ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from msb_kernels.environments.environment import Environment
from msb_kernels.kernelspecs.choice import KernelChoice
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.kernelspecs.spec_files import kernelspec, write_kernelspec
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.settings.config import MsbSettings


def choices(name: str) -> list[KernelChoice]:
    return [KernelChoice(TEMPLATES["python"], flavor, name) for flavor in FLAVORS.values()]


def install(environment: Environment, settings: MsbSettings, prefix: str | None = None, user: bool = False) -> list[str]:
    """Write one kernelspec per flavor whose argv[0] is the environment's interpreter."""
    manager = KernelSpecManager()
    lines = []
    for choice in choices(environment.name):
        spec = kernelspec(choice.template, choice.flavor, settings, environment.name, environment.python)
        # What a client that sees only kernelspecs (Lab, a remote gateway's MCP tools) shows of the environment.
        spec["metadata"]["msb"].update(python_version=environment.python_version, packages=environment.main_packages())
        lines.append(write_kernelspec(manager, choice, spec, prefix, user))
    return lines


def installed(name: str) -> dict[str, str]:
    """The environment's kernelspecs that Jupyter finds here: {kernel name: directory}."""
    wanted = {choice.kernel_name for choice in choices(name)}
    return {kernel: path for kernel, path in KernelSpecManager().find_kernel_specs().items() if kernel in wanted}


def refresh(environment: Environment) -> None:
    """What the installed kernelspecs say of the environment (its Python, main packages), after a check looked again."""
    for path in installed(environment.name).values():
        spec_file = Path(path) / "kernel.json"
        try:
            spec = json.loads(spec_file.read_text())
            spec["metadata"]["msb"].update(python_version=environment.python_version, packages=environment.main_packages())
            spec_file.write_text(json.dumps(spec, indent=1))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a kernelspec this user cannot write, or one edited by hand: install rewrites it


def remove(name: str) -> list[str]:
    """Delete every kernelspec of the environment found here; the lines that say so."""
    report = []
    for kernel, path in sorted(installed(name).items()):
        shutil.rmtree(path, ignore_errors=True)
        report.append(f"removed {kernel} ({path})" if not Path(path).exists() else f"could not remove {kernel} ({path})")
    return report
