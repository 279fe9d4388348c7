"""Swarm kernels from a process on the kernels' network: each one's service, where its keys go, its limits, and the
escapes that apply inside a container. Not collected by name: test_swarm.py runs this file (with the contract suite)
inside the network namespace of a container on the swarm's overlay, where a gateway runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from msb_kernels.errors import ResourceLimitExceeded
from tests.kernel_helpers import HostListener, connect_outcomes, execute, write_attempts

pytestmark = [pytest.mark.asyncio, pytest.mark.skipif(not os.environ.get("MSBT_ON_SWARM"), reason="runs on the swarm's network only")]

FORK_BOMB = """
import os, time
refused = 0
children = []
end = time.time() + {seconds}
while time.time() < end:
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        time.sleep(0.01)
        continue
    if pid == 0:
        time.sleep({seconds} + 2)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
refused
"""

SPINNERS = """
import multiprocessing, os, time
def spin(seconds):
    end = time.time() + seconds
    while time.time() < end: pass
start = time.time(); before = os.times()
workers = [multiprocessing.Process(target=spin, args=(3,)) for _ in range(2)]
[w.start() for w in workers]; [w.join() for w in workers]
after = os.times()
print((after.children_user + after.children_system - before.children_user - before.children_system) / (time.time() - start))
"""


@pytest.fixture(autouse=True)
def on_swarm(monkeypatch):
    monkeypatch.setenv("MSB_BACKEND", "swarm")


def service_of(km) -> dict:
    import docker

    return docker.from_env().api.inspect_service(km.provisioner.sandbox.service)


async def test_a_kernel_is_one_locked_down_service_sized_by_its_flavor(start_kernel):
    km, kc = await start_kernel()
    spec = service_of(km)["Spec"]
    task = spec["TaskTemplate"]
    container, resources = task["ContainerSpec"], task["Resources"]
    assert resources["Limits"]["NanoCPUs"] == resources["Reservations"]["NanoCPUs"] == 10**9
    assert resources["Limits"]["MemoryBytes"] == resources["Reservations"]["MemoryBytes"] == 1024 * 2**20
    assert resources["Limits"]["Pids"] == 256
    assert container["User"] == "1000:1000" and container["ReadOnly"] is True and container["CapabilityDrop"] == ["ALL"]
    assert task["RestartPolicy"]["Condition"] == "none" and spec["Mode"]["Replicated"]["Replicas"] == 1
    assert [n["Target"] for n in task["Networks"]] and spec["EndpointSpec"]["Mode"] == "dnsrr"
    assert not spec["EndpointSpec"].get("Ports"), "a kernel publishes nothing"
    seen = (
        await execute(kc, "import os; (os.getuid(), open('/proc/self/status').read().split('CapBnd:')[1].split()[0], os.cpu_count())")
    ).value
    assert seen[0] == 1000 and int(seen[1], 16) == 0, seen  # no capability, not even for a setuid program


async def test_the_kernels_keys_are_in_no_label_environment_or_log(start_kernel):
    import docker

    km, kc = await start_kernel()
    await execute(kc, "print('something for the log')")
    secrets = [km.session.key.decode(), km.curve_secretkey.decode(), km.curve_publickey.decode()]
    client = docker.from_env()
    service = client.api.inspect_service(km.provisioner.sandbox.service)
    tasks = client.api.tasks(filters={"service": service["ID"]})
    logs = b"".join(client.api.service_logs(service["ID"], stdout=True, stderr=True, follow=False))
    readable = json.dumps(service) + json.dumps(tasks) + logs.decode(errors="replace")
    for secret in secrets:
        assert secret not in readable, "a key shows in the service, its tasks or its logs"
    names = [reference["SecretName"] for reference in service["Spec"]["TaskTemplate"]["ContainerSpec"]["Secrets"]]
    assert all(
        reference["File"]["Mode"] == 0o400 and reference["File"]["UID"] == "1000"
        for reference in service["Spec"]["TaskTemplate"]["ContainerSpec"]["Secrets"]
    )
    assert names and all(name.startswith(km.provisioner.sandbox.service) for name in names), names


async def test_memory_past_the_flavor_kills_only_the_kernel_and_says_why(start_kernel):
    km, kc = await start_kernel()
    assert (await execute(kc, "y = bytearray(256 << 20); len(y) >> 20")).result == "256"
    kc.execute("x = bytearray(1536 << 20)")
    began = time.monotonic()
    while await km.provisioner.poll() is None and time.monotonic() - began < 60:
        await __import__("asyncio").sleep(0.5)
    assert km.provisioner.sandbox.exit_reason() == "out of memory for flavor small (1024 MiB); try medium"


async def test_a_fork_bomb_is_held_by_the_pids_limit_and_the_kernel_lives(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_MAX_PROCESSES", "64")
    km, kc = await start_kernel()
    refused = int((await execute(kc, FORK_BOMB.format(seconds=3), timeout=120)).result)
    assert refused > 0, "no fork was refused"
    assert await km.is_alive() and (await execute(kc, "'alive'")).result == "'alive'"


async def test_cpu_time_is_held_to_the_flavor(start_kernel):
    _, kc = await start_kernel()
    used = float((await execute(kc, SPINNERS, timeout=60)).stdout)
    assert used < 1.3, f"two spinning processes got {used:.2f} CPUs in a 1-CPU flavor"


async def test_only_home_tmp_and_shm_are_writable(start_kernel):
    _, kc = await start_kernel()
    code = write_attempts(["/msb-escape", "/usr/msb-escape", "/etc/msb-escape", "/run/msb-escape"], ["/tmp/ok", "~/ok", "/dev/shm/ok"])
    blocked, allowed = (await execute(kc, code)).value
    assert all(outcome in ("OSError", "PermissionError", "FileNotFoundError") for outcome in blocked.values()), blocked
    assert set(allowed.values()) == {"written"}, allowed


async def test_the_kernel_reaches_no_node_no_host_and_no_other_kernels_channels(start_kernel):
    """Nothing outside the internal overlay: not the nodes (Docker's API, swarm's ports), not this machine, not the
    internet. Another kernel is on the same overlay, so its ports take a TCP connection; without its keys CurveZMQ
    answers nothing, which the kernel tries from inside."""
    worker = os.environ.get("MSBT_SWARM_WORKER", "198.18.0.3")
    other_km, _ = await start_kernel()
    _, kc = await start_kernel()
    with HostListener() as listener:
        targets = [(worker, 2377), (worker, 2375), (worker, 7946), ("127.0.0.1", listener.port), ("192.0.2.1", 443)]
        outcomes = await connect_outcomes(kc, targets)
        assert all(outcome != "connected" for outcome in outcomes), dict(zip(targets, outcomes, strict=True))
        assert listener.accepted == []
    address, port = other_km.ip, other_km.shell_port
    code = f"""
import zmq, json, uuid
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.connect("tcp://{address}:{port}")
socket.send_multipart([b"<IDS|MSG>", b"", json.dumps({{"msg_id": uuid.uuid4().hex, "msg_type": "kernel_info_request"}}).encode(), b"{{}}", b"{{}}", b"{{}}"])
socket.poll(3000) == 0
"""
    assert (await execute(kc, code, timeout=30)).result == "True", "another kernel answered without its keys"


async def test_a_flavor_no_node_can_hold_is_refused_at_once_with_the_schedulers_reason(start_kernel):
    began = time.monotonic()
    with pytest.raises(ResourceLimitExceeded) as refused:
        await start_kernel("msb-python-large")
    assert time.monotonic() - began < 10
    assert "no suitable node (insufficient resources on 2 nodes)" in refused.value.message


async def test_the_sweep_removes_kernels_whose_owner_is_gone_and_keeps_the_rest(start_kernel, monkeypatch):
    """Three kernels: this process's own (it beats), one of an owner that never beat and has no grace (gone for good),
    and one of a gone gateway still within its grace (adoptable). Only the second goes, with its secrets."""
    import docker

    from msb_kernels.backends import get_backend
    from msb_kernels.backends.cluster import backend as cluster
    from msb_kernels.settings.config import load_settings

    km, kc = await start_kernel()
    backend = get_backend(load_settings())
    gone, kept = f"gone-{os.getpid()}", f"restarting-{os.getpid()}"
    services = []
    for owner, grace in ((gone, "0"), (kept, "600")):
        spec = dataclasses.replace(km.provisioner.sandbox.spec, sandbox_id=f"00000000-0000-4000-8000-{os.urandom(6).hex()}")
        service = backend._service_for(spec, owner)
        service.labels.update({cluster.LABEL_OWNER: owner, cluster.LABEL_GRACE: grace})
        backend.engine.run(service)
        services.append(service)
    began = time.monotonic()
    while any(backend.engine.state(s.name, max_age=0).phase != "running" for s in services) and time.monotonic() - began < 60:
        time.sleep(0.2)
    monkeypatch.setattr(cluster, "OWNER_TIMEOUT", 0.0)  # owners that never beat are silent at once
    swept = await backend.sweep_orphans()
    assert swept == [services[0].kernel_id], swept
    names = {s.name for s in backend.engine.services()}
    assert services[0].name not in names and services[1].name in names and km.provisioner.sandbox.service in names
    assert not docker.from_env().secrets.list(filters={"label": f"msb-kernels.service={services[0].name}"})
    backend.engine.remove(services[1].name)
    assert (await execute(kc, "'still here'")).result == "'still here'"
