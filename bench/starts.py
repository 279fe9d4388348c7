"""Cold starts only, of the kernels named, interleaved start by start: a quick check between full runs.

    .venv/bin/python bench/starts.py msb-python-small python3
    .venv/bin/python bench/starts.py -n 30 msb-python-small MSB_FORK_KERNELS=false:msb-python-small

Each kernel is a kernelspec name, optionally with settings for its starts (``NAME=VALUE,...:kernelspec``):
msb-kernels reads its settings at each start, so two variants of one kernelspec interleave in one run. A start is
timed as in bench/run.py (create -> first kernel_info reply), after a first untimed round that starts the fork
servers; the order alternates every round, so neither kernel always follows the other. The VM this project runs
on drifts by a third between minutes: compare kernels within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.environment import isolate, settle  # noqa: E402
from bench.kernels import start_kernel, stop_kernel  # noqa: E402
from bench.stats import summary  # noqa: E402


def variant(text: str) -> tuple[str, dict[str, str]]:
    """("kernelspec", {setting: value}) from "kernelspec" or "NAME=VALUE,...:kernelspec"."""
    settings_text, _, name = text.rpartition(":")
    settings = {}
    for pair in filter(None, settings_text.split(",")):
        key, equals, value = pair.partition("=")
        if not equals or not key.startswith("MSB_"):
            raise SystemExit(f"bench/starts.py: {pair!r} in {text!r} is not MSB_NAME=VALUE; write MSB_NAME=VALUE,...:kernelspec")
        settings[key] = value
    return name, settings


def forked(km) -> bool | None:
    """Whether a sandboxed kernel was forked from a fork server; None for a kernel of another provisioner."""
    sandbox = getattr(km.provisioner, "sandbox", None)
    return sandbox.info().get("forked") if sandbox is not None else None


async def measure(kernels: list[str], rounds: int) -> dict[str, dict]:
    """Each kernel's start times (summary) and how its kernels started ("forked": the set of forked())."""
    base_env = dict(os.environ)
    times: dict[str, list[float]] = {text: [] for text in kernels}
    how: dict[str, set] = {text: set() for text in kernels}
    for round_ in range(rounds + 1):
        for text in kernels if round_ % 2 else kernels[::-1]:
            name, settings = variant(text)
            os.environ.clear()
            os.environ.update(base_env | settings)
            elapsed, km, kc = await start_kernel(name)
            if round_:
                times[text].append(elapsed)
                how[text].add(forked(km))
            await stop_kernel(km, kc)
            await settle()
    os.environ.clear()
    os.environ.update(base_env)
    return {text: {**summary(samples), "forked": how[text]} for text, samples in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="+", help="kernelspec names, each optionally NAME=VALUE,...:kernelspec")
    parser.add_argument("-n", "--starts", type=int, default=10, help="timed starts of each (10)")
    args = parser.parse_args(argv)
    from jupyter_client.kernelspec import KernelSpecManager

    installed = KernelSpecManager().find_kernel_specs()
    for text in args.kernels:  # a malformed or unknown one stops the run before any kernel starts
        name, _ = variant(text)
        if name not in installed:
            raise SystemExit(f"bench/starts.py: no kernelspec {name!r}; installed: {', '.join(sorted(installed))}")
    isolate(Path(tempfile.mkdtemp(prefix="msb-starts-")), max_sessions=len(args.kernels) + 2)
    results = asyncio.run(measure(args.kernels, args.starts))
    last = results[args.kernels[-1]]
    for text, figure in results.items():
        ratio = f"  {figure['p50_ms'] / last['p50_ms']:.2f}x the last at p50" if text != args.kernels[-1] else ""
        started = {True: ", forked", False: ", exec'd"}.get(next(iter(figure["forked"])), "") if len(figure["forked"]) == 1 else ""
        print(
            f"{text}: p50 {figure['p50_ms']:.1f} / mean {figure['mean_ms']:.1f} / min {figure['min_ms']:.1f} ms "
            f"(n={figure['n']}{started}){ratio}"
        )


if __name__ == "__main__":
    main()
