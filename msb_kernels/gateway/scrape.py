"""The gateway's side of /metrics: what is read at scrape time (sessions by state, each kernel's cgroup, the pool,
the gateway's own memory and what it retains), and MSB_METRICS_PORT's listener.

The counters (starts, failures, stops, restarts, OOM kills, MCP calls, adoptions, egress) are msb_kernels.observability.metrics';
jupyter_server's own metrics stay where they are, in the same default registry, at the same /metrics.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from msb_kernels.backends.core import leftovers
from msb_kernels.gateway.host import gateway_process_stats
from msb_kernels.gateway.kernels.records import backend_of, sandbox_of
from msb_kernels.jupyter.compat import kernels_of
from msb_kernels.provisioning.registry import live_in_this_process

log = logging.getLogger("msb_kernels")


class GatewayCollector(Collector):
    """Reads a kernel manager (weakly: a test's gateway may come and go in one process) at each scrape."""

    def __init__(self, manager: Any):
        self._manager = weakref.ref(manager)

    def collect(self):
        manager = self._manager()
        if manager is None:
            return
        sessions = GaugeMetricFamily(
            "msb_sessions", "Sessions (kernels) by state, flavor and backend", labels=["state", "flavor", "backend"]
        )
        cpu = CounterMetricFamily("msb_kernel_cpu_seconds", "CPU time each kernel's sandbox used (cgroup)", labels=["kernel_id", "flavor"])
        memory = GaugeMetricFamily(
            "msb_kernel_memory_bytes", "Memory each kernel's sandbox holds now (cgroup)", labels=["kernel_id", "flavor"]
        )
        limit = GaugeMetricFamily("msb_kernel_memory_limit_bytes", "Each kernel's flavor memory", labels=["kernel_id", "flavor"])
        counted: Counter = Counter()
        for kernel_id, record in list(manager.records.items()):
            sandbox = sandbox_of(kernels_of(manager).get(kernel_id))
            counted[(manager.kernel_status(kernel_id), record.flavor.name, backend_of(sandbox))] += 1
            labels = [kernel_id, record.flavor.name]
            limit.add_metric(labels, record.flavor.memory_bytes)
            if sandbox is None:
                continue
            try:
                used, seconds = sandbox.memory_bytes(), sandbox.cpu_seconds()
            except OSError:
                continue
            if used is not None:
                memory.add_metric(labels, used)
            if seconds is not None:
                cpu.add_metric(labels, seconds)
        for (state, flavor, backend), count in sorted(counted.items()):
            sessions.add_metric([state, flavor, backend], count)
        yield from (sessions, cpu, memory, limit, sessions_per_person(manager.records.values()))

        pool = manager.pool.stats()
        waiting = GaugeMetricFamily("msb_pool_waiting", "Warm kernels waiting in the pool, per kernelspec", labels=["kernel_name"])
        for name, count in pool["waiting"].items():
            waiting.add_metric([name], count)
        yield waiting
        yield CounterMetricFamily("msb_pool_hits", "Sessions the warm pool served with a kernel it had started", value=pool["handed_out"])

        if manager.hibernate_after > 0:
            from msb_kernels.gateway.kernels.stats import backend_stats

            images = backend_stats(manager.msb_settings)[1].get("hibernation_images_bytes")
            if images is not None:
                yield GaugeMetricFamily("msb_hibernation_images_bytes", "Disk the hibernated kernels' images take", value=images)

        yield from scratch_disks(manager.msb_settings.scratch_root(), manager.msb_settings.runtime_root(), live_in_this_process())

        own = gateway_process_stats()
        yield GaugeMetricFamily("msb_gateway_resident_bytes", "The gateway process's resident memory", value=own["rss_mib"] * 2**20)
        retained = GaugeMetricFamily(
            "msb_gateway_retained", "Entries the gateway keeps in its bounded structures, by structure", labels=["structure"]
        )
        for name, size in manager.retained_sizes().items():
            retained.add_metric([name], size)
        yield retained


def scratch_disks(root: Path, runtime_root: Path, live: set[str]) -> list[GaugeMetricFamily]:
    """The scratch dir's disk images, every runtime dir's (backends/core/leftovers.py): what they hold of the host's
    disk, what is written in those the host mounts, and what no live sandbox holds (msb_scratch_swept_bytes_total
    counts what sweeps removed). live: this process's sandboxes, whose state is not read again on each scrape."""
    disks = leftovers.disks(root, leftovers.STARTS_WITHIN, live)
    used = [leftovers.used_bytes(disk, runtime_root) for disk in disks]
    return [
        GaugeMetricFamily(
            "msb_scratch_reserved_bytes",
            "Bytes of the host's disk the sandboxes' scratch disk images hold",
            value=sum(d.allocated for d in disks),
        ),
        GaugeMetricFamily(
            "msb_scratch_used_bytes",
            "Bytes written inside the scratch disks: the host's mounts (gVisor's), and this gateway's namespace sandboxes'",
            value=sum(filter(None, used)),
        ),
        GaugeMetricFamily(
            "msb_scratch_left_bytes",
            "Bytes of scratch disk images no live sandbox holds, which the next sweep or `msb-kernels doctor --clean` removes",
            value=sum(d.allocated for d in disks if d.left),
        ),
    ]


PEOPLE_LABELS = 50  # the most active people, each by name; the rest of a large team add up under "(others)"


def sessions_per_person(records: Any) -> GaugeMetricFamily:
    """Sessions by the person who started them, with a bounded label set: at most PEOPLE_LABELS names per scrape (the
    people with the most sessions), "(others)" for the rest, and "(system)" for kernels no person started. A
    thousand-person team then costs Prometheus 52 series here, not a thousand."""
    counts = Counter(r.owner.name if r.owner is not None else "(system)" for r in list(records))
    family = GaugeMetricFamily(
        "msb_sessions_per_person",
        f"Sessions per person: the {PEOPLE_LABELS} with the most by name, the rest as (others)",
        labels=["person"],
    )
    named = counts.most_common(PEOPLE_LABELS)
    for person, count in named:
        family.add_metric([person], count)
    others = sum(counts.values()) - sum(count for _, count in named)
    if others:
        family.add_metric(["(others)"], others)
    return family


def register(manager: Any) -> GatewayCollector:
    """Add the manager's collector to the default registry, which /metrics serves."""
    collector = GatewayCollector(manager)
    REGISTRY.register(collector)
    return collector


def serve_metrics(host: str, port: int) -> None:
    """MSB_METRICS_PORT: /metrics (the default registry) on a listener of its own, without the token, for a scraper
    that cannot send one; keep it on an address only the scraper reaches."""
    start_http_server(port, addr=host)
    log.info("Prometheus metrics at http://%s:%d/metrics (no token)", host, port)
