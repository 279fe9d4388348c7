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

from msb_kernels.backends import cgroups
from tests.conftest import host_pids
from tests.kernel_helpers import execute

pytestmark = pytest.mark.asyncio
needs_cgroups = pytest.mark.skipif(cgroups.detect()[0] is None, reason=f"flavor limits need cgroups: {cgroups.detect()[1]}")


async def test_only_loopback_exists_in_the_sandbox(shared_kernel):
    _, kc = shared_kernel
    result = await execute(kc, "import socket; sorted(name for _, name in socket.if_nameindex())")
    assert result.value == ["lo"]


async def test_writes_outside_the_allowed_dirs_fail(shared_kernel):
    _, kc = shared_kernel
    venv_file = os.path.join(sys.prefix, "msb-escape")
    code = (
        "import os\n"
        "def attempt(path):\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('x')\n"
        "        os.remove(path)\n"
        "        return 'written'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"blocked = {{p: attempt(p) for p in ['/msb-escape', '/usr/msb-escape', '/etc/msb-escape', '/root/msb-escape', '/run/msb-escape', {venv_file!r}]}}\n"
        "allowed = {p: attempt(p) for p in ['/tmp/ok', os.path.expanduser('~/ok'), '/run/kernel/ok', '/dev/shm/ok']}\n"
        "(blocked, allowed)"
    )
    blocked, allowed = (await execute(kc, code)).value
    assert all(outcome in ("OSError", "PermissionError") for outcome in blocked.values()), blocked
    assert set(allowed.values()) == {"written"}, allowed
    assert not os.path.exists(venv_file)


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
    signal_attempt = await execute(kc_a, f"import os, signal\ntry:\n    os.kill({max(host_pids(km_b))}, signal.SIGKILL)\nexcept OSError as exc:\n    print(type(exc).__name__)")
    assert signal_attempt.stdout.strip() in ("ProcessLookupError", "PermissionError")
    assert await km_b.is_alive()
    assert (await execute(kc_b, "1 + 1")).result == "2"


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


@needs_cgroups
async def test_fork_bomb_is_contained(start_kernel):
    km, kc = await start_kernel()
    code = (
        "import os, time\n"
        "children, failure = [], None\n"
        "try:\n"
        "    for _ in range(5000):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        children.append(pid)\n"
        "except OSError as exc:\n"
        "    failure = type(exc).__name__\n"
        "host_check = None\n"
        "for pid in children:\n"
        "    os.waitpid(pid, 0)\n"
        "(len(children), failure)"
    )
    task = asyncio.ensure_future(execute(kc, code, timeout=120))
    await asyncio.sleep(1.0)
    assert subprocess.run(["true"]).returncode == 0, "the host could not start a process during the fork bomb"
    forked, failure = (await task).value
    assert failure == "BlockingIOError"
    assert forked < 256
    assert (await execute(kc, "'alive'")).result == "'alive'"


@needs_cgroups
async def test_cpu_time_is_capped_at_the_flavors_cpus(start_kernel):
    km, kc = await start_kernel()
    code = (
        "import os, time, resource\n"
        "start = time.monotonic()\n"
        "workers = []\n"
        "for _ in range(2):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.monotonic() + 2.0\n"
        "        while time.monotonic() < end:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    workers.append(pid)\n"
        "cpu = 0.0\n"
        "for pid in workers:\n"
        "    _, _, usage = os.wait4(pid, 0)\n"
        "    cpu += usage.ru_utime + usage.ru_stime\n"
        "cpu / (time.monotonic() - start)"
    )
    cpus_used = float((await execute(kc, code, timeout=60)).result)
    assert cpus_used < 1.3, f"small flavor used {cpus_used:.2f} CPUs"


async def test_shared_volume_is_mounted_at_the_guest_path(start_kernel, monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
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


OWNER_SCRIPT = """
import asyncio, json, os, sys, time
from jupyter_client.manager import AsyncKernelManager
async def main():
    km = AsyncKernelManager(kernel_name="msb-python-small")
    await km.start_kernel()
    sandbox = km.provisioner.sandbox
    print(json.dumps({"kernel_id": km.kernel_id, "pids": sorted(sandbox.cgroup.pids() if sandbox.cgroup else [sandbox.init_pid]),
                      "state_dir": str(sandbox.state_dir),
                      "cgroups": [str(p) for p in (sandbox.cgroup.paths.values() if sandbox.cgroup else [])]}), flush=True)
    if sys.argv[1] == "hold":
        await asyncio.sleep(3600)
    await km.shutdown_kernel()
asyncio.run(main())
"""


async def test_kill_9_of_the_host_process_leaves_no_sandbox_after_next_start():
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(owner.stdout.readline())
    finally:
        owner.kill()  # SIGKILL: no cleanup code runs in the owner
        owner.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in started["pids"]):
        assert time.monotonic() < deadline, "sandbox processes outlived their owner"
        await asyncio.sleep(0.1)
    # Its state is still on disk; the next start of msb-kernels, in a new process, sweeps it.
    assert Path(started["state_dir"]).exists()
    next_start = subprocess.run([sys.executable, "-c", OWNER_SCRIPT, "once"], capture_output=True, text=True, timeout=120)
    assert next_start.returncode == 0, next_start.stderr[-2000:]
    assert not Path(started["state_dir"]).exists()
    assert not any(Path(p).exists() for p in started["cgroups"])


async def test_sweep_stops_a_running_sandbox_whose_owner_died(runtime_root):
    """Without the lifeline (an owner that is gone but whose sandbox still runs), the sweep kills it."""
    from msb_kernels.backends import get_backend
    from msb_kernels.backends.base import SandboxSpec
    from msb_kernels.config import load_settings
    from msb_kernels.flavors import FLAVORS

    backend = get_backend(load_settings())
    stand_in_owner = subprocess.Popen(["sleep", "60"])
    sandbox_id = str(uuid.uuid4())
    spec = SandboxSpec(sandbox_id, FLAVORS["small"], "python", ["sleep", "600"], {"PATH": "/usr/bin:/bin"},
                       backend.io_dir_for(sandbox_id), owner_pid=stand_in_owner.pid)
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
        assert km.provisioner.sandbox.pidfd >= 1024
        assert await km.is_alive()
        assert (await execute(kc, "6 * 7")).result == "42"
        await km.shutdown_kernel()
        assert not await km.is_alive()
    finally:
        for fd in padding:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
