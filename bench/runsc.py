"""gVisor under two runsc builds and their platforms, side by side in one run (issue 45), as root:

    .venv/bin/python bench/runsc.py --rounds 3 -n 200 [--old /usr/bin/runsc] [--json out.json]

Rows: a bare ipykernel; the host's runsc (--old; Debian 12's 0.0~20221219 has only ptrace, no systrap) and this
environment's own (Debian 13's, scripts/install-runsc) on systrap and on ptrace. Rounds interleave the rows; each
row-round is a process of its own (runsc and its platform are settings, read once per process) that measures:

- cold start to the first kernel_info reply of a small kernel (ipc), and `1+1` p50 over -n round trips;
- idle RSS: every host process of the sandbox (Sentry, gofer, runsc) once the kernel is idle;
- over tcp, as hibernation runs: checkpoint of an idle kernel, and restore to its first execute reply.

Then where a start's time goes, under `runsc do` with each row's runsc and platform, beside the host: the sandbox's
boot alone (`/bin/true`: Sentry and gofer up and down), the interpreter (`python -c pass`), and the kernel's imports
(`import ipykernel.kernelapp`). A gVisor kernel's cold start is boot + interpreter + imports + ZeroMQ and the
handshake; the bare row has only the last three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate, machine
from bench.kernels import execute_rtt, kernel_memory, start_kernel, stop_kernel
from bench.stats import percentile

OWN = Path(sys.prefix) / "share" / "msb-kernels" / "gvisor" / "runsc"


def version(runsc: str) -> str:
    return subprocess.run([runsc, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


async def one_row(kernel: str, n: int, hibernate: bool) -> dict:
    """One process's figures for the settings in its environment (MSB_RUNSC, MSB_RUNSC_PLATFORM, MSB_BACKEND)."""
    from msb_kernels.gateway.kernels.hibernation import reconnect_of

    figures: dict = {}
    cold, km, kc = await start_kernel(kernel)
    try:
        for _ in range(20):  # warm: the first round trips pay for imports in the kernel
            await execute_rtt(kc)
        rtts = [await execute_rtt(kc) for _ in range(n)]
        await asyncio.sleep(1)
        figures.update(cold_start_s=cold, rtt_p50_ms=percentile(rtts, 50) * 1000, idle_rss_mib=kernel_memory(km)["rss"] / 2**20)
    finally:
        await stop_kernel(km, kc)
    if hibernate:
        os.environ["MSB_TRANSPORT"] = "tcp"
        _, km, kc = await start_kernel(kernel)
        try:
            await kc.execute_interactive("x = 41", timeout=120)
            sandbox = km.provisioner.sandbox
            started = time.perf_counter()
            await sandbox.hibernate(reconnect_of(km))
            figures["checkpoint_s"] = time.perf_counter() - started
            started = time.perf_counter()
            await sandbox.wake(reconnect_of(km))
            reply = await kc.execute_interactive("x + 1", timeout=120, output_hook=lambda message: None)
            assert reply["content"]["status"] == "ok", reply["content"]
            figures["restore_to_reply_s"] = time.perf_counter() - started
        finally:
            await stop_kernel(km, kc)
    return figures


def runsc_do(runsc: str, platform: str, argv: list[str], rounds: int) -> float:
    """Median seconds of `runsc do ARGV` (the host's root, read-only, no network)."""
    root = tempfile.mkdtemp(prefix="msb-runsc-do-")
    times = []
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            subprocess.run(
                [runsc, f"--root={root}", "--network=none", f"--platform={platform}", "do", *argv], check=True, capture_output=True
            )
            times.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(times)


def on_host(argv: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", type=int, default=200, help="1+1 round trips per row-round")
    parser.add_argument("--old", default="/usr/bin/runsc", help="the host's runsc to compare with this environment's own")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a row-round's own process: prints its figures as JSON
    args = parser.parse_args()

    if args.row:
        kernel, hibernate = ("python3", False) if args.row == "bare" else ("msb-python-small", True)
        print(json.dumps(asyncio.run(one_row(kernel, args.n, hibernate))))
        return

    rows = {"bare ipykernel": ("bare", "", "")}
    if os.access(args.old, os.X_OK):
        rows[f"host runsc ({version(args.old).split()[-1]}), ptrace"] = ("gvisor", args.old, "ptrace")
    if os.access(OWN, os.X_OK):
        for platform in ("systrap", "ptrace"):
            rows[f"own runsc ({version(str(OWN)).split()[-1]}), {platform}"] = ("gvisor", str(OWN), platform)
    base = Path(tempfile.mkdtemp(prefix="msbr-", dir="/tmp"))
    isolate(base, max_sessions=10, backend="gvisor")
    key = base / "key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    os.environ.update(MSB_HIBERNATE_AFTER_SECONDS="600", MSB_HIBERNATE_DIR=str(base / "images"), MSB_HIBERNATE_KEY_FILE=str(key))
    results: dict[str, list[dict]] = {name: [] for name in rows}
    try:
        for round_number in range(args.rounds):
            for name, (row, runsc, platform) in rows.items():
                env = {**os.environ, "MSB_RUNSC": runsc, "MSB_RUNSC_PLATFORM": platform} if runsc else dict(os.environ)
                done = subprocess.run(
                    [sys.executable, __file__, "--row", row, "-n", str(args.n)], capture_output=True, text=True, env=env, timeout=900
                )
                if done.returncode != 0:
                    raise SystemExit(f"{name}, round {round_number + 1}: {done.stderr[-3000:]}")
                results[name].append(json.loads(done.stdout.splitlines()[-1]))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    table = {name: {field: statistics.median(r[field] for r in runs) for field in runs[0]} for name, runs in results.items()}
    bare = table["bare ipykernel"]
    python = sys.executable
    host_parts = {
        "python -c pass": on_host([python, "-c", "pass"], 5),
        "import ipykernel.kernelapp": on_host([python, "-c", "import ipykernel.kernelapp"], 5),
    }
    print(f"{'row':34} {'cold start':>11} {'x bare':>7} {'1+1 p50':>9} {'idle RSS':>9} {'checkpoint':>11} {'restore':>8}")
    for name, row in table.items():
        hibernation = f"{row['checkpoint_s']:>10.2f}s {row['restore_to_reply_s']:>7.2f}s" if "checkpoint_s" in row else ""
        print(
            f"{name:34} {row['cold_start_s']:>10.2f}s {row['cold_start_s'] / bare['cold_start_s']:>6.1f}x "
            f"{row['rtt_p50_ms']:>7.2f}ms {row['idle_rss_mib']:>7.0f}Mi {hibernation}"
        )
    parts: dict[str, dict] = {"host": host_parts}
    print(f"\nwhere a start goes (median of 5): on the host, python -c pass {host_parts['python -c pass']:.3f} s, "
          f"import ipykernel.kernelapp {host_parts['import ipykernel.kernelapp']:.3f} s")  # fmt: skip
    for name, (_, runsc, platform) in rows.items():
        if not runsc:
            continue
        boot = runsc_do(runsc, platform, ["/bin/true"], 5)
        interpreter = runsc_do(runsc, platform, [python, "-c", "pass"], 5)
        imports = runsc_do(runsc, platform, [python, "-c", "import ipykernel.kernelapp"], 5)
        parts[name] = {"boot_s": boot, "interpreter_s": interpreter - boot, "imports_s": imports - interpreter}
        print(
            f"{name}: sandbox boot {boot:.3f} s, + python -c pass {interpreter - boot:.3f} s, + import ipykernel {imports - interpreter:.3f} s"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "rounds": args.rounds, "n": args.n, "rows": table, "parts": parts}, indent=2)
        )


if __name__ == "__main__":
    main()
