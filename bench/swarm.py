"""The swarm backend beside the namespace backend and a bare ipykernel, in one run: cold start and `1+1`, and the warm
pool's hand-out through the gateway service.

    .venv/bin/python bench/swarm.py            # as root: private engines, a two-node swarm (tests/engines.py)
    .venv/bin/python bench/swarm.py -n 20 --rtt 200
    flock -x /tmp/heavy.lock timeout 1800 .venv/bin/python bench/swarm.py --fit 40   # services per node that fit

The swarm, its images and the stack are made as the tests make them (tests/msb_kernels/backends/cluster/): two
private dockerds in network namespaces, `msb-kernels image build`, `docker stack deploy`. The kernels are measured
from where a gateway runs them, a process in the network namespace of a container on the kernels' overlay; the
three kinds interleave start by start there, so the machine's drift touches them alike. The pool's hand-out is
POST /api/kernels against the stack's gateway while its pool holds a ready kernel, beside a start of the same kernel
that the pool cannot serve (it asks for a variable the waiting kernel lacks), through the same gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the harness imports itself as the package bench
    sys.path.insert(0, str(REPO))

from bench.stats import summary  # noqa: E402

KINDS = {"swarm": ("swarm", "msb-python-small"), "namespace": ("namespace", "msb-python-small"), "bare ipykernel": (None, "python3")}


async def inside(rounds: int, rtts: int) -> dict:
    """On the overlay: starts and `1+1` of each kind, interleaved."""
    from bench.environment import isolate
    from bench.kernels import execute_rtt, start_kernel, stop_kernel

    isolate(Path(tempfile.mkdtemp(prefix="msb-swarm-bench-", dir="/tmp")), max_sessions=10)  # the venv's kernelspecs
    starts: dict[str, list[float]] = {kind: [] for kind in KINDS}
    round_trips: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for round_ in range(rounds + 1):
        for kind in list(KINDS) if round_ % 2 else list(KINDS)[::-1]:
            backend, kernelspec = KINDS[kind]
            if backend:
                os.environ["MSB_BACKEND"] = backend
            elapsed, km, kc = await start_kernel(kernelspec)
            try:
                if round_:  # the first round warms the fork servers and the nodes' page caches
                    starts[kind].append(elapsed)
                    if round_ == 1:
                        for _ in range(rtts):
                            round_trips[kind].append(await execute_rtt(kc))
            finally:
                await stop_kernel(km, kc)
    return {"cold_start": {k: summary(v) for k, v in starts.items()}, "one_plus_one": {k: summary(v) for k, v in round_trips.items()}}


async def fit(cap: int) -> dict:
    """On the overlay: small swarm kernels started one after another and left idle, until a start fails or cap;
    the services each node runs then, what each node offers, and why the count stopped."""
    from collections import Counter

    import docker

    from bench.environment import isolate
    from bench.kernels import start_kernel, stop_kernel

    isolate(Path(tempfile.mkdtemp(prefix="msb-swarm-fit-", dir="/tmp")), max_sessions=cap + 5, backend="swarm")
    client = docker.from_env()
    nodes = {node.id: node.attrs["Description"] for node in client.nodes.list()}
    kernels, stop, seconds = [], f"the cap of {cap} kernels", []
    try:
        while len(kernels) < cap:
            try:
                elapsed, km, kc = await start_kernel("msb-python-small")
            except Exception as exc:  # the finding: where and why the swarm stops taking kernels
                stop = f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"
                break
            kernels.append((km, kc))
            seconds.append(elapsed)
        running = Counter(
            nodes[task["NodeID"]]["Hostname"]
            for service in client.services.list()
            for task in service.tasks(filters={"desired-state": "running"})
            if task["Status"]["State"] == "running"
        )
    finally:
        await asyncio.gather(*(stop_kernel(km, kc) for km, kc in kernels), return_exceptions=True)
    return {
        "kernels": len(kernels),
        "stopped_by": stop,
        "per_node": dict(running),
        "nodes": {
            d["Hostname"]: {"cpus": d["Resources"]["NanoCPUs"] / 1e9, "memory_gib": round(d["Resources"]["MemoryBytes"] / 2**30, 1)}
            for d in nodes.values()
        },
        "start_median_s": round(sorted(seconds)[len(seconds) // 2], 2) if seconds else None,
    }


async def pool_hand_out(gateway_url: str, token: str, rounds: int) -> dict:
    import httpx

    headers = {"Authorization": f"token {token}"}
    hand_outs, cold = [], []
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=120) as client:
        for _ in range(rounds):
            while sum((await client.get("/api/msb/stats")).json()["pool"]["waiting"].values()) < 1:
                await asyncio.sleep(0.2)
            # A variable the waiting kernel lacks makes a start its own (msb_kernels/provisioning/pool.py): the same small kernel, cold.
            for body, times in (
                ({"name": "msb-python-small"}, hand_outs),
                ({"name": "msb-python-small", "env": {"KERNEL_BENCH": "cold"}}, cold),
            ):
                began = time.perf_counter()
                response = await client.post("/api/kernels", json=body)
                times.append(time.perf_counter() - began)
                assert response.status_code == 201, response.text
                await client.delete(f"/api/kernels/{response.json()['id']}")
    return {"pool_hand_out": summary(hand_outs), "cold_start_through_the_gateway": summary(cold)}


def outside(rounds: int, rtts: int, fit_cap: int = 0) -> dict:
    """The swarm, the images, the measurements on the overlay, then the stack and its pool (with fit_cap: only how
    many kernels fit, on the overlay)."""
    from tests.engines import TwoNodeSwarm
    from tests.swarm import KERNEL_IMAGE, NETWORK, built_archive

    kernel_archive, gateway_archive = built_archive("python"), built_archive("gateway")
    swarm = TwoNodeSwarm(Path(tempfile.mkdtemp(prefix="msbb-", dir="/tmp")))
    swarm.start()
    try:
        for engine, archive in ((swarm.manager, kernel_archive), (swarm.worker, kernel_archive), (swarm.manager, gateway_archive)):
            engine.load(archive)
        client = swarm.client()
        client.networks.create(NETWORK, driver="overlay", internal=True, attachable=True)
        env = {**os.environ, "DOCKER_HOST": swarm.manager.url}
        anchor = client.containers.run(KERNEL_IMAGE, ["sleep", "infinity"], network=NETWORK, detach=True)
        try:
            anchor.reload()
            command = ["nsenter", f"--net=/proc/{anchor.attrs['State']['Pid']}/ns/net", sys.executable, __file__, "--inside"]
            options = ["--fit", str(fit_cap)] if fit_cap else ["-n", str(rounds), "--rtt", str(rtts)]
            done = subprocess.run([*command, *options], capture_output=True, text=True, env=env, cwd=REPO)
            if done.returncode != 0:
                raise SystemExit(f"the measurement on the overlay failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            anchor.remove(force=True)
        if fit_cap:
            return figures
        token, port = secrets.token_hex(16), 18765
        subprocess.run(
            ["/usr/bin/docker", "-H", swarm.manager.url, "secret", "create", "msb-token", "-"], input=token, text=True, env=env, check=True
        )
        stack_env = {**env, "MSB_PORT": str(port), "MSB_POOL_SIZE": "python-small=1", "DOCKER_SOCKET": str(swarm.manager.socket)}
        deploy = [
            "/usr/bin/docker",
            "-H",
            swarm.manager.url,
            "stack",
            "deploy",
            "--resolve-image",
            "never",
            "-c",
            str(REPO / "deploy/swarm/stack.yml"),
            "msb",
        ]
        subprocess.run(deploy, env=stack_env, check=True, capture_output=True)
        url = f"http://{swarm.manager_addr}:{port}"
        figures.update(asyncio.run(_when_up(url, token, rounds)))
        return figures
    finally:
        swarm.stop()


async def _when_up(url: str, token: str, rounds: int) -> dict:
    import httpx

    deadline = time.monotonic() + 120
    while True:
        try:
            async with httpx.AsyncClient(timeout=5) as probe:
                if (await probe.get(url + "/api/msb/health")).status_code == 200:
                    break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the stack's gateway did not answer within 120 s")
        await asyncio.sleep(0.5)
    return await pool_hand_out(url, token, rounds)


def report(figures: dict) -> str:
    def ms(entry: dict) -> str:
        return f"{entry['p50_ms']:.1f} ms (p95 {entry['p95_ms']:.1f})"

    starts, rtts = figures["cold_start"], figures["one_plus_one"]
    lines = ["| | swarm | namespace | bare ipykernel |", "|---|---|---|---|"]
    lines.append("| cold start, p50 | " + " | ".join(ms(starts[k]) for k in KINDS) + " |")
    lines.append("| `1+1`, p50 | " + " | ".join(ms(rtts[k]) for k in KINDS) + " |")
    lines.append(
        f"\nswarm `1+1` - namespace `1+1`: {rtts['swarm']['p50_ms'] - rtts['namespace']['p50_ms']:+.2f} ms; "
        f"swarm cold start / bare: {starts['swarm']['p50_ms'] / starts['bare ipykernel']['p50_ms']:.2f}x"
    )
    lines.append(
        f"pool hand-out through the gateway service, p50: {ms(figures['pool_hand_out'])}; "
        f"the same small kernel started cold through it: {ms(figures['cold_start_through_the_gateway'])}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10, help="measured rounds of starts (and of pool hand-outs)")
    parser.add_argument("--rtt", type=int, default=100, help="`1+1` round trips per kind")
    parser.add_argument("--fit", type=int, default=0, metavar="CAP", help="only: start small kernels until one fails or CAP")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(asyncio.run(fit(args.fit) if args.fit else inside(args.n, args.rtt))))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench/swarm.py starts private Docker engines: run it as root")
    figures = outside(args.n, args.rtt, args.fit)
    if args.fit:
        print(json.dumps(figures, indent=1))
        return
    print(report(figures))
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
