"""Flavors: the only sizes a sandbox comes in.

Every other module (kernelspecs, limits, the gateway, the MCP bridge) reads sizes
from here, so a flavor is defined exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from msb_kernels.errors import InvalidRequest


@dataclass(frozen=True)
class Flavor:
    name: str
    cpus: int
    memory_mib: int
    disk_mib: int
    description: str

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024

    @property
    def disk_bytes(self) -> int:
        return self.disk_mib * 1024 * 1024

    @property
    def shm_mib(self) -> int:
        """/dev/shm is memory: a sixteenth of it, so filling /dev/shm fails (ENOSPC) long before it takes the kernel's memory."""
        return self.memory_mib // 16

    @property
    def memory_scratch_mib(self) -> int:
        """/tmp and home where the host gives no disk: RAM, so half the memory, and a write fails before the kernel is killed."""
        return self.memory_mib // 2

    def next_larger(self) -> Flavor | None:
        names = list(FLAVORS)
        index = names.index(self.name)
        return FLAVORS[names[index + 1]] if index + 1 < len(names) else None

    def out_of_memory_message(self) -> str:
        larger = self.next_larger()
        advice = f"try {larger.name}" if larger else "free memory (del large objects) or restart the kernel"
        return f"out of memory for flavor {self.name} ({self.memory_mib} MiB); {advice}"


FLAVORS: dict[str, Flavor] = {
    flavor.name: flavor
    for flavor in (
        Flavor("small", cpus=1, memory_mib=1024, disk_mib=2048, description="basic tasks, simple scripts"),
        Flavor("medium", cpus=2, memory_mib=2048, disk_mib=4096, description="data processing, moderate workloads"),
        Flavor("large", cpus=4, memory_mib=4096, disk_mib=8192, description="intensive computation, large datasets"),
    )
}


def describe_flavors(last_separator: str = ", ") -> str:
    """'small (1 CPU, 1 GiB), medium (2 CPU, 2 GiB), large (4 CPU, 4 GiB)', for tool descriptions and help."""
    parts = [f"{f.name} ({f.cpus} CPU, {f.memory_mib / 1024:g} GiB)" for f in FLAVORS.values()]
    return ", ".join(parts[:-1]) + last_separator + parts[-1]


def get_flavor(name: str, *, argument: str = "flavor") -> Flavor:
    """Look a flavor up by name; unknown names raise InvalidRequest naming the accepted values."""
    try:
        return FLAVORS[str(name).strip().lower()]
    except KeyError:
        raise InvalidRequest(
            f"{argument}={name!r} is not a flavor; use one of {', '.join(FLAVORS)}",
            suggestions=[
                f"use one of: {', '.join(f'{f.name} ({f.cpus} CPU, {f.memory_mib} MiB, {f.disk_mib} MiB disk)' for f in FLAVORS.values())}"
            ],
        ) from None
