"""What a kernel's microVM is made of: its image, network policy, labels, guest command and environment, and the
keyword arguments for ``microsandbox.Sandbox.create`` (pure functions of the spec and the settings)."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

from msb_kernels.backends.core import iodir
from msb_kernels.backends.core.base import SANDBOX_LABEL, SandboxRecord, SandboxSpec
from msb_kernels.backends.core.processes import owner_alive, process_start_time
from msb_kernels.environments.kernel_images import kernel_argv, kernel_image
from msb_kernels.images import GUEST_HOME, GUEST_PATH, GUEST_UID, LOCAL_IMAGE_PREFIX
from msb_kernels.settings.config import MsbSettings

GUEST_IO_DIR = "/run/kernel"
NAME_PREFIX = "msbk-"
SMOKE_PREFIX = "msbk-smoke-"
SMOKE_MEMORY_MIB = 256

LABEL_OWNER_PID = "msb-kernels.owner-pid"
LABEL_OWNER_START = "msb-kernels.owner-start"
LABEL_HOST = "msb-kernels.host"
LABEL_KERNEL = "msb-kernels.kernel-id"
LABEL_FLAVOR = "msb-kernels.flavor"
LABEL_TEMPLATE = "msb-kernels.template"
LABEL_CREATED = "msb-kernels.created"


def network_for(allow_network: bool) -> Any:
    """Outbound denied unless MSB_ALLOW_NETWORK, and then only to the public internet (not the host or
    its LAN); inbound allowed, because the kernel's published ports are inbound."""
    from microsandbox import (
        Action,
        DestGroup,
        Destination,
        Network,
        NetworkPolicy,
        Rule,
    )

    if allow_network:
        rules = (*Rule.allow_dns(), Rule.allow(destination=Destination.group(DestGroup.PUBLIC)))
        return Network(policy=NetworkPolicy(default_egress=Action.DENY, default_ingress=Action.ALLOW, rules=rules))
    return Network(policy=NetworkPolicy(default_egress=Action.DENY, default_ingress=Action.ALLOW, rules=()))


def pull_policy_for(image: str) -> Any:
    """Never pull our own image names (`msb-kernels image build` makes them; a registry must not supply them)."""
    from microsandbox import PullPolicy

    return PullPolicy.NEVER if image.startswith(LOCAL_IMAGE_PREFIX) else PullPolicy.IF_MISSING


def labels_for(spec: SandboxSpec, hostname: str | None = None) -> dict[str, str]:
    labels = {
        SANDBOX_LABEL: "1",
        LABEL_KERNEL: spec.sandbox_id,
        LABEL_HOST: hostname or socket.gethostname(),
        LABEL_FLAVOR: spec.flavor.name,
        LABEL_TEMPLATE: spec.template,
        LABEL_CREATED: f"{time.time():.3f}",
    }
    if spec.owner_pid is not None:
        labels[LABEL_OWNER_PID] = str(spec.owner_pid)
        labels[LABEL_OWNER_START] = str(process_start_time(spec.owner_pid) or "")
    return labels


def guest_argv(spec: SandboxSpec) -> list[str]:
    """The kernel command in the image: its python3 or tslab, not the host's interpreter paths (an environment's
    image holds its interpreter at the host's path)."""
    return kernel_argv(spec.template, spec.argv, spec.environment)


def guest_env(spec: SandboxSpec) -> dict[str, str]:
    env = dict(spec.env)
    env["PATH"] = GUEST_PATH
    env["HOME"] = GUEST_HOME
    return env


def sandbox_name(sandbox_id: str) -> str:
    return NAME_PREFIX + sandbox_id


def create_kwargs(spec: SandboxSpec, settings: MsbSettings, ports: list[int], *, hostname: str | None = None) -> dict[str, Any]:
    """The keyword arguments for microsandbox.Sandbox.create(sandbox_name(id), **these)."""
    from microsandbox import PortBinding, Volume

    # What the host wrote (iodir.host_dir), writable: ipykernel rewrites its connection file at start (Debian's 6.17
    # does, even when nothing changed), and dies if it cannot. The host writes it only while the VM is stopped, each
    # file anew (iodir.write_host_file: never through a link the VM left), and reads nothing of it back; the kernel's
    # channels are TCP ports, and its status is msb's word.
    volumes = {GUEST_IO_DIR: Volume.bind(str(iodir.host_dir(spec.io_dir)), readonly=False, uid=GUEST_UID, gid=GUEST_UID)}
    if spec.shared_volume is not None:
        volumes[spec.shared_volume.guest_path] = Volume.bind(
            str(spec.shared_volume.host_path), readonly=False, uid=GUEST_UID, gid=GUEST_UID
        )
    for directory in spec.host_directories:
        volumes[directory.path] = Volume.bind(directory.path, readonly=not directory.writable, uid=GUEST_UID, gid=GUEST_UID)
    image = kernel_image(settings, spec.template, spec.environment)
    return {
        "image": image,
        "cpus": spec.flavor.cpus,
        "memory": spec.flavor.memory_mib,
        "hostname": "sandbox",
        "ports": [PortBinding.tcp(port, port, bind="127.0.0.1") for port in ports],
        "volumes": volumes,
        "network": network_for(spec.allow_network),
        "labels": labels_for(spec, hostname),
        "idle_timeout": None,  # off: the VM's idle clock does not see ZMQ traffic; Jupyter culls idle kernels
        "max_duration": None,
        "pull_policy": pull_policy_for(image),
        "replace": True,  # a restart reuses the kernel's name
        "detached": True,  # the VM outlives this handle; labels and sweeps find it if we die
    }


def record_from_handle(handle: Any, backend: str) -> SandboxRecord:
    """A VM found on the host, as a SandboxRecord: read back from the labels labels_for() gave it."""
    config = {}
    with contextlib.suppress(Exception):
        config = handle.config() or {}
    labels = dict(config.get("labels") or {})
    owner_pid = int(labels[LABEL_OWNER_PID]) if labels.get(LABEL_OWNER_PID, "").isdigit() else None
    owner_start = int(labels[LABEL_OWNER_START]) if labels.get(LABEL_OWNER_START, "").isdigit() else None
    kernel_id = labels.get(LABEL_KERNEL) or handle.name.removeprefix(NAME_PREFIX)
    status = str(getattr(handle, "status", ""))
    details = {
        "vm": handle.name,
        "status": status,
        "labels": labels,
        "owner_pid": owner_pid,
        "owner_start": owner_start,
        "host": labels.get(LABEL_HOST),
        "flavor": labels.get(LABEL_FLAVOR),
        "template": labels.get(LABEL_TEMPLATE),
    }
    created = handle.created_at or float(labels.get(LABEL_CREATED) or 0)
    return SandboxRecord(
        kernel_id, backend, owner_alive(owner_pid, owner_start), status in ("running", "starting", "draining"), created, details
    )
