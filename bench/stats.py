"""Latency summaries: the same percentiles for every figure, so sandboxed and bare compare directly."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(seconds: list[float]) -> dict:
    return {
        "n": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1000,
        "p95_ms": percentile(seconds, 95) * 1000,
        "mean_ms": statistics.fmean(seconds) * 1000,
        "min_ms": min(seconds) * 1000,
        "max_ms": max(seconds) * 1000,
    }
