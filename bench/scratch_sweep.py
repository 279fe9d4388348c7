"""What reading the scratch dir costs a gateway with many sessions (issue 58): each scrape of /metrics and each sweep
at a later start read every disk image there. N images, each linked to a state dir whose owner (this process) lives,
as a gateway's own kernels are; each read with every sandbox's state read, and with this process's own sandboxes
known (what the scrape and the start's sweep pass), p50 of five, in process.

    .venv/bin/python bench/scratch_sweep.py -n 1000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msb_kernels.backends.core import leftovers, scratch
from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.core.state import write_state
from msb_kernels.gateway.scrape import scratch_disks


def p50_ms(call, rounds: int = 5) -> float:
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return statistics.median(took) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="disk images (sessions)")
    count = parser.parse_args().n
    base = Path(tempfile.mkdtemp(prefix="msb-bench-sweep-", dir="/tmp"))
    try:
        root, runtime = base / "scratch", base / "rt"
        root.mkdir(mode=0o700)
        runtime.mkdir(mode=0o700)
        me, started = os.getpid(), process_start_time(os.getpid())
        ids = [f"bench-{number:05d}" for number in range(count)]
        for sandbox_id in ids:
            state_dir = runtime / sandbox_id
            (state_dir / "io").mkdir(parents=True)
            write_state(state_dir, {"sandbox_id": sandbox_id, "backend": "namespace", "owner_pid": me, "owner_start": started})
            image = scratch.image_path(root, sandbox_id)
            with open(image, "wb") as handle:
                handle.truncate(1 << 30)  # sparse: the bench reads the directory, not the disks
            os.symlink(state_dir, image.with_suffix(scratch.STATE_LINK_SUFFIX))
        own = set(ids)
        for what, call in (
            ("scrape, every state read", lambda: scratch_disks(root, runtime, set())),
            ("scrape, the gateway's own known", lambda: scratch_disks(root, runtime, own)),
            ("start's sweep, every state read", lambda: leftovers.sweep(root, leftovers.STARTS_WITHIN)),
            ("start's sweep, this process's own known", lambda: leftovers.sweep(root, leftovers.STARTS_WITHIN, own)),
        ):
            print(f"{count} images, {what}: p50 {p50_ms(call):.1f} ms")
        assert len(list(root.glob(f"*{scratch.IMAGE_SUFFIX}"))) == count, "a sweep removed a live sandbox's disk"
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
