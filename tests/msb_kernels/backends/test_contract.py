"""The contract every sandbox backend keeps: the kernel protocol and isolation, per backend.

Each test runs once per backend (MSB_BACKEND=namespace, gvisor and microsandbox), and
once more for the namespace sandbox reached over tcp (MSB_TRANSPORT=tcp).
A backend that cannot run on this host is skipped with its reason, which for the
microVM backend is `msb doctor`'s (for example "CPU virtualization is not
available"), so `pytest -ra` prints why.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import socket
import uuid
from pathlib import Path

import pytest

from msb_kernels.backends import backend_classes
from msb_kernels.backends.core import iodir
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.provisioning.provisioner import GUEST_CONNECTION_FILE
from msb_kernels.settings.config import backend_locations
from tests.conftest import REPO, TEST_BASE, KernelFactory
from tests.kernel_helpers import (
    HostListener,
    assert_unanswered_without_keys,
    connect_outcomes,
    execute,
    interrupt_busy_loop,
    open_outcomes,
)

pytestmark = pytest.mark.asyncio


def registered_variants() -> dict[str, tuple[str, str]]:
    """test id -> (MSB_BACKEND, MSB_TRANSPORT): every installed backend (the ``msb_kernels.backends`` entry points) on
    each transport it offers, its own first; so a new backend is tested by being installed.

    A cluster's kernels are reached on the cluster's network only: tests/msb_kernels/backends/cluster/test_swarm.py runs
    this suite in a process on that network, with MSBT_ON_SWARM set, for the cluster backends alone."""
    variants = {}
    on_cluster = bool(os.environ.get("MSBT_ON_SWARM"))
    for location in backend_locations():
        module, _, attribute = backend_locations()[location].partition(":")
        try:
            cls = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):
            variants[location] = (location, "auto")  # the variant fixture skips it with the import error
            continue
        if cls.runs_on_cluster != on_cluster:
            continue
        for index, transport in enumerate(cls.transports):
            variants[cls.name if index == 0 else f"{cls.name}-{transport}"] = (cls.name, transport)
    return variants


VARIANTS = registered_variants()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> tuple[str, str]:
    """MSB_BACKEND and MSB_TRANSPORT for the tests that use it, or a skip that says why the backend cannot run here."""
    name, transport = VARIANTS[request.param]
    classes = backend_classes()
    if name not in classes:
        pytest.skip(f"{name} backend is not installed")
    availability = classes[name].availability()
    if not availability.ok:
        pytest.skip(f"{name} backend cannot run on this host: {availability.reason}")
    patch = pytest.MonkeyPatch()
    patch.setenv("MSB_BACKEND", name)
    patch.setenv("MSB_TRANSPORT", transport)
    yield name, transport
    patch.undo()


@pytest.fixture(scope="module")
def backend(variant) -> str:
    return variant[0]


@pytest.fixture(scope="module")
async def contract_kernel(backend):
    factory = KernelFactory()
    yield await factory(env={"MSB_BACKEND": backend})
    await factory.close()


@pytest.fixture
async def fresh_kernel(backend, start_kernel):
    return await start_kernel(env={"MSB_BACKEND": backend})


async def test_the_kernel_runs_in_the_requested_backend(contract_kernel, variant):
    km, kc = contract_kernel
    backend, transport = variant
    assert km.provisioner.backend.name == backend
    assert km.transport == km.provisioner.backend.transport == transport
    assert (await execute(kc, "import os; os.environ['MSB_SANDBOX']")).value == backend


async def test_execute_keeps_state_and_streams_output(contract_kernel):
    _, kc = contract_kernel
    await execute(kc, "counter = 41")
    code = "import sys, time\nfor i in range(3):\n    print('line', i, flush=True)\n    time.sleep(0.4)\nprint('oops', file=sys.stderr)\ncounter + 1"
    result = await execute(kc, code)
    assert result.status == "ok"
    assert result.stdout == "line 0\nline 1\nline 2\n" and result.stderr == "oops\n"
    assert result.result == "42"


async def test_output_arrives_while_the_cell_still_runs(contract_kernel):
    """The cell prints, then waits for input the test gives only once that print has reached it.
    Output held back until the cell ends would never arrive, and the test would time out."""
    _, kc = contract_kernel
    msg_id = kc.execute("print('before the wait', flush=True)\nanswer = input()\nprint('after', answer)", allow_stdin=True)
    seen: list[str] = []
    while "before the wait\n" not in seen:
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            seen.append(message["content"]["text"])
    request = await kc.get_stdin_msg(timeout=60)
    assert request["msg_type"] == "input_request"
    kc.input("go")
    reply = await kc.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = await kc.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "ok"


async def test_display_png(contract_kernel):
    _, kc = contract_kernel
    result = await execute(kc, "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert result.status == "ok", result.error
    images = [m["content"]["data"]["image/png"] for m in result.of_type("display_data") if "image/png" in m["content"]["data"]]
    assert images and base64.b64decode(images[0]).startswith(b"\x89PNG")


async def test_a_widget_displays_and_follows_the_frontend(contract_kernel):
    """ipywidgets ships with the kernel: display opens a comm, and a frontend's update reaches the model."""
    _, kc = contract_kernel
    shown = await execute(kc, "import ipywidgets\nslider = ipywidgets.IntSlider(value=3)\ndisplay(slider)")
    opened = {m["content"]["comm_id"] for m in shown.of_type("comm_open") if m["content"]["target_name"] == "jupyter.widget"}
    views = [m["content"]["data"] for m in shown.of_type("display_data")]
    assert shown.error is None, shown.traceback
    model_id = views[0]["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert model_id in opened
    update = {"comm_id": model_id, "data": {"method": "update", "state": {"value": 7}, "buffer_paths": []}}
    kc.shell_channel.send(kc.session.msg("comm_msg", update))
    assert (await execute(kc, "slider.value")).value == 7


# The shell commands a notebook user types first, each run in the kernel's sandbox as a `!` line runs it; the egress
# half (curl to an allowed host through the proxy) is tests/msb_kernels/egress/test_proxy.py's, on namespace and gVisor.
EVERYDAY = r"""
import json, os, subprocess, sys, zipfile
def sh(*argv):
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=240)
    return {"rc": done.returncode, "out": done.stdout[-3000:], "err": done.stderr[-3000:]}
w = f"/tmp/everyday-{os.getpid()}"
os.makedirs(f"{w}/src/sub")
open(f"{w}/src/sub/a.txt", "w").write("hello\n")
with open(f"{w}/big.txt", "w") as big:
    big.writelines(f"line {i}\n" for i in range(1_000_000))
os.makedirs(f"{w}/wheels")
with zipfile.ZipFile(f"{w}/wheels/msbeveryday-1.0-py3-none-any.whl", "w") as wheel:
    wheel.writestr("msbeveryday/__init__.py", "VALUE = 1\n")
    wheel.writestr("msbeveryday-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: msbeveryday\nVersion: 1.0\n")
    wheel.writestr("msbeveryday-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    wheel.writestr("msbeveryday-1.0.dist-info/RECORD", "")
ran = {
    "!ls /": "\n".join(get_ipython().getoutput("ls /")),
    "!stat /tmp": "\n".join(get_ipython().getoutput("stat /tmp")),
    "ls /": sh("ls", "/"),
    "ls -la ~": sh("ls", "-la", os.path.expanduser("~")),
    "stat": sh("stat", "/tmp", os.path.expanduser("~")),
    "df": sh("df", "-h", "/tmp"),
    "du": sh("du", "-s", f"{w}/src"),
    "find": sh("find", f"{w}/src", "-name", "*.txt"),
    "cp": sh("cp", "-r", f"{w}/src", f"{w}/copy"),
    "mv": sh("mv", f"{w}/copy/sub/a.txt", f"{w}/copy/sub/b.txt"),
    "tar": sh("tar", "czf", f"{w}/src.tgz", "-C", w, "src"),
    "tar list": sh("tar", "tzf", f"{w}/src.tgz"),
    "gzip": sh("gzip", "-k", f"{w}/big.txt"),
    "gzip test": sh("gzip", "-t", f"{w}/big.txt.gz"),
    "git init": sh("git", "init", "-q", f"{w}/repo"),
}
open(f"{w}/repo/notes.md", "w").write("# notes\n")
ran["git add"] = sh("git", "-C", f"{w}/repo", "add", "notes.md")
ran["git commit"] = sh("git", "-C", f"{w}/repo", "-c", "user.name=A", "-c", "user.email=a@example.org", "commit", "-qm", "first")
ran["git log"] = sh("git", "-C", f"{w}/repo", "log", "--format=%s")
ran["sqlite3"] = sh("sqlite3", f"{w}/db.sqlite", "create table t(x); insert into t values (41), (1); select sum(x) from t;")
ran["venv"] = sh(sys.executable, "-m", "venv", f"{w}/venv")
ran["pip download"] = sh(f"{w}/venv/bin/python", "-m", "pip", "download", "--disable-pip-version-check", "--no-index",
                         "--find-links", f"{w}/wheels", "-d", f"{w}/dl", "msbeveryday==1.0")
ran["head"] = sh("head", "-n", "3", f"{w}/big.txt")
ran["wc -l"] = sh("wc", "-l", f"{w}/big.txt")
ran["moved"] = os.path.exists(f"{w}/copy/sub/b.txt") and not os.path.exists(f"{w}/copy/sub/a.txt")
ran["downloaded"] = os.listdir(f"{w}/dl") if os.path.isdir(f"{w}/dl") else []
subprocess.run(["rm", "-rf", w])
print("RESULT" + json.dumps(ran))
"""


async def test_everyday_shell_commands_run_and_print_what_they_should(contract_kernel):
    _, kc = contract_kernel
    execution = await execute(kc, EVERYDAY, timeout=600)
    assert "RESULT" in execution.stdout, execution.stdout[-2000:] + execution.stderr[-2000:] + str(execution.error)
    ran = json.loads(execution.stdout.split("RESULT", 1)[1])
    for line in ("!ls /", "!stat /tmp"):
        assert "Invalid argument" not in ran[line] and "cannot" not in ran[line], (line, ran[line])
    assert "tmp" in ran["!ls /"].split(), ran["!ls /"]
    failed = {name: result for name, result in ran.items() if isinstance(result, dict) and result["rc"] != 0}
    assert not failed, failed
    assert {"tmp", "usr"} <= set(ran["ls /"]["out"].split()), ran["ls /"]
    assert ran["ls -la ~"]["out"].startswith("total "), ran["ls -la ~"]
    assert ran["stat"]["out"].count("File: ") == 2, ran["stat"]
    assert ran["df"]["out"].splitlines()[0].split()[0] == "Filesystem" and len(ran["df"]["out"].splitlines()) == 2, ran["df"]
    assert ran["du"]["out"].split()[1].endswith("/src"), ran["du"]
    assert ran["find"]["out"].strip().endswith("/src/sub/a.txt"), ran["find"]
    assert ran["moved"] is True
    assert ran["tar list"]["out"].split() == ["src/", "src/sub/", "src/sub/a.txt"], ran["tar list"]
    assert ran["git log"]["out"] == "first\n", ran["git log"]
    assert ran["sqlite3"]["out"] == "42\n", ran["sqlite3"]
    assert ran["downloaded"] == ["msbeveryday-1.0-py3-none-any.whl"], ran["pip download"]
    assert ran["head"]["out"] == "line 0\nline 1\nline 2\n"
    assert ran["wc -l"]["out"].split()[0] == "1000000", ran["wc -l"]


PAST_THE_DISK = """
import errno, json, os
sizes = {p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in ("/tmp", os.path.expanduser("~"))}
def free_at_home():
    found = os.statvfs(os.path.expanduser("~"))
    return found.f_bfree * found.f_frsize
before = free_at_home()
with open("/tmp/shared", "wb") as shared:
    shared.write(b"x" * (32 << 20)); shared.flush(); os.fsync(shared.fileno())
same = before - free_at_home() >= 30 << 20  # one disk: a write to /tmp takes home's room (gVisor's gofer shows two st_dev)
os.remove("/tmp/shared")
df = __import__("subprocess").run(["df", "-h", "/tmp"], capture_output=True, text=True).stdout.splitlines()[-1]
fd = os.open("/tmp/past-the-disk", os.O_CREAT | os.O_WRONLY, 0o600)
try:
    os.posix_fallocate(fd, 0, PROMISE + (64 << 20))
    refused = None
except OSError as exc:
    refused = errno.errorcode.get(exc.errno, str(exc.errno))
finally:
    os.close(fd)
    os.remove("/tmp/past-the-disk")
open("/tmp/after", "w").write("room"); os.remove("/tmp/after")
print(json.dumps({"sizes": sizes, "same": same, "df": df, "refused": refused}))
"""


async def test_tmp_and_home_hold_the_backends_promise_and_refuse_past_it(contract_kernel):
    km, kc = contract_kernel
    promise = km.provisioner.backend.scratch_bytes(FLAVORS[km.provisioner.flavor])
    execution = await execute(kc, "marker = 'kept'\n" + PAST_THE_DISK.replace("PROMISE", str(promise)), timeout=120)
    assert execution.status == "ok", execution.error
    found = json.loads(execution.stdout)
    print(f"{km.provisioner.backend.name}: promised {promise >> 20} MiB; df: {found['df']}")
    if promise == FLAVORS[km.provisioner.flavor].disk_bytes:  # a disk is one file system for both, as the docs say;
        assert found["same"], found  # the memory fallback may be two tmpfs (Swarm's home and /tmp)
    for path, size in found["sizes"].items():
        assert 0.9 * promise < size <= promise, (path, size, promise)
    assert found["refused"] == "ENOSPC", found
    assert (await execute(kc, "marker")).result == "'kept'"


async def test_host_home_and_checkout_are_invisible(contract_kernel):
    _, kc = contract_kernel
    secret = Path.home() / f"msb-secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    try:
        paths = [str(secret), str(REPO / "README.md"), str(REPO / "pyproject.toml"), "/etc/shadow"]
        assert await open_outcomes(kc, paths) == ["FileNotFoundError"] * 4
    finally:
        secret.unlink()


async def test_network_is_blocked(contract_kernel):
    """No route anywhere: not the host's loopback (the gateway listens there), its other addresses, or beyond
    (192.0.2.1 is TEST-NET-1, never routed: with no route, nothing leaves the sandbox to try it)."""
    _, kc = contract_kernel
    with HostListener() as listener:
        host_address = socket.gethostbyname(socket.gethostname())
        targets = [("127.0.0.1", listener.port), (host_address, listener.port), ("192.0.2.1", 443)]
        outcomes = await connect_outcomes(kc, targets)
        assert all(outcome != "connected" for outcome in outcomes), outcomes
        await asyncio.sleep(0.3)
        assert listener.accepted == [], "the sandbox reached a port open on the host"


async def test_interrupt_stops_a_busy_loop_and_keeps_state(fresh_kernel):
    km, kc = fresh_kernel
    await execute(kc, "kept = 'still here'")
    reply = await interrupt_busy_loop(km, kc)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert (await execute(kc, "kept")).result == "'still here'"


async def test_restart_forgets_state_in_a_fresh_sandbox(fresh_kernel):
    km, kc = fresh_kernel
    await execute(kc, "x = 1")
    first_sandbox = km.provisioner.sandbox
    await km.restart_kernel()
    moved = kc.ip != km.ip  # a cluster's kernel restarts as a new task at a new address: a client follows, as JupyterLab does
    if moved:
        kc.stop_channels()
        kc = km.client()
        kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=120)
        assert km.provisioner.sandbox is not first_sandbox
        result = await execute(kc, "x")
        assert result.status == "error" and result.error["ename"] == "NameError"
        assert (await execute(kc, "40 + 2")).result == "42"
    finally:
        if moved:
            kc.stop_channels()


async def test_curve_encryption_over_tcp_or_when_asked(variant, start_kernel):
    """tcp turns CurveZMQ on by itself; any backend does under transport_encryption='auto'.
    A client without the keys then gets no answer: the channels really are encrypted."""
    from msb_kernels.backends import get_backend
    from msb_kernels.settings.config import load_settings

    backend, transport = variant
    if not await get_backend(load_settings()).supports_curve("python"):
        pytest.skip(
            f"the {backend} backend's python kernel does not speak CurveZMQ (an offline Debian image has "
            "ipykernel 6.17; `msb-kernels image build python --online` installs one that does)"
        )
    asked = {} if transport == "tcp" else {"transport_encryption": "auto"}
    km, kc = await start_kernel(env={"MSB_BACKEND": backend}, **asked)
    assert km.transport == transport
    assert km.curve_publickey is not None and km.curve_secretkey is not None
    guest_file = json.loads((iodir.host_dir(km.provisioner.io_dir) / GUEST_CONNECTION_FILE).read_text())  # what the host gave it
    assert guest_file["curve_publickey"] == km.curve_publickey.decode()
    assert (await execute(kc, "6 * 7")).result == "42"
    await assert_unanswered_without_keys(km)


VOLUME_PROBE = """
import json, os, subprocess
seen = {"listing": sorted(os.listdir("/shared"))}
listed = subprocess.run(["ls", "-la", "/shared"], capture_output=True, text=True)  # once "Invalid argument" on gVisor
assert listed.returncode == 0 and listed.stdout.startswith("total"), listed
if WRITE:
    os.makedirs("/shared/notes", exist_ok=True)
    with open("/shared/notes/today.txt", "a") as notes:
        notes.write("WHO was here\\n")
if os.path.exists("/shared/notes/today.txt"):
    seen["notes"] = open("/shared/notes/today.txt").read()
print(json.dumps(seen))
"""


async def test_a_persons_volume_is_theirs_in_each_of_their_kernels_and_no_one_elses(variant, start_kernel, monkeypatch):
    """A person's part of the shared volume (a StartRequest's volume, which the gateway sets from the caller): a host
    directory made with default modes on this host's backends (MSB_SHARED_VOLUME_PATH), a Docker named volume on a
    cluster's (MSB_SHARED_VOLUME_NAME). Each of alice's kernels reads and adds to what her earlier ones wrote; bob's
    sees none of it (docs/teams.md, "Your files"). On a cluster a local named volume is its node's own: a kernel finds
    what her kernels on the same node wrote. Three of hers on two nodes put two on one node, so that holds at least once."""
    from msb_kernels.identity.people import Owner
    from msb_kernels.identity.person_registry import person_key
    from msb_kernels.provisioning.start_request import StartRequest

    backend, _ = variant
    if backend_classes()[backend].runs_on_cluster:
        monkeypatch.setenv("MSB_SHARED_VOLUME_NAME", f"msb-t{uuid.uuid4().hex[:8]}")
    else:
        root = TEST_BASE / f"volume-{uuid.uuid4().hex[:8]}"
        root.mkdir(mode=0o755)  # as an operator makes it: nothing opened up for the sandboxes
        root.chmod(0o755)
        monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", str(root))

    async def run(who: str, write: bool) -> tuple[dict, str | None]:
        owner = Owner("users-file", who)  # the gateway sets both from the caller (MsbKernelManager.start_kernel)
        km, kc = await start_kernel(env={"MSB_BACKEND": backend}, start_request=StartRequest(owner=owner, volume=person_key(owner)))
        reply = await execute(kc, VOLUME_PROBE.replace("WRITE", str(write)).replace("WHO", who))
        assert reply.error is None, reply.traceback
        node = km.provisioner.sandbox.info().get("node")  # None: this host
        kc.stop_channels()
        await km.shutdown_kernel(now=True)  # its reservation back: a test swarm's two nodes hold few kernels at once
        return json.loads(reply.stdout), node

    earlier: dict[str | None, int] = {}
    for _ in range(3):
        seen, node = await run("alice", write=True)
        before = earlier.get(node, 0)
        assert seen == {"listing": ["notes"] if before else [], "notes": "alice was here\n" * (before + 1)}, (node, earlier, seen)
        earlier[node] = before + 1
    assert max(earlier.values()) >= 2, earlier
    assert (await run("bob", write=False))[0] == {"listing": []}
