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
    description: str

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024

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
        Flavor("small", cpus=1, memory_mib=1024, description="basic tasks, simple scripts"),
        Flavor("medium", cpus=2, memory_mib=2048, description="data processing, moderate workloads"),
        Flavor("large", cpus=4, memory_mib=4096, description="intensive computation, large datasets"),
    )
}


def get_flavor(name: str, *, argument: str = "flavor") -> Flavor:
    """Look a flavor up by name; unknown names raise InvalidRequest naming the accepted values."""
    try:
        return FLAVORS[str(name).strip().lower()]
    except KeyError:
        raise InvalidRequest(
            f"{argument}={name!r} is not a flavor; use one of {', '.join(FLAVORS)}",
            suggestions=[f"use one of: {', '.join(f'{f.name} ({f.cpus} CPU, {f.memory_mib} MiB)' for f in FLAVORS.values())}"],
        ) from None
