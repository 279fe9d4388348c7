"""JupyterLab's root in the sandboxes (MSB_LAB_ROOT_PATH): what is shown, how, and where a notebook's kernel starts.

Where JupyterLab and the gateway share a host, a kernel started for ``project/analysis.ipynb`` should
open ``project/data.csv`` as it would without a sandbox. JupyterLab's gateway client sends the
notebook's directory as ``KERNEL_WORKING_DIR``, a host path; with the Lab root shown at the same
path inside every sandbox, that path is the kernel's working directory too.
"""

from __future__ import annotations

import os

from msb_kernels.backends.core import hostpaths
from msb_kernels.backends.core.base import HostDirectory
from msb_kernels.config import MsbSettings
from msb_kernels.errors import ConfigError


def lab_directories(settings: MsbSettings) -> list[HostDirectory]:
    """The host directories every sandbox shows: Lab's root, read-only unless MSB_LAB_ROOT_WRITABLE."""
    root = settings.lab_root
    if root is None:
        return []
    for inner, name in ((settings.runtime_root(), "MSB_RUNTIME_DIR"), (settings.scratch_root(), "MSB_SCRATCH_DIR")):
        inner_path = os.path.realpath(inner)
        if hostpaths.under(inner_path, str(root)):
            raise ConfigError(
                f"MSB_LAB_ROOT_PATH={root} holds {name} ({inner_path}): every sandbox would see the others' sockets and disks",
                [f"move {name} out of JupyterLab's root, or show a narrower directory"],
            )
    return [HostDirectory(str(root), settings.lab_root_writable)]


def working_dir(settings: MsbSettings, requested: str | None) -> str | None:
    """The notebook's directory (a StartRequest's working_dir) as the kernel's working directory, when the sandbox
    shows it; else None (its home)."""
    root = settings.lab_root
    if root is None or not requested:
        return None
    path = os.path.realpath(requested)
    return path if hostpaths.under(path, str(root)) and os.path.isdir(path) else None
