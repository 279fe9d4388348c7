"""pip install of a small wheel, and the latency of one HTTP request, through the egress proxy, beside
MSB_ALLOW_NETWORK's slirp4netns and a bare ipykernel on the host's network, in one run (as root).

    .venv/bin/python bench/egress.py -n 10 --requests 200

The package index and the web host are in a test-made network namespace (tests/upstreams.py), reached by address,
so no name lookup is timed: the proxied kernel's list is that address's /32. For each kind of kernel, in turn round
by round: `pip install --no-cache-dir` of a 1 KiB wheel into a fresh target (its whole wall time: pip's start, the
index page, the download), and --requests sequential GETs of /echo over one keep-alive connection (requests.Session),
whose p50 and p95 are reported with the ratio to the bare kernel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate
from bench.kernels import start_kernel, stop_kernel
from bench.stats import percentile

CELL = """
import json, subprocess, sys, time, requests
started = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--target",
                       "/tmp/bench-{round}", "--index-url", "http://{address}/simple/", "--trusted-host", "{address}", "msbtiny"],
                      capture_output=True, text=True)
pip_s = time.perf_counter() - started
session = requests.Session()
session.trust_env = {trust_env}
session.get("http://{address}/echo")  # the connection, once
latencies = []
for _ in range({requests}):
    started = time.perf_counter()
    session.get("http://{address}/echo").raise_for_status()
    latencies.append(time.perf_counter() - started)
print("RESULT" + json.dumps({{"pip_rc": done.returncode, "pip_err": done.stderr[-300:], "pip_s": pip_s, "latencies": latencies}}))
"""


async def measure(kernel_name: str, settings: dict[str, str], address: str, round_number: int, requests: int) -> dict:
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        _, km, kc = await start_kernel(kernel_name)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    try:
        proxied = "MSB_NETWORK_ALLOW" in settings
        code = CELL.format(round=round_number, address=address, requests=requests, trust_env=proxied)
        reply = await kc.execute_interactive(code, timeout=600, output_hook=lambda message: outputs.append(message))
    finally:
        await stop_kernel(km, kc)
    text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
    outputs.clear()
    if "RESULT" not in text:
        raise RuntimeError(f"{kernel_name} {settings}: {reply['content'].get('evalue')} {text[-500:]}")
    return json.loads(text.split("RESULT", 1)[1])


outputs: list[dict] = []


async def run(rounds: int, requests: int) -> None:
    from tests.upstreams import Upstream, serve_package

    base = Path(tempfile.mkdtemp(prefix="msbe-", dir="/tmp"))
    isolate(base, max_sessions=4)
    upstream = Upstream(base / "upstream").start()
    try:
        serve_package(upstream)
        kinds = {
            "bare ipykernel": ("python3", {}),
            "MSB_ALLOW_NETWORK=true (slirp4netns)": ("msb-python-small", {"MSB_ALLOW_NETWORK": "true"}),
            "allow-list proxy": ("msb-python-small", {"MSB_NETWORK_ALLOW": f"{upstream.address}/32"}),
        }
        results: dict[str, dict[str, list[float]]] = {kind: {"pip": [], "request": []} for kind in kinds}
        for round_number in range(rounds):
            for kind, (kernel_name, settings) in kinds.items():
                found = await measure(kernel_name, settings, upstream.address, round_number, requests)
                if found["pip_rc"] != 0:
                    raise RuntimeError(f"{kind}: pip failed: {found['pip_err']}")
                results[kind]["pip"].append(found["pip_s"])
                results[kind]["request"] += found["latencies"]
        bare = results["bare ipykernel"]
        print(f"{rounds} rounds, {requests} requests each, {os.cpu_count()} CPUs")
        print(f"{'kernel':40} {'pip install p50':>16} {'x bare':>7} {'GET p50':>10} {'GET p95':>10} {'x bare':>7}")
        for kind, found in results.items():
            pip = percentile(found["pip"], 50)
            get50, get95 = percentile(found["request"], 50), percentile(found["request"], 95)
            print(
                f"{kind:40} {pip:14.2f} s {pip / percentile(bare['pip'], 50):6.2f}x "
                f"{get50 * 1000:8.2f} ms {get95 * 1000:8.2f} ms {get50 / percentile(bare['request'], 50):6.2f}x"
            )
        added = percentile(results["allow-list proxy"]["request"], 50) - percentile(
            results["MSB_ALLOW_NETWORK=true (slirp4netns)"]["request"], 50
        )
        print(f"the proxy adds {added * 1000:+.2f} ms per request (p50) beside slirp4netns")
    finally:
        upstream.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/egress.py needs root: its upstream host is a network namespace it makes")
    asyncio.run(run(args.rounds, args.requests))


if __name__ == "__main__":
    main()
