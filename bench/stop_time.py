"""How long `msb-kernels serve` takes to stop on SIGTERM with kernels running, some of them busy.

    .venv/bin/python bench/stop_time.py            # 5 kernels, 2 busy (one ignores SIGINT and SIGTERM)
    .venv/bin/python bench/stop_time.py --kernels 20 --busy 10

Prints the seconds from the signal to the server's exit, and whether any sandbox outlived it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.environment import isolate
from bench.servers import KernelSocket, start_gateway

BUSY = (
    "import signal\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\nprint('busy', flush=True)\nwhile True: pass"
)


async def measure(kernels: int, busy: int) -> float:
    from mcp_bridge import jupyter_ws

    base = Path(tempfile.mkdtemp(prefix="msbs-", dir="/tmp"))
    isolate(base, max_sessions=kernels + 1)
    gateway = start_gateway(base)
    await gateway.wait_up()
    ids = [(await gateway.request("POST", "/api/kernels", {"name": "msb-python-small"}))["id"] for _ in range(kernels)]
    sockets = [await KernelSocket.open(gateway, kernel_id) for kernel_id in ids[:busy]]
    for ws in sockets:
        request = jupyter_ws.message("shell", "execute_request", jupyter_ws.execute_content(BUSY), session=ws.session, username="bench")
        ws.connection.write_message(jupyter_ws.encode(request))
    await asyncio.sleep(2)  # the busy cells run
    started = time.perf_counter()
    gateway.process.send_signal(signal.SIGTERM)
    while gateway.process.poll() is None:
        await asyncio.sleep(0.02)
    took = time.perf_counter() - started
    left = [path.parent.name for path in (base / "gw").glob("*/state.json")]
    print(f"{kernels} kernels ({busy} busy): stopped in {took:.2f} s, exit {gateway.process.returncode}, {len(left)} sandbox(es) left")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(measure(args.kernels, args.busy))


if __name__ == "__main__":
    main()
