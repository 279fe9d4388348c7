"""Prometheus metrics: one definition of each, counted where it happens, read at /metrics beside jupyter_server's own.

Counters and histograms live in prometheus_client's default registry, which jupyter_server's /metrics handler
serves (behind the gateway's token), and MSB_METRICS_PORT's listener too. What changes between scrapes without
an event (sessions by state, each kernel's cgroup, the pool, the gateway's own memory) is read at scrape time by
the gateway's collector (gateway/scrape.py). Names follow Prometheus' conventions: msb_ prefix, _total counters,
base units (seconds, bytes).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)

KERNEL_STARTS = Histogram(
    "msb_kernel_start_seconds",
    "Seconds from a start request to a kernel that answers, by flavor, backend and whether the warm pool served it",
    ["flavor", "backend", "from_pool"],
    buckets=START_BUCKETS,
)
KERNEL_START_FAILURES = Counter(
    "msb_kernel_start_failures_total",
    "Starts that gave no kernel, by reason (max_sessions, capacity_memory, capacity_cpus, invalid_request, sandbox_error, ...)",
    ["reason"],
)
KERNEL_STOPS = Counter(
    "msb_kernel_stops_total",
    "Kernels that ended, by how: shutdown, culled (idle past the timeout), died",
    ["how"],
)
KERNEL_RESTARTS = Counter("msb_kernel_restarts_total", "Kernels restarted under the same id, by cause: requested, died", ["cause"])
OOM_KILLS = Counter("msb_kernel_oom_kills_total", "Kernels ended by their flavor's memory limit, by flavor", ["flavor"])
ADOPTIONS = Counter(
    "msb_kernel_adoptions_total", "Kernels a starting gateway found from the one before it, by outcome: adopted, lost", ["outcome"]
)
MCP_CALLS = Counter("msb_mcp_calls_total", "MCP tool calls, by tool and outcome (ok, or the error's type)", ["tool", "outcome"])
EGRESS_CONNECTIONS = Counter(
    "msb_egress_connections_total", "Connections kernels asked the egress proxy for, by decision: allowed, refused", ["decision"]
)
EGRESS_DNS = Counter("msb_egress_dns_queries_total", "DNS queries kernels sent the egress proxy, by answer: answered, refused", ["answer"])
HIBERNATIONS = Counter(
    "msb_hibernations_total",
    "Hibernation events, by outcome: hibernated, restored, refused (the kernel runs on), failed and restore_failed (it ended)",
    ["outcome"],
)
HIBERNATE_SECONDS = Histogram(
    "msb_hibernate_seconds", "Seconds to checkpoint an idle kernel to disk, its image sealed", buckets=START_BUCKETS
)
RESTORE_SECONDS = Histogram("msb_restore_seconds", "Seconds to restore a hibernated kernel until it runs again", buckets=START_BUCKETS)
CULL_PASSES = Histogram(
    "msb_cull_pass_seconds",
    "Seconds a culler pass took that culled nothing: its visit of every kernel (it lets requests in every 50 kernels)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
SCRATCH_SWEPT_BYTES = Counter(
    "msb_scratch_swept_bytes_total",
    "Bytes of scratch disk images that no live sandbox held, removed by a sweep (backends/core/leftovers.py)",
)
EGRESS_BYTES = Counter("msb_egress_bytes_total", "Bytes through the egress proxy, by direction: out (to hosts), in", ["direction"])


def start_failure_reason(error: BaseException) -> str:
    """The reason label of a failed start: the limit it hit, else its error class in snake case."""
    limit = getattr(error, "limit", None)
    if limit:
        return str(limit)
    name = getattr(error, "error_type", None) or type(error).__name__
    return {"InvalidRequest": "invalid_request", "SystemError": "sandbox_error", "ResourceLimitExceeded": "resource_limit"}.get(
        name, "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    )
