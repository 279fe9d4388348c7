"""A Docker API proxy for the gateway of MSB_BACKEND=swarm: it passes only the calls the swarm backend makes, and only
with bodies that describe kernels.

Why our own: the gateway runs as a Swarm service and starts kernels through the Docker API, and whoever holds a
manager's socket is root on every node (a service that bind-mounts / or runs privileged). A generic socket proxy
allows or denies whole API sections by path and method: with services and POST allowed, the gateway could still
create exactly such a service. This one reads each request body and lets the gateway create only kernel-shaped
services (a kernel image, not root, read-only, no capabilities, tmpfs only, the kernels' internal network, limits
on CPU, memory and processes), its own network, secrets and configs, and remove only what carries the msb-kernels
label. It also hides other stacks' services, tasks, secrets and configs from its listings (their environment and
config data are theirs). Everything else is refused with 403 and a message that says which rule.

    msb-kernels swarm-proxy --listen 0.0.0.0:2375 --docker-socket /var/run/docker.sock
    (the gateway: DOCKER_HOST=tcp://<proxy>:2375, on a private overlay that only the gateway and the proxy join)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from msb_kernels.backends.cluster.api_rules import (
    DELETE_PATH,
    MAX_BODY_BYTES,
    NOT_A_CALL,
    Policy,
    Refused,
    classify,
    parse_body,
    spec_labelled,
    split_path,
)
from msb_kernels.backends.cluster.swarm import LABEL
from msb_kernels.errors import SandboxError
from msb_kernels.settings.config import MsbSettings, load_settings

log = logging.getLogger("msb_kernels")

UPSTREAM_TIMEOUT_S = 120.0
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
NOT_COPIED_BACK = HOP_BY_HOP | {"content-length", "content-encoding"}


class SwarmProxy:
    def __init__(self, docker_socket: str, policy: Policy):
        self.docker_socket = docker_socket
        self.policy = policy
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.docker_socket), base_url="http://docker", timeout=UPSTREAM_TIMEOUT_S
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def handle(self, request: Request) -> Response:
        method = request.method
        path = request.url.path
        # Matched decoded (as the engine decodes it), forwarded as sent: an image name's "@" comes percent-encoded.
        raw_path = request.scope.get("raw_path", path.encode()).decode("latin-1")
        query = request.url.query
        prefix, call = split_path(path)
        log.debug("swarm proxy: %s %s", method, raw_path)
        try:
            kind = classify(method, call)
            if kind == "read":
                return await self._read(request, prefix, call, raw_path, query)
            if kind == "create":
                return await self._create(request, prefix, call, raw_path, query)
            return await self._delete(request, prefix, call)
        except Refused as refusal:
            log.warning("swarm proxy refused %s %s: %s", method, path, refusal.rule)
            if refusal.rule == NOT_A_CALL:
                message = f"msb-kernels swarm proxy: {method} {path} is not a call the swarm backend makes"
            else:
                message = f"msb-kernels swarm proxy: {method} {path} refused: {refusal.rule}"
            return JSONResponse({"message": message}, status_code=refusal.status)
        except httpx.HTTPError as exc:
            log.warning("swarm proxy: the engine at %s does not answer %s %s: %s", self.docker_socket, method, path, exc)
            message = f"msb-kernels swarm proxy: the Docker engine at {self.docker_socket} does not answer: {exc}"
            return JSONResponse({"message": message}, status_code=502)

    # -- upstream -----------------------------------------------------------------------------

    async def _upstream(self, request: Request, method: str, target: str, body: bytes | None = None) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"host", "content-length"}}
        return await self.client.request(method, target, headers=headers, content=body)

    @staticmethod
    def _response(upstream: httpx.Response, content: bytes | None = None) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_COPIED_BACK}
        return Response(upstream.content if content is None else content, status_code=upstream.status_code, headers=headers)

    async def _inspect(self, request: Request, prefix: str, kind: str, ident: str) -> httpx.Response:
        return await self._upstream(request, "GET", f"{prefix}/{kind}/{quote(ident, safe='')}")

    # -- calls --------------------------------------------------------------------------------

    async def _read(self, request: Request, prefix: str, call: str, raw_path: str, query: str) -> Response:
        target = raw_path + (f"?{query}" if query else "")
        upstream = await self._upstream(request, request.method, target)
        if upstream.status_code != 200 or (
            call not in ("/services", "/tasks", "/secrets", "/configs") and not call.startswith("/services/")
        ):
            return self._response(upstream)
        # Other stacks' services, tasks and configs carry their environment and data: the gateway sees only ours.
        found = upstream.json()
        if call.startswith("/services/"):
            if not spec_labelled(found):
                raise Refused(f"service {call.rsplit('/', 1)[1]} is not an msb-kernels service")
            return self._response(upstream)
        if call == "/tasks":
            services = await self._upstream(request, "GET", f"{prefix}/services?filters=" + quote(json.dumps({"label": [f"{LABEL}=1"]})))
            services.raise_for_status()
            ours = {service["ID"] for service in services.json() if spec_labelled(service)}
            kept = [task for task in found if isinstance(task, dict) and task.get("ServiceID") in ours]
        else:
            kept = [item for item in found if spec_labelled(item)]
        return self._response(upstream, json.dumps(kept).encode())

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise Refused(f"its body is over {MAX_BODY_BYTES} bytes", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise Refused(f"its body is over {MAX_BODY_BYTES} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _create(self, request: Request, prefix: str, call: str, raw_path: str, query: str) -> Response:
        body = parse_body(await self._body(request))
        if call == "/services/create":
            secret_ids, network_ids = self.policy.check_service(body)
            for secret_id in secret_ids:
                found = await self._inspect(request, prefix, "secrets", secret_id)
                secret = found.json() if found.status_code == 200 else {}
                if secret.get("ID") != secret_id or not spec_labelled(secret):
                    raise Refused(f"secret {secret_id} is not an msb-kernels secret")
            for network_id in network_ids:
                found = await self._inspect(request, prefix, "networks", network_id)
                network = found.json() if found.status_code == 200 else {}
                if network.get("Id") != network_id or network.get("Name") != self.policy.network:
                    raise Refused(f"network {network_id} is not the kernels' network {self.policy.network!r}")
        elif call == "/networks/create":
            self.policy.check_network(body)
        else:
            self.policy.check_object(call.split("/")[1].rstrip("s"), body)
        # What was checked is what goes on: one parse, ours, so no quirk of the engine's JSON decoder sees other fields.
        upstream = await self._upstream(request, "POST", raw_path + (f"?{query}" if query else ""), json.dumps(body).encode())
        log.info("swarm proxy: POST %s %s -> %d", call, body.get("Name"), upstream.status_code)
        return self._response(upstream)

    async def _delete(self, request: Request, prefix: str, call: str) -> Response:
        match = DELETE_PATH.match(call)
        assert match is not None  # classify matched it
        kind, ident = match.group(1), match.group(2)
        found = await self._inspect(request, prefix, kind, ident)
        if found.status_code != 200:
            return self._response(found)  # gone already: the backend's remove expects the engine's 404
        obj = found.json()
        if not spec_labelled(obj):
            raise Refused(f"{kind.rstrip('s')} {ident} does not carry the label {LABEL}=1")
        # By the ID inspected, not the name given: a name could be taken by another object in between.
        upstream = await self._upstream(request, "DELETE", f"{prefix}/{kind}/{obj['ID']}")
        log.info("swarm proxy: DELETE %s/%s (%s) -> %d", kind, obj["ID"][:12], (obj.get("Spec") or {}).get("Name"), upstream.status_code)
        return self._response(upstream)


def build_app(docker_socket: str, settings: MsbSettings) -> Starlette:
    """The proxy as an ASGI app, forwarding what it allows to the engine at the unix socket docker_socket."""
    proxy = SwarmProxy(docker_socket, Policy.from_settings(settings))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.close()

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", proxy.handle, methods=methods)], lifespan=lifespan)


def serve(listen_host: str, listen_port: int, docker_socket: str) -> None:
    """Run the proxy until interrupted (`msb-kernels swarm-proxy`)."""
    import uvicorn

    settings = load_settings()
    try:
        is_socket = stat.S_ISSOCK(os.stat(docker_socket).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise SandboxError(
            f"{docker_socket} is not the Docker engine's socket",
            ["mount the manager's socket into the proxy's container (/var/run/docker.sock)", "or name it with --docker-socket"],
        )
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)  # what it let through and what it refused is the proxy's audit trail
    policy = Policy.from_settings(settings)
    log.info(
        "swarm proxy on %s:%d for %s: kernels on network %s from %s%s",
        listen_host,
        listen_port,
        docker_socket,
        policy.network,
        ", ".join(policy.images),
        " (network allowed)" if policy.allow_network else "",
    )
    app = build_app(docker_socket, settings)
    # The engine's own Server and Date headers come back: uvicorn's would repeat them.
    uvicorn.run(app, host=listen_host, port=listen_port, log_level="warning", access_log=False, server_header=False, date_header=False)
