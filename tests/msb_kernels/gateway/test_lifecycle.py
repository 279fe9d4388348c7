"""The gateway's limits, culling, stops and restarts, and what it says of bad settings."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from mcp_bridge import jupyter_ws
from msb_kernels.provisioning.limits import files_needed, zmq_max_sockets
from tests.conftest import TEST_BASE, VENV_BIN, soft_open_files
from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, free_port, init_pids, launch_jupyter_server, pid_alive, wait_until


async def test_max_sessions_and_capacity_refusals(gateway_factory) -> None:
    gateway = await gateway_factory(extra_env={"MSB_MAX_SESSIONS": "2", "MSB_CAPACITY_MEMORY_MIB": "3072", "MSB_CAPACITY_CPUS": "8"})
    medium = await gateway.start_kernel("msb-python-medium")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-medium"})
    assert refused.code == 429, refused.body
    body = refused.json
    assert body["type"] == body["reason"] == "ResourceLimitExceeded"
    assert body["limit"] == "capacity_memory"
    assert "MSB_CAPACITY_MEMORY_MIB=3072" in body["message"]
    assert any("stop a session" in s for s in body["suggestions"])
    assert any("smaller flavor" in s and "small" in s for s in body["suggestions"])
    # KERNEL_FLAVOR asks for more than the kernelspec: the same check
    env_refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"KERNEL_FLAVOR": "large"}})
    assert env_refused.code == 429 and env_refused.json["limit"] == "capacity_memory"

    small = await gateway.start_kernel("msb-python-small")
    refused = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"})
    assert refused.code == 429 and refused.json["limit"] == "max_sessions", refused.body
    assert "MSB_MAX_SESSIONS=2" in refused.json["message"]
    assert any("stop a session" in s for s in refused.json["suggestions"])
    stats = await gateway.stats()
    assert stats["active_sessions"] == 2 and stats["max_sessions"] == 2
    (fork_server,) = stats["fork_servers"]  # it forked both kernels, and counts toward no limit
    assert fork_server["kernels_forked"] >= 2 and fork_server["python"].endswith("python"), fork_server
    assert (stats["total_memory_mb"], stats["total_cpus"]) == (3072, 3)
    assert stats["available"] == {"memory_mb": 0, "cpus": 5}
    assert stats["utilization"]["sessions"] == 100.0 and stats["utilization"]["memory"] == 100.0
    assert len(gateway.sandboxes()) == 2, "a refused start left a sandbox"

    # stopping a session frees its share: the refused start now works
    assert (await gateway.request("DELETE", f"/api/kernels/{medium}")).code == 204
    again = await gateway.start_kernel("msb-python-medium")
    assert {k["id"] for k in (await gateway.stats())["kernels"]} == {small, again}

    # a refusal through jupyter_server's GatewayClient reaches its user with the reason and the advice
    js = await launch_jupyter_server(gateway)
    try:
        response = await js.request("POST", "/api/kernels", {"name": "msb-python-small"})
        assert response.code == 429, response.body
        # jupyter_server 2.21 sends its client the unformatted "Error from Gateway: [%s] %s" (its own bug),
        # and logs the gateway's message and advice in full:
        await wait_until(lambda: "MSB_MAX_SESSIONS=2" in js.log(), 5, "the refusal in jupyter_server's log")
        assert "stop a session" in js.log() and "ResourceLimitExceeded" in js.log()
    finally:
        js.stop()


async def test_idle_kernels_are_culled_honouring_the_kernelspec_override(gateway_factory, installed_kernelspecs: Path) -> None:
    # The installed kernelspecs carry the timeout install wrote (1800): the server's MSB_SESSION_TIMEOUT_SECONDS
    # decides for them. A kernelspec whose cull_idle_timeout was edited by hand overrides it.
    spec_dir = installed_kernelspecs / "msb-python-keep-meta"
    spec_dir.mkdir(exist_ok=True)
    spec = json.loads((installed_kernelspecs / "msb-python-small" / "kernel.json").read_text())
    assert spec["metadata"]["cull_idle_timeout"] == spec["metadata"]["msb"]["installed_cull_idle_timeout"] == 1800
    spec["metadata"]["cull_idle_timeout"] = 3600
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    # 5 s idle: enough to read the first kernel's pid on a loaded host; whether it is culled before or
    # after the second kernel is up does not matter.
    gateway = await gateway_factory(extra_env={"MSB_SESSION_TIMEOUT_SECONDS": "5", "MSB_CULL_INTERVAL_SECONDS": "1"})
    culled = await gateway.start_kernel("msb-python-small")
    pid = init_pids(gateway)[culled]
    kept = await gateway.start_kernel("msb-python-keep-meta")  # its kernelspec says 3600 s: the override wins

    async def listed() -> list[str]:
        return [k["id"] for k in (await gateway.request("GET", "/api/kernels")).json]

    # What a user sees decides: the kernel leaves /api/kernels a few awaits after its sandbox stops, so
    # waiting on the sandbox alone raced the listing on a loaded host.
    async def culled_is_gone() -> bool:
        return culled not in await listed()

    await wait_until(culled_is_gone, 40, "the idle kernel to be culled")
    assert culled not in init_pids(gateway) and not pid_alive(pid), "culling left the sandbox's processes"
    assert await listed() == [kept]
    stats = await gateway.stats()
    assert stats["active_sessions"] == 1 and stats["total_memory_mb"] == 1024
    (stopped,) = [s for s in stats["recently_stopped"] if s["id"] == culled]
    assert stopped["status"] == "stopped" and "culled" in stopped["reason"]
    assert stats["culling"] == {"idle_timeout": 5, "interval": 1, "connected": False, "busy": False}
    (entry,) = stats["kernels"]
    assert entry["cull_idle_timeout"] == 3600

    # A pass that culls nothing is timed: its visit of every kernel, the event loop's to share (msb_cull_pass_seconds).
    async def timed_passes() -> bool:
        metrics = (await gateway.request("GET", "/metrics")).body.decode()
        return any(line.startswith("msb_cull_pass_seconds_count ") and float(line.split()[1]) >= 1 for line in metrics.splitlines())

    await wait_until(timed_passes, 15, "a timed culler pass")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_clean_stop_leaves_no_sandbox(gateway_factory, signum: int, tmp_path: Path) -> None:
    """Quickly too: a kernel that is busy and ignores the shutdown request does not hold the stop up for
    shutdown_wait_time (set to 60 s here, so waiting for it would fail the 20 s bound)."""
    (tmp_path / "msb_kernels_serve_config.py").write_text("c.KernelManager.shutdown_wait_time = 60\n")
    gateway = await gateway_factory(extra_env={"JUPYTER_CONFIG_DIR": str(tmp_path)})
    kernel_id, stubborn_id = await gateway.start_kernel(), await gateway.start_kernel()
    pids = init_pids(gateway)
    assert set(pids) == {kernel_id, stubborn_id}
    ws = await KernelSocket.open(gateway, kernel_id)
    await ws.execute("import subprocess\nchild = subprocess.Popen(['sleep', '600'])")  # something more to stop
    stubborn = await KernelSocket.open(gateway, stubborn_id)
    busy = stubborn.send(
        "execute_request",
        jupyter_ws.execute_content(
            "import signal\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\nprint('busy', flush=True)\nwhile True: pass"
        ),
    )
    await stubborn.wait_for(busy, lambda m: m["msg_type"] == "stream", 60)
    assert gateway.stop(signum, timeout=20) == 0, gateway.log()[-3000:]
    assert not gateway.sandboxes(), "a sandbox outlived the server"
    assert not any(pid_alive(pid) for pid in pids.values())
    assert not list(gateway.runtime_dir.glob("*/state.json"))


async def test_without_a_grace_period_kill_9_ends_the_kernels_and_leaves_nothing(gateway_factory) -> None:
    """MSB_ADOPT_GRACE_SECONDS=0: kernels end with the gateway, as they did before restarts kept them (test_adoption.py),
    and their keeper sweeps what they left at once, with no restart needed (issue 58)."""
    gateway = await gateway_factory(extra_env={"MSB_ADOPT_GRACE_SECONDS": "0"})
    kernel_id = await gateway.start_kernel()
    pid = init_pids(gateway)[kernel_id]
    gateway.process.kill()
    gateway.process.wait(10)
    await wait_until(lambda: not pid_alive(pid), 20, "the sandbox to die with its owner")
    await wait_until(lambda: not gateway.sandboxes(), 30, "the keeper to sweep the killed gateway's sandbox")

    again = await gateway_factory(runtime_dir=gateway.runtime_dir, extra_env={"MSB_ADOPT_GRACE_SECONDS": "0"})
    assert not again.sandboxes(), "the restarted server found an orphan"
    assert (await again.stats())["active_sessions"] == 0


async def test_debug_lines_are_written_at_the_debug_log_level_only(gateway: Gateway, gateway_factory) -> None:
    """--log-level DEBUG shows jupyter_server's debug lines (a request's, here); the default level builds none."""
    debug = await gateway_factory(args=["--log-level", "DEBUG"])
    for server in (gateway, debug):
        assert (await server.request("GET", "/api/kernelspecs")).code == 200
    await wait_until(lambda: "200 GET /api/kernelspecs" in debug.log(), 5, "the request's debug line")
    assert "200 GET /api/kernelspecs" not in gateway.log()


async def test_a_second_gateway_on_the_same_runtime_dir_is_refused(gateway_factory) -> None:
    """It stops at once, saying whose dir it is and what to do, and the first one's kernel is unharmed."""
    first = await gateway_factory()
    kernel_id = await first.start_kernel()
    second = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "serve", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env={**first.env, "MSB_TOKEN": "another"},
    )
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"another msb-kernels serve (pid {first.process.pid}) already uses the runtime dir {first.runtime_dir}" in second.stderr
    assert "MSB_RUNTIME_DIR" in second.stderr
    ws = await KernelSocket.open(first, kernel_id)
    assert (await ws.execute("1 + 1")).result == "2"


def test_bad_settings_stop_the_start_with_a_clear_message(tmp_path: Path) -> None:
    for variable, value in (("MSB_CAPACITY_CPUS", "many"), ("MSB_PORT", "99999"), ("MSB_CULL_BUSY", "maybe"), ("MSB_MAX_SESSIONS", "0")):
        result = subprocess.run(
            [str(VENV_BIN / "msb-kernels"), "serve"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, variable: value, "MSB_RUNTIME_DIR": str(TEST_BASE / "bad")},
        )
        assert result.returncode == 2, (variable, result.stderr)
        assert variable in result.stderr and "Traceback" not in result.stderr, result.stderr


async def test_serve_lifts_its_open_file_limit_and_sizes_zeromq_for_max_sessions(gateway_factory) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with soft_open_files(512):  # systemd's default soft limit is 1024: a gateway must not keep it
        gateway = await gateway_factory(extra_env={"MSB_MAX_SESSIONS": "1000", "MSB_POOL_SIZE": "0"})
    limits = next(
        line for line in Path(f"/proc/{gateway.process.pid}/limits").read_text().splitlines() if line.startswith("Max open files")
    )
    assert limits.split()[3:5] == [str(hard), str(hard)], limits
    log = gateway.log()
    assert f"open files (RLIMIT_NOFILE) raised from 512 to {hard}" in log, log[-2000:]
    assert f"ZeroMQ MAX_SOCKETS {zmq_max_sockets(1000)} for MSB_MAX_SESSIONS=1000" in log, log[-2000:]
    if hard < files_needed(1000):  # the hard limit is the operator's: the log says what to set
        assert f"LimitNOFILE={files_needed(1000)}" in log, log[-2000:]
    kernel = await gateway.start_kernel()  # kernels start and answer through the sized context
    socket = await KernelSocket.open(gateway, kernel)
    try:
        assert (await socket.execute("1+1")).result == "2"
    finally:
        socket.close()
