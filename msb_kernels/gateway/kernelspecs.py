"""The gateway's kernelspecs: only those that run in a sandbox, so nothing started here runs on the host."""

from __future__ import annotations

import json
from pathlib import Path

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from msb_kernels.kernelspecs import PROVISIONER_NAME


def _is_sandboxed(resource_dir: str) -> bool:
    try:
        spec = json.loads((Path(resource_dir) / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return spec.get("metadata", {}).get("kernel_provisioner", {}).get("provisioner_name") == PROVISIONER_NAME


class MsbKernelSpecManager(KernelSpecManager):
    """Only kernelspecs that run in a sandbox: a plain python3 spec would run on the host."""

    def find_kernel_specs(self) -> dict[str, str]:
        return {name: path for name, path in super().find_kernel_specs().items() if _is_sandboxed(path)}

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        spec = super().get_kernel_spec(kernel_name)
        if spec.metadata.get("kernel_provisioner", {}).get("provisioner_name") != PROVISIONER_NAME:
            raise NoSuchKernel(kernel_name)
        metadata = spec.metadata
        if "cull_idle_timeout" in metadata and metadata["cull_idle_timeout"] == metadata.get("msb", {}).get("installed_cull_idle_timeout"):
            # Only what install wrote, not an override: this server's MSB_SESSION_TIMEOUT_SECONDS decides.
            del metadata["cull_idle_timeout"]
        return spec
