"""MSB_ALLOW_NETWORK in the namespace sandbox: off, nothing is routed; on, the public internet only.

Traffic goes only to this machine: to listeners on the host itself (which must stay
unreachable), and to a network namespace the test creates, which stands in for a server
on the internet (a package index).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from msb_kernels.backends.namespace import network
from msb_kernels.egress.netlink import host_ipv4_addresses
from msb_kernels.errors import SandboxError
from tests.kernel_helpers import HostListener, connect_outcomes, execute, live_processes

pytestmark = pytest.mark.asyncio
needs_helper = pytest.mark.skipif(network.helper_path() is None, reason=f"MSB_ALLOW_NETWORK needs slirp4netns: {network.INSTALL_HINT}")
RTF_REJECT = 0x0200

# Inside the kernel: the errno name of a TCP connect, so "no route" is told apart from a timeout.
CONNECT_ERRNO = """
import errno, socket, time
def _msb_connect_errno(host, port):
    started = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=3).close()
        return 'connected', 0.0
    except OSError as exc:
        return errno.errorcode.get(exc.errno, type(exc).__name__), time.monotonic() - started
"""

# Inside the kernel: the routes of its network namespace as (destination/bits, is_rejected).
ROUTES = """
import socket, struct
def _msb_routes():
    routes = []
    for line in open('/proc/net/route').read().splitlines()[1:]:
        fields = line.split()
        destination = socket.inet_ntoa(struct.pack('<I', int(fields[1], 16)))
        bits = bin(int(fields[7], 16)).count('1')
        routes.append((f'{destination}/{bits}', fields[0], bool(int(fields[3], 16) & 0x0200)))
    return routes
"""


@pytest.fixture
async def network_kernel(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    return await start_kernel()


def pip_install(arguments: str) -> str:
    """A notebook user's `%pip install` (IPython runs the kernel's own pip through a pty)."""
    return f"%pip install --no-cache-dir {arguments}"


def helper_pids(init_pid: int) -> list[int]:
    """Host pids of the slirp4netns serving the sandbox whose init is init_pid."""
    return live_processes(network.HELPER, str(init_pid))


async def test_without_allow_network_nothing_is_routed(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    _, kc = await start_kernel()
    await execute(kc, CONNECT_ERRNO)
    interfaces = (await execute(kc, "import socket; sorted(name for _, name in socket.if_nameindex())")).value
    # A documentation address: with no route, connect fails before any packet is built.
    outcome, seconds = (await execute(kc, "_msb_connect_errno('203.0.113.7', 80)")).value
    assert interfaces == ["lo"]
    assert outcome == "ENETUNREACH" and seconds < 1, (outcome, seconds)


@needs_helper
async def test_allowed_network_has_an_interface_and_a_default_route(network_kernel):
    _, kc = network_kernel
    await execute(kc, ROUTES)
    interfaces = (await execute(kc, "import socket; sorted(name for _, name in socket.if_nameindex())")).value
    routes = (await execute(kc, "_msb_routes()")).value
    assert interfaces == ["lo", network.INTERFACE]
    assert ("0.0.0.0/0", network.INTERFACE, False) in routes, routes


@needs_helper
async def test_host_loopback_and_own_addresses_stay_unreachable(network_kernel):
    """The gateway listens on the host's loopback; other services on its addresses. Neither is reachable."""
    _, kc = network_kernel
    own = [a for a in host_ipv4_addresses() if not a.startswith("127.")]
    assert own, "this host has no non-loopback address to try"
    with HostListener() as listener:  # every interface: loopback and the host's own addresses
        targets = [("127.0.0.1", listener.port), (network.GATEWAY, listener.port), (network.DNS_ALIAS, listener.port)]
        targets += [(address, listener.port) for address in own]
        outcomes = await connect_outcomes(kc, targets)
        time.sleep(0.3)
        assert all(outcome != "connected" for outcome in outcomes), dict(zip(targets, outcomes, strict=True))
        assert listener.accepted == [], "the sandbox reached a port open on the host"


@needs_helper
async def test_the_lan_and_link_local_are_prohibited(network_kernel):
    """Checked in the routing table, not by sending: a LAN or metadata address is no place for test traffic."""
    _, kc = network_kernel
    await execute(kc, ROUTES)
    rejected = {destination for destination, _, reject in (await execute(kc, "_msb_routes()")).value if reject}
    assert set(network.LAN_NETWORKS) <= rejected, rejected


@needs_helper
async def test_sandboxed_code_cannot_lift_the_block(network_kernel):
    _, kc = network_kernel
    own = next(a for a in host_ipv4_addresses() if not a.startswith("127."))
    code = (
        "import subprocess\n"
        f"attempts = [['ip', 'route', 'del', 'prohibit', '{own}/32'], ['ip', 'route', 'flush', 'table', 'main'],\n"
        "            ['ip', 'link', 'set', 'tap0', 'down'], ['unshare', '-Urn', 'true']]\n"
        "[subprocess.run(a, capture_output=True).returncode for a in attempts]"
    )
    await execute(kc, ROUTES)
    codes = (await execute(kc, code)).value
    rejected = {destination for destination, _, reject in (await execute(kc, "_msb_routes()")).value if reject}
    assert all(code != 0 for code in codes), codes
    assert f"{own}/32" in rejected


@needs_helper
async def test_the_helper_dies_with_the_sandbox(network_kernel):
    km, kc = network_kernel
    init_pid = km.provisioner.sandbox.init_pid
    assert helper_pids(init_pid), "no slirp4netns serves the sandbox"
    os.kill(init_pid, signal.SIGKILL)  # not a clean shutdown: the sandbox's pid 1 is simply gone
    deadline = time.monotonic() + 5
    while helper_pids(init_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert helper_pids(init_pid) == []


async def test_a_missing_helper_is_a_clear_error(start_kernel, monkeypatch, runtime_root):
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    monkeypatch.setattr(network, "helper_path", lambda: None)
    before = set(runtime_root.iterdir())  # the suite's runtime dir holds other tests' sandboxes, coming and going
    with pytest.raises(SandboxError) as raised:
        await start_kernel()
    message = str(raised.value)
    assert "MSB_ALLOW_NETWORK" in message and "apt-get install slirp4netns" in message, message
    left = {path for path in set(runtime_root.iterdir()) - before if path.name != "runsc"}
    assert left == set(), f"a refused start left its directory behind: {[sorted(p.rglob('*')) for p in left]}"


async def test_sandbox_dns_servers_are_neither_the_host_nor_slirps_aliases(monkeypatch, tmp_path):
    """Only resolv.conf is read here: nothing is sent."""
    own = next(a for a in host_ipv4_addresses() if not a.startswith("127."))
    stub, upstream = tmp_path / "resolv.conf", tmp_path / "upstream.conf"
    stub.write_text(f"nameserver 127.0.0.53\nnameserver {own}\nnameserver {network.DNS_ALIAS}\noptions edns0\n")
    upstream.write_text("nameserver 9.9.9.9\nnameserver 9.9.9.9\nnameserver ::1\n")
    monkeypatch.setattr(network, "RESOLV_CONFS", (str(stub), str(upstream)))
    assert network.host_nameservers() == ["9.9.9.9"]
    monkeypatch.setattr(network, "RESOLV_CONFS", (str(stub),))
    assert network.host_nameservers() == []


async def test_doctor_says_what_provides_the_network(monkeypatch):
    if network.helper_path() is not None:
        doctor = subprocess.run(
            [str(Path(sys.executable).with_name("msb-kernels")), "doctor"],
            capture_output=True,
            text=True,
            env={**os.environ, "MSB_ALLOW_NETWORK": "true"},
            timeout=120,
        )
        line = next(line for line in doctor.stdout.splitlines() if line.startswith("namespace network:"))
        assert f"slirp4netns ({network.helper_path()})" in line and "MSB_ALLOW_NETWORK=true" in line, line
    monkeypatch.setattr(network, "helper_path", lambda: None)
    missing = network.describe(True)
    assert missing.startswith("none") and "MSB_ALLOW_NETWORK=true" in missing and "apt-get install slirp4netns" in missing
    assert network.describe(False).startswith("none (MSB_ALLOW_NETWORK=false")


# -- outbound works: a package index in a network namespace this test creates ------------------------


def _wheel(name: str, module: str, source: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel."""
    dist = f"{module}-1.0.dist-info"
    files = {
        f"{module}/__init__.py": source.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: msb-kernels-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for path, data in files.items()
        )
        + f"{dist}/RECORD,,\n"
    )
    files[f"{dist}/RECORD"] = record.encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return f"{module}-1.0-py3-none-any.whl", buffer.getvalue()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def package_index(tmp_path) -> Iterator[tuple[str, str, str]]:
    """An HTTP package index in a fresh network namespace behind a veth pair: (url, host side, package)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a test network namespace needs root and iproute2's ip")
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16)
    host_side, index_side = f"198.18.{octet}.1", f"198.18.{octet}.2"  # benchmarking range: nobody's network
    namespace, host_link, index_link = f"msbt-{tag}", f"msbh{tag}", f"msbi{tag}"
    root = tmp_path / "index"
    name, module = f"msb-net-probe-{tag}", f"msb_net_probe_{tag}"
    filename, wheel = _wheel(name, module, "VALUE = 'installed over the network'\n")
    (root / "simple" / name).mkdir(parents=True)
    (root / filename).write_bytes(wheel)
    (root / "simple" / name / "index.html").write_text(f'<html><body><a href="../../{filename}">{filename}</a></body></html>\n')
    server = None
    try:
        _ip("netns", "add", namespace)
        _ip("link", "add", host_link, "type", "veth", "peer", "name", index_link)
        _ip("link", "set", index_link, "netns", namespace)
        _ip("addr", "add", f"{host_side}/30", "dev", host_link)
        _ip("link", "set", host_link, "up")
        _ip("-n", namespace, "addr", "add", f"{index_side}/30", "dev", index_link)
        _ip("-n", namespace, "link", "set", index_link, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "http.server", "8080", "--bind", index_side, "--directory", str(root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while (
            subprocess.run(
                ["ip", "netns", "exec", namespace, "ss", "-Htln", "sport = :8080"], capture_output=True, text=True
            ).stdout.strip()
            == ""
        ):
            assert time.monotonic() < deadline, "the test index did not start"
            time.sleep(0.05)
        yield f"http://{index_side}:8080/simple/", host_side, name
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@needs_helper
@pytest.mark.slow
async def test_pip_install_reaches_an_index_outside_the_host(package_index, start_kernel, monkeypatch):
    url, host_side, name = package_index
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    _, kc = await start_kernel()  # after the veth exists, so its host side counts as one of the host's addresses
    installed = await execute(kc, pip_install(f"--index-url {url} --trusted-host {url.split('/')[2].split(':')[0]} {name}"), timeout=120)
    module = name.replace("-", "_")
    imported = await execute(kc, f"import {module}; {module}.VALUE")
    outcomes = await connect_outcomes(kc, [(host_side, 8080)])
    assert "Successfully installed" in installed.stdout, installed.stdout + installed.stderr
    assert imported.error is None, imported.traceback
    assert imported.value == "installed over the network"
    assert outcomes == ["PermissionError"], "the host's side of the link is one of its own addresses"


def _configured_indexes() -> list[str]:
    """The package indexes pip on this host is configured with (pip config and PIP_*INDEX_URL)."""
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    values = [os.environ.get("PIP_INDEX_URL", ""), os.environ.get("PIP_EXTRA_INDEX_URL", "")]
    values += [
        line.partition("=")[2].strip().strip("'\"") for line in result.stdout.splitlines() if line.partition("=")[0].endswith("index-url")
    ]
    return [url for value in values for url in value.split()]


@needs_helper
@pytest.mark.slow
async def test_pip_install_from_the_hosts_package_index(start_kernel, monkeypatch):
    """Only the index this host is configured with: no default to the public PyPI, so no test reaches the internet uninvited."""
    configured = _configured_indexes()
    remote = [url for url in configured if url.startswith(("http://", "https://"))]
    if not remote:
        pytest.skip(f"the host's package indexes are {configured or 'not configured'}: none is a network service")
    index = remote[0]
    parts = urlsplit(index)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), timeout=5).close()
    except OSError as exc:
        pytest.skip(f"the package index {index} is not reachable from this host: {exc}")
    monkeypatch.setenv("MSB_ALLOW_NETWORK", "true")
    monkeypatch.setenv("MSB_BACKEND", "namespace")
    _, kc = await start_kernel()
    installed = await execute(kc, pip_install(f"--index-url {index} six"), timeout=180)
    imported = await execute(kc, "import six; six.__name__")
    assert imported.error is None, installed.stdout + installed.stderr
