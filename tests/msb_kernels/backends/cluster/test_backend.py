"""The cluster backend's own rules, without an engine: whose kernel is held, adoptable or an orphan, and Docker's times.
The same rules run live against a swarm in on_the_swarm.py (the sweep) and test_swarm.py (adoption)."""

from __future__ import annotations

import socket
import time

import pytest

from msb_kernels.backends.cluster import backend as cluster
from msb_kernels.backends.cluster.engine import ServiceRecord, TaskState
from msb_kernels.backends.cluster.swarm import _timestamp
from msb_kernels.provisioning import registry
from msb_kernels.settings.config import MsbSettings


def test_docker_times_with_and_without_a_fraction():
    assert _timestamp("2024-01-01T00:00:00Z") == pytest.approx(1704067200.0)
    assert _timestamp("2024-01-01T00:00:00.250000000Z") == pytest.approx(1704067200.25)
    assert _timestamp(None) == _timestamp("not a time") == 0.0


def record(kernel: str, owner: str, grace: float, phase: str = "running", age: float = 100.0) -> ServiceRecord:
    labels = {cluster.LABEL_KERNEL: kernel, cluster.LABEL_OWNER: owner, cluster.LABEL_GRACE: f"{grace:g}"}
    return ServiceRecord(f"msb-{kernel}", labels, time.time() - age, TaskState(phase, address="198.19.0.9"))


@pytest.fixture
def backend(tmp_path) -> cluster.SwarmBackend:
    return cluster.SwarmBackend(MsbSettings(runtime_dir=str(tmp_path), swarm_owner="msb_gateway"))


def test_whose_kernel_is_held_adoptable_or_an_orphan(backend, monkeypatch):
    now = time.time()
    monkeypatch.setitem(registry.default().live_sandboxes, "held", object())
    records = [
        record("held", "msb_gateway", 600),  # this process runs it
        record("mine", "msb_gateway", 600),  # this gateway's owner, not run here: the last task of this gateway's
        record("beating", "other-gateway", 600),  # another gateway, alive
        record("in-grace", "gone-gateway", 600),  # another gateway, silent for 100 s of its 600
        record("past-grace", "long-gone", 60),  # silent for 200 s, grace 60
        record("a-process", "host:1:1", 0),  # a process's kernel, its owner silent
        record("pending", "msb_gateway", 600, phase="pending"),  # never ran: nothing to adopt
        record("starting", "msb_gateway", 600, phase="pending"),  # this process is starting it: never an orphan
    ]
    backend._starting.add("starting")
    beats = {"msb_gateway": now, "other-gateway": now - 5, "gone-gateway": now - 100, "long-gone": now - 200, "host:1:1": now - 100}
    found = {r.sandbox_id: r for r in backend._classify(records, beats)}
    assert found["held"].owner_alive and not found["held"].adoptable
    assert found["starting"].owner_alive
    assert found["mine"].adoptable and not found["mine"].owner_alive
    assert found["beating"].owner_alive and not found["beating"].adoptable
    assert found["in-grace"].adoptable and not found["in-grace"].owner_alive
    orphans = [k for k, r in found.items() if not r.owner_alive and not r.adoptable]
    assert sorted(orphans) == ["a-process", "past-grace", "pending"]


def test_a_gateways_owner_is_the_same_across_its_restarts(backend, tmp_path):
    from msb_kernels.backends.core.base import SandboxSpec
    from msb_kernels.kernelspecs.flavors import FLAVORS

    spec = SandboxSpec("k", FLAVORS["small"], "python", [], {}, tmp_path, owner_pid=1, adopt_grace=600)
    assert backend.owner_for(spec) == "msb_gateway"
    unowned = cluster.SwarmBackend(MsbSettings(runtime_dir=str(tmp_path)))
    assert (
        unowned.owner_for(spec) == unowned.gateway_owner() == cluster.SwarmBackend(MsbSettings(runtime_dir=str(tmp_path))).gateway_owner()
    )
    spec.adopt_grace = 0  # anyone but a gateway: the process itself
    assert backend.owner_for(spec).startswith(f"{socket.gethostname()}:1:")
