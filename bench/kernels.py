"""Direct jupyter_client kernels: start, stop, time a round trip, and count every host process and byte they hold."""

from __future__ import annotations

import contextlib
import queue
import time
from pathlib import Path
from typing import Any


async def start_kernel(
    name: str, timeout: float = 120, extra_arguments: list[str] | None = None, context: Any = None
) -> tuple[float, Any, Any]:
    """create -> first kernel_info reply; returns (seconds, manager, client), the client ready for iopub too.
    extra_arguments: added to the kernelspec's command line (jupyter_client's own parameter). context: a zmq.asyncio
    context for the manager (jupyter_client's default: one of its own per manager, an I/O thread each).

    Timed to the reply itself: jupyter_client's wait_for_ready then waits 0.2 s or more for iopub, for every kernel alike."""
    from jupyter_client.manager import AsyncKernelManager

    started = time.perf_counter()
    km = AsyncKernelManager(kernel_name=name, **({"context": context} if context is not None else {}))
    await km.start_kernel(extra_arguments=extra_arguments or [])
    kc = km.client()
    kc.start_channels()
    try:
        elapsed = await first_kernel_info_reply(km, kc, started, timeout)
        await kc.wait_for_ready(timeout=timeout)
    except BaseException:
        kc.stop_channels()
        with contextlib.suppress(Exception):
            await km.shutdown_kernel(now=True)
        raise
    return elapsed, km, kc


class KernelDied(RuntimeError):
    """The kernel process exited before its first kernel_info reply."""


async def start_kernel_again_if_it_dies(name: str, timeout: float = 120, attempts: int = 3) -> tuple[int, Any, Any]:
    """start_kernel, started again (up to ``attempts`` in all) when the kernel dies before it answers; returns
    (starts it took, manager, client).

    jupyter_client picks a kernel's TCP ports by binding and releasing them, and another process can take one
    before the kernel binds it ("Address already in use"); in a burst of bare kernels that happens now and then.
    A user would start such a kernel again, so the burst does, and its time includes the failed start."""
    for attempt in range(1, attempts + 1):
        try:
            _, km, kc = await start_kernel(name, timeout)
            return attempt, km, kc
        except KernelDied:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


async def first_kernel_info_reply(km: Any, kc: Any, started: float, timeout: float) -> float:
    """Seconds from started to the first kernel_info reply. The request goes again at a growing interval, as
    wait_for_ready sends it again, since a kernel's ports can be lost to a race; a kernel that died raises."""
    deadline = started + timeout
    interval = 0.05
    while time.perf_counter() < deadline:
        kc.kernel_info()
        try:
            while True:
                reply = await kc.get_shell_msg(timeout=interval)
                if reply["msg_type"] == "kernel_info_reply":
                    return time.perf_counter() - started
        except queue.Empty:
            pass
        if not await km.is_alive():
            raise KernelDied(f"kernel {km.kernel_id} died before it answered kernel_info")
        interval = min(interval * 2, 1.0)
    raise TimeoutError(f"kernel {km.kernel_id} did not answer kernel_info within {timeout:.0f} s")


async def stop_kernel(km: Any, kc: Any) -> None:
    if kc is not None:
        kc.stop_channels()
    with contextlib.suppress(Exception):
        await km.shutdown_kernel(now=True)


async def drain_iopub(kc: Any) -> None:
    while True:
        try:
            await kc.get_iopub_msg(timeout=0)
        except queue.Empty:
            return


async def execute_rtt(kc: Any, code: str = "1+1") -> float:
    started = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        reply = await kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    elapsed = time.perf_counter() - started
    assert reply["content"]["status"] == "ok", reply["content"]
    return elapsed


async def execute_to_idle(kc: Any, code: str = "1+1") -> float:
    """A direct client doing what execute_code does: the reply, the result (on iopub) and the idle status that says
    the output is complete. execute_rtt stops at the reply, before the result has been read."""
    await drain_iopub(kc)
    started = time.perf_counter()
    msg_id = kc.execute(code)
    replied = idle = False
    result = None
    while not replied:
        reply = await kc.get_shell_msg(timeout=60)
        replied = reply["parent_header"].get("msg_id") == msg_id
    while not idle:
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "execute_result":
            result = message["content"]["data"].get("text/plain")
        idle = message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"
    elapsed = time.perf_counter() - started
    assert reply["content"]["status"] == "ok" and result is not None, (reply["content"], result)
    return elapsed


async def first_stdout(kc: Any) -> float:
    """execute print('x') -> the first stdout stream message on iopub."""
    await drain_iopub(kc)
    started = time.perf_counter()
    msg_id = kc.execute("print('x')")
    while True:
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            elapsed = time.perf_counter() - started
            break
    while (await kc.get_shell_msg(timeout=60))["parent_header"].get("msg_id") != msg_id:
        pass
    return elapsed


def _kib_field(path: str, field: str) -> int:
    """A "Name:  123 kB" line of a /proc file, in bytes; 0 for a process that is gone."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    return _kib_field(f"/proc/{pid}/status", "VmRSS:")


def process_children() -> dict[int, list[int]]:
    """Every host process's children, from one pass over /proc (a thousand sandboxes' trees need only one)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int, children: dict[int, list[int]] | None = None) -> set[int]:
    children = process_children() if children is None else children
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kernel_processes(km: Any) -> set[int]:
    """Every host process a kernel consists of: the sandbox's cgroup and init's tree, or the bare kernel's tree."""
    provisioner = km.provisioner
    sandbox = getattr(provisioner, "sandbox", None)
    if sandbox is not None:
        pids = set(descendants(sandbox.init_pid))
        if getattr(sandbox, "cgroup", None) is not None:
            pids |= sandbox.cgroup.pids()
        return pids
    return descendants(provisioner.process.pid)


def kernel_rss(km: Any) -> int:
    return sum(rss_bytes(pid) for pid in kernel_processes(km))


def pss_bytes(pid: int) -> int:
    """Proportional set size: pages shared with other processes (a fork server's, siblings') count by their share."""
    return _kib_field(f"/proc/{pid}/smaps_rollup", "Pss:")


def uss_bytes(pid: int) -> int:
    """Pages only this process maps: what its end would give back."""
    rollup = f"/proc/{pid}/smaps_rollup"
    return _kib_field(rollup, "Private_Dirty:") + _kib_field(rollup, "Private_Clean:")


def kernel_memory(km: Any) -> dict[str, int]:
    """RSS, PSS and USS in bytes of every process a kernel consists of (found once), and how many there are."""
    pids = kernel_processes(km)
    return {
        "rss": sum(rss_bytes(pid) for pid in pids),
        "pss": sum(pss_bytes(pid) for pid in pids),
        "uss": sum(uss_bytes(pid) for pid in pids),
        "processes": len(pids),
    }
