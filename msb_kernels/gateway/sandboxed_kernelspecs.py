"""The gateway's kernelspecs: only those that run in a sandbox, so nothing started here runs on the host."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from msb_kernels.kernelspecs.choice import CONVENTIONAL_NAMES, DEFAULT_TEMPLATE, LISTED_NAMES, conventional_choice
from msb_kernels.kernelspecs.spec_files import PROVISIONER_NAME
from msb_kernels.settings.config import load_settings


def _is_sandboxed(resource_dir: str) -> bool:
    try:
        spec = json.loads((Path(resource_dir) / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return spec.get("metadata", {}).get("kernel_provisioner", {}).get("provisioner_name") == PROVISIONER_NAME


def alias_display_name(display_name: str, template: str) -> str:
    """How a conventional name's card reads: the kernel it stands for, and that it is the default.

    JupyterLab 4 (4.6's kernelOptions), asked to pick a kernel for a notebook that names none (File > New > Notebook,
    a notebook written by a script), preselects nothing, so the browser shows the first option: the kernelspecs
    sorted by display name with localeCompare, where "JavaScript (Node.js) (sandbox, large)" came first. Only a Lab
    whose settings say autoStartDefaultKernel (msb-kernels install writes them where Lab runs from its prefix) skips
    the question. So python3's card, the gateway's default kernel, reads "Default: Python 3 (sandbox, small)", which
    sorts first in any Lab; the others say "default" after the flavor, which keeps them out of the first place."""
    if template == DEFAULT_TEMPLATE:
        return f"Default: {display_name}"
    return f"{display_name[:-1]}, default)" if display_name.endswith(")") else f"{display_name} (default)"


class MsbKernelSpecManager(KernelSpecManager):
    """Only kernelspecs that run in a sandbox: a plain python3 spec would run on the host.

    The conventional names (choice.CONVENTIONAL_NAMES: python3, javascript, ...) are served too, each as the
    sandboxed kernelspec of the default flavor, so that a notebook from elsewhere starts in a sandbox as it
    opens, where JupyterLab would otherwise ask which of the flavors to use."""

    @functools.cached_property
    def _default_flavor(self) -> str:
        return load_settings(self.config).default_flavor  # read once: every start and listing asks

    def _conventional(self, kernel_name: str, specs: dict[str, str] | None = None) -> str | None:
        """The msb kernelspec a conventional name stands for here, if it is installed (in specs, when the caller has
        scanned them already). Any other name costs a dict lookup: this runs for every start and listed spec."""
        if kernel_name.lower() not in CONVENTIONAL_NAMES:
            return None
        choice = conventional_choice(kernel_name, self._default_flavor)
        installed = self._sandboxed_specs() if specs is None else specs
        return choice.kernel_name if choice is not None and choice.kernel_name in installed else None

    def _sandboxed_specs(self) -> dict[str, str]:
        return {name: path for name, path in super().find_kernel_specs().items() if _is_sandboxed(path)}

    def find_kernel_specs(self) -> dict[str, str]:
        """The sandboxed kernelspecs, with the default flavor's of each template listed under its conventional name
        (python3, javascript) in its place: one launcher card per kernel (issue 55 saw two, "Python 3 (sandbox, small)"
        beside its alias). A kernel started as python3 is reported as python3 (MsbKernelManager.kernel_model), so Lab
        saves that name, which opens here and anywhere else. The unlisted names (msb-python-small, python, jslab,
        nodejs) start kernels still."""
        specs = self._sandboxed_specs()
        for name in LISTED_NAMES.values():
            target = self._conventional(name, specs)
            if target is not None:
                specs[name] = specs.pop(target)
        return specs

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        target = self._conventional(kernel_name)
        if target is not None:
            spec = self.get_kernel_spec(target)
            spec.display_name = alias_display_name(spec.display_name, spec.metadata["msb"]["template"])
            spec.metadata["msb"]["stands_for"] = target
            return spec
        spec = super().get_kernel_spec(kernel_name)
        if spec.metadata.get("kernel_provisioner", {}).get("provisioner_name") != PROVISIONER_NAME:
            raise NoSuchKernel(kernel_name)
        metadata = spec.metadata
        if "cull_idle_timeout" in metadata and metadata["cull_idle_timeout"] == metadata.get("msb", {}).get("installed_cull_idle_timeout"):
            # Only what install wrote, not an override: this server's MSB_SESSION_TIMEOUT_SECONDS decides.
            del metadata["cull_idle_timeout"]
        return spec
