"""Kernel start time and execute round trip: sandboxed kernels beside a plain local ipykernel.

    .venv/bin/python bench/bench_kernels.py [--starts 10] [--executes 500]

Every figure is measured in the same run for both, so ratios hold on a noisy shared
machine where absolute times drift. Writes bench/results/kernels.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def start_once(kernel_name: str) -> tuple[float, AsyncKernelManager, object]:
    started = time.perf_counter()
    km = AsyncKernelManager(kernel_name=kernel_name)
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    return time.perf_counter() - started, km, kc


async def measure_starts(kernel_name: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        elapsed, km, kc = await start_once(kernel_name)
        times.append(elapsed)
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return times


async def measure_round_trips(kernel_name: str, count: int) -> list[float]:
    _, km, kc = await start_once(kernel_name)
    try:
        for _ in range(20):  # warm up
            kc.execute("1+1")
            await kc.get_shell_msg(timeout=30)
        times = []
        for _ in range(count):
            started = time.perf_counter()
            msg_id = kc.execute("1+1")
            reply = await kc.get_shell_msg(timeout=30)
            times.append(time.perf_counter() - started)
            assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
        return times
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": percentile(values, 50) * 1000, "p95_ms": percentile(values, 95) * 1000,
            "mean_ms": statistics.fmean(values) * 1000}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--executes", type=int, default=500)
    parser.add_argument("--kernels", nargs="+", default=["python3", "msb-python-small"],
                        help="kernelspecs to compare; the first is the baseline (python3 = plain local ipykernel)")
    args = parser.parse_args()
    os.environ.setdefault("MSB_RUNTIME_DIR", tempfile.mkdtemp(prefix="msbb-", dir="/tmp"))
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
                     "kernels": {}}
    # Interleave the kernels round by round so drift on the machine hits all of them alike.
    starts: dict[str, list[float]] = {k: [] for k in args.kernels}
    for _ in range(args.starts):
        for kernel in args.kernels:
            starts[kernel] += await measure_starts(kernel, 1)
    for kernel in args.kernels:
        results["kernels"][kernel] = {"start": summary(starts[kernel]), "execute_1plus1": summary(await measure_round_trips(kernel, args.executes))}
    baseline = results["kernels"][args.kernels[0]]
    lines = [f"| kernel | start p50 (ms) | start p95 (ms) | start ratio (p50) | 1+1 p50 (ms) | 1+1 p95 (ms) | 1+1 p50 delta (ms) |",
             "|---|---|---|---|---|---|---|"]
    for kernel, figures in results["kernels"].items():
        start, rtt = figures["start"], figures["execute_1plus1"]
        figures["start_ratio_p50"] = start["p50_ms"] / baseline["start"]["p50_ms"]
        figures["execute_delta_p50_ms"] = rtt["p50_ms"] - baseline["execute_1plus1"]["p50_ms"]
        lines.append(f"| {kernel} | {start['p50_ms']:.0f} | {start['p95_ms']:.0f} | {figures['start_ratio_p50']:.2f}x | "
                     f"{rtt['p50_ms']:.2f} | {rtt['p95_ms']:.2f} | {figures['execute_delta_p50_ms']:+.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernels.json").write_text(json.dumps(results, indent=1))
    table = "\n".join(lines)
    (RESULTS / "kernels.md").write_text(table + "\n")
    print(f"{args.starts} starts and {args.executes} executes per kernel, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(table)


if __name__ == "__main__":
    asyncio.run(main())
