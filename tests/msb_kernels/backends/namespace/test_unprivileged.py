"""The namespace backend when msb-kernels does not run as root (a user's laptop).

The suite runs as root, whose Python lives in a private home, so this test builds a
virtual environment from the system Python, installs msb-kernels into it, and runs a
kernel as the unprivileged user `nobody`: user namespaces instead of root's setup,
rlimits instead of cgroups, with the warning that says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ
from msb_kernels.backends.namespace import network
from msb_kernels.egress.netlink import host_ipv4_addresses
from msb_kernels.kernelspecs.flavors import FLAVORS
from tests.conftest import REPO
from tests.kernel_helpers import HostListener, live_processes

SYSTEM_PYTHON = "/usr/bin/python3"
# What the checkout's msb_kernels imports to start a kernel, and the egress proxy's three.
VENV_PACKAGES = (
    *("jupyter_client>=8.6,<8.11", "ipykernel>=6.29", "traitlets", "pyzmq", "h11", "cryptography", "prometheus_client"),
    "ahocorasick-rs>=1.0,<2",  # the egress proxy's scan of answers for a secret
)
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or shutil.which("setpriv") is None,
    reason="needs root (to become nobody), a system /usr/bin/python3 and setpriv",
)

SCRIPT = textwrap.dedent("""
    import asyncio, json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from msb_kernels.settings.config import load_settings
    from msb_kernels.kernelspecs.spec_files import install
    from jupyter_client.manager import AsyncKernelManager
    install(load_settings(), prefix=os.environ["HOME"])
    CODE = '''
    import json, os, resource, socket
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    print(json.dumps({"uid": os.getuid(), "host": socket.gethostname(), "root": sorted(os.listdir("/")),
        "nnp": status["NoNewPrivs"].strip(), "cpus": len(os.sched_getaffinity(0)),
        "oom_score_adj": int(open("/proc/self/oom_score_adj").read()),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
        "data": resource.getrlimit(resource.RLIMIT_DATA)[0], "ifaces": [n for _, n in socket.if_nameindex()],
        "tmp_mib": os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize >> 20, "pty": os.ttyname(os.openpty()[1]),
        "probe": {t: probe(t) for t in PROBE.split(",") if t}, "fetch": {u: fetch(u) for u in FETCH.split(",") if u}}))
    '''
    CODE = f"PROBE = {os.environ.get('MSB_TEST_PROBE', '')!r}\\nFETCH = {os.environ.get('MSB_TEST_FETCH', '')!r}\\n" + '''
    import socket, urllib.request
    def fetch(url):
        try:
            return urllib.request.urlopen(url, timeout=10).status
        except Exception as exc:
            return str(exc)
    def probe(target):
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            return "connected"
        except OSError as exc:
            return type(exc).__name__
    ''' + CODE
    async def main():
        km = AsyncKernelManager(kernel_name="msb-python-small")
        try:
            await km.start_kernel()
        except Exception as exc:
            print(json.dumps({"error": str(exc)}))
            return
        kc = km.client(); kc.start_channels(); await kc.wait_for_ready(timeout=60)
        forked = km.provisioner.sandbox.info()["forked"]
        out = []
        await kc.execute_interactive(CODE, output_hook=lambda m: out.append(m["content"].get("text", "")), timeout=60)
        kc.stop_channels(); await km.shutdown_kernel()
        seen = json.loads("".join(out).strip())
        seen["transport"], seen["encrypted"], seen["forked"] = km.transport, getattr(km, "curve_publickey", None) is not None, forked
        print(json.dumps(seen))
    asyncio.run(main())
""")


@pytest.fixture(scope="module")
def unprivileged_python() -> Path:
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + " ".join(VENV_PACKAGES).encode()).hexdigest()[:12]
    venv = Path(f"/tmp/msb-unprivileged-venv-{digest}")
    if not (venv / ".ready").exists():
        shutil.rmtree(venv, ignore_errors=True)
        created = subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], capture_output=True, text=True)
        if created.returncode != 0:
            pytest.skip(f"the system Python cannot make a venv: {created.stderr.strip()[-300:]}")
        installed = subprocess.run(
            [str(venv / "bin/pip"), "install", "-q", *VENV_PACKAGES],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if installed.returncode != 0:
            pytest.skip(f"cannot install kernel packages for the system Python: {installed.stderr.strip()[-300:]}")
        (venv / ".ready").touch()
    # The checkout's current code, copied in, so the test never runs a stale install.
    site = next((venv / "lib").glob("python3*/site-packages"))
    shutil.rmtree(site / "msb_kernels", ignore_errors=True)
    shutil.copytree(REPO / "msb_kernels", site / "msb_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "msb_kernels-0.0.0.dist-info").mkdir(exist_ok=True)
    (site / "msb_kernels-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: msb-kernels\nVersion: 0.0.0\n")
    (site / "msb_kernels-0.0.0.dist-info" / "entry_points.txt").write_text(
        "[jupyter_client.kernel_provisioners]\nmsb-sandbox = msb_kernels.provisioning.provisioner:SandboxProvisioner\n"
    )
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.fixture
def nobody_home():
    """A home nobody can reach (pytest's own tmp dirs are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="msbu-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base / "home"
    shutil.rmtree(base, ignore_errors=True)


def run_as_nobody(python: Path, home: Path, **env: str) -> tuple[dict, str]:
    home.mkdir()
    shutil.chown(home, "nobody", "nogroup")
    (home / "run.py").write_text(SCRIPT)
    shutil.chown(home / "run.py", "nobody", "nogroup")  # readable by nobody whatever root's umask
    environment = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "JUPYTER_PATH": f"{home}/share/jupyter",
        "MSB_RUNTIME_DIR": f"{home}/rt",
        "JUPYTER_RUNTIME_DIR": f"{home}/jr",
        **env,
    }
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python), str(home / "run.py")],
        capture_output=True,
        text=True,
        env=environment,
        cwd=home,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_unprivileged_user_gets_a_sandbox_with_rlimit_fallback(unprivileged_python, nobody_home):
    seen, log = run_as_nobody(unprivileged_python, nobody_home)
    assert seen["uid"] == 1000 and seen["host"] == "sandbox" and seen["nnp"] == "1"
    assert seen["forked"], "without root the kernel is still forked from a fork server"
    assert seen["ifaces"] == ["lo"]
    assert "root" not in seen["root"] and "work" not in seen["root"]
    assert seen["cpus"] == 1, "small flavor is pinned to one core without cgroups"
    assert seen["nproc"] == 256
    assert seen["data"] == 1024 * 2**20, "without cgroups, memory is capped per process at the flavor's size"
    assert "flavor limits are only partly enforced" in log and "not running as root" in log
    # No loop devices without root: /tmp and home are RAM, half the flavor's memory, and the log says so.
    assert seen["tmp_mib"] == FLAVORS["small"].memory_scratch_mib
    assert "/tmp and /home/sandbox are RAM (tmpfs), not disk" in log
    assert seen["pty"] == "/dev/pts/0"
    assert seen["oom_score_adj"] == SANDBOX_OOM_SCORE_ADJ, "the host's OOM killer picks a sandbox first, root or not"


def test_unprivileged_user_gets_the_tcp_transport(unprivileged_python, nobody_home):
    """MSB_TRANSPORT=tcp without root: the relay works in a user namespace too, and CurveZMQ is on."""
    seen, _ = run_as_nobody(unprivileged_python, nobody_home, MSB_TRANSPORT="tcp")
    assert (seen["transport"], seen["encrypted"], seen["uid"], seen["ifaces"]) == ("tcp", True, 1000, ["lo"]), seen


def test_require_limits_refuses_without_cgroups(unprivileged_python, nobody_home):
    seen, _ = run_as_nobody(unprivileged_python, nobody_home, MSB_REQUIRE_LIMITS="true")
    assert "cannot enforce flavor limits with cgroups" in seen["error"]


@pytest.mark.skipif(network.helper_path() is None, reason=f"MSB_ALLOW_NETWORK needs slirp4netns: {network.INSTALL_HINT}")
def test_unprivileged_user_gets_the_network_but_not_the_host(unprivileged_python, nobody_home):
    if tun := network.tun_unusable_reason(rootful=False):
        seen, _ = run_as_nobody(unprivileged_python, nobody_home, MSB_ALLOW_NETWORK="true")
        assert tun in seen["error"] and "chmod 0666 /dev/net/tun" in seen["error"], seen
        pytest.skip(f"unprivileged sandboxes get no network on this host: {tun}")
    own = [a for a in host_ipv4_addresses() if not a.startswith("127.")]
    with HostListener() as listener:
        targets = [f"{address}:{listener.port}" for address in ["127.0.0.1", network.GATEWAY, *own]]
        seen, _ = run_as_nobody(unprivileged_python, nobody_home, MSB_ALLOW_NETWORK="true", MSB_TEST_PROBE=",".join(targets))
        assert listener.accepted == [], seen["probe"]
    assert seen["ifaces"] == ["lo", network.INTERFACE]
    assert set(seen["probe"]) == set(targets) and "connected" not in seen["probe"].values(), seen["probe"]
    leftover = [pid for pid in live_processes(network.HELPER) if os.stat(f"/proc/{pid}").st_uid == 65534]
    assert leftover == [], "the network helper outlived its sandbox"


def test_unprivileged_user_gets_the_allow_list_through_the_egress_proxy(unprivileged_python, nobody_home, upstream):
    """MSB_NETWORK_ALLOW without root: the relay, the proxy's socket and the proxy itself run as the user."""
    seen, _ = run_as_nobody(
        unprivileged_python,
        nobody_home,
        MSB_NETWORK_ALLOW="api.msb.test",
        MSB_NETWORK_DNS=upstream.dns,
        MSB_TEST_FETCH="http://api.msb.test/echo,http://other.msb.test/echo",
        MSB_TEST_PROBE=f"{upstream.address}:80",
    )
    assert "fetch" in seen, seen
    assert seen["fetch"]["http://api.msb.test/echo"] == 200, seen
    assert "other.msb.test:80 is not allowed by MSB_NETWORK_ALLOW (api.msb.test)" in seen["fetch"]["http://other.msb.test/echo"], seen
    assert seen["probe"] == {f"{upstream.address}:80": "OSError"} and seen["ifaces"] == ["lo"], seen


def test_doctor_says_scratch_is_ram_without_root(unprivileged_python, nobody_home):
    nobody_home.mkdir()
    shutil.chown(nobody_home, "nobody", "nogroup")
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(unprivileged_python), "-m", "msb_kernels.cli", "doctor"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(nobody_home)},
        cwd=nobody_home,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "disk (namespace and gvisor backends): /tmp and /home/sandbox are RAM (tmpfs), not disk, because loop-mounted disk images need root"
    ) in result.stdout, result.stdout
    assert f"{FLAVORS['small'].memory_scratch_mib} MiB" in result.stdout
