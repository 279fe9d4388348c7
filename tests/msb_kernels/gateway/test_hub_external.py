"""The gateway as an external JupyterHub service: the operator starts `msb-kernels serve`, not the Hub.

The Hub's config names the service with a url and an api_token and no command; the operator exports the three
variables JupyterHub gives a service (JUPYTERHUB_API_URL, JUPYTERHUB_API_TOKEN, JUPYTERHUB_SERVICE_NAME) and starts
the gateway. It serves under /services/msb-kernels/ by itself and takes each person's Hub token, as the managed
service does (test_hub.py).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator

import pytest

from tests.conftest import TEST_BASE, VENV_BIN
from tests.hub import SERVICE, Hub, launch_hub
from tests.msb_kernels.gateway.conftest import HttpServer, free_port
from tests.skips import needs_hub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), needs_hub]


@pytest.fixture(scope="module")
async def external() -> AsyncIterator[tuple[Hub, HttpServer]]:
    api_port, gateway_port, service_token = free_port(), free_port(), secrets.token_hex(24)
    log_path = TEST_BASE / f"external-gateway-{gateway_port}.log"
    env = {
        **os.environ,
        "JUPYTERHUB_API_URL": f"http://127.0.0.1:{api_port}/hub/api",
        "JUPYTERHUB_API_TOKEN": service_token,
        "JUPYTERHUB_SERVICE_NAME": SERVICE,
        "MSB_RUNTIME_DIR": str(TEST_BASE / f"x{gateway_port}"),
        "MSB_HUB_AUTH_CACHE_SECONDS": "0",  # ask the Hub at every request
    }
    env.pop("MSB_TOKEN", None)
    with open(log_path, "wb") as log:  # the operator's start: no prefix, no token of its own, only the Hub's three variables
        process = subprocess.Popen(
            [str(VENV_BIN / "msb-kernels"), "serve", "--port", str(gateway_port)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    gateway = HttpServer(gateway_port, "", process, log_path)
    # The shipped config's managed service, made external: a url and a token, no command.
    config = (
        f"c.JupyterHub.services = [s for s in c.JupyterHub.services if s['name'] != {SERVICE!r}] + "
        f'[{{"name": {SERVICE!r}, "url": "http://127.0.0.1:{gateway_port}", "api_token": {service_token!r}, "display": False}}]'
    )
    try:
        hub = await launch_hub(users=("alice", "bob"), env={"MSB_HUB_API_PORT": str(api_port)}, extra_config=config)
    except BaseException:
        gateway.stop()
        raise
    yield hub, gateway
    hub.stop()
    gateway.stop()


async def test_an_operator_started_gateway_serves_each_person_their_own_kernels(external) -> None:
    hub, gateway = external
    alice, bob = await hub.token_for("alice"), await hub.token_for("bob")
    started = await hub.gateway("POST", "api/kernels", token=alice, body={"name": "msb-python-small"})
    assert started.code == 201, (started.code, started.body, gateway.log()[-2000:])
    kernel = started.json["id"]
    try:
        assert [k["id"] for k in (await hub.gateway("GET", "api/kernels", token=alice)).json] == [kernel]
        assert (await hub.gateway("GET", "api/kernels", token=bob)).json == []
        assert (await hub.gateway("GET", f"api/kernels/{kernel}", token=bob)).code == 404
        assert (await hub.gateway("GET", "api/kernels", token=None)).code in (401, 403)
        # It serves under the service prefix by itself: its own port answers there, and not at the root.
        assert (await gateway.request("GET", f"/services/{SERVICE}/api/kernels", token=alice)).code == 200
        assert (await gateway.request("GET", "/api/kernels", token=alice)).code == 404
    finally:
        await hub.gateway("DELETE", f"api/kernels/{kernel}", token=alice)
    # With no cache, a revoked token is refused at its next request.
    assert (await hub.gateway("GET", "api/kernels", token=bob)).code == 200
    await hub.revoke("bob", bob)
    assert (await hub.gateway("GET", "api/kernels", token=bob)).code in (401, 403)
    assert "Traceback" not in gateway.log(), gateway.log()[-3000:]
