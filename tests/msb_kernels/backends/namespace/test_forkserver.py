"""Forked kernels (forkserver.py, forkservers.py): what they must not share, and how the servers come and go.

Every other namespace test starts its Python kernels this way too (MSB_FORK_KERNELS is on by default), so the
sandbox's escape tests, limits, interrupts and restarts all run against forked kernels.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sysconfig
import uuid
from pathlib import Path

import pytest

from tests.kernel_helpers import assert_kill_9_of_the_owner_leaves_no_sandbox, execute

pytestmark = pytest.mark.asyncio

# Every descriptor the kernel holds, as readlink shows it: pipes and sockets by inode, files by path.
FD_TARGETS = (
    "import os\n"
    "def fd_targets():\n"
    "    found = {}\n"
    "    for name in os.listdir('/proc/self/fd'):\n"
    "        try:\n"
    "            found[int(name)] = os.readlink(f'/proc/self/fd/{name}')\n"
    "        except OSError:\n"
    "            pass  # the directory listdir held open\n"
    "    return found\n"
    "fd_targets()"
)


def fork_servers(km) -> list[dict]:
    return km.provisioner.backend.stats()["fork_servers"]


def host_fd_targets(pid: int) -> set[str]:
    targets = set()
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.add(os.readlink(entry))
        except OSError:
            continue
    return targets


def kernel_host_pid(km) -> int:
    """The kernel process: init's only child besides a relay."""
    init = km.provisioner.sandbox.init_pid
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    return int(children[-1])


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def waiting_launcher(server_pid: int, other_than: int | None = None) -> int:
    """The launcher the server keeps forked ahead: once a start's launcher has exited, its only child."""
    for _ in range(200):
        waiting = children(server_pid)
        if len(waiting) == 1 and waiting[0] != other_than:
            return waiting[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"the fork server {server_pid} has children {children(server_pid)}, not one waiting launcher")


def anonymous(targets) -> set[str]:
    """Pipes and sockets, by inode: what could only be shared by inheritance, not opened again by a path."""
    return {t for t in targets if t.startswith(("pipe:[", "socket:["))}


async def test_a_forked_kernel_holds_nothing_of_the_server_or_a_sibling(start_kernel, runtime_root):
    km_a, kc_a = await start_kernel()
    km_b, kc_b = await start_kernel()
    assert km_a.provisioner.sandbox.info()["forked"] and km_b.provisioner.sandbox.info()["forked"]
    (server,) = fork_servers(km_a)
    inside = (await execute(kc_a, FD_TARGETS)).value
    server_fds = anonymous(host_fd_targets(server["pid"]))
    sibling_fds = anonymous(host_fd_targets(kernel_host_pid(km_b)))
    assert server_fds and sibling_fds
    assert not anonymous(inside.values()) & (server_fds | sibling_fds), inside
    assert not [t for t in inside.values() if str(runtime_root) in t or "forkserver" in t], inside
    # The same descriptors as a kernel started by exec, by kind: nothing extra came through the fork.
    assert sorted(inside)[:3] == [0, 1, 2]

    # Not the server's numbers, and not each other's: random is reseeded in every child.
    draws = [(await execute(kc, "import random; random.getrandbits(64)")).value for kc in (kc_a, kc_b)]
    assert draws[0] != draws[1]
    sessions = []
    for kc in (kc_a, kc_b):
        msg_id = kc.kernel_info()
        reply = await kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        sessions.append(reply["header"]["session"])
    assert sessions[0] != sessions[1]

    # Neither the server, the launcher it keeps forked ahead, nor a sibling can be named, signalled, traced or read.
    targets = [server["pid"], await waiting_launcher(server["pid"]), kernel_host_pid(km_b), km_b.provisioner.sandbox.init_pid]
    attempts = (
        await execute(
            kc_a,
            (
                "import ctypes, os\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "def attempt(pid):\n"
                "    outcome = []\n"
                "    try:\n"
                "        os.kill(pid, 0)\n"
                "        outcome.append('signalled')\n"
                "    except OSError as exc:\n"
                "        outcome.append(type(exc).__name__)\n"
                "    outcome.append('ptrace ok' if libc.ptrace(16, pid, 0, 0) == 0 else os.strerror(ctypes.get_errno()))\n"
                "    outcome.append(os.path.exists(f'/proc/{pid}/mem'))\n"
                "    return outcome\n"
                f"[attempt(pid) for pid in {targets!r}]"
            ),
        )
    ).value
    assert all(outcome == ["ProcessLookupError", "No such process", False] for outcome in attempts), attempts
    assert os.path.exists(f"/proc/{server['pid']}")

    # The server's environment block stays in a forked kernel's memory: it holds nothing of the host's.
    environ = (await execute(kc_a, "open('/proc/self/environ').read().split(chr(0))")).value
    assert not [v for v in environ if v.startswith(("MSB_RUNTIME", "JUPYTER_", "MSB_TOKEN"))], environ
    assert (await execute(kc_a, "import os; os.environ['MSB_FLAVOR']")).value == "small"


async def test_a_killed_fork_server_is_replaced_and_its_kernels_live_on(start_kernel):
    km_a, kc_a = await start_kernel()
    await execute(kc_a, "kept = 41")
    (server,) = fork_servers(km_a)
    waiting = await waiting_launcher(server["pid"])
    os.kill(server["pid"], signal.SIGKILL)
    while os.path.exists(f"/proc/{server['pid']}") and "Z" not in Path(f"/proc/{server['pid']}/stat").read_text().split(")")[1][:3]:
        await asyncio.sleep(0.05)
    assert (await execute(kc_a, "kept + 1")).value == 42
    for _ in range(100):  # the launcher it kept waiting holds no sandbox: it ends with the server
        if not os.path.exists(f"/proc/{waiting}/stat") or ") Z" in Path(f"/proc/{waiting}/stat").read_text():
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the waiting launcher {waiting} outlived its fork server")
    km_b, kc_b = await start_kernel()
    assert km_b.provisioner.sandbox.info()["forked"]
    (fresh,) = fork_servers(km_b)
    assert fresh["pid"] != server["pid"]
    assert (await execute(kc_b, "1 + 1")).value == 2
    assert (await execute(kc_a, "kept")).value == 41


async def test_the_server_keeps_a_launcher_forked_ahead_and_replaces_one_that_dies(start_kernel):
    """No start waits for a fork of the server: a launcher forked ahead takes the connection, and the server forks
    the next one after it; one killed while it waits is replaced, and the next start is served as usual."""
    km_a, _ = await start_kernel()
    (server,) = fork_servers(km_a)
    first = await waiting_launcher(server["pid"])
    km_b, kc_b = await start_kernel()
    after_start = await waiting_launcher(server["pid"], other_than=first)  # the start took the one that waited
    assert not os.path.exists(f"/proc/{first}/stat") or ") Z" in Path(f"/proc/{first}/stat").read_text()
    os.kill(after_start, signal.SIGKILL)
    await waiting_launcher(server["pid"], other_than=after_start)
    km_c, kc_c = await start_kernel()
    assert km_c.provisioner.sandbox.info()["forked"] and fork_servers(km_c)[0]["pid"] == server["pid"]
    assert fork_servers(km_c)[0]["kernels_forked"] == server["kernels_forked"] + 2
    assert [(await execute(kc, "1 + 1")).value for kc in (kc_b, kc_c)] == [2, 2]


async def test_a_package_installed_in_the_kernels_environment_gets_a_fresh_fork_server(start_kernel):
    km_a, _ = await start_kernel()
    (before,) = fork_servers(km_a)
    package = Path(sysconfig.get_paths()["purelib"]) / f"msb_forktest_{uuid.uuid4().hex[:8]}.py"
    package.write_text("ANSWER = 42\n")
    try:
        km_b, kc_b = await start_kernel()
        (after,) = fork_servers(km_b)
        assert after["pid"] != before["pid"]
        assert not os.path.exists(f"/proc/{before['pid']}") or "Z" in Path(f"/proc/{before['pid']}/stat").read_text()
        assert (await execute(kc_b, f"import {package.stem}; {package.stem}.ANSWER")).value == 42
    finally:
        package.unlink()
    km_c, kc_c = await start_kernel()
    assert fork_servers(km_c)[0]["pid"] != after["pid"]  # removing it is a change too
    assert (await execute(kc_c, f"import importlib.util; importlib.util.find_spec({package.stem!r}) is None")).value is True


async def test_without_fork_kernels_each_kernel_starts_its_own_interpreter(start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_FORK_KERNELS", "false")
    km, kc = await start_kernel()
    assert km.provisioner.sandbox.info()["forked"] is False
    cmdline = (await execute(kc, "open('/proc/self/cmdline').read().split(chr(0))")).value
    assert cmdline[1:3] == ["-m", "ipykernel_launcher"]


async def test_the_fork_server_ends_with_the_process_that_started_it():
    started = await assert_kill_9_of_the_owner_leaves_no_sandbox(grace_seconds=10)
    assert started["fork_servers"], "the owner's kernel was not forked"


def parsed(app_class: type, arguments: list[str]) -> dict:
    app = app_class()
    app.parse_command_line(arguments)
    return {
        "cli_config": app.cli_config,
        "config": app.config,
        "extra_args": app.extra_args,
        "argv": app.argv,
        "connection_file": app.connection_file,
        "exec_files": app.exec_files,
    }


async def test_a_forked_kernel_reads_the_provisioners_command_line_as_traitlets_does(start_kernel):
    """The forked kernel's app takes the provisioner's own command line without traitlets' argparse parser: it must
    end with what traitlets' parse gives, and hand any other command line to traitlets."""
    from ipykernel.kernelapp import IPKernelApp

    from msb_kernels.backends.namespace import forkserver_program as forkserver
    from msb_kernels.kernelspecs.templates import TEMPLATES

    km, kc = await start_kernel()
    guest_argv = (await execute(kc, "from ipykernel.kernelapp import IPKernelApp; IPKernelApp.instance().argv")).value
    template = TEMPLATES["python"]
    # Its own copy of the connection file (ipykernel may rewrite it), the startup file where the host wrote it.
    assert guest_argv == ["-f", "/run/kernel/connection.json", *template.launch_arguments("/run/msb/msb_startup.py")]
    assert forkserver._provisioner_command_line(guest_argv) is not None, "the provisioner's command line would be parsed by argparse"

    fast = forkserver.kernel_app_class()
    assert fast.__name__ == "IPKernelApp" and issubclass(fast, IPKernelApp)
    assert parsed(fast, guest_argv) == parsed(IPKernelApp, guest_argv)
    for other in (
        ["-f", "/k.json", "--debug"],
        ["-f", "/k.json", "script.py"],
        ["--IPKernelApp.exec_files=/s.py"],
        ["-f", "/k.json", "--IPKernelApp.exec_files=/a.py", "--IPKernelApp.exec_files=/b.py"],
        ["-f", "/k.json", "--HistoryManager.hist_file=:memory:", "--HistoryManager.hist_file=/h.sqlite"],
        ["-f", "/k.json", "--HistoryManager.enabled=False"],
    ):
        assert forkserver._provisioner_command_line(other) is None, other
        assert parsed(fast, other) == parsed(IPKernelApp, other)
