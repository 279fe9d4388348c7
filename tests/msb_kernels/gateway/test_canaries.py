"""A property of every start: the gateway's environment is seeded with canaries, and whatever a start request holds
(any names, any values, the markers and substitutions a client might try, through REST or /api/sessions), no canary
appears in the kernel's environment, its files or anything it can read under /proc. A request is either refused with
a clear error or runs clean.

Hypothesis draws the requests; each runs on a real gateway with a real sandboxed kernel (namespace), so the examples
are few. A failure prints the request that broke it, which hypothesis then keeps trying first.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.msb_kernels.gateway.conftest import Gateway, KernelSocket, canary_probe, launch_gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "canary-token-" + uuid.uuid4().hex
CANARIES = {
    "SOME_DB_PASSWORD": "canary-db-" + uuid.uuid4().hex,
    "AWS_SECRET_ACCESS_KEY": "canary-aws-" + uuid.uuid4().hex,
    "JUPYTER_GATEWAY_AUTH_TOKEN": "canary-gw-" + uuid.uuid4().hex,
    "MSB_EXTRA_SECRET": "canary-msb-" + uuid.uuid4().hex,
}
NAMES = [*CANARIES, "MSB_TOKEN"]
SEEN = [TOKEN, *CANARIES.values()]

# What a client might put in a start request's env to reach the gateway's variables.
variable_names = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(["KERNEL_ENV_NAMES", "KERNEL_FLAVOR", "KERNEL_NETWORK_ALLOW", "KERNEL_SECRETS", "KERNEL_WORKING_DIR"]),
    st.sampled_from(["KERNEL_NETWORK_ARGUMENTS", "KERNEL_USERNAME", "KERNEL_LAUNCH_TIMEOUT", "JPY_SESSION_NAME", "JPY_API_TOKEN"]),
    st.sampled_from(["LD_PRELOAD", "PYTHONSTARTUP", "MSB_VOLUME_OWNER", "PATH", "HOME", "JUPYTER_RUNTIME_DIR", "kernel_env_names"]),
    st.from_regex(r"\A[A-Z][A-Z0-9_]{0,20}\Z", fullmatch=True),
)
variable_values = st.one_of(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=4).map(",".join),
    st.sampled_from(NAMES).map(lambda name: "${" + name + "}"),
    st.sampled_from(NAMES).map(lambda name: "$" + name),
    st.sampled_from(["small", "medium", "none", "*", "", "/tmp", "../..", "{}"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\0"), max_size=30),
)
requests = st.fixed_dictionaries(
    {"env": st.dictionaries(variable_names, variable_values, max_size=6), "route": st.sampled_from(["rest", "sessions"])}
)


@pytest.fixture(scope="module")
def seeded() -> Iterator[Gateway]:
    """A gateway whose own environment holds the canaries beside its token (no pool: every request starts its own)."""
    environment = {"MSB_POOL_SIZE": "python-small=0", "MSB_BACKEND": "namespace", **CANARIES}
    gateway = asyncio.run(launch_gateway(environment, token=TOKEN))
    yield gateway
    gateway.stop()


async def start_and_probe(gateway: Gateway, env: dict, route: str) -> list | None:
    """The canaries found in the kernel a request started; None where the request was refused (with a JSON error)."""
    if route == "rest":
        response = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": env})
        kernel = response.json["id"] if response.code == 201 else None
    else:  # a session carries no env: its path is what a client controls, here one of the drawn values
        path = next(iter(env.values()), "a.ipynb") or "a.ipynb"
        response = await gateway.request(
            "POST", "/api/sessions", {"path": path, "type": "notebook", "kernel": {"name": "msb-python-small"}}
        )
        kernel = response.json["kernel"]["id"] if response.code == 201 else None
    if kernel is None:
        assert response.code in (400, 404), (response.code, response.body)
        assert "message" in response.json and "Traceback" not in response.body.decode(), response.body
        assert not [c for c in SEEN if c in response.body.decode()], response.body
        return None
    try:
        socket = await KernelSocket.open(gateway, kernel)
        try:
            reply = await socket.execute(canary_probe(SEEN, ["/run/kernel", "/tmp"]), timeout=60)
        finally:
            socket.close()
        assert reply.reply["content"]["status"] == "ok", reply.reply
        return json.loads(reply.stdout.strip().splitlines()[-1])["found"]
    finally:
        await gateway.request("DELETE", f"/api/kernels/{kernel}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests)
def test_no_start_request_brings_a_canary_of_the_gateways_environment_into_its_kernel(seeded: Gateway, request: dict) -> None:
    found = asyncio.run(start_and_probe(seeded, request["env"], request["route"]))
    event("refused" if found is None else "ran")
    assert not found, f"{request}: {found}"


def test_the_canaries_are_where_the_property_looks_for_them(seeded: Gateway) -> None:
    """The property can fail: the gateway's own process holds every canary, where the probe's reading would see it."""
    environ = open(f"/proc/{seeded.process.pid}/environ", "rb").read()
    assert all(canary.encode() in environ for canary in SEEN)
