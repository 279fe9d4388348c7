"""The microsandbox backend, everything that needs no microVM boot, for real.

`msb doctor` runs here, images are really built and `msb load`ed (then removed),
and the orphan sweep removes real sandbox records that microsandbox keeps after a
boot attempt. What needs a booted VM is in test_contract.py, skipped with the
doctor's reason where microVMs cannot boot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import microsandbox  # a hard dependency: a broken install must fail here, not skip
import pytest

from msb_kernels.backends import choose_backend
from msb_kernels.backends.core import iodir
from msb_kernels.backends.core.base import SANDBOX_LABEL, SandboxSpec, SharedVolume
from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.gvisor import GVisorBackend
from msb_kernels.backends.microsandbox import backend as backend_module
from msb_kernels.backends.microsandbox import images
from msb_kernels.backends.microsandbox.backend import MicrosandboxBackend
from msb_kernels.backends.microsandbox.msb_cli import msb_binary, parse_doctor, run_doctor
from msb_kernels.backends.microsandbox.vm import (
    GUEST_IO_DIR,
    LABEL_HOST,
    LABEL_KERNEL,
    LABEL_OWNER_PID,
    LABEL_OWNER_START,
    create_kwargs,
    guest_argv,
    guest_env,
    sandbox_name,
)
from msb_kernels.errors import BackendUnavailable
from msb_kernels.images import IMAGE_CURVE_LABEL, TEMPLATE_LABEL, archives, builds
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.settings.config import MsbSettings

CPU_VIRT = any(flag in open("/proc/cpuinfo").read().split() for flag in ("vmx", "svm"))
MSB = msb_binary()
DOCTOR = subprocess.run([MSB, "doctor"], capture_output=True, text=True, timeout=60)
CAN_BOOT = MicrosandboxBackend.availability().ok


def spec(tmp_path: Path, flavor: str = "small", template: str = "python", shared: bool = False) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id="k-" + uuid.uuid4().hex[:8],
        flavor=FLAVORS[flavor],
        template=template,
        argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "/run/kernel/connection.json"]
        if template == "python"
        else ["/usr/bin/node", "/x/node_modules/tslab/bin/tslab", "kernel", "--config-path", "/run/kernel/connection.json", "--js"],
        env={"PATH": "/host/venv/bin:/usr/bin", "HOME": "/home/sandbox", "MSB_FLAVOR": flavor},
        io_dir=tmp_path / "io",
        shared_volume=SharedVolume(tmp_path, "/shared") if shared else None,
        owner_pid=os.getpid(),
    )


# -- doctor detection on this host ----------------------------------------------------------


def test_doctor_detection_agrees_with_msb_doctor_and_the_cpu():
    ok, reason, hints = run_doctor()
    assert ok == (DOCTOR.returncode == 0)
    if not CPU_VIRT:  # these dev/CI machines: /dev/kvm, but no vmx/svm
        assert not ok
        assert reason == "CPU virtualization is not available"
        assert any("vmx" in hint for hint in hints)


def test_parse_doctor_takes_the_error_and_its_hints_not_the_warnings():
    ok, reason, hints = parse_doctor(DOCTOR.returncode, DOCTOR.stdout + DOCTOR.stderr)
    assert ok == (DOCTOR.returncode == 0)
    text = (
        "  ✗ CPU virt            not found\nwarn: MSB_HOME does not support reflink clones\n  → use a reflink fs\n"
        "error: CPU virtualization is not available\n  → no vmx (Intel) or svm (AMD) flag in /proc/cpuinfo\n"
    )
    assert parse_doctor(1, text) == (False, "CPU virtualization is not available", ["no vmx (Intel) or svm (AMD) flag in /proc/cpuinfo"])
    assert parse_doctor(1, "  ✗ KVM access          permission denied\n")[1] == "KVM access: permission denied"
    assert parse_doctor(0, "")[0] is True


# Where no microVM boots, auto takes the next backend that runs here: gVisor where runsc is installed, else namespaces.
NEXT_AFTER_MICROVM = "gvisor" if GVisorBackend.availability().ok else "namespace"


@pytest.mark.skipif(CAN_BOOT, reason="microVMs boot on this host")
def test_backend_choice_where_microvms_cannot_boot(monkeypatch):
    availability = MicrosandboxBackend.availability()
    assert not availability.ok and availability.reason.startswith("msb doctor: ")
    name, why = choose_backend("auto")
    assert name == NEXT_AFTER_MICROVM
    assert "microsandbox: msb doctor:" in why  # auto says why it did not pick the microVM
    monkeypatch.setattr(MicrosandboxBackend, "_availability", None)  # time a real probe, not the cached answer
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        choose_backend("microsandbox")
    assert time.monotonic() - started < 5, "MSB_BACKEND=microsandbox must fail at once"
    assert availability.reason in caught.value.message


@pytest.mark.skipif(CAN_BOOT, reason="microVMs boot on this host")
async def test_msb_backend_microsandbox_refuses_to_start_a_kernel(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_BACKEND", "microsandbox")
    with pytest.raises(BackendUnavailable) as caught:
        await start_kernel()
    assert "msb doctor" in caught.value.message and "MSB_BACKEND=microsandbox" in caught.value.message


def test_cli_doctor_prints_the_report():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "msb-kernels"), "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MSB_BACKEND": "auto"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backend microsandbox: " in out and "msb doctor: " in out
    assert "microVM ports: 8000-9000" in out and "outbound network: denied" in out
    if not CAN_BOOT:
        assert "backend microsandbox: unavailable - msb doctor:" in out
        assert f"-> picked {NEXT_AFTER_MICROVM}" in out


# -- flavor and config -> create arguments ----------------------------------------------------


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_flavor_becomes_cpus_and_memory(tmp_path, flavor):
    kwargs = create_kwargs(spec(tmp_path, flavor), MsbSettings(), [8000, 8001, 8002, 8003, 8004])
    assert (kwargs["cpus"], kwargs["memory"]) == (FLAVORS[flavor].cpus, FLAVORS[flavor].memory_mib)


def test_create_arguments_from_spec_and_settings(tmp_path, monkeypatch):
    from microsandbox import Action, MountKind, PortBinding, PullPolicy

    monkeypatch.setenv("MSB_SESSION_TIMEOUT_SECONDS", "600")
    the_spec = spec(tmp_path, "medium", shared=True)
    ports = [8010, 8011, 8012, 8013, 8014]
    kwargs = create_kwargs(the_spec, MsbSettings(), ports, hostname="host-a")
    assert kwargs["image"] == "msb-kernels/python:latest" and kwargs["pull_policy"] == PullPolicy.NEVER
    assert kwargs["ports"] == [PortBinding.tcp(p, p, bind="127.0.0.1") for p in ports]
    io_mount, shared_mount = kwargs["volumes"][GUEST_IO_DIR], kwargs["volumes"]["/shared"]
    # What the host wrote, the one directory a VM is shown (its channels are TCP ports; ipykernel rewrites its file).
    assert io_mount.kind == MountKind.BIND and io_mount.bind == str(iodir.host_dir(the_spec.io_dir))
    assert (io_mount.override_uid, io_mount.override_gid) == (1000, 1000)
    assert shared_mount.bind == str(tmp_path) and not shared_mount.readonly
    policy = kwargs["network"].policy
    assert policy.default_egress == Action.DENY and policy.default_ingress == Action.ALLOW and policy.rules == ()
    labels = kwargs["labels"]
    assert labels[SANDBOX_LABEL] == "1" and labels[LABEL_KERNEL] == the_spec.sandbox_id and labels[LABEL_HOST] == "host-a"
    assert labels[LABEL_OWNER_PID] == str(os.getpid()) and labels[LABEL_OWNER_START] == str(process_start_time(os.getpid()))
    # The VM's idle clock is off, so Jupyter's culler (MSB_SESSION_TIMEOUT_SECONDS) alone ends idle sessions.
    assert kwargs["idle_timeout"] is None and kwargs["max_duration"] is None
    assert kwargs["detached"] is True and kwargs["replace"] is True
    kwargs["network"]._to_dict()  # the SDK accepts what we built
    for mount in kwargs["volumes"].values():
        mount._to_dict()


def test_network_opt_in_allows_the_public_internet_only(tmp_path):
    from microsandbox import Action, DestGroup, Direction

    allowed_spec = spec(tmp_path)
    allowed_spec.allow_network = True  # what the provisioner sets from MSB_ALLOW_NETWORK
    policy = create_kwargs(allowed_spec, MsbSettings(), [])["network"].policy
    assert policy.default_egress == Action.DENY and policy.default_ingress == Action.ALLOW
    allowed = {
        (rule.destination.value, rule.protocol, rule.port)
        for rule in policy.rules
        if rule.action == Action.ALLOW and rule.direction == Direction.EGRESS
    }
    assert (DestGroup.PUBLIC.value, None, None) in allowed
    assert not {DestGroup.HOST.value, DestGroup.PRIVATE.value} & {d for d, _, p in allowed if p is None}


def test_template_picks_image_and_guest_command(tmp_path, monkeypatch):
    monkeypatch.setenv("MSB_NODE_IMAGE", "ghcr.io/me/node-kernel:1")
    node = spec(tmp_path, template="node")
    kwargs = create_kwargs(node, MsbSettings(), [])
    assert kwargs["image"] == "ghcr.io/me/node-kernel:1" and kwargs["pull_policy"] == microsandbox.PullPolicy.IF_MISSING
    assert guest_argv(node) == ["tslab", "kernel", "--config-path", "/run/kernel/connection.json", "--js"]
    python = spec(tmp_path)
    assert guest_argv(python) == ["python3", "-m", "ipykernel_launcher", "-f", "/run/kernel/connection.json"]
    env = guest_env(python)
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin" and "/host/venv" not in env["PATH"] and env["MSB_FLAVOR"] == "small"


def test_an_environments_kernel_runs_its_own_image_or_is_refused_naming_the_command(tmp_path, monkeypatch):
    """microVMs cannot boot here: what a start would ask for. An environment's kernel runs the image its record names,
    with its interpreter at its host path (the image holds it there); one without an image is refused."""
    from msb_kernels.environments.environment import Environment
    from msb_kernels.environments.store import EnvironmentStore
    from msb_kernels.errors import InvalidRequest

    monkeypatch.setenv("MSB_ENVIRONMENTS_DIR", str(tmp_path / "environments"))
    store = EnvironmentStore(tmp_path / "environments")
    store.put(Environment("data", "/opt/data/bin/python", "added", "", "3.11.7", image="msb-kernels/python-data:latest"))
    store.put(Environment("bare", "/opt/bare/bin/python", "added", "", "3.11.7"))
    data = dataclasses.replace(spec(tmp_path), environment="data", argv=["/opt/data/bin/python", "-m", "ipykernel_launcher"])
    kwargs = create_kwargs(data, MsbSettings(), [])
    assert kwargs["image"] == "msb-kernels/python-data:latest" and kwargs["pull_policy"] == microsandbox.PullPolicy.NEVER
    assert guest_argv(data) == ["/opt/data/bin/python", "-m", "ipykernel_launcher"]
    with pytest.raises(InvalidRequest) as refused:
        create_kwargs(dataclasses.replace(data, environment="bare"), MsbSettings(), [])
    assert "environment bare has no kernel image" in refused.value.message
    assert "`msb-kernels image build python --env bare`" in refused.value.message


def test_ports_come_from_the_range_and_show_in_stats(monkeypatch):
    from tests.msb_kernels.backends.core.test_ports import free_block

    first = free_block(10)
    monkeypatch.setenv("MSB_PORT_RANGE", f"{first}-{first + 9}")
    backend = MicrosandboxBackend(MsbSettings())
    ports = backend.reserve_ports("a")
    assert len(ports) == 5 and all(first <= p <= first + 9 for p in ports)
    assert backend.reserve_ports("a") == ports  # a restart keeps them
    assert backend.stats()["ports"]["allocated"] == 5 and backend.stats()["ports"]["available"] == 5
    backend.release_ports("a")
    backend.release_ports("a")
    assert backend.stats()["ports"]["allocated"] == 0


# -- images: build, msb load, msb image ls, remove ------------------------------------------------


def copy_host_binaries(*binaries: str):
    """A minimal real rootfs: host binaries and the shared libraries they load."""

    def prepare(rootfs: Path) -> None:
        for binary in binaries:
            real = Path(binary).resolve()
            linked = subprocess.run(["ldd", str(real)], capture_output=True, text=True).stdout
            libraries = [Path(part) for line in linked.splitlines() for part in line.split() if part.startswith("/")]
            for source, target in [(real, Path(binary)), *((lib, lib) for lib in libraries)]:
                destination = rootfs / str(target).lstrip("/")
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
        # The real kernelapp of the ipykernel installed here, which speaks CurveZMQ: the build must find that out.
        import ipykernel.kernelapp

        kernelapp = rootfs / "usr/lib/python3/dist-packages/ipykernel/kernelapp.py"
        kernelapp.parent.mkdir(parents=True)
        shutil.copy2(ipykernel.kernelapp.__file__, kernelapp)

    return prepare


@pytest.fixture(scope="module")
def tiny_image():
    tag = f"msb-kernels/test-{uuid.uuid4().hex[:8]}:1"
    result = builds.build_offline(
        "python", tag, prepare_rootfs=copy_host_binaries("/bin/sh", "/bin/cat"), load=images.load_archive, log=lambda line: None
    )
    yield tag, result
    if images.image_present(tag):
        images.remove_image(tag)


async def test_offline_build_loads_a_tagged_image_and_cleans_up(tiny_image):
    from microsandbox import Image

    tag, result = tiny_image
    assert result.tag == tag and result.mode == "offline" and result.curve is True and "loaded with msb load" in result.report()
    assert images.image_present(tag), images.list_images()
    detail = await Image.inspect(tag)
    assert detail.config.labels[IMAGE_CURVE_LABEL] == "true"
    assert detail.config.labels[TEMPLATE_LABEL] == "python"
    assert detail.config.working_dir == "/home/sandbox" and "PATH=/usr/local/bin:/usr/bin:/bin" in detail.config.env
    settings = MsbSettings(python_image=tag)
    assert await MicrosandboxBackend(settings).supports_curve("python") is True
    assert await MicrosandboxBackend(MsbSettings(python_image="msb-kernels/absent:1")).supports_curve("python") is False


async def test_online_build_layering_on_a_saved_base(tiny_image, tmp_path):
    """The online build's last steps: msb save the base, add a layer, msb load; then remove it."""
    base, _ = tiny_image
    base_archive, archive = tmp_path / "base.tar", tmp_path / "out.tar"
    images._msb("save", base, "-o", str(base_archive))
    layer = tmp_path / "layer"
    (layer / "usr/local/lib/python3.11/site-packages/msb_marker").mkdir(parents=True)
    (layer / "usr/local/lib/python3.11/site-packages/msb_marker/__init__.py").write_text("")
    tag = f"msb-kernels/test-online-{uuid.uuid4().hex[:8]}:1"
    archives.append_layer(base_archive, layer, "python", tag, archive, curve=False)
    images.load_archive(archive, tag)
    try:
        assert images.image_present(tag)
        from microsandbox import Image

        detail = await Image.inspect(tag)
        assert len(detail.layers) == 2 and detail.config.labels[IMAGE_CURVE_LABEL] == "false"
    finally:
        images.remove_image(tag)
    assert not images.image_present(tag)


def test_image_build_cli_reports_errors_cleanly():
    cli = str(Path(sys.executable).parent / "msb-kernels")
    result = subprocess.run([cli, "image", "build", "ruby"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice" in result.stderr
    if not CAN_BOOT:  # the online build needs a builder microVM: it says at once why it cannot run
        result = subprocess.run([cli, "image", "build", "python", "--online"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "microVMs cannot run here" in result.stderr and "Traceback" not in result.stderr
        assert "msb-kernels image build python" in result.stderr  # the offline way out


# -- orphans: real sandbox records (a boot attempt leaves one, booted or not) ------------------------


async def test_sweep_removes_orphans_and_keeps_owned_sandboxes(tiny_image, tmp_path, monkeypatch):
    from microsandbox import Network
    from microsandbox import Sandbox as VM

    tag, _ = tiny_image
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(tmp_path / "rt"))
    backend = MicrosandboxBackend(MsbSettings())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = __import__("socket").gethostname()
    owners = {"orphan": (dead.pid, 1), "owned": (os.getpid(), process_start_time(os.getpid()))}
    names = {key: sandbox_name(f"test-{key}-{uuid.uuid4().hex[:8]}") for key in owners}

    async def make(key: str) -> None:
        pid, start = owners[key]
        labels = {
            SANDBOX_LABEL: "1",
            LABEL_KERNEL: names[key].removeprefix("msbk-"),
            LABEL_HOST: here,
            LABEL_OWNER_PID: str(pid),
            LABEL_OWNER_START: str(start),
        }
        try:  # boots where it can; here the boot fails, and the record stays
            await asyncio.wait_for(
                VM.create(names[key], image=tag, memory=128, cpus=1, labels=labels, detached=True, network=Network.none(), replace=True), 90
            )
        except Exception:
            pass

    await asyncio.gather(make("orphan"), make("owned"))
    stale = backend.io_dir_for("test-stale-dir").parent  # a state dir whose VM is already gone
    (stale / "state.json").write_text(json.dumps({"sandbox_id": "test-stale-dir", "owner_pid": dead.pid, "owner_start": 1}))
    try:
        records = {r.details.get("vm"): r for r in await asyncio.to_thread(backend.list_sandboxes)}
        assert names["orphan"] in records and names["owned"] in records, list(records)
        assert not records[names["orphan"]].owner_alive and records[names["owned"]].owner_alive
        swept = await backend.sweep_orphans()
        assert names["orphan"].removeprefix("msbk-") in swept
        assert names["owned"].removeprefix("msbk-") not in swept
        assert "test-stale-dir" in swept and not stale.exists()
        remaining = {r.details.get("vm") for r in await asyncio.to_thread(backend.list_sandboxes)}
        assert names["orphan"] not in remaining and names["owned"] in remaining
    finally:
        backend._sweeper.cancel()
        for name in names.values():
            await backend.destroy_vm(name)


async def test_an_adopted_vm_belongs_to_the_owner_its_state_names_not_its_labels(tiny_image, tmp_path, monkeypatch):
    """A VM's labels name the gateway that created it, and cannot change. Once another gateway adopted it
    (test_adoption.py, skipped where microVMs cannot boot), its state file names the new owner, and the sweep
    that runs every 10 minutes leaves it alone; with the owner in the state file gone, the sweep removes it."""
    from microsandbox import Network
    from microsandbox import Sandbox as VM

    from msb_kernels.backends.core.state import write_state

    tag, _ = tiny_image
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(tmp_path / "rt"))
    backend = MicrosandboxBackend(MsbSettings())
    first_gateway = subprocess.Popen([sys.executable, "-c", "pass"])
    first_gateway.wait()
    kernel_id = f"test-adopted-{uuid.uuid4().hex[:8]}"
    name = sandbox_name(kernel_id)
    labels = {
        SANDBOX_LABEL: "1",
        LABEL_KERNEL: kernel_id,
        LABEL_HOST: __import__("socket").gethostname(),
        LABEL_OWNER_PID: str(first_gateway.pid),
        LABEL_OWNER_START: "1",
    }
    try:  # boots where it can; here the boot fails, and the record stays
        await asyncio.wait_for(
            VM.create(name, image=tag, memory=128, cpus=1, labels=labels, detached=True, network=Network.none(), replace=True), 90
        )
    except Exception:
        pass
    state_dir = backend.io_dir_for(kernel_id).parent
    adopter = {
        "sandbox_id": kernel_id,
        "backend": "microsandbox",
        "vm": name,
        "owner_pid": os.getpid(),
        "owner_start": process_start_time(os.getpid()),
    }
    write_state(state_dir, adopter)
    try:
        (record,) = [r for r in await asyncio.to_thread(backend.list_sandboxes) if r.details.get("vm") == name]
        assert record.owner_alive and record.details["owner_pid"] == os.getpid(), record
        assert kernel_id not in await backend.sweep_orphans()
        write_state(state_dir, {**adopter, "owner_pid": first_gateway.pid, "owner_start": 1})  # the adopter is gone too
        assert kernel_id in await backend.sweep_orphans()
        assert not state_dir.exists()
    finally:
        backend._sweeper.cancel()
        await backend.destroy_vm(name)


async def test_the_sweep_repeats_while_kernels_run(tmp_path, monkeypatch):
    """The first sweep starts the periodic ones: an orphan left after it is gone within an interval."""
    monkeypatch.setenv("MSB_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setattr(backend_module, "SWEEP_INTERVAL", 0.5)
    backend = MicrosandboxBackend(MsbSettings())
    await backend.sweep_orphans()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = backend.io_dir_for("test-later-orphan").parent
    (stale / "state.json").write_text(json.dumps({"sandbox_id": "test-later-orphan", "owner_pid": dead.pid, "owner_start": 1}))
    try:
        deadline = time.monotonic() + 60
        while stale.exists():
            assert time.monotonic() < deadline, "no periodic sweep removed the orphan"
            await asyncio.sleep(0.1)
    finally:
        backend._sweeper.cancel()
