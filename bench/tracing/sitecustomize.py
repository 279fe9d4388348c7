"""Loaded by the gateway that ``bench/gateway_soak.py --trace FILE`` starts (this folder on its PYTHONPATH). The first
SIGUSR2 starts tracemalloc (tracing the imports would take minutes), each later one takes a snapshot and appends to
FILE what grew since the one before, largest first, with where each block was allocated. Tracing slows the gateway:
its figures are for finding what grows, not for timing."""

import gc
import os
import signal
import tracemalloc

_FILE = os.environ.get("GATEWAY_SOAK_TRACE")
_FRAMES = 12
_TOP = 25

if _FILE:
    _last = []

    def _snapshot(signum, frame):
        if not tracemalloc.is_tracing():
            tracemalloc.start(_FRAMES)
            return
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        with open(_FILE, "a") as out:
            total = sum(stat.size for stat in snapshot.statistics("filename"))
            out.write(f"=== traced {total / 2**20:.1f} MiB\n")
            if _last:
                for stat in snapshot.compare_to(_last[0], "traceback")[:_TOP]:
                    out.write(f"{stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks\n")
                    out.writelines(f"    {frame.filename}:{frame.lineno}\n" for frame in stat.traceback)
        _last[:] = [snapshot]

    signal.signal(signal.SIGUSR2, _snapshot)
