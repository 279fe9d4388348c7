"""The two servers on the WebSocket path, msb-kernels serve and a plain jupyter server, and a raw client to their kernels."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from bench.environment import VENV_BIN


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server subprocess (msb-kernels serve, or a plain jupyter server) reached with a token."""

    def __init__(self, argv: list[str], env: dict, port: int, token: str, health: str, log_path: Path) -> None:
        self.port, self.token, self.health = port, token, health
        self.log_file = open(log_path, "wb")
        self.process = subprocess.Popen(
            argv, env=env, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.request(method, self.url + path, json=body, headers=self.headers)
        response.raise_for_status()
        return response.json() if response.content else None

    async def get_text(self, path: str) -> str:
        import httpx

        async with httpx.AsyncClient(timeout=120) as http:
            response = await http.get(self.url + path, headers=self.headers)
        response.raise_for_status()
        return response.text

    async def wait_up(self, timeout: float = 90) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.process.args[:2]} exited with {self.process.returncode}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                async with httpx.AsyncClient(timeout=5) as http:
                    response = await http.get(self.url + self.health, headers=self.headers)
                    if response.status_code == 200:
                        return
            await asyncio.sleep(0.3)
        raise RuntimeError(f"{self.url} did not come up in {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_file.close()


def start_gateway(
    base: Path,
    port: int | None = None,
    token: str | None = None,
    log: str = "gateway.log",
    runtime: str = "gw",
    code: Path | None = None,
    users_file: Path | None = None,
    pool_size: str = "0",
) -> Server:
    """port and token: a gateway that takes over from another on the same runtime dir. runtime: its runtime dir under
    base (two gateways at once need two). code: a checkout whose msb_kernels and mcp_bridge it imports instead.
    users_file: a gateway of that file's people (MSB_USERS_FILE, no MSB_TOKEN); token is then one person's from it.
    pool_size: its MSB_POOL_SIZE (none by default: most benches time starts)."""
    port, token = port or free_port(), token or secrets.token_hex(16)
    env = {
        **os.environ,
        "MSB_RUNTIME_DIR": str(base / runtime),
        "MSB_POOL_SIZE": pool_size,
        **({"MSB_USERS_FILE": str(users_file)} if users_file is not None else {"MSB_TOKEN": token}),
        **({"PYTHONPATH": str(code)} if code is not None else {}),
    }
    return Server([str(VENV_BIN / "msb-kernels"), "serve", "--port", str(port)], env, port, token, "/api/msb/health", base / log)


def start_plain_jupyter_server(base: Path) -> Server:
    """The bare baseline for the WebSocket path: jupyter_server itself, relaying a plain ipykernel."""
    return start_jupyter(base, "server")


def start_jupyter(base: Path, app: str, *options: str, port: int | None = None, token: str | None = None) -> Server:
    """`jupyter server|lab` on loopback with a token, serving base/js-root; options are added to its command line."""
    port, token = port or free_port(), token or secrets.token_hex(16)
    root = base / "js-root"
    root.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSB_")}
    argv = [
        str(VENV_BIN / "jupyter"),
        app,
        "--no-browser",
        "--allow-root",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--ServerApp.root_dir={root}",
        f"--IdentityProvider.token={token}",
        *options,
    ]
    return Server(argv, env, port, token, "/api/status", base / f"jupyter-{app}.log")


class KernelSocket:
    """A raw /api/kernels/{id}/channels WebSocket (JSON messages), as JupyterLab talks to a gateway."""

    def __init__(self, connection: Any, quickack: bool = False) -> None:
        self.connection = connection
        self.session = uuid.uuid4().hex
        # Diagnostic only: TCP_QUICKACK on this end acknowledges at once, which hides the server's Nagle
        # delay (jupyter_server does not set TCP_NODELAY on kernel WebSockets); see the README.
        self.socket = connection.stream.socket if quickack else None

    @classmethod
    async def open(cls, server: Server, kernel_id: str, quickack: bool = False) -> KernelSocket:
        from mcp_bridge import jupyter_ws

        url = jupyter_ws.channels_url(server.url, kernel_id, uuid.uuid4().hex)
        return cls(await jupyter_ws.connect(url, server.token, 60), quickack)

    async def execute(self, code: str = "1+1") -> float:
        from mcp_bridge import jupyter_ws

        request = jupyter_ws.message("shell", "execute_request", jupyter_ws.execute_content(code), session=self.session, username="bench")
        msg_id = request["header"]["msg_id"]
        payload = jupyter_ws.encode(request)
        started = time.perf_counter()
        self.connection.write_message(payload)
        while True:
            if self.socket is not None:
                self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            raw = await asyncio.wait_for(self.connection.read_message(), 60)
            if raw is None:
                raise ConnectionError("the kernel WebSocket closed")
            message = jupyter_ws.parse(raw)
            if message is not None and message["msg_type"] == "execute_reply" and jupyter_ws.parent_id(message) == msg_id:
                return time.perf_counter() - started

    def close(self) -> None:
        self.connection.close()
