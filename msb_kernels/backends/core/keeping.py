"""Sandboxes that outlive their gateway: the host side of keeper_program.py, and the files adoption trusts.

A gateway's sandboxes are held by the keeper of its runtime dir (keeper_program.py, one process for all of
them), not by the gateway, so they live on through its stop, crash or kill -9, for
MSB_ADOPT_GRACE_SECONDS. The next gateway on the same runtime dir adopts them: it reads each one's
adoption record (``<state dir>/adoption.json``, 0600: the kernel's connection keys, its kernelspec,
flavor, notebook, the person who started it and last activity: the gateway's KernelRecord.to_adoption), and
becomes the sandbox's owner through its keeper socket.

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
import weakref
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.backends.core.keeper_program import LENGTH, PEERCRED, PLAN_FDS
from msb_kernels.errors import SandboxError

KEEPER = str(Path(__file__).resolve().with_name("keeper_program.py"))
KEEPER_SOCKET = "keeper.sock"
KEEPERS_SOCKET = "keepers.sock"  # in the runtime dir of a backend: where its gateway hands sandboxes to their keeper
KEEPERS_LOG = "keepers.log"  # what the keeper says; each sandbox's closing sweep writes to keeper.log in its state dir
ADOPTION_RECORD = "adoption.json"
KEEPER_TIMEOUT = 10.0
DOCTOR_HINT = "run `msb-kernels doctor` to check this host"
UNIX_PATH_MAX = 107


def trusted_json(path: Path, *, private: bool) -> tuple[dict | None, str | None]:
    """The JSON in path and None, or None and why it is not to be trusted (or is missing).

    private: the file must be readable by its owner only (it holds keys)."""
    try:
        folder = os.lstat(path.parent)
        # O_NONBLOCK: a FIFO put there opens at once (and is refused below), where a plain open waited for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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


def socket_path(directory: Path, name: str = KEEPER_SOCKET) -> str:
    """A keeper socket: a sandbox's own in its state dir, or (KEEPERS_SOCKET) the keeper's in the runtime dir."""
    path = str(directory / name)
    if len(path) > UNIX_PATH_MAX:
        raise SandboxError(
            f"the runtime dir's path is too long for a keeper socket ({path})",
            ["set MSB_RUNTIME_DIR to a shorter path, such as /run/msb-kernels"],
        )
    return path


def sweep_command() -> tuple[list[str], dict[str, str]]:
    """What a keeper runs after it stopped its sandbox at the end of the grace period: `msb-kernels sweep` of this
    runtime dir and backend, in this interpreter."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update({name: value for name, value in os.environ.items() if name.startswith("MSB_")})
    env.pop("MSB_TOKEN", None)
    return [sys.executable, "-m", "msb_kernels.cli", "sweep"], env


def keeper_plan(
    state_dir: Path,
    grace: float,
    *,
    sandbox_pid: int | None = None,
    argv: list[str] | None = None,
    lifeline_fd: int | None = None,
    stderr_fd: int | None = None,
    child_stderr_fd: int | None = None,
    sweep_env: dict[str, str] | None = None,
) -> dict:
    """What keeper_program.py is told: its socket and record, the grace period, what it holds, and the sweep it ends with."""
    sweep_argv, env = sweep_command()
    return {
        "socket": socket_path(state_dir),
        "record": str(state_dir / ADOPTION_RECORD),
        "grace": grace,
        "sandbox_pid": sandbox_pid,
        "argv": argv,
        "lifeline_fd": lifeline_fd,
        "stderr_fd": stderr_fd,
        "child_stderr_fd": child_stderr_fd,
        "sweep_argv": sweep_argv,
        "sweep_env": {**env, **(sweep_env or {})},
    }


async def start_keeper(
    state_dir: Path,
    grace: float,
    *,
    sandbox_pid: int | None = None,
    argv: list[str] | None = None,
    lifeline_fd: int | None = None,
    stderr_fd: int | None = None,
    child_stderr_fd: int | None = None,
    sweep_env: dict[str, str] | None = None,
) -> tuple[int, int | None]:
    """Have the keeper of the runtime dir hold the sandbox in state_dir; return (the keeper's pid, the sandbox's pid).

    Called by a backend's create. The keeper holds sandbox_pid, or starts argv as its own child (whose stderr is
    child_stderr_fd), or, with neither (a microVM), holds only the grace period. The descriptors are the keeper's
    once this returns; the caller closes its own copies."""
    plan = keeper_plan(
        state_dir,
        grace,
        sandbox_pid=sandbox_pid,
        argv=argv,
        lifeline_fd=lifeline_fd,
        stderr_fd=stderr_fd,
        child_stderr_fd=child_stderr_fd,
        sweep_env=sweep_env,
    )
    fds = [plan[name] for name in PLAN_FDS if plan.get(name) is not None]
    path = socket_path(state_dir.parent, KEEPERS_SOCKET)
    async with _keeper_lock(path):
        for attempt in (1, 2):
            connection = _keeper_connections.get(path)
            try:
                if connection is None:
                    connection = _keeper_connections[path] = await _connect_keeper(state_dir.parent, path)
                answer = await send_request(connection, plan, fds, KEEPER_TIMEOUT, "the keeper")
                break
            except (OSError, EOFError) as exc:  # a keeper killed since: the next attempt starts a fresh one
                _forget_keeper(path, connection)
                if attempt == 2:
                    raise SandboxError(f"cannot hand the sandbox to its keeper: {exc}", [DOCTOR_HINT]) from None
            except BaseException:
                _forget_keeper(path, connection)
                raise
    if "error" in answer:
        raise SandboxError(answer["error"], [DOCTOR_HINT])
    return int(answer["keeper"]), answer["pid"]


# This process's connection to the keeper of each runtime dir it started sandboxes in: open while it lives, so the
# keeper waits for its next sandbox; the keeper exits once no gateway is connected and it holds nothing.
_keeper_connections: dict[str, socket.socket] = {}
_keeper_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()


def _keeper_lock(path: str) -> asyncio.Lock:
    return _keeper_locks.setdefault(asyncio.get_running_loop(), {}).setdefault(path, asyncio.Lock())


def _forget_keeper(path: str, connection: socket.socket | None) -> None:
    _keeper_connections.pop(path, None)
    if connection is not None:
        connection.close()


def disconnect_keepers() -> None:
    """This process hands no more sandboxes over: each keeper it reached exits once it holds none."""
    for connection in _keeper_connections.values():
        connection.close()
    _keeper_connections.clear()


async def _connect_keeper(root: Path, path: str) -> socket.socket:
    """A connection to the runtime dir's keeper, started first when none listens."""
    try:
        return await connect_unix(path)
    except (FileNotFoundError, ConnectionRefusedError):
        pass  # none yet, or one killed before it could remove its socket
    log = os.open(root / KEEPERS_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-S",
            "-I",
            KEEPER,
            "--serve",
            path,
            "--detach",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
    finally:
        os.close(log)
    assert process.stdout
    try:
        line = await asyncio.wait_for(process.stdout.readline(), KEEPER_TIMEOUT)
    except asyncio.TimeoutError:
        raise SandboxError(f"the keeper did not answer within {KEEPER_TIMEOUT:.0f} s") from None
    finally:
        await process.wait()  # the first fork, gone at once; the keeper is its child
    report = json.loads(line or b'{"error": "the keeper exited without a report"}')
    if "error" in report:
        raise SandboxError(report["error"], [DOCTOR_HINT])
    return await connect_unix(path)


async def connect_unix(path: str) -> socket.socket:
    """A non-blocking connection to a Unix socket, made without blocking the loop (the keeper's, a fork server's)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(connection, path)
    except BaseException:
        connection.close()
        raise
    return connection


async def send_request(connection: socket.socket, plan: dict, fds: list[int], timeout: float, peer: str) -> dict:
    """One request (keeper.receive_request reads it) and its one-line JSON answer, on a non-blocking connection."""
    loop = asyncio.get_running_loop()
    body = json.dumps(plan).encode()
    message = LENGTH.pack(len(body)) + body
    sent = socket.send_fds(connection, [message[:65536]], fds)  # a Unix socket takes this much at once from a new connection
    await loop.sock_sendall(connection, message[sent:])
    received = bytearray()

    async def answer_line() -> bytes:
        while b"\n" not in received:
            chunk = await loop.sock_recv(connection, 65536)
            if not chunk:
                raise EOFError(f"{peer} hung up before it answered")
            received.extend(chunk)
        return bytes(received).split(b"\n", 1)[0]

    try:
        line = await asyncio.wait_for(answer_line(), timeout)
    except asyncio.TimeoutError:
        raise SandboxError(f"{peer} did not answer within {timeout:.0f} s") from None
    return json.loads(line)


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
            raise SandboxError(
                f"cannot reach the keeper of the sandbox in {state_dir}: {exc}",
                ["start the kernel again: a keeper that died (killed while it took the sandbox) is started afresh", DOCTOR_HINT],
            ) from None
        except BaseException:
            connection.close()
            raise
        if "error" in reply:
            connection.close()
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"the keeper of the sandbox in {state_dir} refused: {reply['error']}", [DOCTOR_HINT])
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
