"""papermill runs of one notebook, as a batch job makes them: what the start probe costs a process, and what a kept
verdict saves (issue 39, point 5).

    .venv/bin/python bench/batch_runs.py -n 3
    .venv/bin/python bench/batch_runs.py -n 3 --write   # and the section "Batch runs and the start probe" of RESULTS.md

Each run is a new `papermill notebooks/hello.ipynb -k KERNEL` process, timed from its start to its exit, for:
a bare `python3` ipykernel; msb-python-small with MSB_BACKEND=namespace, =gvisor, and the default auto, once with
an empty verdict cache (a fresh XDG_CACHE_HOME each run: the probe kernel starts, as every run paid before kept
verdicts) and once with the cache an earlier process wrote. After an untimed round of each (which also fills the
warm cache), the kinds interleave run by run, their order rotating every round. Each run's log says whether it
started a probe kernel (msb_kernels' "start probe of the ..." line) and which backend its kernel ran in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.environment import VENV_BIN, machine  # noqa: E402
from bench.report import replace_section  # noqa: E402
from bench.stats import summary  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "hello.ipynb"
RESULTS_FILE = REPO / "bench" / "RESULTS.md"
SECTION = "## Batch runs and the start probe (issue 39)"
# label -> (kernelspec, MSB_BACKEND or None, cache: None (the user's own), "cold" (empty each run) or "warm")
KINDS: dict[str, tuple[str, str | None, str | None]] = {
    "a bare `python3`": ("python3", None, None),
    "`MSB_BACKEND=namespace`": ("msb-python-small", "namespace", None),
    "`MSB_BACKEND=gvisor`": ("msb-python-small", "gvisor", None),
    "the default `auto`, no kept verdict": ("msb-python-small", "auto", "cold"),
    "the default `auto`, its verdict kept": ("msb-python-small", "auto", "warm"),
}


def run_once(base: Path, label: str, run: int) -> dict:
    """One papermill process of kind label: its seconds, whether it started a probe kernel, where its kernel ran."""
    kernel, backend, cache = KINDS[label]
    env = {name: value for name, value in os.environ.items() if not name.startswith("MSB_")}
    env["MSB_RUNTIME_DIR"] = str(base / "rt")
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    if backend:
        env["MSB_BACKEND"] = backend
    if cache == "cold":
        env["XDG_CACHE_HOME"] = str(base / f"cold-{run}")
    elif cache == "warm":
        env["XDG_CACHE_HOME"] = str(base / "warm")
    argv = [str(VENV_BIN / "papermill"), str(NOTEBOOK), str(base / "out.ipynb"), "-k", kernel, "--log-level", "INFO"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"bench/batch_runs.py: papermill -k {kernel} ({label}) failed:\n{done.stderr[-3000:]}")
    ran_in = next(
        (line.split("sandbox (")[0].rsplit(" ", 2)[-2] for line in reversed(done.stderr.splitlines()) if "started in a" in line), None
    )
    return {"seconds": seconds, "probes": done.stderr.count("start probe of the "), "backend": ran_in or "none (no sandbox)"}


def measure(rounds: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix="msb-batch-", dir="/tmp"))
    labels = list(KINDS)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    try:
        for label in labels:  # untimed: page cache, fork servers' first imports, the warm cache's one probe
            run_once(base, label, -1)
        for round_ in range(rounds):
            order = labels[round_ % len(labels) :] + labels[: round_ % len(labels)]
            for label in order:
                runs[label].append(run_once(base, label, round_))
                print(f"round {round_ + 1}: {label}: {runs[label][-1]}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return runs


def table(runs: dict) -> list[str]:
    bare = summary([r["seconds"] for r in runs["a bare `python3`"]])["p50_ms"]
    lines = [
        "| kernel | time per run (min-max) | median | vs bare `python3` | probe kernels started per run | kernel ran in |",
        "|---|---|---|---|---|---|",
    ]
    for label, done in runs.items():
        seconds = [r["seconds"] for r in done]
        median = summary(seconds)["p50_ms"] / 1000
        probes = sorted({r["probes"] for r in done})
        backends = ", ".join(sorted({r["backend"] for r in done}))
        lines.append(
            f"| {label} | {min(seconds):.1f}-{max(seconds):.1f} s | {median:.1f} s | {median * 1000 / bare:.2f}x | "
            f"{', '.join(map(str, probes))} | {backends} |"
        )
    p50 = {label: summary([r["seconds"] for r in done])["p50_ms"] / 1000 for label, done in runs.items()}
    cold, warm, gvisor = (
        p50["the default `auto`, no kept verdict"],
        p50["the default `auto`, its verdict kept"],
        p50["`MSB_BACKEND=gvisor`"],
    )
    lines += [
        "",
        f"A kept verdict saves {cold - warm:.1f} s of each run (median); `auto` with one is {warm - gvisor:+.1f} s from "
        "`MSB_BACKEND=gvisor`, which starts no probe either.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--rounds", type=int, default=3, help="timed runs of each kind (3)")
    parser.add_argument("--write", action="store_true", help=f"write the section {SECTION!r} of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    begun = time.perf_counter()
    runs = measure(args.rounds)
    lines = table(runs)
    print("\n".join(lines))
    if args.write:
        m = machine()
        command = " ".join(["bench/batch_runs.py", *(argv if argv is not None else sys.argv[1:])])
        load = Path("/proc/loadavg").read_text().split()[:3]
        replace_section(
            RESULTS_FILE,
            SECTION,
            [
                "",
                f"Written by `{command}` ({(time.perf_counter() - begun) / 60:.1f} minutes, {args.rounds} runs of each kind, "
                f"interleaved) on {m['cpus']} CPUs ({m['cpu_model']}), Linux {m['linux']}, {m['user']}, papermill on "
                f"notebooks/hello.ipynb, wall time of each process; load average at the end {' '.join(load)}.",
                "",
                *lines,
            ],
        )
        print(f"wrote {SECTION!r} in {RESULTS_FILE}")


if __name__ == "__main__":
    main()
