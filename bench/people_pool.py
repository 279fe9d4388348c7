"""A JupyterHub person's new session, with and without the warm pool, beside a bare ipykernel.

    .venv/bin/python bench/people_pool.py [-n 10]     # as root, with runsc

Four Hubs (deploy/jupyterhub/jupyterhub_config.py as tests/hub.py runs it), each with its managed gateway and a
shared volume: on gVisor and on namespace, each with no pool and with a pool of one. Each sample is what a person's Lab does for a new
notebook: ``POST /api/kernels`` with the notebook's folder, in their home (MSB_LAB_ROOT_PATH's default under the
Hub), through the Hub's proxy with the person's own Hub token, then a WebSocket and ``1+1``, timed to its reply. The
pooled Hubs' pools are refilled before each of their samples, so each is a hand-out (core/handout.py): their volume and
Lab root shown to a kernel that was started with nothing of anyone's. A bare local ipykernel's start to its first
``1+1`` reply is the reference. Samples alternate between the five; p50 and p95, and each against the bare kernel.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script, sys.path starts at bench/
    sys.path.insert(0, str(REPO))

from bench.auth import import_hub_harness  # noqa: E402
from bench.environment import isolate  # noqa: E402
from bench.kernels import execute_rtt, start_kernel, stop_kernel  # noqa: E402
from bench.servers import KernelSocket  # noqa: E402
from bench.stats import percentile  # noqa: E402

MSB, BARE = "msb-python-small", "python3"
PERSON = "alice"
# label -> (MSB_BACKEND, MSB_POOL_SIZE)
HUBS = {
    "Hub person, gVisor, no pool": ("gvisor", "0"),
    "Hub person, gVisor, pool hand-out": ("gvisor", "python-small=1"),
    "Hub person, namespace, no pool": ("namespace", "0"),
    "Hub person, namespace, pool hand-out": ("namespace", "python-small=1"),
}


async def hub_session(hub, token: str, home: Path) -> float:
    """A new notebook's kernel, as the person's Lab asks for it, to its first 1+1 reply; the kernel is deleted after."""
    began = time.perf_counter()
    body = {"name": MSB, "env": {"KERNEL_WORKING_DIR": str(home), "JPY_SESSION_NAME": str(home / "analysis.ipynb")}}
    started = await hub.gateway("POST", "api/kernels", token, body, timeout=180)
    assert started.code == 201, (started.code, started.body)
    kernel = started.json["id"]
    socket = await KernelSocket.open(SimpleNamespace(url=hub.gateway_url, token=token), kernel)  # type: ignore[arg-type]
    try:
        await socket.execute("1+1")
        return time.perf_counter() - began
    finally:
        socket.connection.close()
        await hub.gateway("DELETE", f"api/kernels/{kernel}", token)


async def pool_waiting(hub, token: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stats = await hub.gateway("GET", "api/msb/stats", token)
        if stats.json["pool"]["waiting"].get(MSB) == 1:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("the pool did not refill within 300 s")


async def measure(rounds: int) -> dict[str, list[float]]:
    base = Path(tempfile.mkdtemp(prefix="msb-people-pool-"))
    isolate(base, 20)
    harness, _, unavailable = import_hub_harness()
    if unavailable:
        raise SystemExit(f"people_pool.py: {unavailable}")
    hubs = {}
    try:
        for key, (backend, pool) in HUBS.items():
            shared = base / f"shared-{key}"
            shared.mkdir(mode=0o755)
            env = {"MSB_BACKEND": backend, "MSB_POOL_SIZE": pool, "MSB_SHARED_VOLUME_PATH": str(shared)}
            hub = await harness.launch_hub(users=(PERSON,), env=env)
            hub.tokens[PERSON] = await hub.token_for(PERSON)  # her home: the gateway makes it hers at her first start
            hubs[key] = hub
        samples: dict[str, list[float]] = {"bare": [], **{key: [] for key in HUBS}}
        for _ in range(rounds):
            seconds, km, kc = await start_kernel(BARE)
            await execute_rtt(kc)
            samples["bare"].append(seconds + await execute_rtt(kc))
            await stop_kernel(km, kc)
            for key, hub in hubs.items():
                token = hub.tokens[PERSON]
                if HUBS[key][1] != "0":
                    await pool_waiting(hub, token)
                samples[key].append(await hub_session(hub, token, hub.state_dir / "home" / PERSON))
        return samples
    finally:
        for hub in hubs.values():
            hub.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--rounds", type=int, default=10, help="rounds; each starts one session of each (10)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    if os.geteuid() != 0:
        raise SystemExit("people_pool.py: run as root (gVisor's sandboxes, a person's own ids)")
    samples = asyncio.run(measure(args.rounds))
    bare = percentile(samples["bare"], 50)
    print(f"| a new session to its first 1+1 (s), n={args.rounds} | p50 | p95 | x bare at p50 |")
    print("|---|---|---|---|")
    for key, values in samples.items():
        label = "bare ipykernel, local" if key == "bare" else key
        print(f"| {label} | {percentile(values, 50):.3f} | {percentile(values, 95):.3f} | {percentile(values, 50) / bare:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
