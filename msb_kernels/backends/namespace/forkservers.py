"""The namespace backend's fork servers: one per Python kernel environment, so a kernel starts without importing.

A kernelspec whose argv is ``<python> [options] -m ipykernel_launcher ...`` gets its kernels from the fork
server of that interpreter and those options (forkserver_program.py, which runs there). A server starts with the
first such kernel, is started again when it has died or when its environment changed (a package installed
or removed: an import directory's mtime moved), counts toward no session limit, and exits when the process
that started it does (its stdin is that process's lifeline). Kernels never depend on it: once forked, a
sandbox is held by its own init (and keeper), whatever becomes of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from msb_kernels.backends.core.keeping import connect_unix, send_request
from msb_kernels.errors import SandboxError

log = logging.getLogger("msb_kernels")

FORK_SERVER = str(Path(__file__).resolve().with_name("forkserver_program.py"))
LAUNCHER_MODULE = "ipykernel_launcher"
START_TIMEOUT = 60.0
REPORT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Interpreter:
    """A Python and the options its kernels run with: what one fork server imports for."""

    python: str
    options: tuple[str, ...]

    @property
    def name(self) -> str:
        return hashlib.sha256(json.dumps([self.python, *self.options]).encode()).hexdigest()[:16]


def forkable(argv: list[str]) -> Interpreter | None:
    """The interpreter of an argv that runs ``-m ipykernel_launcher``; None for any other kernel (node, a script)."""
    try:
        index = argv.index("-m")
    except ValueError:
        return None
    if index == 0 or argv[index + 1 : index + 2] != [LAUNCHER_MODULE] or not os.path.isabs(argv[0]):
        return None
    return Interpreter(argv[0], tuple(argv[1:index]))


@dataclass
class ForkServer:
    interpreter: Interpreter
    process: subprocess.Popen
    socket_path: Path
    watched: dict[str, int]  # import directory -> its mtime before the server imported
    started: float = field(default_factory=time.time)
    forks: int = 0

    def current(self) -> bool:
        """Running, on the environment it imported: a pip install since then makes it stale."""
        if self.process.poll() is not None:
            return False
        for directory, mtime in self.watched.items():
            try:
                if os.stat(directory).st_mtime_ns != mtime:
                    return False
            except OSError:
                return False
        return True

    def stop(self) -> None:
        """Close its lifeline: it exits at once; sandboxes it forked, and launches under way, go on."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.socket_path.unlink()

    def info(self) -> dict:
        return {
            "python": self.interpreter.python,
            "options": list(self.interpreter.options),
            "pid": self.process.pid,
            "started": self.started,
            "kernels_forked": self.forks,
        }


class ForkServers:
    """The fork servers of one backend (one runtime dir), by interpreter."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._servers: dict[Interpreter, ForkServer] = {}
        self._failed: dict[Interpreter, str] = {}
        self._starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Interpreter, asyncio.Lock]] = weakref.WeakKeyDictionary()

    async def launch(self, interpreter: Interpreter, plan: dict, fds: list[int]) -> tuple[dict, socket.socket] | None:
        """Have the interpreter's server fork the sandbox: (the launcher's report, the connection to close once init's
        pidfd is held). None where this interpreter cannot have a server: the caller execs the kernel instead.

        fds go with the plan: the sandbox's stderr, then the lifeline (when the plan has one), then the listeners."""
        for attempt in (1, 2):
            server = await self._server(interpreter)
            if server is None:
                return None
            try:
                connection = await self._connect(server)
            except OSError as exc:
                if attempt == 2:
                    raise SandboxError(
                        f"cannot reach the fork server of {interpreter.python}: {exc}",
                        ["start the kernel again", "or set MSB_FORK_KERNELS=false"],
                    ) from None
                server.stop()  # dead or wedged: the next attempt starts a fresh one
                continue
            try:
                report = await send_request(connection, plan, fds, REPORT_TIMEOUT, "the fork server's launcher")
            except EOFError as exc:
                connection.close()
                raise SandboxError(f"the sandbox did not start: {exc}", ["run `msb-kernels doctor` to check this host"]) from None
            except BaseException:
                connection.close()
                raise
            server.forks += 1
            return report, connection
        return None

    async def _server(self, interpreter: Interpreter) -> ForkServer | None:
        if interpreter in self._failed:
            return None
        loop = asyncio.get_running_loop()
        lock = self._starting.setdefault(loop, {}).setdefault(interpreter, asyncio.Lock())
        async with lock:
            server = self._servers.get(interpreter)
            if server is not None and server.current():
                return server
            if server is not None:
                why = "its environment changed" if server.process.poll() is None else f"it exited ({server.process.returncode})"
                log.info("fork server of %s: starting a fresh one, %s", interpreter.python, why)
                server.stop()
                del self._servers[interpreter]
            try:
                server = await self._start(interpreter)
            except OSError as exc:
                self._failed[interpreter] = str(exc)
                log.warning("kernels of %s start without a fork server, each importing its own modules: %s", interpreter.python, exc)
                return None
            self._servers[interpreter] = server
            return server

    async def _start(self, interpreter: Interpreter) -> ForkServer:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        socket_path = self.directory / f"{interpreter.name}-{time.monotonic_ns()}.sock"
        python_dir = os.path.dirname(interpreter.python)
        # What a sandboxed kernel's environment holds, nothing of this process's: the server's environment block
        # stays in every forked kernel's memory (its /proc/self/environ), so no host variable may be in it.
        env = {
            "PATH": f"{python_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/home/sandbox",
            "USER": "sandbox",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONUNBUFFERED": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }  # debugpy warns at import of frozen modules, into the server's log
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(socket_path))  # in a directory only this user can enter
            listener.listen(128)
            with open(self.directory / f"{interpreter.name}.log", "ab") as log_file:
                process = subprocess.Popen(
                    [interpreter.python, *interpreter.options, "-s", FORK_SERVER, str(listener.fileno())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    env=env,
                    cwd="/",
                    start_new_session=True,
                    pass_fds=[listener.fileno()],
                )
        finally:
            listener.close()
        try:
            line = await self._ready_line(process)
            ready = json.loads(line or b'{"error": "it exited before it was ready"}')
        except asyncio.TimeoutError:
            process.kill()
            process.wait()
            raise OSError(f"the fork server did not answer within {START_TIMEOUT:.0f} s") from None
        except ValueError as exc:
            process.kill()
            process.wait()
            raise OSError(f"the fork server's first line is not JSON: {exc}") from None
        if "error" in ready:
            process.wait()
            raise OSError(f"the fork server could not import the kernel: {ready['error']}")
        log.info("fork server of %s ready (pid %d)", interpreter.python, process.pid)
        return ForkServer(interpreter, process, socket_path, ready["watched"])

    @staticmethod
    async def _ready_line(process: subprocess.Popen) -> bytes:
        """Its first line, read without blocking the loop: the server imports for a few hundred ms first."""
        loop = asyncio.get_running_loop()
        fd = process.stdout.fileno()
        os.set_blocking(fd, False)
        received = bytearray()
        done = loop.create_future()

        def readable() -> None:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            received.extend(chunk)
            if (not chunk or b"\n" in received) and not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(done, START_TIMEOUT)
        finally:
            loop.remove_reader(fd)
            process.stdout.close()
        return bytes(received).split(b"\n", 1)[0]

    @staticmethod
    async def _connect(server: ForkServer) -> socket.socket:
        if server.process.poll() is not None:
            raise ConnectionRefusedError(f"it exited ({server.process.returncode})")
        return await connect_unix(str(server.socket_path))

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()

    def info(self) -> list[dict]:
        return [server.info() for server in self._servers.values() if server.process.poll() is None]
