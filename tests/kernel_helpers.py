"""Talking to a real kernel over its channels: execute and collect what comes back."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient


@dataclass
class Execution:
    reply: dict
    messages: list[dict] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)  # monotonic time each iopub message arrived

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

    def of_type(self, msg_type: str) -> list[dict]:
        return [m for m in self.messages if m["msg_type"] == msg_type]

    @property
    def result(self) -> Any:
        results = self.of_type("execute_result")
        return results[0]["content"]["data"]["text/plain"] if results else None

    @property
    def value(self) -> Any:
        """The execute_result as a Python value (it must be a literal)."""
        return ast.literal_eval(self.result)

    @property
    def traceback(self) -> str:
        """The error's traceback without terminal colours."""
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.error["traceback"])) if self.error else ""

    @property
    def error(self) -> dict | None:
        errors = self.of_type("error")
        return errors[0]["content"] if errors else None


async def execute(kc: AsyncKernelClient, code: str, timeout: float = 60, stdin_answer: str | None = None) -> Execution:
    """Run code and collect its iopub messages until the kernel is idle again."""
    msg_id = kc.execute(code, allow_stdin=stdin_answer is not None)
    execution = Execution(reply={})
    deadline = time.monotonic() + timeout
    idle = False
    while not idle:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no idle status within {timeout} s for {code[:60]!r}")
        if stdin_answer is not None:
            try:
                request = await kc.get_stdin_msg(timeout=0.05)
                kc.input(stdin_answer)
                execution.messages.append(request)
                stdin_answer = None
            except Exception:  # no input request yet (queue.Empty or a timeout)
                pass
        try:
            message = await kc.get_iopub_msg(timeout=min(remaining, 0.2))
        except Exception:
            continue
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "status":
            idle = message["content"]["execution_state"] == "idle"
            continue
        execution.messages.append(message)
        execution.arrival.append(time.monotonic())
    while True:
        reply = await kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            execution.reply = reply
            return execution


async def open_outcomes(kc: AsyncKernelClient, paths: list[str]) -> list[str]:
    """Try to read each path inside the kernel: its content, or the name of the error."""
    code = (
        "def _msb_probe(path):\n"
        "    try:\n"
        "        return open(path).read()\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"[_msb_probe(p) for p in {paths!r}]"
    )
    return (await execute(kc, code)).value


async def connect_outcomes(kc: AsyncKernelClient, targets: list[tuple[str, int]], timeout: float = 3) -> list[str]:
    """Try a TCP connection to each (host, port) from inside the kernel: 'connected' or the error's name."""
    code = (
        "import socket\n"
        "def _msb_attempt(host, port):\n"
        "    try:\n"
        f"        socket.create_connection((host, port), timeout={timeout}).close()\n"
        "        return 'connected'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"[_msb_attempt(h, p) for h, p in {targets!r}]"
    )
    return (await execute(kc, code, timeout=60)).value


def live_processes(program: str, argument: str | None = None) -> list[int]:
    """Host pids of running (not zombie) processes of program, optionally with argument on their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and argv[0].endswith(program.encode()) and (argument is None or argument.encode() in argv):
                found.append(int(entry.name))
    return found


class HostListener:
    """A TCP port open on the host (every interface) that records whoever connects."""

    def __init__(self) -> None:
        import socket
        import threading

        self.server = socket.socket()
        self.server.bind(("0.0.0.0", 0))
        self.server.listen()
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self.server.accept())
            except OSError:
                pass

    def __enter__(self) -> HostListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


async def assert_unanswered_without_keys(km: Any) -> None:
    """A client without the CurveZMQ keys gets no answer: the kernel's channels really are encrypted."""
    import zmq

    plain = km.client(curve_publickey=None, curve_secretkey=None)
    plain.start_channels()
    # Its handshakes fail, so the shell socket may have no peer at the moment it sends, and a DEALER then blocks
    # in send for ever: a send timeout turns that into zmq.Again, which is no answer too.
    plain.shell_channel.socket.setsockopt(zmq.SNDTIMEO, 3000)
    try:
        with pytest.raises((TimeoutError, asyncio.TimeoutError, zmq.Again)):
            await plain.kernel_info(reply=True, timeout=3)
    finally:
        plain.stop_channels()


async def interrupt_busy_loop(km: Any, kc: AsyncKernelClient) -> dict:
    """Start `while True: pass`, interrupt it once it runs, and return the execute reply."""
    msg_id = kc.execute("print('looping', flush=True)\nwhile True: pass")
    while True:  # interrupt only once the loop runs
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            break
    await km.interrupt_kernel()
    reply = await kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    # ipykernel aborts what reaches it until its stop-on-error callback has run: at once on an idle host, later on a
    # busy one (the swarm's contract suite, beside another worker, got "aborted" for the next cell). Wait that out.
    for _ in range(100):
        probe = kc.execute("", silent=True)
        while (answer := await kc.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != probe:
            pass
        if answer["content"]["status"] != "aborted":
            break
        await asyncio.sleep(0.1)
    return reply


# A separate process that starts one sandboxed kernel, prints where its sandbox lives, and either
# holds it (argv[1] == 'hold', until killed) or shuts it down. Tests kill it to leave orphans.
OWNER_SCRIPT = """
import asyncio, json, os, sys, time
from jupyter_client.manager import AsyncKernelManager
async def main():
    km = AsyncKernelManager(kernel_name="msb-python-small")
    await km.start_kernel()
    sandbox = km.provisioner.sandbox
    print(json.dumps({"kernel_id": km.kernel_id, "pids": sorted(sandbox.cgroup.pids() if sandbox.cgroup else [sandbox.init_pid]),
                      "state_dir": str(sandbox.state_dir),
                      "cgroups": [str(p) for p in (sandbox.cgroup.paths.values() if sandbox.cgroup else [])],
                      "fork_servers": [s["pid"] for s in km.provisioner.backend.stats().get("fork_servers", [])]}), flush=True)
    if sys.argv[1] == "hold":
        await asyncio.sleep(3600)
    await km.shutdown_kernel()
asyncio.run(main())
"""


def write_attempts(blocked: list[str], allowed: list[str]) -> str:
    """Kernel code whose value is ({path: outcome} for blocked, the same for allowed); outcome is
    "written" or the OSError's class name. Each written file is removed again."""
    return (
        "import os\n"
        "def attempt(path):\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('x')\n"
        "        os.remove(path)\n"
        "        return 'written'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        f"({{p: attempt(p) for p in {blocked!r}}}, {{p: attempt(os.path.expanduser(p)) for p in {allowed!r}}})"
    )


async def assert_kill_9_of_the_owner_leaves_no_sandbox(grace_seconds: float) -> dict:
    """A kernel started by another process, which is then killed with SIGKILL (no cleanup code runs):
    the sandbox's host processes, and the owner's fork servers, end within grace_seconds, and its keeper
    sweeps its state and cgroups within 30 s more, with no new start (issue 58). MSB_BACKEND picks the
    backend. Returns what the owner said of its kernel."""
    import json
    import os
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    assert started["pids"], "the sandbox had no host processes to watch"
    deadline = time.monotonic() + grace_seconds
    while any(os.path.exists(f"/proc/{pid}") for pid in started["pids"] + started["fork_servers"]):
        assert time.monotonic() < deadline, "sandbox processes or fork servers outlived their owner"
        await asyncio.sleep(0.1)
    while Path(started["state_dir"]).exists() or any(Path(p).exists() for p in started["cgroups"]):
        assert time.monotonic() < deadline + 30, "the dead owner's sandbox was left for a later start to sweep"
        await asyncio.sleep(0.2)
    return started
