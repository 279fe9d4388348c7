"""The README's commands as users run them: from a home directory as a user without root, and beside a busy apt.

scripts/bootstrap.sh is what both commands source; scripts/apt-install is its Debian step.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from msb_kernels.identity.people import Owner
from msb_kernels.identity.person_registry import person_key
from tests.conftest import REPO, copy_checkout

# The machine's certificate settings, which a user's login shell would have: pip and npm need them to reach their indexes.
PASSED_ENV = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)
DPKG_FRONTEND_LOCK = "/var/lib/dpkg/lock-frontend"
needs_root_apt = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("apt-get") is None or shutil.which("setpriv") is None,
    reason="needs root, apt-get and setpriv (to hold apt's lock, or to become an unprivileged user)",
)


class HeldAptLock:
    """dpkg's frontend lock, held as another apt-get would hold it (an fcntl lock on the same file)."""

    def __enter__(self) -> HeldAptLock:
        self.fd = os.open(DPKG_FRONTEND_LOCK, os.O_RDWR | os.O_CREAT, 0o640)
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        return self

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __exit__(self, *exc: object) -> None:
        self.release()


def installed_package() -> str:
    """A package apt-get install takes the lock for and then finds installed: no download, no change."""
    return next(
        name
        for name in ("slirp4netns", "runsc", "iproute2", "bash")
        if subprocess.run(["dpkg", "-s", name], capture_output=True).returncode == 0
    )


@needs_root_apt
def test_apt_install_waits_for_a_busy_package_manager_then_installs():
    with HeldAptLock() as lock:
        process = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "apt-install"), installed_package()],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MSB_APT_LOCK_TIMEOUT": "120"},
        )
        time.sleep(4)
        assert process.poll() is None, f"apt-install returned while apt's lock was held: {process.stderr.read()}"
        lock.release()
        assert process.wait(timeout=120) == 0, process.stderr.read()


@needs_root_apt
def test_apt_install_says_when_it_gives_up_on_the_lock():
    with HeldAptLock():
        result = subprocess.run(
            ["bash", str(REPO / "scripts" / "apt-install"), installed_package()],
            capture_output=True,
            text=True,
            env={**os.environ, "MSB_APT_LOCK_TIMEOUT": "1"},
            timeout=300,
        )
    assert result.returncode == 1
    assert "another package manager held apt's lock for 1 s" in result.stderr and "MSB_APT_LOCK_TIMEOUT" in result.stderr, result.stderr


@pytest.fixture(scope="module")
def nobody_checkout():
    """As `nobody`, a checkout in /home/<user> bootstrapped with the README's first command's bootstrap."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, apt-get and setpriv (to hold apt's lock, or to become an unprivileged user)")
    home = Path(f"/home/msbt-{uuid.uuid4().hex[:8]}")
    checkout = home / "msb"
    try:
        copy_checkout(checkout)
        subprocess.run(["chown", "-R", "nobody:nogroup", str(home)], check=True)
        env = {
            "HOME": str(home),
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            **{name: os.environ[name] for name in PASSED_ENV if name in os.environ},
        }
        boot = subprocess.run(
            [*AS_NOBODY, "bash", "scripts/bootstrap.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900
        )
        assert boot.returncode == 0, boot.stderr[-3000:]
        yield checkout, env
    finally:
        shutil.rmtree(home, ignore_errors=True)


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.slow
def test_a_user_without_root_bootstraps_from_their_home_and_runs_the_demo(nobody_checkout):
    """As `nobody`, from a checkout in /home/<user>: the README's first command's bootstrap, then `msb-kernels demo`."""
    checkout, env = nobody_checkout
    demo = subprocess.run(
        [*AS_NOBODY, str(checkout / ".venv" / "bin" / "msb-kernels"), "demo"],
        cwd=checkout.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, f"{demo.stdout[-2000:]}\n{demo.stderr[-3000:]}"
    assert "user: 1000 | host: sandbox" in demo.stdout and "state survives between cells: 42" in demo.stdout, demo.stdout
    assert "flavor limits are only partly enforced: cgroups need root here" in demo.stderr, demo.stderr  # honest about it
    assert "Traceback" not in demo.stderr, demo.stderr[-3000:]


@pytest.mark.slow
def test_the_run_script_installs_only_when_asked_and_says_what_its_arguments_do(nobody_checkout):
    """`./scripts/run --install-only` installs (again: idempotent) and says how to start the gateway, without starting
    it; `--help` says what the script's arguments do, then serve's own options, which the rest go to."""
    checkout, env = nobody_checkout
    installed = subprocess.run(
        [*AS_NOBODY, "./scripts/run", "--install-only"], cwd=checkout, env=env, capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert f"msb-kernels is installed in {checkout}/.venv" in installed.stdout and "./scripts/run [serve options]" in installed.stdout
    helped = subprocess.run(
        [*AS_NOBODY, str(checkout / "scripts" / "run"), "--help"], cwd="/", env=env, capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "--install-only" in helped.stdout and "usage: msb-kernels serve" in helped.stdout and "--port PORT" in helped.stdout


@pytest.mark.slow
async def test_a_user_without_root_serves_a_team_from_a_users_file(nobody_checkout):
    """The operator without root: `msb-kernels users add` twice, `msb-kernels serve` with the users file, and each
    person sees only their own kernels, and their own files: their volume and their Lab root, made by the operator
    with mkdir and default modes, read and written by each of their kernels, all of it the operator's on the host (the
    sandboxes run as the operator's own user), and none of it in the other person's kernels."""
    from tests.msb_kernels.gateway.conftest import HttpServer, KernelSocket, free_port, wait_until

    checkout, env = nobody_checkout
    program = str(checkout / ".venv" / "bin" / "msb-kernels")
    users = checkout.parent / "users.json"
    tokens = {}
    for name in ("alice", "bob"):
        added = subprocess.run([*AS_NOBODY, program, "users", "add", name, "--file", str(users)], env=env, capture_output=True, text=True)
        assert added.returncode == 0, added.stderr
        tokens[name] = added.stdout.splitlines()[0].rsplit(": ", 1)[1]
    assert oct(users.stat().st_mode & 0o777) == "0o600" and users.stat().st_uid == 65534
    port = free_port()
    log_path = checkout.parent / "serve.log"
    shared, labs = checkout.parent / "shared", checkout.parent / "labs"
    for directory in (shared, labs):
        made = subprocess.run([*AS_NOBODY, "mkdir", str(directory)], capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
    serve_env = {
        **env,
        "MSB_USERS_FILE": str(users),
        "MSB_RUNTIME_DIR": str(checkout.parent / "rt"),
        "MSB_POOL_SIZE": "0",
        "MSB_SHARED_VOLUME_PATH": str(shared),
        "MSB_LAB_ROOT_PATH": str(labs / "{username}"),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*AS_NOBODY, program, "serve", "--port", str(port)], env=serve_env, stdout=log, stderr=subprocess.STDOUT, cwd=checkout.parent
        )
    server = HttpServer(port, tokens["alice"], process, log_path)
    try:
        await wait_until(lambda: _health(server), 60, "the non-root gateway's health")
        started = await server.request("POST", "/api/kernels", {"name": "msb-python-small"})
        assert started.code == 201, (started.body, server.log()[-2000:])
        kernel = started.json["id"]
        socket = await KernelSocket.open(server, kernel)
        try:
            assert (await socket.execute("import os; os.getuid(), 6 * 7")).result == "(1000, 42)"
        finally:
            socket.close()
        assert kernel not in (await server.request("GET", "/api/kernels", token=tokens["bob"])).body.decode()
        assert (await server.request("DELETE", f"/api/kernels/{kernel}", token=tokens["bob"])).code == 404
        assert (await server.request("DELETE", f"/api/kernels/{kernel}")).code == 204

        lab = labs / "alice"
        probe = f"import os; open('/shared/kept.txt', 'a').write('x'); open({str(lab / 'out.txt')!r}, 'a').write('y'); print(os.getcwd())"
        for who, code, expected in (
            ("alice", probe, str(lab)),
            ("alice", f"print(open('/shared/kept.txt').read(), open({str(lab / 'out.txt')!r}).read())", "x y"),
            ("bob", f"import os; print(os.listdir('/shared'), os.path.exists({str(lab)!r}))", "[] False"),
        ):
            body = {"name": "msb-python-small", "env": {"KERNEL_WORKING_DIR": str(lab)}}
            started = await server.request("POST", "/api/kernels", body, token=tokens[who])
            assert started.code == 201, (started.body, server.log()[-2000:])
            socket = await KernelSocket.open(server, started.json["id"], token=tokens[who])
            try:
                assert (await socket.execute(code)).stdout.strip() == expected, who
            finally:
                socket.close()
            assert (await server.request("DELETE", f"/api/kernels/{started.json['id']}", token=tokens[who])).code == 204
        own = shared / person_key(Owner("users-file", "alice"))  # her volume, under the key the gateway gives her
        written = [own / "kept.txt", lab / "out.txt", own, lab]
        assert {path.stat().st_uid for path in written} == {65534}, [(path, path.stat().st_uid) for path in written]
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        server.stop()


async def _health(server) -> bool:
    if not server.running():
        raise AssertionError(f"msb-kernels serve exited:\n{server.log()[-3000:]}")
    try:
        return (await server.request("GET", "/api/msb/health", token=None, timeout=5)).code == 200
    except (ConnectionError, OSError):
        return False
