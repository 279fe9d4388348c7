r"""The cost of checking answers for a secret (issue 54): a 100 MiB download over HTTPS through the egress proxy,
from a kernel whose request carries a secret (so the proxy masks and scans the whole answer: egress/reflection.py)
against the same download without one and with the check off (every answer of a secret's host is checked, so this
is the download as it was before there was a check), in the same kernel, rounds interleaved, each first every other
round (as root).

    .venv/bin/python bench/egress_secrets.py -n 5 --mib 100
    .venv/bin/python bench/egress_secrets.py -n 5 --mib 100 --body json

``--body json`` serves JSON lines as an API writes them (``\/`` and ``\"`` escapes every few bytes, non-ASCII as
``\u00e9``), which the proxy reads unescaped, without spacing and lower-cased as well; the default is random bytes.

The host is in a test-made network namespace (tests/upstreams.py), with its own CA; the secret is bound to it, so the
proxy ends the kernel's TLS for both downloads and the only difference is the scan. Reported: each download's p50
wall time in the kernel (requests, 1 MiB reads), its throughput, and the ratio; the target is at most 1.2x.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
import json, os, time, requests
headers = {{"Authorization": "Bearer " + os.environ["OP_TOKEN"]}} if {secret} else {{}}
started = time.perf_counter()
size = 0
with requests.get("https://api.msb.test/{path}", headers=headers, stream=True, timeout=600) as response:
    response.raise_for_status()
    for block in response.iter_content(1 << 20):
        size += len(block)
assert size == {size}, size
print("RESULT" + json.dumps(time.perf_counter() - started))
"""


def unchecked(enabled: bool) -> None:
    """The proxy (in this process) with or without its check of answers: every answer of a secret's host is
    checked, so the download without a secret is timed with the check off, as it was before there was one."""
    from msb_kernels.egress import proxy, reflection

    proxy.Reflection = reflection.Reflection if enabled else (lambda sent: None)


def body_block(body: str) -> bytes:
    """1 MiB of the body, which the file repeats."""
    if body == "random":
        return os.urandom(1 << 20)
    lines = []
    for i in itertools.count():
        record = {"id": i, "url": f"https://api.msb.test/items/{i}", "title": f'Caf\u00e9 "{i}"', "token": os.urandom(8).hex()}
        lines.append(json.dumps(record).replace("/", "\\/"))
        if sum(map(len, lines)) > 1 << 20:
            return "\n".join(lines).encode()[: 1 << 20]


async def download(kc, secret: bool, mib: int, path: str) -> float:
    outputs: list[dict] = []
    cell = CELL.format(secret=secret, size=mib << 20, path=path)
    await kc.execute_interactive(cell, timeout=600, output_hook=outputs.append)
    text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
    if "RESULT" not in text:
        raise RuntimeError(text[-2000:])
    return json.loads(text.split("RESULT", 1)[1])


async def run(rounds: int, mib: int, backend: str, body: str) -> None:
    from tests.upstreams import Upstream

    base = Path(tempfile.mkdtemp(prefix="msbs-", dir="/tmp"))
    isolate(base, max_sessions=2)
    upstream = Upstream(base / "upstream").start()
    try:
        block, path = body_block(body), f"big.{body}"
        with open(upstream.base / "root" / path, "wb") as big:
            for _ in range(mib):
                big.write(block)
        secrets_file = base / "secrets.json"
        secrets_file.write_text(json.dumps({"OP_TOKEN": {"value": "S3cr/T+k=" + os.urandom(12).hex(), "hosts": ["api.msb.test"]}}))
        secrets_file.chmod(0o600)
        os.environ.update(
            {
                "MSB_BACKEND": backend,
                "MSB_NETWORK_ALLOW": "*.msb.test",
                "MSB_NETWORK_DNS": upstream.dns,
                "MSB_NETWORK_CA_FILE": upstream.ca_file,
                "MSB_NETWORK_SECRETS_FILE": str(secrets_file),
            }
        )
        _, km, kc = await start_kernel("msb-python-small")
        times: dict[str, list[float]] = {"with a secret": [], "without": []}
        try:
            for round_number in range(rounds):
                for kind in ("with a secret", "without")[:: 1 if round_number % 2 else -1]:  # each first every other round
                    unchecked(kind == "with a secret")
                    times[kind].append(await download(kc, kind == "with a secret", mib, path))
        finally:
            unchecked(True)
            await stop_kernel(km, kc)
        without = percentile(times["without"], 50)
        print(f"{backend}: {rounds} rounds of {mib} MiB of {body} over HTTPS through the proxy, {os.cpu_count()} CPUs")
        for kind, found in times.items():
            p50 = percentile(found, 50)
            print(
                f"  {kind:14} p50 {p50:6.2f} s  {mib / p50:7.1f} MiB/s  {p50 / without:5.2f}x   (each: {', '.join(f'{t:.2f}' for t in found)})"
            )
    finally:
        upstream.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--backend", default="namespace", choices=("namespace", "gvisor"))
    parser.add_argument("--body", default="random", choices=("random", "json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/egress_secrets.py needs root: its upstream host is a network namespace it makes")
    asyncio.run(run(args.rounds, args.mib, args.backend, args.body))


if __name__ == "__main__":
    main()
