"""The harness the swarm backend's tests stand on (tests/engines.py): a real two-node swarm forms, runs limited services
on both nodes that reach each other over an internal overlay, sees a killed worker as down within seconds, and leaves
nothing on the host; a second swarm in the same process does the same."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker.types import EndpointSpec, Resources, RestartPolicy

from tests.engines import TwoNodeSwarm, busybox_archive
from tests.parallel import SWARM

pytestmark = [pytest.mark.slow, SWARM]  # swarms of its own, on the free address pools the session's finds too

IMAGE = "msbt/busybox:1"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "private Docker engines need root"
    if not shutil.which("dockerd", path="/usr/local/sbin:/usr/sbin:/sbin:/usr/bin"):
        return "dockerd is not installed (bash scripts/apt-install docker.io)"
    if not Path("/bin/busybox").is_file():
        return "busybox is not installed (bash scripts/apt-install busybox-static)"
    return None


@pytest.fixture
def base() -> Iterator[Path]:
    if reason := _unavailable():
        pytest.skip(f"two-node swarm harness cannot run: {reason}")
    # Short: dockerd's and containerd's unix sockets live under it and must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="msbt-", dir="/tmp"))
    yield path
    if not os.environ.get("MSB_TESTS_KEEP_BASE"):
        shutil.rmtree(path, ignore_errors=True)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def test_two_node_swarm(base: Path) -> None:
    swarm = TwoNodeSwarm(base)
    try:
        swarm.start()
        print("start", {k: round(v, 2) for k, v in swarm.timings.items()})
        c = swarm.client()
        ids = swarm.node_ids()
        roles = {n.id: (n.attrs["Spec"]["Role"], n.attrs["Status"]["State"]) for n in c.nodes.list()}
        assert roles == {ids["manager"]: ("manager", "ready"), ids["worker"]: ("worker", "ready")}

        archive = busybox_archive(base / "busybox.tar", tag=IMAGE)
        assert swarm.manager.load(archive) == [IMAGE] and swarm.worker.load(archive) == [IMAGE]
        net = swarm.network("msbt-net")
        assert swarm.network("msbt-net") == net and c.networks.get(net).attrs["Internal"]
        services = [
            c.services.create(
                IMAGE,
                ["busybox", "sleep", "300"],
                name=f"s{i}",
                networks=[net],
                constraints=[f"node.role=={role}"],
                resources=Resources(cpu_limit=500_000_000, mem_limit=64 * 2**20),
                restart_policy=RestartPolicy(condition="none"),
                # No IPVS in this kernel, so no virtual IPs: names resolve to the tasks themselves.
                endpoint_spec=EndpointSpec(mode="dnsrr"),
            )
            for i, role in enumerate(["manager", "worker"] * 2)
        ]

        def tasks() -> list[dict]:
            return [t for s in services for t in c.api.tasks(filters={"service": s.id})]

        _wait(lambda: len(tasks()) == 4 and all(t["Status"]["State"] == "running" for t in tasks()), 60, "4 running tasks")
        placed = {role: [t for t in tasks() if t["NodeID"] == node] for role, node in ids.items()}
        assert [len(placed["manager"]), len(placed["worker"])] == [2, 2]

        engines = {"manager": swarm.manager.client(), "worker": swarm.worker.client()}
        containers = {role: engines[role].containers.get(placed[role][0]["Status"]["ContainerStatus"]["ContainerID"]) for role in engines}
        for container in containers.values():
            assert (container.attrs["HostConfig"]["NanoCpus"], container.attrs["HostConfig"]["Memory"]) == (500_000_000, 64 * 2**20)
        worker_ip = placed["worker"][0]["NetworksAttachments"][0]["Addresses"][0].split("/")[0]
        containers["worker"].exec_run(["sh", "-c", "nc -l -p 5000 > /tmp/got"], detach=True)

        def delivered() -> bool:
            containers["manager"].exec_run(["sh", "-c", f"echo over-the-overlay | nc -w 2 {worker_ip} 5000"])
            return containers["worker"].exec_run(["cat", "/tmp/got"]).output == b"over-the-overlay\n"

        _wait(delivered, 10, "message from the manager's task to the worker's over the overlay")

        swarm.kill_worker()
        down_s = swarm.wait_node_state(ids["worker"], "down", timeout=10)
        print(f"worker seen down {down_s:.2f} s after the kill")
        node = c.nodes.get(ids["worker"]).attrs["Status"]
        assert (node["State"], node.get("Message")) == ("down", "heartbeat failure")
        # What the backend reads: the dead node's tasks keep their last state, and swarm wants them shut down.
        _wait(lambda: all(t["DesiredState"] == "shutdown" for t in placed_on(tasks(), ids["worker"])), 5, "desired shutdown")
        assert {t["Status"]["State"] for t in placed_on(tasks(), ids["worker"])} == {"running"}
    finally:
        swarm.stop()
    assert swarm.leftovers() == []
    swarm.stop()  # idempotent

    again = TwoNodeSwarm(base)
    try:
        again.start()
        assert sorted(n.attrs["Status"]["State"] for n in again.client().nodes.list()) == ["ready", "ready"]
    finally:
        again.stop()
    assert again.leftovers() == []


def placed_on(tasks: list[dict], node_id: str) -> list[dict]:
    return [t for t in tasks if t["NodeID"] == node_id]
