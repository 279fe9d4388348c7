"""Escape attempts against the namespace sandbox. Each one must fail inside the sandbox.

Host files and the network are tried for every backend in test_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import host_pids, make_persons
from tests.kernel_helpers import assert_kill_9_of_the_owner_leaves_no_sandbox, execute, write_attempts
from tests.skips import needs_cgroups

pytestmark = pytest.mark.asyncio


async def test_only_loopback_exists_in_the_sandbox(shared_kernel):
    _, kc = shared_kernel
    result = await execute(kc, "import socket; sorted(name for _, name in socket.if_nameindex())")
    assert result.value == ["lo"]


async def test_writes_outside_the_allowed_dirs_fail(shared_kernel):
    _, kc = shared_kernel
    venv_file = os.path.join(sys.prefix, "msb-escape")
    code = write_attempts(
        ["/msb-escape", "/usr/msb-escape", "/etc/msb-escape", "/root/msb-escape", "/run/msb-escape", "/run/msb/msb-escape", venv_file],
        ["/tmp/ok", "~/ok", "/run/kernel/ok", "/dev/shm/ok"],
    )
    blocked, allowed = (await execute(kc, code)).value
    assert all(outcome in ("OSError", "PermissionError") for outcome in blocked.values()), blocked
    assert set(allowed.values()) == {"written"}, allowed
    assert not os.path.exists(venv_file)


@needs_cgroups
async def test_every_sandbox_process_is_in_its_cgroups_and_sees_only_its_own(start_kernel):
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    init = sandbox.init_pid
    children = {int(pid) for pid in Path(f"/proc/{init}/task/{init}/children").read_text().split()}
    for path in sandbox.cgroup.paths.values():  # every hierarchy: memory, cpu and pids
        members = {int(pid) for pid in (Path(path) / "cgroup.procs").read_text().split()}
        assert {init} | children <= members, (path, init, children, members)
    inside = (await execute(kc, "open('/proc/self/cgroup').read().split()")).value
    assert inside and all(line.endswith(":/") for line in inside), inside  # its cgroup namespace is rooted at its own


@pytest.mark.parametrize("fork", ["true", "false"])
async def test_the_kernel_cannot_trace_its_init_to_outlive_its_owner(start_kernel, monkeypatch, fork):
    """The kernel runs as its init's uid. PTRACE_ATTACH to init (pid 1) stopped it, so it never saw its lifeline
    close: the sandbox, its disk and loop device outlived its owner and keeper, and no sweep took them (issue 58's
    hostile run). Init, forked by the fork server or exec'd, is undumpable: no one inside traces or reads it."""
    monkeypatch.setenv("MSB_FORK_KERNELS", fork)
    km, kc = await start_kernel()
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, 1, 0, 0), os.strerror(ctypes.get_errno()), os.access('/proc/1/mem', os.R_OK))"
    )
    assert (await execute(kc, code)).stdout.strip() == "-1 Operation not permitted False"
    assert (await execute(kc, "print(6 * 7)")).stdout.strip() == "42"  # the kernel lives on, init untouched


async def test_the_kernel_is_never_host_root(start_kernel):
    km, kc = await start_kernel()
    status = (await execute(kc, "print(open('/proc/self/status').read())")).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Uid"].split()[0] == "1000"
    assert fields["NoNewPrivs"].strip() == "1"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    for pid in host_pids(km):  # seen from the host, no sandbox process runs as uid 0
        with open(f"/proc/{pid}/status") as handle:
            uid_line = next(line for line in handle if line.startswith("Uid:"))
        assert all(int(uid) != 0 for uid in uid_line.split()[1:]), (pid, uid_line)
    result = await execute(kc, "import os\ntry:\n    os.setuid(0)\nexcept OSError as exc:\n    print(type(exc).__name__)")
    assert result.stdout.strip() in ("PermissionError", "OSError")  # EPERM, or EINVAL: uid 0 does not exist in there


async def test_other_kernels_processes_and_sockets_are_invisible(start_kernel):
    km_a, kc_a = await start_kernel()
    km_b, kc_b = await start_kernel()
    code = (
        "import os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "cmds = [open(f'/proc/{p}/cmdline').read().replace(chr(0), ' ') for p in pids]\n"
        "sockets = open('/proc/net/unix').read()\n"
        "(pids, cmds, sorted(os.listdir('/run/kernel')), sockets)"
    )
    pids, cmds, io_entries, unix_sockets = (await execute(kc_a, code)).value
    assert pids[:2] == [1, 2], pids  # the sandbox's own init and kernel
    assert not any(km_b.kernel_id in cmd for cmd in cmds)
    assert str(km_b.provisioner.io_dir) not in unix_sockets
    assert km_b.kernel_id not in unix_sockets
    b_io = km_b.provisioner.io_dir
    probe = await execute(kc_a, f"import os; [os.path.exists({str(b_io)!r}), os.path.exists({str(b_io.parent.parent)!r})]")
    assert probe.value == [False, False]
    with open(km_a.connection_file) as handle:
        key_a = json.load(handle)["key"]
    guest_key = (await execute(kc_a, "import json; json.load(open('/run/kernel/connection.json'))['key']")).result
    assert guest_key == repr(key_a)
    signal_attempt = await execute(
        kc_a,
        f"import os, signal\ntry:\n    os.kill({max(host_pids(km_b))}, signal.SIGKILL)\nexcept OSError as exc:\n    print(type(exc).__name__)",
    )
    assert signal_attempt.stdout.strip() in ("ProcessLookupError", "PermissionError")
    assert await km_b.is_alive()
    assert (await execute(kc_b, "1 + 1")).result == "2"


RELAY_PROBE = """
import ctypes, errno, os, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
def comm(pid):
    try:
        return open(f'/proc/{pid}/comm').read().strip()
    except OSError:
        return ''
relay = next(int(p) for p in os.listdir('/proc') if p.isdigit() and comm(p) == 'msb-relay')
def attempt(call):
    try:
        call()
        return 'done'
    except OSError as exc:
        return errno.errorcode[exc.errno]
def syscall(number, *args):
    if libc.syscall(number, *args) < 0:
        raise OSError(ctypes.get_errno(), 'syscall')
outcomes = {'list_fds': attempt(lambda: os.listdir(f'/proc/{relay}/fd')),
            'ptrace': attempt(lambda: syscall(101, 0x4206, relay, 0, 0)),  # PTRACE_SEIZE: the relay would go on running
            'kill': attempt(lambda: os.kill(relay, 0))}
pidfd = os.pidfd_open(relay)
outcomes['pidfd_getfd'] = attempt(lambda: syscall(438, pidfd, 3, 0))
# Every socket the other processes here hold must be one of this namespace (listed in its /proc/net).
known = set()
for table in ('tcp', 'tcp6', 'udp', 'udp6', 'unix', 'raw', 'netlink', 'packet'):
    try:
        known.update(open(f'/proc/net/{table}').read().split())
    except OSError:
        pass
foreign, unreadable = [], []
for pid in (p for p in os.listdir('/proc') if p.isdigit() and int(p) != relay):
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except PermissionError:  # undumpable, as init is: no one here reads its descriptors either
        unreadable.append(int(pid))
        continue
    for fd in fds:
        try:
            target = os.readlink(f'/proc/{pid}/fd/{fd}')
        except OSError:
            continue
        if target.startswith('socket:[') and target[8:-1] not in known:
            foreign.append((pid, fd, target))
outcomes['foreign_sockets'] = foreign
outcomes['unreadable'] = unreadable
outcomes
"""


async def test_tcp_transport_keeps_the_hosts_sockets_out_of_the_kernels_reach(start_kernel, monkeypatch):
    """MSB_TRANSPORT=tcp: the relay holds sockets of the host's network namespace, which could be reconnected
    anywhere; the kernel's processes can neither read its descriptors, nor trace it, nor copy one out,
    and hold no socket outside the sandbox's namespace. The host ports are free again after shutdown."""
    from msb_kernels.backends.core.ports import port_is_free

    monkeypatch.setenv("MSB_TRANSPORT", "tcp")
    km, kc = await start_kernel()
    assert km.transport == "tcp"
    ports = [km.shell_port, km.iopub_port, km.stdin_port, km.control_port, km.hb_port]
    assert not any(port_is_free(port) for port in ports)
    outcomes = (await execute(kc, RELAY_PROBE)).value
    expected = {"list_fds": "EACCES", "ptrace": "EPERM", "kill": "done", "pidfd_getfd": "EPERM", "foreign_sockets": [], "unreadable": [1]}
    assert outcomes == expected, outcomes
    await km.shutdown_kernel(now=True)
    assert all(port_is_free(port) for port in ports)
    assert km.provisioner.backend.listeners.ports.owned(km.kernel_id) == []


@needs_cgroups
async def test_allocating_past_the_flavor_raises_memory_error_with_advice(start_kernel):
    km, kc = await start_kernel()
    result = await execute(kc, "hog = bytearray(2 * 1024**3)")
    assert result.status == "error" and result.error["ename"] == "MemoryError"
    assert "out of memory for flavor small (1024 MiB); try medium" in result.stderr
    assert await km.is_alive()
    assert (await execute(kc, "sum(range(10))")).result == "45"


@needs_cgroups
async def test_memory_the_process_limit_misses_kills_only_this_kernel(start_kernel):
    km_victim, kc_victim = await start_kernel()
    km_bystander, kc_bystander = await start_kernel()
    await execute(kc_bystander, "survivor = 'ok'")
    # Shared anonymous memory is not counted by RLIMIT_DATA, only by the cgroup.
    code = "import mmap\nm = mmap.mmap(-1, 1536 * 2**20)\nfor i in range(0, len(m), 4096):\n    m[i] = 1"
    kc_victim.execute(code)
    deadline = time.monotonic() + 60
    while await km_victim.is_alive():
        assert time.monotonic() < deadline, "the memory hog was not stopped"
        await asyncio.sleep(0.2)
    sandbox = km_victim.provisioner.sandbox
    assert sandbox.exit_reason() == "out of memory for flavor small (1024 MiB); try medium"
    assert (await execute(kc_bystander, "survivor")).result == "'ok'"
    provisioner = km_victim.provisioner
    await km_victim.shutdown_kernel(now=True)
    assert provisioner.last_exit_reason == "out of memory for flavor small (1024 MiB); try medium"
    # The cgroup that counted the OOM kill is gone now; a late question (the bridge asks when its
    # execution notices the death, which can be after jupyter_client restarted the kernel) gets the same answer.
    assert sandbox.exit_reason() == "out of memory for flavor small (1024 MiB); try medium"


def _cgroup_file(km, controller: str, name: str) -> Path:
    """A file of the kernel's sandbox cgroup, as the host sees it (v1: per controller; v2: one group)."""
    paths = km.provisioner.sandbox.cgroup.paths
    return paths.get(controller, paths.get("unified")) / name


# A binary tree of forks, 11 levels deep: up to 4095 processes if nothing stops it, so past the
# flavor's pids limit at any plausible setting, yet finite should that limit be missing. Every
# process that is refused a fork writes one byte to the pipe; all of them exit at the deadline.
FORK_BOMB = """
import os, time
refusals_r, refusals_w = os.pipe()
deadline = time.monotonic() + {seconds}
root = os.fork()
if root == 0:
    children = []
    for depth in range(11):
        for _ in range(2):
            try:
                pid = os.fork()
            except BlockingIOError:
                os.write(refusals_w, b"x")
                continue
            if pid == 0:
                children = []
                break
            children.append(pid)
        else:
            break
    while time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in children:
        os.waitpid(pid, 0)
    os._exit(0)
os.close(refusals_w)
os.waitpid(root, 0)
refused = len(os.read(refusals_r, 1 << 20))
refused
"""


@needs_cgroups
async def test_fork_bomb_is_contained(start_kernel):
    """An exponential fork bomb stops at the flavor's pids limit; another sandbox can still start processes."""
    from msb_kernels.settings.config import load_settings

    limit = load_settings().max_processes
    km, kc = await start_kernel()
    _, bystander = await start_kernel()
    pids_current = _cgroup_file(km, "pids", "pids.current")
    task = asyncio.ensure_future(execute(kc, FORK_BOMB.format(seconds=8), timeout=120))
    peak = 0
    deadline = time.monotonic() + 60
    while peak < limit - 8:  # saturated: every slot but the few the kernel's own threads hold
        assert time.monotonic() < deadline and not task.done(), f"the bomb never reached the limit (peak {peak} of {limit})"
        peak = max(peak, int(pids_current.read_text()))
        await asyncio.sleep(0.02)
    spawned = await execute(bystander, "import subprocess; subprocess.run(['true']).returncode", timeout=60)
    assert spawned.result == "0", "a sandbox beside the fork bomb could not start a process"
    while not task.done():
        peak = max(peak, int(pids_current.read_text()))
        await asyncio.sleep(0.02)
    refused = int((await task).result)
    assert peak <= limit, f"{peak} processes in a sandbox limited to {limit}"
    assert refused > 0, "no fork was refused"
    assert (await execute(kc, "'alive'")).result == "'alive'"


SPINNERS = """
import os, time
start = time.monotonic()
workers = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        os._exit(0)
    workers.append(pid)
cpu = 0.0
for pid in workers:
    _, _, usage = os.wait4(pid, 0)
    cpu += usage.ru_utime + usage.ru_stime
print(cpu / (time.monotonic() - start))
"""


def _throttled_periods(km) -> int:
    stats = dict(line.split() for line in _cgroup_file(km, "cpu", "cpu.stat").read_text().splitlines())
    return int(stats["nr_throttled"])


@needs_cgroups
async def test_cpu_time_is_capped_at_the_flavors_cpus(start_kernel):
    """Two spinning processes in a small kernel get at most one CPU, because the cgroup throttles them.

    The throttle counter is the positive control: on a host too busy to give the two spinners more
    than one CPU anyway, "under 1.3 CPUs" holds from contention alone, but the quota is still set
    and the counter shows whether it bit. Where the host had room (the same load outside any
    cgroup got clearly more than one CPU just before), the quota must have bitten.
    """
    km, kc = await start_kernel()
    quota = int(_cgroup_file(km, "cpu", "cpu.cfs_quota_us").read_text())
    period = int(_cgroup_file(km, "cpu", "cpu.cfs_period_us").read_text())
    assert quota / period == km.provisioner.flavor_spec.cpus == 1
    outside = subprocess.run([sys.executable, "-c", SPINNERS], capture_output=True, text=True, timeout=60)
    host_room = float(outside.stdout)
    throttled_before = _throttled_periods(km)
    cpus_used = float((await execute(kc, SPINNERS, timeout=60)).stdout)
    throttled = _throttled_periods(km) - throttled_before
    assert cpus_used < 1.3, f"small flavor used {cpus_used:.2f} CPUs"
    if host_room > 1.5:
        assert throttled > 0, f"the same load got {host_room:.2f} CPUs outside, yet the sandbox was never throttled"


async def test_shared_volume_is_mounted_at_the_guest_path(start_kernel, monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    make_persons(shared)
    (shared / "from-host.txt").write_text("hello sandbox")
    monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", str(shared))
    monkeypatch.setenv("MSB_SHARED_VOLUME_GUEST_PATH", "/data")
    km, kc = await start_kernel()
    result = await execute(kc, "open('/data/from-host.txt').read()")
    assert result.result == "'hello sandbox'"
    await execute(kc, "open('/data/from-kernel.txt', 'w').write('hello host')")
    assert (shared / "from-kernel.txt").read_text() == "hello host"
    assert (await execute(kc, "import os; os.environ['MSB_SHARED_VOLUME']")).result == "'/data'"


async def test_a_crashed_kernel_leaves_nothing_behind(start_kernel):
    km, kc = await start_kernel()
    sandbox = km.provisioner.sandbox
    pids = host_pids(km)
    kc.execute("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    deadline = time.monotonic() + 20
    while await km.is_alive():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await km.shutdown_kernel(now=True)
    assert not sandbox.state_dir.exists()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


async def test_kill_9_of_the_host_process_leaves_no_sandbox():
    await assert_kill_9_of_the_owner_leaves_no_sandbox(grace_seconds=10)


async def test_sweep_stops_a_running_sandbox_whose_owner_died(runtime_root):
    """Without the lifeline (an owner that is gone but whose sandbox still runs), the sweep kills it."""
    from msb_kernels.backends import get_backend
    from msb_kernels.backends.core.base import SandboxSpec
    from msb_kernels.kernelspecs.flavors import FLAVORS
    from msb_kernels.settings.config import load_settings

    backend = get_backend(load_settings())
    stand_in_owner = subprocess.Popen(["sleep", "60"])
    sandbox_id = str(uuid.uuid4())
    spec = SandboxSpec(
        sandbox_id,
        FLAVORS["small"],
        "python",
        ["sleep", "600"],
        {"PATH": "/usr/bin:/bin"},
        backend.io_dir_for(sandbox_id),
        owner_pid=stand_in_owner.pid,
    )
    sandbox = await backend.create(spec)
    try:
        assert await sandbox.poll() is None
        assert await backend.sweep_orphans() == []  # the owner lives: hands off
        stand_in_owner.kill()
        stand_in_owner.wait()
        assert sandbox_id in await backend.sweep_orphans()
        assert await asyncio.wait_for(sandbox.wait(), 10) is not None
        assert not (runtime_root / sandbox_id).exists()
    finally:
        await sandbox.cleanup()


async def test_no_namespaces_can_be_made_inside_the_sandbox(shared_kernel):
    """A nested user namespace would hand the kernel capabilities (and the host kernel's attack surface)."""
    _, kc = shared_kernel
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "outcomes = {}\n"
        "for name, flag in [('user', 0x10000000), ('net', 0x40000000), ('mount', 0x00020000)]:\n"
        "    outcomes[name] = 'created' if libc.unshare(flag) == 0 else os.strerror(ctypes.get_errno())\n"
        "outcomes"
    )
    outcomes = (await execute(kc, code)).value
    assert "created" not in outcomes.values(), outcomes


async def test_a_process_with_many_open_files_still_manages_its_kernels(start_kernel):
    """Descriptors past 1024 (a gateway holding ~40 kernels with clients has them) must not break polling."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    padding = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        km, kc = await start_kernel()
        assert km.provisioner.sandbox.process.pidfd >= 1024
        assert await km.is_alive()
        assert (await execute(kc, "6 * 7")).result == "42"
        await km.shutdown_kernel()
        assert not await km.is_alive()
    finally:
        for fd in padding:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_shell_escapes_and_terminals_work(shared_kernel):
    """IPython runs `!cmd`, `%sx` and `%pip` on a pty; the sandbox has its own devpts for them."""
    _, kc = shared_kernel
    echoed = await execute(kc, "!echo from-a-shell-escape")
    assert echoed.status == "ok" and echoed.stdout.strip() == "from-a-shell-escape", echoed.stdout + echoed.traceback
    pip = await execute(kc, "%pip --version", timeout=120)
    assert pip.stdout.startswith("pip ") and "out of pty" not in pip.stdout, pip.stdout + pip.traceback
    captured = await execute(kc, "captured = %sx echo captured-by-sx\ncaptured")
    assert captured.value == ["captured-by-sx"], captured.traceback
    code = (
        "import os, pty\n"
        "main, child = os.openpty()\n"
        "os.write(child, b'through-a-pty\\n')\n"
        "seen = os.read(main, 100)\n"
        "os.close(main); os.close(child)\n"
        "(seen.decode().strip(), os.waitstatus_to_exitcode(pty.spawn(['/bin/true'])))"
    )
    assert (await execute(kc, code)).value == ("through-a-pty", 0)


async def test_only_the_sandboxs_own_terminals_are_visible(shared_kernel):
    host_main, host_child = os.openpty()  # a host terminal exists while the sandbox looks
    try:
        _, kc = shared_kernel
        code = (
            "import os\n"
            "opened = [os.openpty() for _ in range(2)]\n"
            "own = sorted(os.ttyname(child).removeprefix('/dev/pts/') for _, child in opened)\n"
            "listed = sorted(os.listdir('/dev/pts'))\n"
            "for fds in opened:\n"
            "    for fd in fds:\n"
            "        os.close(fd)\n"
            "(own, listed, os.path.realpath('/dev/ptmx'), sorted(os.listdir('/dev/pts')))"
        )
        own, listed, ptmx, after = (await execute(kc, code)).value
        assert listed == sorted(own + ["ptmx"]), (own, listed)
        assert ptmx == "/dev/pts/ptmx"
        assert after == ["ptmx"]
        assert os.ttyname(host_child).startswith("/dev/pts/")
    finally:
        os.close(host_main)
        os.close(host_child)
