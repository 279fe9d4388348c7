"""Sandboxes that outlive their gateway: the host side of keeper.py, and the files adoption trusts.

A gateway's sandboxes are held by keepers (keeper.py), not by the gateway, so they live on
through its stop, crash or kill -9, for MSB_ADOPT_GRACE_SECONDS. The next gateway on the same
runtime dir adopts them: it reads each one's adoption record (``<state dir>/adoption.json``,
0600: the kernel's connection keys, its kernelspec, flavor, notebook and last activity),
and becomes its owner through the keeper's socket.

Adoption trusts only files that no sandbox can have written: regular files (not links)
owned by this process's user and writable by no one else, in a state dir that is the
same user's and private to it. No sandbox sees its state dir; the kernel can write only
its io dir, and nothing is read back from there.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.backends.keeper import PEERCRED
from msb_kernels.errors import SandboxError

KEEPER = str(Path(__file__).resolve().with_name("keeper.py"))
KEEPER_SOCKET = "keeper.sock"
KEEPER_LOG = "keeper.log"  # what the keeper and its closing sweep say, for an operator looking into a sandbox left behind
ADOPTION_RECORD = "adoption.json"
KEEPER_TIMEOUT = 10.0
UNIX_PATH_MAX = 107


def trusted_json(path: Path, *, private: bool) -> tuple[dict | None, str | None]:
    """The JSON in path and None, or None and why it is not to be trusted (or is missing).

    private: the file must be readable by its owner only (it holds keys)."""
    try:
        folder = os.lstat(path.parent)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except OSError as exc:
        return None, f"{path} cannot be read: {exc.strerror}"
    try:
        found = os.fstat(fd)
        problem = None
        if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid() or folder.st_mode & 0o077:
            problem = f"{path.parent} is not a directory private to uid {os.geteuid()}"
        elif not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            problem = f"{path} is not a regular file of uid {os.geteuid()}"
        elif found.st_mode & (0o077 if private else 0o022):
            problem = f"{path} is open to other users (mode {stat.S_IMODE(found.st_mode):o})"
        if problem:
            return None, problem
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = json.loads(handle.read(1 << 20))
        if not isinstance(data, dict):
            return None, f"{path} does not hold a JSON object"
        return data, None
    except (OSError, ValueError) as exc:
        return None, f"{path} is unreadable: {exc}"
    finally:
        os.close(fd)


def write_private_json(path: Path, data: dict) -> None:
    """Replace path whole with data, readable by this user only: a reader never sees half of it."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(json.dumps(data))
    temporary.replace(path)


def socket_path(state_dir: Path) -> str:
    path = str(state_dir / KEEPER_SOCKET)
    if len(path) > UNIX_PATH_MAX:
        raise SandboxError(f"the runtime dir's path is too long for a keeper socket ({path})",
                           ["set MSB_RUNTIME_DIR to a shorter path, such as /run/msb-kernels"])
    return path


def sweep_command() -> tuple[list[str], dict[str, str]]:
    """What a keeper runs after it stopped its sandbox at the end of the grace period: `msb-kernels sweep` of this
    runtime dir and backend, in this interpreter."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update({name: value for name, value in os.environ.items() if name.startswith("MSB_")})
    env.pop("MSB_TOKEN", None)
    return [sys.executable, "-m", "msb_kernels.cli", "sweep"], env


def keeper_plan(state_dir: Path, grace: float, *, sandbox_pid: int | None = None, argv: list[str] | None = None,
                lifeline_fd: int | None = None, stderr_fd: int | None = None, child_stderr_fd: int | None = None,
                sweep_env: dict[str, str] | None = None) -> dict:
    """What keeper.py is told: its socket and record, the grace period, what it holds, and the sweep it ends with."""
    sweep_argv, env = sweep_command()
    return {"socket": socket_path(state_dir), "record": str(state_dir / ADOPTION_RECORD), "grace": grace, "sandbox_pid": sandbox_pid,
            "argv": argv, "lifeline_fd": lifeline_fd, "stderr_fd": stderr_fd, "child_stderr_fd": child_stderr_fd,
            "sweep_argv": sweep_argv, "sweep_env": {**env, **(sweep_env or {})}}


async def start_keeper(state_dir: Path, grace: float, *, sandbox_pid: int | None = None, argv: list[str] | None = None,
                       lifeline_fd: int | None = None, stderr_fd: int | None = None, child_stderr_fd: int | None = None,
                       sweep_env: dict[str, str] | None = None) -> tuple[int, int | None]:
    """Start the sandbox's keeper; return (its pid, the sandbox's pid).

    Called by a backend's create. The keeper holds sandbox_pid, or starts argv as its own child
    (whose stderr is child_stderr_fd), or, with neither (a microVM), holds only the grace period.
    Its parent exits at once, so it is nobody's child here."""
    return await exec_keeper(state_dir, keeper_plan(state_dir, grace, sandbox_pid=sandbox_pid, argv=argv, lifeline_fd=lifeline_fd,
                                                    stderr_fd=stderr_fd, child_stderr_fd=child_stderr_fd, sweep_env=sweep_env))


async def exec_keeper(state_dir: Path, plan: dict) -> tuple[int, int | None]:
    """start_keeper's work for a plan already made (keeper_plan): keeper.py in an interpreter of its own."""
    fds = [plan[name] for name in ("lifeline_fd", "stderr_fd", "child_stderr_fd") if plan[name] is not None]
    log = os.open(state_dir / KEEPER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-S", "-I", KEEPER, "--detach", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=log, pass_fds=fds, start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    finally:
        os.close(log)
    assert process.stdin and process.stdout
    try:
        process.stdin.write((json.dumps(plan) + "\n").encode())
        await process.stdin.drain()
        line = await asyncio.wait_for(process.stdout.readline(), KEEPER_TIMEOUT)
    except asyncio.TimeoutError:
        raise SandboxError(f"the sandbox's keeper did not answer within {KEEPER_TIMEOUT:.0f} s") from None
    finally:
        process.stdin.close()
        await process.wait()  # the first fork, gone at once; the keeper is its child
    report = json.loads(line or b'{"error": "the sandbox\'s keeper exited without a report"}')
    if "error" in report:
        raise SandboxError(report["error"], ["run `msb-kernels doctor` to check this host"])
    return int(report["keeper"]), report["pid"]


@dataclass
class KeeperLink:
    """This process's ownership of one kept sandbox: it lasts while the connection is open."""

    connection: socket.socket
    stderr_fd: int | None  # the sandbox's stderr, handed over by the keeper
    sandbox_pid: int | None
    unowned_seconds: float
    keeper_pid: int | None = None

    @classmethod
    def own(cls, state_dir: Path, keeper_pid: int | None = None) -> KeeperLink:
        """Become the owner of the sandbox the keeper in state_dir holds; SandboxError if that cannot be."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(KEEPER_TIMEOUT)
        try:
            connection.connect(socket_path(state_dir))
            if keeper_pid is not None:
                peer_pid, _, _ = PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
                if peer_pid != keeper_pid:
                    raise SandboxError(f"the keeper socket in {state_dir} is held by pid {peer_pid}, not its keeper {keeper_pid}")
            connection.sendall(b'{"op": "own"}\n')
            message, fds, _, _ = socket.recv_fds(connection, 4096, 1)
            reply = json.loads(message or b'{"error": "the keeper hung up"}')
        except (OSError, ValueError) as exc:
            connection.close()
            raise SandboxError(f"cannot reach the keeper of the sandbox in {state_dir}: {exc}") from None
        except BaseException:
            connection.close()
            raise
        if "error" in reply:
            connection.close()
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"the keeper of the sandbox in {state_dir} refused: {reply['error']}")
        connection.setblocking(False)
        return cls(connection, fds[0] if fds else None, reply.get("pid"), float(reply.get("unowned_seconds", 0)), keeper_pid)

    def close(self) -> None:
        """Give the sandbox up: the keeper's grace period starts (it ends at once if the sandbox is gone)."""
        self.connection.close()

    def release(self) -> None:
        """The sandbox is removed: its keeper exits (for a sandbox it cannot see end, such as a microVM)."""
        try:
            self.connection.setblocking(True)
            self.connection.sendall(b"gone\n")
        except OSError:
            pass
        self.connection.close()
