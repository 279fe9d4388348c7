"""Hibernation of gVisor kernels (issue 29), in one run, as root with runsc:

    .venv/bin/python bench/hibernation.py --rounds 3 --sessions 100 --concurrent 10

1. Cold start to first reply: a plain local ipykernel, and a gVisor kernel over its network stack (MSB_TRANSPORT=tcp,
   which hibernation needs).
2. For an idle kernel and for one holding 500 MiB of numpy arrays (random: runsc compresses its image): checkpoint time (the image sealed with a key, and
   written out of the page cache), image size, and restore to the first execute reply; ratios to the cold start.
3. Capacity: --sessions kernels started and hibernated one after another, with the host's used memory (MemTotal -
   MemAvailable) read before and after; then --concurrent of them restored at once, each to its first reply, and the
   state each set read back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate, meminfo_mib, raise_host_limits
from bench.kernels import start_kernel, stop_kernel
from msb_kernels.gateway.kernels.hibernation import reconnect_of


def used_mib() -> int:
    return (meminfo_mib("MemTotal") or 0) - (meminfo_mib("MemAvailable") or 0)


async def run(code: str, kc, timeout: float = 300) -> tuple[float, str]:
    """Seconds to the execute reply, and what it printed."""
    printed: list[str] = []

    def hook(message: dict) -> None:
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])

    started = time.perf_counter()
    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r}: {reply['content']}")
    return time.perf_counter() - started, "".join(printed)


async def cold_starts(rounds: int) -> dict:
    bare, gvisor = [], []
    for _ in range(rounds):
        elapsed, km, kc = await start_kernel("python3")
        bare.append(elapsed)
        await stop_kernel(km, kc)
        elapsed, km, kc = await start_kernel("msb-python-small")
        gvisor.append(elapsed)
        await stop_kernel(km, kc)
    return {"bare_ipykernel_s": statistics.median(bare), "gvisor_tcp_s": statistics.median(gvisor)}


async def cycle(setup: str, check: str, expect: str, rounds: int) -> dict:
    """Start, set state, then rounds of hibernate and restore-to-first-reply."""
    _, km, kc = await start_kernel("msb-python-small")
    try:
        await run(setup, kc)
        sandbox = km.provisioner.sandbox
        awake = sandbox.memory_bytes() or 0
        checkpoints, restores, sizes = [], [], []
        for _ in range(rounds):
            started = time.perf_counter()
            sizes.append(await sandbox.hibernate(reconnect_of(km)))
            checkpoints.append(time.perf_counter() - started)
            asleep = sandbox.memory_bytes() or 0
            started = time.perf_counter()
            await sandbox.wake(reconnect_of(km))
            _, printed = await run(check, kc)
            restores.append(time.perf_counter() - started)
            assert printed == expect, (printed, expect)
        return {
            "memory_awake_mib": awake / 2**20,
            "memory_hibernated_mib": asleep / 2**20,
            "checkpoint_s": statistics.median(checkpoints),
            "image_mib": statistics.median(sizes) / 2**20,
            "restore_to_reply_s": statistics.median(restores),
        }
    finally:
        await stop_kernel(km, kc)


async def capacity(sessions: int, concurrent: int) -> dict:
    before = used_mib()
    kernels, starts = [], []
    try:
        for number in range(sessions):
            elapsed, km, kc = await start_kernel("msb-python-small")
            starts.append(elapsed)
            await run(f"mine = {number}", kc)
            await km.provisioner.sandbox.hibernate(reconnect_of(km))
            kernels.append((number, km, kc))
        await asyncio.sleep(2)
        asleep = used_mib()
        images = sum(f.stat().st_size for f in Path(os.environ["MSB_HIBERNATE_DIR"]).rglob("*") if f.is_file())

        async def restore(number: int, km, kc) -> float:
            started = time.perf_counter()
            await km.provisioner.sandbox.wake(reconnect_of(km))
            _, printed = await run("print(mine)", kc)
            assert printed == f"{number}\n", (printed, number)
            return time.perf_counter() - started

        started = time.perf_counter()
        chosen = kernels[:: max(1, len(kernels) // concurrent)][:concurrent]
        each = await asyncio.gather(*(restore(*kernel) for kernel in chosen))
        together = time.perf_counter() - started
        return {
            "sessions": sessions,
            "host_used_mib_before": before,
            "host_used_mib_all_hibernated": asleep,
            "per_hibernated_kernel_kib": (asleep - before) * 1024 / max(1, sessions),
            "images_mib": images / 2**20,
            "start_median_s": statistics.median(starts),
            "concurrent_restores": len(chosen),
            "concurrent_restore_median_s": statistics.median(each),
            "concurrent_restore_max_s": max(each),
            "concurrent_restore_wall_s": together,
        }
    finally:
        await asyncio.gather(*(stop_kernel(km, kc) for _, km, kc in kernels), return_exceptions=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="msbh-", dir="/tmp"))
    isolate(base, max_sessions=args.sessions + 10, backend="gvisor")
    key = base / "key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    os.environ.update(
        MSB_PORT_RANGE=f"20000-{20000 + 5 * (args.sessions + 20)}",  # 5 host ports per kernel
        MSB_TRANSPORT="tcp",
        MSB_HIBERNATE_AFTER_SECONDS="60",
        MSB_HIBERNATE_DIR=str(base / "images"),
        MSB_HIBERNATE_KEY_FILE=str(key),
    )
    for said in raise_host_limits(args.sessions):
        print(said)
    try:
        cold = await cold_starts(args.rounds)
        idle = await cycle("x = 41", "print(x + 1)", "42\n", args.rounds)
        big = await cycle(  # 8 x 64 MiB of random doubles, which runsc's compression cannot shrink
            "import numpy; arrays = [numpy.random.default_rng(i).random(2**23) for i in range(8)]; "
            "total = sum(float(a.sum()) for a in arrays)",
            "print(sum(float(a.sum()) for a in arrays) == total)",
            "True\n",
            args.rounds,
        )
        held = await capacity(args.sessions, args.concurrent) if args.sessions else None
    finally:
        shutil.rmtree(base, ignore_errors=True)

    figures = {"cold_start": cold, "idle": idle, "numpy_500_mib": big, "capacity": held}
    print(json.dumps(figures, indent=2))
    gvisor = cold["gvisor_tcp_s"]
    print(f"cold start to first reply: bare ipykernel {cold['bare_ipykernel_s']:.2f} s, gVisor (tcp) {gvisor:.2f} s")
    for name, row in (("idle", idle), ("500 MiB numpy", big)):
        print(
            f"{name}: checkpoint {row['checkpoint_s']:.2f} s, image {row['image_mib']:.1f} MiB, memory {row['memory_awake_mib']:.0f} "
            f"-> {row['memory_hibernated_mib']:.0f} MiB, restore to first reply {row['restore_to_reply_s']:.2f} s "
            f"({row['restore_to_reply_s'] / gvisor:.2f}x gVisor's cold start, {row['restore_to_reply_s'] / cold['bare_ipykernel_s']:.2f}x "
            "a bare ipykernel's)"
        )
    if held:
        live = (meminfo_mib("MemTotal") or 0) // 1024  # small flavor: 1 GiB each, as the gateway counts capacity
        print(
            f"{held['sessions']} hibernated: host memory used {held['host_used_mib_before']} -> {held['host_used_mib_all_hibernated']} MiB "
            f"({held['per_hibernated_kernel_kib']:.0f} KiB each), images {held['images_mib']:.0f} MiB on disk; the host's live capacity "
            f"is {live} small kernels: {held['sessions'] / max(1, live):.1f}x that held here"
        )
        print(
            f"{held['concurrent_restores']} restored at once: each to its first reply median {held['concurrent_restore_median_s']:.2f} s, "
            f"max {held['concurrent_restore_max_s']:.2f} s, all in {held['concurrent_restore_wall_s']:.2f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
