"""Capacity: the checks before every start (a person's share, and the flavors' memory and CPUs added up against
MSB_CAPACITY_MEMORY_MIB and MSB_CAPACITY_CPUS), and the flavor a start request gets. MSB_MAX_SESSIONS is the
registry's one count (registry.SandboxRegistry.claim_session), which the kernel manager claims as it reserves an id.

A hibernated kernel is a session (MSB_MAX_SESSIONS counts it) that holds no memory or CPU: those count awake kernels
only, and a wake makes room first (hibernation.py)."""

from __future__ import annotations

from typing import Any

from jupyter_client.kernelspec import NoSuchKernel

from msb_kernels.backends import get_backend
from msb_kernels.errors import NoSuchKernelspec, ResourceLimitExceeded
from msb_kernels.gateway.host import host_memory_mib
from msb_kernels.identity.people import acting
from msb_kernels.kernelspecs.flavors import FLAVORS, Flavor, get_flavor
from msb_kernels.provisioning.start_request import StartRequest

CLUSTER_CAPACITY_MIB = 2**40  # no bound of this host's


class CapacityMixin:
    """MsbKernelManager's limits. Reads its msb_settings, pool, records (their flavors) and kernel_spec_manager."""

    msb_settings: Any
    pool: Any
    records: dict
    kernel_spec_manager: Any

    # The capacity is MsbSettings' (MSB_CAPACITY_*, or `serve --capacity-*`). Memory is the real limit:
    # unset, the flavors add up to at most the host's memory, so no kernel filling its flavor is the reason
    # another is killed. CPU time is shared (each kernel is held to its flavor's CPUs by its quota, and an
    # idle one uses none), so unset, CPUs admit any number of kernels. Where kernels run on a cluster's nodes, not
    # this host, its memory bounds nothing: unset, the cluster's scheduler is the one to refuse.
    @property
    def capacity_memory_mib(self) -> int:
        if self.msb_settings.capacity_memory_mib:
            return self.msb_settings.capacity_memory_mib
        return CLUSTER_CAPACITY_MIB if get_backend(self.msb_settings).runs_on_cluster else host_memory_mib()

    @property
    def capacity_cpus(self) -> int | None:
        return self.msb_settings.capacity_cpus

    def counted_flavors(self, awake: bool = False) -> list[Flavor]:
        """Every kernel the limits count: sessions, and waiting pooled kernels if MSB_POOL_COUNTS_AS_SESSIONS; with
        awake, less the hibernated ones."""
        pooled = self.pool.waiting_flavors() if self.pool.counts_as_sessions else []
        sessions = [r.flavor for kernel_id, r in list(self.records.items()) if not (awake and self.is_hibernated(kernel_id))]
        return sessions + pooled

    def allocated(self) -> tuple[int, int]:
        """Memory (MiB) and CPUs the awake kernels' flavors add up to."""
        flavors = self.counted_flavors(awake=True)
        return sum(f.memory_mib for f in flavors), sum(f.cpus for f in flavors)

    def fits(self, flavor: Flavor) -> bool:
        """Whether one more awake kernel of this flavor stays within the memory and CPU capacity."""
        memory, cpus = self.allocated()
        return memory + flavor.memory_mib <= self.capacity_memory_mib and (
            self.capacity_cpus is None or cpus + flavor.cpus <= self.capacity_cpus
        )

    def check_capacity(self, flavor: Flavor) -> None:
        """Raise ResourceLimitExceeded (the handlers answer 429) when one more kernel of this flavor would pass the
        memory or CPU capacity."""
        memory, cpus = self.allocated()
        over = []
        if memory + flavor.memory_mib > self.capacity_memory_mib:
            over.append(
                ("capacity_memory", f"memory {memory} + {flavor.memory_mib} MiB > MSB_CAPACITY_MEMORY_MIB={self.capacity_memory_mib}")
            )
        if self.capacity_cpus is not None and cpus + flavor.cpus > self.capacity_cpus:
            over.append(("capacity_cpus", f"CPUs {cpus} + {flavor.cpus} > MSB_CAPACITY_CPUS={self.capacity_cpus}"))
        if not over:
            return
        fitting = [
            f
            for f in FLAVORS.values()
            if f.memory_mib < flavor.memory_mib
            and memory + f.memory_mib <= self.capacity_memory_mib
            and (self.capacity_cpus is None or cpus + f.cpus <= self.capacity_cpus)
        ]
        suggestions = ["stop a session you no longer need (DELETE /api/kernels/<id>)"]
        if fitting:
            suggestions.append("pick a smaller flavor: " + ", ".join(f"{f.name} ({f.cpus} CPU, {f.memory_mib} MiB)" for f in fitting))
        raise ResourceLimitExceeded(
            f"host capacity reached: a {flavor.name} kernel ({flavor.cpus} CPU, {flavor.memory_mib} MiB) does not fit: "
            + "; ".join(text for _, text in over),
            suggestions,
            limit=over[0][0],
        )

    def check_share(self, flavor: Flavor) -> None:
        """A person's fair share (MSB_MAX_SESSIONS_PER_USER, MSB_USER_MEMORY_MIB): checked before the host's limits and
        counting only the caller's own kernels, so one person at their limit is refused while the others still start
        at once. Every kernel a person holds counts, awake or asleep: a hibernated kernel is theirs to wake, and a share
        that left it out was passed at the wake, at another person's cost. The refusal names the setting and the
        person's use; the system (the pool) has no share."""
        person = acting()
        if person is None or person.is_system:
            return
        settings = self.msb_settings
        mine = self.held_by(person)
        if settings.max_sessions_per_user is not None and len(mine) >= settings.max_sessions_per_user:
            raise ResourceLimitExceeded(
                f"{person.name} runs {len(mine)} of MSB_MAX_SESSIONS_PER_USER={settings.max_sessions_per_user} kernels",
                [
                    "stop one of your sessions you no longer need (DELETE /api/kernels/<id>, or the MCP stop_session)",
                    "or ask the operator to raise MSB_MAX_SESSIONS_PER_USER",
                ],
                limit="max_sessions_per_user",
            )
        if settings.user_memory_mib is not None:
            used = sum(record.flavor.memory_mib for record in mine)
            if used + flavor.memory_mib > settings.user_memory_mib:
                smaller = [f.name for f in FLAVORS.values() if used + f.memory_mib <= settings.user_memory_mib]
                raise ResourceLimitExceeded(
                    f"{person.name}'s kernels hold {used} MiB of MSB_USER_MEMORY_MIB={settings.user_memory_mib} "
                    f"(hibernated ones included); a {flavor.name} kernel ({flavor.memory_mib} MiB) does not fit",
                    [
                        "stop one of your sessions you no longer need",
                        *([f"pick a smaller flavor: {', '.join(smaller)}"] if smaller else []),
                        "or ask the operator to raise MSB_USER_MEMORY_MIB",
                    ],
                    limit="user_memory",
                )

    def held_by(self, person: Any) -> list:
        """Every kernel record a person owns, awake or hibernated."""
        return [record for record in list(self.records.values()) if record.owner is not None and record.owner == person.owner]

    def check_wake_share(self, kernel_id: str) -> None:
        """A wake that would put the kernel's owner past their memory share is refused, naming the setting: the share
        counts sleeping kernels, so this holds only where the operator lowered MSB_USER_MEMORY_MIB below what a person
        already holds. The refused wake costs nobody else anything: no other kernel is put to sleep for it."""
        settings = self.msb_settings
        record = self.records.get(kernel_id)
        if settings.user_memory_mib is None or record is None or record.owner is None:
            return
        used = sum(other.flavor.memory_mib for other in self.records.values() if other.owner == record.owner)
        if used > settings.user_memory_mib:
            raise ResourceLimitExceeded(
                f"kernel {kernel_id} cannot wake: {record.owner.name}'s kernels hold {used} MiB, over "
                f"MSB_USER_MEMORY_MIB={settings.user_memory_mib}",
                ["stop one of your sessions you no longer need", "or ask the operator to raise MSB_USER_MEMORY_MIB"],
                limit="user_memory",
            )

    def flavor_for(self, kernel_name: str, request: StartRequest) -> tuple[Flavor, str, str | None]:
        """The flavor, template and environment a start request gets: its flavor (KERNEL_FLAVOR), else the
        kernelspec's; the kernelspec's template and environment."""
        try:
            spec = self.kernel_spec_manager.get_kernel_spec(kernel_name)
        except NoSuchKernel:
            names = sorted(self.kernel_spec_manager.find_kernel_specs())
            raise NoSuchKernelspec(
                f"no sandboxed kernelspec named {kernel_name!r}",
                [f"use one of: {', '.join(names)}" if names else "run `msb-kernels install` first"],
            ) from None
        config = spec.metadata.get("kernel_provisioner", {}).get("config", {})
        if request.flavor:
            flavor = get_flavor(request.flavor, argument="KERNEL_FLAVOR")
        else:
            flavor = get_flavor(config.get("flavor") or self.msb_settings.default_flavor)
        return flavor, config.get("template", "python"), config.get("environment") or None
