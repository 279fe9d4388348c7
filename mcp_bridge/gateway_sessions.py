"""Sessions of a running gateway (``msb-mcp --gateway``): its Jupyter REST API and kernel channels WebSocket.

The facts plain Jupyter lacks (flavor, creation time, why a kernel died) come from the msb
gateway's /api/msb/stats; another Jupyter server works too, with less to say.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from mcp_bridge import jupyter_ws
from mcp_bridge.sessions import (
    KernelConnection,
    KernelSessions,
    Listener,
    SessionInfo,
    not_found,
    parse_kernel_name,
)
from msb_kernels.errors import InvalidRequest, ResourceLimitExceeded, SandboxError, error_from_body
from msb_kernels.kernelspecs.choice import KernelChoice
from msb_kernels.observability.status import epoch_seconds, session_status
from msb_kernels.provisioning.start_request import StartRequest


class GatewayConnection(KernelConnection):
    """The kernel channels websocket of a Jupyter-compatible gateway (JSON messages with a "channel" key)."""

    def __init__(self, sessions: GatewayKernelSessions, session_id: str):
        super().__init__()
        self.sessions = sessions
        self.session_id = session_id
        self.client_session = uuid.uuid4().hex
        self.ws: Any = None
        self.task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.kernel_died = False  # the gateway said the kernel died or restarts (not just that the socket closed)
        self.restarted = False

    async def open(self, timeout: float) -> None:
        url = jupyter_ws.channels_url(self.sessions.url, self.session_id, self.client_session)
        try:
            self.ws = await jupyter_ws.connect(url, self.sessions.token, timeout)
        except Exception as exc:
            raise SandboxError(f"cannot open the kernel channels of session {self.session_id} at the gateway: {exc}") from None
        self.task = asyncio.create_task(self._pump())
        # wait until the kernel answers a kernel_info_request
        answered = asyncio.Event()
        msg_id = self._send("shell", "kernel_info_request", {}, lambda channel, message: answered.set() if channel == "shell" else None)
        try:
            await asyncio.wait_for(answered.wait(), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise SandboxError(f"the kernel of session {self.session_id} did not answer within {timeout:g} s") from None
        finally:
            self.unlisten(msg_id)

    def _send(self, channel: str, msg_type: str, content: dict, listener: Listener) -> str:
        request = jupyter_ws.message(channel, msg_type, content, session=self.client_session, username="msb-mcp")
        msg_id = request["header"]["msg_id"]
        self.listen(msg_id, listener)
        self.ws.write_message(jupyter_ws.encode(request))
        return msg_id

    async def _pump(self) -> None:
        while not self.closed:
            try:
                raw = await self.ws.read_message()
            except asyncio.CancelledError:
                raise
            except Exception:
                raw = None
            if raw is None:
                if not self.closed:
                    self.dead_reason = self.dead_reason or "the connection to the kernel at the gateway closed"
                return
            message = jupyter_ws.parse(raw)
            if message is None:
                continue
            if message["msg_type"] == "status" and not jupyter_ws.parent_id(message):
                state = (message.get("content") or {}).get("execution_state")
                if state in ("dead", "restarting"):
                    self.kernel_died = True
                    self.restarted = state == "restarting"
                    self.dead_reason = "the kernel died"
            self.dispatch(message["channel"], message)

    async def execute(self, code: str, listener: Listener, *, silent: bool, store_history: bool) -> str:
        content = jupyter_ws.execute_content(code, silent=silent, store_history=store_history, stop_on_error=False)
        return self._send("shell", "execute_request", content, listener)

    async def death_reason(self) -> str | None:
        if self.dead_reason and self.kernel_died:
            cause = await self.sessions.exit_reason(self.session_id)
            return (cause or self.dead_reason) + ("; it was restarted with a fresh kernel" if self.restarted else "")
        return self.dead_reason

    async def close(self) -> None:
        self.closed = True
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


class GatewayKernelSessions(KernelSessions):
    """Sessions of a running gateway (``msb-kernels serve``), over its Jupyter REST and websocket API."""

    local_kernels = False

    def __init__(self, url: str, token: str | None = None, *, start_timeout: float = 60.0):
        super().__init__()
        import httpx

        self.url = url.rstrip("/")
        self.token = token
        self.start_timeout = start_timeout
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers(), timeout=httpx.Timeout(start_timeout + 30))

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SandboxError(
                f"the gateway at {self.url} cannot be reached: {exc}",
                suggestions=["check that `msb-kernels serve` runs there", "check --gateway URL"],
            ) from None
        if response.status_code in (401, 403):
            raise SandboxError(
                f"the gateway at {self.url} refused the token (HTTP {response.status_code})",
                suggestions=["pass the gateway's token with --token or MSB_GATEWAY_TOKEN"],
            )
        return response

    @staticmethod
    def _message(response: Any) -> str:
        try:
            body = response.json()
        except ValueError:
            return response.text[:300]
        return str(body.get("message") or body.get("reason") or body)[:500]

    async def kernelspecs(self) -> dict[str, dict]:
        response = await self._request("GET", "/api/kernelspecs")
        if response.status_code >= 400:
            raise SandboxError(f"the gateway answered HTTP {response.status_code}: {self._message(response)}")
        return {name: entry.get("spec") or {} for name, entry in (response.json().get("kernelspecs") or {}).items()}

    async def kernel_model(self, session_id: str, missing_ok: bool = False) -> dict | None:
        if not isinstance(session_id, str) or not session_id or "/" in session_id or "?" in session_id:
            raise not_found(str(session_id))
        response = await self._request("GET", f"/api/kernels/{session_id}")
        if response.status_code == 404:
            self.forget(session_id)
            if missing_ok:
                return None
            raise not_found(session_id)
        if response.status_code >= 400:
            raise SandboxError(f"the gateway answered HTTP {response.status_code}: {self._message(response)}")
        return response.json()

    async def create(self, choice: KernelChoice, request: StartRequest) -> str:
        name = choice.kernel_name
        env = request.wire_env()  # the gateway sets the owner and the volume itself, from this client's token
        response = await self._request("POST", "/api/kernels", json={"name": name, **({"env": env} if env else {})})
        if response.status_code >= 400:
            with contextlib.suppress(ValueError):
                error = error_from_body(response.json())
                if error is not None:
                    raise error
            message = self._message(response)
            if response.status_code in (429, 503) or "MSB_MAX_SESSIONS" in message or "ResourceLimit" in message:
                raise ResourceLimitExceeded(message)
            if response.status_code in (400, 404, 422):
                raise InvalidRequest(f"the gateway cannot start {name}: {message}")
            raise SandboxError(f"the gateway could not start {name}: {message}")
        session_id = response.json()["id"]
        return await self._connect_new(session_id)

    def _describe(self, model: dict, paths: dict[str, str], stats: dict[str, dict]) -> SessionInfo:
        session_id = model["id"]
        msb = stats.get(session_id) or {}
        # The msb gateway's stats name the kernelspec a kernel runs; its model, the name it was started by (python3).
        kernel_name = msb.get("kernel_name") or model.get("name")
        language, flavor = parse_kernel_name(kernel_name)
        return self.session_info(
            session_id,
            language=msb.get("template", language) if language else language,
            flavor=msb.get("flavor", flavor) if flavor else flavor,
            status=session_status(model.get("execution_state")),
            created=epoch_seconds(msb.get("created")),
            kernel_active=epoch_seconds(model.get("last_activity")),
            kernel_name=kernel_name,
            notebook_path=paths.get(session_id),
            network=msb.get("network"),
        )

    async def _paths_and_stats(self) -> tuple[dict[str, str], dict[str, dict]]:
        """Notebook paths as the msb gateway's stats give them; from /api/sessions where a server has no stats."""
        stats = await self._kernel_stats()
        if stats:
            return {k: entry["notebook_path"] for k, entry in stats.items() if entry.get("notebook_path")}, stats
        response = await self._request("GET", "/api/sessions")
        if response.status_code >= 400:
            return {}, stats
        return {s["kernel"]["id"]: s.get("path") for s in response.json() if s.get("kernel")}, stats

    async def _kernel_stats(self) -> dict[str, dict]:
        """Per-kernel facts the msb gateway adds (/api/msb/stats): flavor, template, creation time."""
        response = await self._request("GET", "/api/msb/stats")
        if response.status_code >= 400:
            return {}
        try:
            return {k["id"]: k for k in response.json().get("kernels", []) if isinstance(k, dict) and "id" in k}
        except (ValueError, AttributeError):
            return {}

    async def exit_reason(self, session_id: str) -> str | None:
        """Why this kernel last died, when the gateway knows (/api/msb/stats recently_stopped)."""
        response = await self._request("GET", "/api/msb/stats")
        if response.status_code >= 400:
            return None
        with contextlib.suppress(ValueError, AttributeError):
            stopped = [e for e in response.json().get("recently_stopped", []) if isinstance(e, dict) and e.get("id") == session_id]
            return stopped[-1].get("exit_reason") if stopped else None
        return None

    async def info(self, session_id: str) -> SessionInfo:
        model = await self.kernel_model(session_id)
        return self._describe(model, *await self._paths_and_stats())

    async def list(self) -> list[SessionInfo]:
        response = await self._request("GET", "/api/kernels")
        if response.status_code >= 400:
            raise SandboxError(f"the gateway answered HTTP {response.status_code}: {self._message(response)}")
        paths, stats = await self._paths_and_stats()
        models = response.json()
        for gone in set(self.records) - {model["id"] for model in models}:
            self.forget(gone)  # stopped, culled or deleted on the gateway, not through this bridge
        return [self._describe(model, paths, stats) for model in models]

    async def connection(self, session_id: str) -> KernelConnection:
        await self.kernel_model(session_id)
        record = self.record(session_id)
        async with record.connecting:
            connection = record.connection
            assert connection is None or isinstance(connection, GatewayConnection)
            # A dead kernel's connection is handed out once more, so that its user hears of the death.
            if connection is not None and not connection.closed and (connection.dead_reason is None or connection.kernel_died):
                return connection
            if connection is not None:
                await connection.close()
            connection = GatewayConnection(self, session_id)
            await connection.open(self.start_timeout)
            record.connection = connection
            self.records.setdefault(session_id, record)  # forgotten while it connected: kept, so that it is closed
            return connection

    async def _kernel_call(self, method: str, session_id: str, action: str, path: str = "") -> None:
        """One call on /api/kernels/<id><path>; a 404 is SessionNotFound, other failures SystemError."""
        response = await self._request(method, f"/api/kernels/{session_id}{path}")
        if response.status_code == 404:
            raise not_found(session_id)
        if response.status_code >= 400:
            raise SandboxError(f"the gateway could not {action} session {session_id}: {self._message(response)}")

    async def _post(self, session_id: str, action: str) -> None:
        await self.kernel_model(session_id)
        await self._kernel_call("POST", session_id, action, f"/{action}")

    async def stop(self, session_id: str) -> None:
        await self.kernel_model(session_id)
        await self.drop_connection(session_id)
        await self._kernel_call("DELETE", session_id, "stop")
        self.forget(session_id)

    async def interrupt(self, session_id: str) -> None:
        await self._post(session_id, "interrupt")

    async def restart(self, session_id: str) -> None:
        await self.drop_connection(session_id)
        await self._post(session_id, "restart")

    async def close(self) -> None:
        """Close the websockets and stop the kernels this bridge started; the notebook users' kernels stay."""
        for session_id in list(self.records):
            await self.drop_connection(session_id)
        for session_id in self.started_here():
            with contextlib.suppress(Exception):
                await self._request("DELETE", f"/api/kernels/{session_id}")
            self.forget(session_id)
        await self.http.aclose()
