"""msb-kernels benchmark harness: every figure beside a plain local ipykernel, in one run.

    .venv/bin/python bench/run.py            # the full run (about 10 minutes on 2 cores)
    .venv/bin/python bench/run.py --quick    # a short smoke run with small counts
    .venv/bin/python bench/run.py --backend gvisor   # every figure with gVisor sandboxes

Writes bench/results/bench.json, bench/results/bench.md and bench/results/bench.png, and after a full run
bench/RESULTS.md, the record kept in git.
The baseline is the kernelspec "python3" (ipykernel's own, no sandbox); the sandboxed
kernel is "msb-python-small". Absolute times drift on shared machines, so compare the
ratios and deltas, which come from samples taken side by side (interleaved) in the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, sys.path starts at bench/: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402
from bench.environment import isolate, raise_host_limits  # noqa: E402
from bench.figures import Bench  # noqa: E402

RESULTS = REPO / "bench" / "results"
RESULTS_FILE = REPO / "bench" / "RESULTS.md"  # kept in git: the figures the README quotes come from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run with small counts")
    parser.add_argument("--starts", type=int, help="cold starts per kernel (10)")
    parser.add_argument("--new-sessions", type=int, help="new MCP sessions with and without the pool (10)")
    parser.add_argument("--executes", type=int, help="1+1 round trips per path (500)")
    parser.add_argument("--stdout-samples", type=int, help="print('x') samples (100)")
    parser.add_argument("--parallel", type=int, help="sessions for throughput and idle memory (10)")
    parser.add_argument("--throughput-seconds", type=float, help="seconds of parallel executes (5)")
    parser.add_argument("--capacity", type=int, help="idle small sessions to try at once (50)")
    parser.add_argument("--levels", type=int, nargs="+", help="live-session levels for cost growth (1 10 50)")
    parser.add_argument("--growth-starts", type=int, help="starts measured at each level (5)")
    parser.add_argument("--growth-executes", type=int, help="1+1 round trips at each level (100)")
    parser.add_argument("--burst", type=int, help="kernels asked for at once in the burst figure (20)")
    parser.add_argument("--batch", type=int, help="kernels started at once while filling up (5)")
    parser.add_argument(
        "--backend",
        default="namespace",
        help="MSB_BACKEND of the sandboxed kernels in every figure but "
        "the cold start, which measures each backend that runs here (namespace)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory (bench/results)")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only rewrite the table and chart from an earlier bench.json")
    args = parser.parse_args(argv)
    full = dict(
        starts=10,
        new_sessions=10,
        executes=500,
        stdout_samples=100,
        parallel=10,
        throughput_seconds=5.0,
        capacity=50,
        levels=[1, 10, 50],
        growth_starts=5,
        growth_executes=100,
        batch=5,
        burst=20,
    )
    quick = dict(
        starts=3,
        new_sessions=3,
        executes=50,
        stdout_samples=10,
        parallel=3,
        throughput_seconds=1.0,
        capacity=4,
        levels=[1, 4],
        growth_starts=2,
        growth_executes=20,
        batch=2,
        burst=4,
    )
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


async def run(args: argparse.Namespace) -> dict:
    base = Path(tempfile.mkdtemp(prefix="msbb-", dir="/tmp"))  # short: ipc socket paths must fit in 107 bytes
    isolate(base, max_sessions=max(args.capacity, max(args.levels)) + 10, backend=args.backend)
    limits = raise_host_limits(max(args.capacity, max(args.levels)))
    for line in limits:
        print(f"host limits: {line}", flush=True)
    bench = Bench(args, base)
    bench.results["host_limits"] = limits
    began = time.perf_counter()
    try:
        await bench.cold_start()
        await bench.mcp_new_session()
        await bench.round_trips()
        await bench.backends_side_by_side()
        await bench.gateway_and_mcp()
        await bench.throughput_and_memory()
        await bench.burst()
        await bench.capacity_and_growth()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results = bench.results
    results["runtime_seconds"] = time.perf_counter() - began
    results["targets"] = report.targets(results["figures"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    table = report.write(results, args.out)
    if not args.quick and args.out == RESULTS:  # the committed record of the latest full run
        report.write_results_file(results, RESULTS_FILE, " ".join(["bench/run.py", *sys.argv[1:]]))
    mach = results["machine"]
    print(
        f"\n{results['mode']} run, {results['runtime_seconds']:.0f} s; {mach['cpus']} CPUs ({mach['cpu_model']}), "
        f"{mach['memory_mib']} MiB, Python {mach['python']}, Linux {mach['linux']}\n"
    )
    print(table)
    for t in results["targets"]:
        print(f"{report.verdict(t['met']).upper():7} {t['target']}: {t['measured']}")
    print(f"\nwrote {args.out / 'bench.json'}, bench.md, bench.png")
    return results


def replot(args: argparse.Namespace) -> None:
    """The targets judged again from the figures (a verdict may have changed since), the table and chart redrawn."""
    results = json.loads(args.replot.read_text())
    results["targets"] = report.targets(results["figures"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    print(report.write(results, args.out))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
