"""The quick flush alone: two plain ipykernels, one with msb-kernels' quick flush installed, interleaved.

    .venv/bin/python bench/quick_flush.py            # 400 rounds
    .venv/bin/python bench/quick_flush.py -n 100

Both are the kernelspec python3 (no sandbox); the second runs msb_kernels.kernelspecs.kernel_code.PYTHON_QUICK_FLUSH, the
code every sandboxed Python kernel runs at start, through --IPKernelApp.exec_lines. Each round times `1+1` to its
reply and to its idle status on each, in an order that alternates, so the difference is the flush alone.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.kernels import execute_rtt, execute_to_idle, start_kernel, stop_kernel  # noqa: E402
from bench.stats import percentile  # noqa: E402
from msb_kernels.kernelspecs.kernel_code import PYTHON_QUICK_FLUSH  # noqa: E402

INSTALLED = "import sys; print(getattr(type(sys.stdout).flush, 'msb_quick_flush', False))"


async def installed(kc) -> bool:
    msg_id = kc.execute(INSTALLED)
    while True:
        message = await kc.get_iopub_msg(timeout=60)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            return message["content"]["text"].strip() == "True"


async def measure(rounds: int) -> dict[str, dict[str, float]]:
    kernels = {
        key: (await start_kernel("python3", extra_arguments=extra))[1:]
        for key, extra in (("ipykernel", []), ("quick flush", [f"--IPKernelApp.exec_lines={PYTHON_QUICK_FLUSH}"]))
    }
    try:
        if not await installed(kernels["quick flush"][1]) or await installed(kernels["ipykernel"][1]):
            raise SystemExit(
                "bench/quick_flush.py: the quick flush is not where it should be (is ipykernel's OutStream a "
                "version without _buffers and _flush_pending?)"
            )
        samples: dict[str, dict[str, list[float]]] = {key: {"reply": [], "idle": []} for key in kernels}
        for i in range(rounds + 20):  # the first 20 rounds warm up and are not kept
            for key in list(kernels) if i % 2 == 0 else list(kernels)[::-1]:
                kc = kernels[key][1]
                reply, idle = await execute_rtt(kc), await execute_to_idle(kc)
                if i >= 20:
                    samples[key]["reply"].append(reply)
                    samples[key]["idle"].append(idle)
        return {key: {what: percentile(values, 50) * 1000 for what, values in figures.items()} for key, figures in samples.items()}
    finally:
        await asyncio.gather(*(stop_kernel(km, kc) for km, kc in kernels.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=400, help="rounds, each timing both kernels (400)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    figures = asyncio.run(measure(args.rounds))
    for key, figure in figures.items():
        print(f"{key}: 1+1 to its reply p50 {figure['reply']:.2f} ms, to its idle status p50 {figure['idle']:.2f} ms")
    plain, quick = figures["ipykernel"], figures["quick flush"]
    print(
        f"quick flush - ipykernel: reply {quick['reply'] - plain['reply']:+.2f} ms, idle {quick['idle'] - plain['idle']:+.2f} ms "
        f"(p50, n={args.rounds})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
