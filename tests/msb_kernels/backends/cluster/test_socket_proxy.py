"""The swarm socket proxy: the swarm backend's engine works through it, and the calls that would make its holder root
on a node (or reach other stacks' objects) are refused with a message naming the rule.

The policy is checked on its own first (no Docker); then against a private dockerd in a swarm of its own, in a
network namespace of its own, with the proxy in this process in front of it and the real Docker SDK as the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import httpx
import pytest
import uvicorn
from docker.types import EndpointSpec, Mount, Privileges, Resources, RestartPolicy, SecretReference, ServiceMode

from msb_kernels.backends.cluster.api_rules import MAX_BODY_BYTES, Policy, Refused, classify, image_reference, split_path
from msb_kernels.backends.cluster.engine import KernelService
from msb_kernels.backends.cluster.socket_proxy import build_app
from msb_kernels.backends.cluster.swarm import DockerSwarm
from msb_kernels.settings.config import load_settings
from tests.engines import DockerEngine, EngineUnavailable, busybox_archive
from tests.parallel import SWARM

pytestmark = SWARM  # a dockerd of its own, on an address pool it finds free as the swarm's engines do
NETWORK = "msb-kernels"
IMAGE = "msb-kernels/python:latest"
POLICY = Policy(NETWORK, (IMAGE, "msb-kernels/node:latest"))
KERNEL_USER = "1000:1000"


def kernel_spec(**changes: Any) -> dict[str, Any]:
    """A service spec as swarm.py's run() sends it (docker-py's JSON), with changes to the ContainerSpec."""
    container = {
        "Image": IMAGE,
        "Command": ["/bin/sh", "-c", 'exec "$@"', "kernel", "/bin/busybox", "sleep", "300"],
        "Labels": {"msb-kernels": "1"},
        "Env": ["HOME=/home/sandbox"],
        "Dir": "/home/sandbox",
        "User": KERNEL_USER,
        "Hostname": "sandbox",
        "ReadOnly": True,
        "CapabilityDrop": ["ALL"],
        "Init": True,
        "StopGracePeriod": 2_000_000_000,
        "Mounts": [{"Target": "/tmp", "Source": None, "Type": "tmpfs", "ReadOnly": False, "TmpfsOptions": {"SizeBytes": 2**20}}],
        "Secrets": [
            {"File": {"Name": "kernel.json", "UID": "1000", "GID": "1000", "Mode": 0o400}, "SecretID": "a" * 25, "SecretName": "msb-x"}
        ],
        **changes,
    }
    return {
        "Name": "msb-k1-abc123",
        "Labels": {"msb-kernels": "1"},
        "TaskTemplate": {
            "ContainerSpec": container,
            "Resources": {"Limits": {"NanoCPUs": 10**8, "MemoryBytes": 2**26, "Pids": 64}, "Reservations": {"NanoCPUs": 10**8}},
            "RestartPolicy": {"Condition": "none"},
            "Networks": [{"Target": NETWORK}],
        },
        "EndpointSpec": {"Mode": "dnsrr"},
    }


def refusal(call: Any) -> str:
    with pytest.raises(Refused) as caught:
        call()
    return caught.value.rule


# -- the policy, without Docker ------------------------------------------------------------------


def test_only_the_swarm_backends_paths_are_calls():
    assert split_path("/v1.41/services/create") == ("/v1.41", "/services/create")
    assert split_path("/services/create") == ("", "/services/create")
    for method, path in [
        ("HEAD", "/_ping"),
        ("GET", "/version"),
        ("GET", "/info"),
        ("GET", "/nodes"),
        ("GET", "/tasks"),
        ("GET", "/services"),
        ("GET", "/services/msb-k1-abc123"),
        ("GET", "/networks/msb-kernels"),
        ("GET", "/images/registry.example:5000/msb-kernels/python:latest/json"),
        ("GET", "/secrets"),
        ("GET", "/configs"),
    ]:
        assert classify(method, path) == "read", path
    assert classify("POST", "/services/create") == "create"
    assert classify("DELETE", "/configs/abc") == "delete"
    for method, path in [
        ("POST", "/containers/create"),
        ("POST", "/containers/abc/exec"),
        ("POST", "/images/create"),
        ("POST", "/swarm/leave"),
        ("POST", "/nodes/abc/update"),
        ("POST", "/services/abc/update"),
        ("GET", "/secrets/abc"),
        ("GET", "/services/abc/logs"),
        ("GET", "/containers/json"),
        ("DELETE", "/networks/msb-kernels"),
        ("DELETE", "/images/abc"),
        ("PUT", "/containers/abc/archive"),
        ("GET", "/images/../containers/abc/json"),
        ("GET", "/services//x"),
    ]:
        with pytest.raises(Refused):
            classify(method, path)


def test_kernel_images_are_the_configured_ones_however_docker_spells_them():
    assert image_reference("msb-kernels/python:latest") == ("docker.io/msb-kernels/python", "latest", None)
    assert image_reference("localhost:5000/a/b") == ("localhost:5000/a/b", None, None)
    digest = "sha256:" + "0" * 64
    for ref in ("msb-kernels/python:latest", "msb-kernels/python", "docker.io/msb-kernels/python:latest", f"{IMAGE}@{digest}"):
        assert POLICY.kernel_image(ref), ref
    for ref in ("busybox", "msb-kernels/python:other", "evil/msb-kernels/python:latest", "msb-kernels/pythonx", f"{IMAGE}@sha256:00"):
        assert not POLICY.kernel_image(ref), ref


def test_environments_images_are_the_python_images_repository_with_their_name():
    """`msb-kernels image build python --env data` tags msb-kernels/python-data:latest: the proxy admits it, any
    environment's name (any tag), and nothing else that merely starts like it."""
    policy = Policy.from_settings(load_settings())
    for ref in ("msb-kernels/python-data:latest", "docker.io/msb-kernels/python-data-science", "msb-kernels/python-probe:2"):
        assert policy.kernel_image(ref), ref
    for ref in ("msb-kernels/python-:latest", "msb-kernels/python-Data", "msb-kernels/python-a/b", "evil/msb-kernels/python-data"):
        assert not policy.kernel_image(ref), ref
    assert not POLICY.kernel_image("msb-kernels/python-data:latest")  # a policy that names no environments' repository


def test_a_kernel_shaped_service_passes_and_each_escape_names_its_rule():
    spec = kernel_spec()
    assert POLICY.check_service(spec) == (["a" * 25], [])
    assert POLICY.check_service({**spec, "Mode": {"Replicated": {"Replicas": 1}}})
    assert POLICY.check_service({**spec, "Mode": {"replicated": {"Replicas": 1}}})  # as docker-py's ServiceMode spells it
    bind = {"Target": "/host", "Source": "/", "Type": "bind"}
    cases = {
        "bind": (kernel_spec(Mounts=[bind]), "only tmpfs"),
        "volume": (kernel_spec(Mounts=[{"Target": "/v", "Source": "data", "Type": "volume"}]), "only tmpfs"),
        "privileges": (kernel_spec(Privileges={"SELinuxContext": {"Disable": True}}), "Privileges"),
        "cap add": (kernel_spec(CapabilityAdd=["SYS_ADMIN"]), "CapabilityAdd"),
        "no cap drop": (kernel_spec(CapabilityDrop=["NET_RAW"]), "CapabilityDrop"),
        "uid 0": (kernel_spec(User="0"), "root"),
        "root:root": (kernel_spec(User="root:root"), "root"),
        "gid 0": (kernel_spec(User="1000:0"), "root"),
        "no user": (kernel_spec(User=""), "User"),
        "image": (kernel_spec(Image="busybox:latest"), "kernel image"),
        "read-write": (kernel_spec(ReadOnly=False), "ReadOnly"),
        "sysctls": (kernel_spec(Sysctls={"net.ipv4.ip_forward": "1"}), "Sysctls is not a field"),
        "case trick": (kernel_spec(capabilityadd=["SYS_ADMIN"]), "capabilityadd is not a field"),
        "devices": (kernel_spec(Devices=[{"PathOnHost": "/dev/sda"}]), "Devices is not a field"),
        "isolation": (kernel_spec(Isolation="hyperv"), "Isolation"),
        "secret path": (kernel_spec(Secrets=[{"File": {"Name": "../x"}, "SecretID": "a"}]), "plain file name"),
        "name": ({**spec, "Name": "evil"}, "Name"),
        "label": ({**spec, "Labels": {}}, "Labels"),
        "ports": ({**spec, "EndpointSpec": {"Ports": [{"PublishedPort": 80, "TargetPort": 80}]}}, "Ports"),
        "network": ({**spec, "Networks": [{"Target": "host"}]}, "not the kernels' network"),
        "global": ({**spec, "Mode": {"Global": {}}}, "Mode.Global is not a field"),
        "replicas": ({**spec, "Mode": {"Replicated": {"Replicas": 5}}}, "one replica"),
        "two modes": ({**spec, "Mode": {"Replicated": {"Replicas": 1}, "replicated": {"Replicas": 9}}}, "twice"),
        "runtime": ({**spec, "TaskTemplate": {**spec["TaskTemplate"], "Runtime": "plugin"}}, "Runtime"),
        "plugin": ({**spec, "TaskTemplate": {**spec["TaskTemplate"], "PluginSpec": {}}}, "PluginSpec is not a field"),
        "no pids": ({**spec, "TaskTemplate": {**spec["TaskTemplate"], "Resources": {"Limits": {"NanoCPUs": 1, "MemoryBytes": 1}}}}, "Pids"),
    }
    for case, (bad, rule) in cases.items():
        assert rule in refusal(lambda bad=bad: POLICY.check_service(bad)), case


def test_only_the_shared_volumes_named_volumes_are_mounted_and_only_at_its_guest_path():
    """MSB_SHARED_VOLUME_NAME=msb-shared: the whole volume and a person's own (msb-shared-alice) at /shared, plain; never
    another volume (an operator's database), another place, options that make a host path of it, or a bind."""
    policy = Policy(NETWORK, (IMAGE,), volume_name="msb-shared", volume_target="/shared")
    tmp = kernel_spec()["TaskTemplate"]["ContainerSpec"]["Mounts"]
    for source in ("msb-shared", "msb-shared-alice", "msb-shared--616c696365"):
        mount = {"Target": "/shared", "Source": source, "Type": "volume", "ReadOnly": False}
        assert policy.check_service(kernel_spec(Mounts=[*tmp, mount])), source
    refused = {
        "db-data": {"Target": "/shared", "Source": "db-data", "Type": "volume"},
        "msb-sharedX": {"Target": "/shared", "Source": "msb-sharedX", "Type": "volume"},
        "msb-other": {"Target": "/shared", "Source": "msb-other", "Type": "volume"},
        "path in name": {"Target": "/shared", "Source": "msb-shared-../../etc", "Type": "volume"},
        "elsewhere": {"Target": "/etc", "Source": "msb-shared-alice", "Type": "volume"},
        "options": {
            "Target": "/shared",
            "Source": "msb-shared-alice",
            "Type": "volume",
            "VolumeOptions": {"DriverConfig": {"Name": "local", "Options": {"type": "none", "o": "bind", "device": "/"}}},
        },
        "bind": {"Target": "/shared", "Source": "msb-shared-alice", "Type": "bind"},
        "spelling": {"Target": "/shared", "Source": "msb-shared-alice", "Type": "Volume"},
    }
    for case, mount in refused.items():
        assert refusal(lambda mount=mount: policy.check_service(kernel_spec(Mounts=[*tmp, mount]))), case
    plain = {"Target": "/shared", "Source": "msb-shared", "Type": "volume"}
    assert "only tmpfs" in refusal(lambda: POLICY.check_service(kernel_spec(Mounts=[plain])))  # no MSB_SHARED_VOLUME_NAME: none


def test_networks_secrets_and_configs_must_be_the_kernels():
    good = {"Name": NETWORK, "Driver": "overlay", "Internal": True, "Attachable": True, "Labels": {"msb-kernels": "1"}, "Scope": "swarm"}
    POLICY.check_network(good)
    assert "Internal" in refusal(lambda: POLICY.check_network({**good, "Internal": False}))
    Policy(NETWORK, (IMAGE,), allow_network=True).check_network({**good, "Internal": False})
    assert "network name" in refusal(lambda: POLICY.check_network({**good, "Name": "other"}))
    assert "Driver" in refusal(lambda: POLICY.check_network({**good, "Driver": "bridge"}))
    assert "Options" in refusal(lambda: POLICY.check_network({**good, "Options": {"com.docker.network.bridge.name": "eth0"}}))
    POLICY.check_object("secret", {"Name": "msb-k1-kernel-json", "Labels": {"msb-kernels": "1"}, "Data": "e30="})
    assert "Name" in refusal(lambda: POLICY.check_object("secret", {"Name": "db-password", "Labels": {"msb-kernels": "1"}}))
    assert "Labels" in refusal(lambda: POLICY.check_object("config", {"Name": "msb-beat-1", "Labels": {}}))
    assert "Templating" in refusal(
        lambda: POLICY.check_object("config", {"Name": "msb-b", "Labels": {"msb-kernels": "1"}, "Templating": {}})
    )


async def test_the_app_answers_refusals_as_the_engine_answers_errors():
    """Refused before any engine is asked: the socket need not exist."""
    app = build_app("/nonexistent/docker.sock", load_settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        answer = await client.post("/v1.41/containers/create", json={"Image": "busybox"})
        assert answer.status_code == 403
        assert answer.json() == {"message": "msb-kernels swarm proxy: POST /v1.41/containers/create is not a call the swarm backend makes"}
        answer = await client.post("/v1.41/secrets/create", content=b"x" * (MAX_BODY_BYTES + 1))
        assert answer.status_code == 413
        answer = await client.post("/v1.41/services/create", content=b'{"Name": "msb-a", "Name": "msb-b"}')
        assert answer.status_code == 403 and "repeats the key" in answer.json()["message"]


# -- a real engine through the proxy --------------------------------------------------------------


@dataclass
class Live:
    real: docker.DockerClient  # the engine's own socket: to look behind the proxy
    proxied: docker.DockerClient
    url: str  # tcp://127.0.0.1:PORT
    http: str  # http://127.0.0.1:PORT


@contextlib.contextmanager
def _proxy_thread(socket_path: str) -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(socket_path, load_settings()), log_level="warning", access_log=False, server_header=False, date_header=False
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the proxy did not start"
            time.sleep(0.02)
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    if os.geteuid() != 0:
        pytest.skip("the swarm proxy's live tests start a private dockerd: they need root")
    missing = [tool for tool in ("dockerd", "ip", "nsenter", "unshare") if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    if missing or not Path("/bin/busybox").is_file():
        pytest.skip(
            f"the swarm proxy's live tests need dockerd, ip, nsenter, unshare and a static busybox (missing: {', '.join(missing) or 'busybox'}; "
            "bash scripts/apt-install docker.io busybox-static)"
        )
    tag = secrets.token_hex(3)
    netns = f"msbsp-{tag}"
    base = Path(f"/tmp/msbsp-{tag}")
    subprocess.run(["ip", "netns", "add", netns], check=True)
    engine = DockerEngine(base, f"msbsp-{tag}", netns=netns)
    try:
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        try:
            engine.start()
        except EngineUnavailable as exc:
            pytest.skip(f"no private Docker engine here: {str(exc)[:300]}")
        real = engine.client()
        real.swarm.init(advertise_addr="127.0.0.1")
        engine.load(busybox_archive(base / "kernel.tar", tag="msb-kernels/python:latest"))
        with _proxy_thread(str(engine.socket)) as address:
            proxied = docker.DockerClient(base_url=f"tcp://{address}", version="1.41", timeout=30)
            try:
                yield Live(real, proxied, f"tcp://{address}", f"http://{address}")
            finally:
                proxied.close()
    finally:
        try:
            engine.stop()
        finally:
            subprocess.run(["ip", "netns", "delete", netns], check=False)
            shutil.rmtree(base, ignore_errors=True)


def _service(name: str) -> KernelService:
    return KernelService(
        name=name,
        kernel_id=name.removeprefix("msb-"),
        image=IMAGE,
        argv=["/bin/busybox", "sleep", "300"],
        env={"PATH": "/bin"},
        cpus=0.1,
        memory_bytes=64 * 2**20,
        scratch_bytes=8 * 2**20,
        max_processes=64,
        files={"kernel.json": b'{"key": "secret"}'},
        files_dir="/run/msb-kernel",
        labels={"msb-kernels": "1", "msb-kernels.kernel-id": name},
        user=KERNEL_USER,
        home="/home/sandbox",
        workdir="/home/sandbox",
    )


def _names(client: docker.DockerClient) -> set[str]:
    return {service.name for service in client.services.list()}


@pytest.mark.slow
def test_the_swarm_engine_works_through_the_proxy(live: Live, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("DOCKER_HOST", live.url)
    caplog.set_level("INFO", logger="msb_kernels")
    engine = DockerSwarm(network=NETWORK)
    ok, why, _warnings = engine.availability()
    assert ok, why
    assert any(line.startswith("swarm node ") for line in engine.doctor_lines())
    assert engine.image_labels(IMAGE) is not None
    name = f"msb-proxy-{secrets.token_hex(3)}"
    engine.run(_service(name))
    network = live.real.networks.get(NETWORK).attrs
    assert (network["Driver"], network["Internal"], network["Attachable"]) == ("overlay", True, True)
    deadline = time.monotonic() + 30
    while (state := engine.state(name, max_age=0)).phase != "running" or not state.address:
        assert state.phase == "pending" and time.monotonic() < deadline, state
        time.sleep(0.2)
    assert name in {record.name for record in engine.services()}

    engine.beat("owner-a")
    engine.beat("owner-a")  # removes the first beat's config, through the proxy
    assert len(live.real.configs.list(filters={"label": "msb-kernels.beat-owner=owner-a"})) == 1
    assert "owner-a" in engine.last_beats()
    engine.forget("owner-a")
    assert "owner-a" not in engine.last_beats()
    engine.tidy()

    engine.remove(name)
    assert name not in _names(live.real)
    assert not live.real.secrets.list(filters={"label": f"msb-kernels.service={name}"})
    engine.remove(name)  # gone: the engine's 404 comes through, and remove() takes it as done
    logged = caplog.text
    assert "swarm proxy: POST /services/create" in logged and "swarm proxy: DELETE services/" in logged


def _kernel_kwargs(name: str, **changes: Any) -> dict[str, Any]:
    """docker-py's services.create arguments as run() gives them."""
    resources = Resources(cpu_limit=10**8, mem_limit=2**26)
    resources["Limits"]["Pids"] = 64
    return {
        "image": IMAGE,
        "command": ["/bin/busybox", "sleep", "300"],
        "name": name,
        "labels": {"msb-kernels": "1"},
        "resources": resources,
        "restart_policy": RestartPolicy(condition="none"),
        "networks": [NETWORK],
        "endpoint_spec": EndpointSpec(mode="dnsrr"),
        "mounts": [Mount("/tmp", None, type="tmpfs", tmpfs_size=2**20)],
        "user": KERNEL_USER,
        "read_only": True,
        "cap_drop": ["ALL"],
        **changes,
    }


def _refused(call: Any, rule: str) -> None:
    with pytest.raises(docker.errors.APIError) as caught:
        call()
    assert caught.value.status_code == 403, caught.value
    assert "msb-kernels swarm proxy" in str(caught.value.explanation) and rule in str(caught.value.explanation), caught.value.explanation


@pytest.mark.slow
def test_escapes_through_the_proxy_are_refused_and_create_nothing(live: Live):
    client = live.proxied
    assert client.ping()
    # The kernels' network: made by the previous test, or now, so that naming another network is the one fault.
    if not live.real.networks.list(names=[NETWORK]):
        live.real.networks.create(NETWORK, driver="overlay", internal=True, attachable=True, labels={"msb-kernels": "1"})
    good = f"msb-good-{secrets.token_hex(3)}"
    client.services.create(**_kernel_kwargs(good))  # the baseline passes: each case below fails for its one change
    client.api.remove_service(good)

    foreign_secret = live.real.secrets.create(name=f"db-password-{secrets.token_hex(3)}", data=b"hunter2")
    escapes = {
        "bind": ({"mounts": ["/:/host:rw"]}, "only tmpfs mounts"),
        "privileges": ({"privileges": Privileges(selinux_disable=True)}, "Privileges"),
        "cap add": ({"cap_add": ["SYS_ADMIN"]}, "CapabilityAdd"),
        "uid 0": ({"user": "0"}, "is root"),
        "root": ({"user": "root"}, "is root"),
        "image": ({"image": "busybox:latest"}, "not a kernel image"),
        "ports": ({"endpoint_spec": EndpointSpec(ports={8080: 80})}, "Ports"),
        "network": ({"networks": ["ingress"]}, "not the kernels' network"),
        "read-write": ({"read_only": False}, "ReadOnly"),
        "global": ({"mode": ServiceMode("global")}, "Mode.global is not a field"),
        "replicas": ({"mode": ServiceMode("replicated", replicas=3)}, "one replica"),
        "sysctls": ({"sysctls": {"net.ipv4.ip_forward": "1"}}, "Sysctls"),
        "foreign secret": ({"secrets": [SecretReference(foreign_secret.id, foreign_secret.name)]}, "not an msb-kernels secret"),
    }
    names = []
    for index, (changes, rule) in enumerate(escapes.values()):
        name = f"msb-escape-{index}"
        names.append(name)
        _refused(lambda changes=changes, name=name: client.services.create(**_kernel_kwargs(name, **changes)), rule)
    # Go's JSON decoder would read "capabilityadd" as CapabilityAdd.
    spec = kernel_spec(capabilityadd=["SYS_ADMIN"], Secrets=None)
    answer = httpx.post(f"{live.http}/v1.41/services/create", content=json.dumps(spec))
    assert answer.status_code == 403 and "capabilityadd is not a field" in answer.json()["message"]
    assert not _names(live.real) & {*names, spec["Name"], good}

    _refused(lambda: client.networks.create(NETWORK, driver="overlay", internal=False, attachable=True), "Internal")
    _refused(lambda: client.networks.create("msb-open", driver="bridge"), "network name")
    assert all(network.attrs["Internal"] for network in live.real.networks.list(names=[NETWORK]))
    assert not live.real.networks.list(names=["msb-open"])
    _refused(lambda: client.secrets.create(name="msb-x", data=b"x"), "Labels")
    _refused(lambda: client.containers.run(IMAGE, "true", privileged=True, volumes={"/": {"bind": "/host"}}), "is not a call")
    _refused(lambda: client.api.exec_create("0123456789ab", "sh"), "is not a call")
    _refused(lambda: client.images.pull("busybox", tag="latest"), "is not a call")
    _refused(lambda: client.swarm.leave(force=True), "is not a call")
    node = client.nodes.list()[0]
    _refused(lambda: node.update({"Availability": "drain", "Role": "manager"}), "is not a call")
    _refused(lambda: client.api.inspect_secret(foreign_secret.id), "is not a call")
    _refused(lambda: client.api.remove_secret(foreign_secret.id), "label msb-kernels=1")
    assert live.real.info()["Swarm"]["LocalNodeState"] == "active"
    assert live.real.nodes.get(node.id).attrs["Spec"]["Availability"] == "active"
    assert live.real.secrets.get(foreign_secret.id)

    foreign = live.real.services.create(IMAGE, ["/bin/busybox", "sleep", "1"], name="web", mode=ServiceMode("replicated", replicas=0))
    _refused(lambda: client.api.remove_service(foreign.id), "label msb-kernels=1")
    _refused(lambda: client.api.remove_service("web"), "label msb-kernels=1")
    _refused(lambda: client.api.inspect_service("web"), "not an msb-kernels service")
    assert "web" not in _names(client)  # other stacks' services are not listed either
    assert "web" in _names(live.real)
    foreign.remove()
    foreign_secret.remove()
