"""What an MCP session is started with (issue 28): its kernel's variables, a network allow-list narrower than the
operator's, and secrets; through the gateway's /mcp with the official client, beside its warm pool, and over REST."""

from __future__ import annotations

import json
import secrets

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.mcp_bridge.conftest import result_error
from tests.msb_kernels.gateway.conftest import gateway_factory, wait_until  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

PROBE = """
import os, subprocess
api = subprocess.run(["curl", "-sS", "-v", "http://api.msb.test/echo"], capture_output=True, text=True)
pypi = subprocess.run(["curl", "-sS", "-H", "X-Token: " + os.environ.get("INDEX_TOKEN", ""), "https://pypi.msb.test/echo?setup"],
                      capture_output=True, text=True)
print(os.environ.get("PROJECT"), os.environ.get("MSB_NETWORK_ALLOW"), os.environ.get("INDEX_TOKEN", "")[:11])
print(next(line for line in api.stderr.splitlines() if line.startswith("< HTTP/")))
print(pypi.stdout)
"""


async def test_mcp_sessions_start_with_env_a_narrower_list_and_secrets_and_skip_the_pool(gateway_factory, upstream):
    gateway = await gateway_factory(
        extra_env={
            "MSB_POOL_SIZE": "python-small=1",
            "MSB_NETWORK_ALLOW": "*.msb.test",
            "MSB_NETWORK_DNS": upstream.dns,
            "MSB_NETWORK_CA_FILE": upstream.ca_file,  # the proxy trusts the test's upstream, whose HTTPS carries the secret
        }
    )

    async def pool() -> dict:
        return (await gateway.stats())["pool"]

    await wait_until(lambda: _ready(pool), 90, "a warm kernel")
    token = f"tok-{secrets.token_hex(8)}"
    headers = {"Authorization": f"Bearer {gateway.token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(180)) as http:
        async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client:
            started = await client.call_tool(
                "start_session",
                {
                    "env": {"PROJECT": "demo"},
                    "network_allow": ["pypi.msb.test"],
                    "secrets": {"INDEX_TOKEN": {"value": token, "hosts": ["pypi.msb.test"], "header": "X-Token"}},
                },
            )
            assert not started.is_error, started.content[0].text
            (session,) = started.structured_content["sessions"]
            assert session["network"] == "allow-list: pypi.msb.test"
            assert (await pool())["handed_out"] == 0, "a session with its own variables starts its own kernel"
            ran = await client.call_tool("execute_code", {"code": PROBE, "session_id": session["id"]})
            lines = ran.structured_content["stdout"].splitlines()
            assert lines[0] == "demo pypi.msb.test msb-secret-", lines
            assert "not allowed by this session's network_allow (KERNEL_NETWORK_ALLOW) (pypi.msb.test)" in lines[1], lines
            assert json.loads(lines[2])["headers"]["x-token"] == "*" * len(token), lines[2]  # masked in the answer
            (sent,) = [entry for entry in upstream.requests() if entry["path"].endswith("?setup")]
            assert {k.lower(): v for k, v in sent["headers"].items()}["x-token"] == token  # the real value went out

            plain = await client.call_tool("execute_code", {"code": "import os; print(os.environ['MSB_NETWORK_ALLOW'])"})
            assert plain.structured_content["stdout"] == "*.msb.test\n"
            await wait_until(lambda: _handed_out(pool), 30, "the pool's hand-out of a plain session")

            refusals = {
                "LD_PRELOAD": {"env": {"LD_PRELOAD": "/tmp/x.so"}},
                "PYTHONPATH": {"env": {"PYTHONPATH": "/tmp"}},
                "MSB_FLAVOR": {"env": {"MSB_FLAVOR": "large"}},
                "KERNEL_NETWORK_ALLOW": {"env": {"KERNEL_NETWORK_ALLOW": "*"}},
                "not within the operator's list": {"network_allow": "pypi.org"},
                "does not allow": {"network_allow": "pypi.msb.test", "secrets": {"T": {"value": "v", "hosts": ["api.msb.test"]}}},
                "a running session keeps what it started with": {"env": {"A": "1"}, "session_id": session["id"]},
            }
            for expected, arguments in refusals.items():
                refused = await client.call_tool("execute_code", {"code": "1", **arguments})
                error = result_error(refused)
                assert error["type"] == "InvalidRequest" and expected in error["message"], (expected, error)
            # A refusal of network_allow or secrets names the argument the client sent, and advice it can follow.
            advised = {
                "network_allow='pypi.org': pypi.org is not within the operator's list": (
                    {"network_allow": "pypi.org"},
                    "for a host outside it, ask the operator to add it to MSB_NETWORK_ALLOW",
                ),
                "secrets: T is for api.msb.test, which this kernel's network allow-list (pypi.msb.test) does not allow": (
                    {"network_allow": "pypi.msb.test", "secrets": {"T": {"value": "v", "hosts": ["api.msb.test"]}}},
                    "add the host to network_allow",
                ),
                "secrets: T is for api.example.com": (
                    {"network_allow": "pypi.msb.test", "secrets": {"T": {"value": "v", "hosts": ["api.example.com"]}}},
                    "for T's host, ask the operator to add it to MSB_NETWORK_ALLOW",
                ),
            }
            for expected, (arguments, advice) in advised.items():
                error = result_error(await client.call_tool("execute_code", {"code": "1", **arguments}))
                assert expected in error["message"] and advice in error["suggestions"], (expected, error)
                assert "KERNEL_" not in error["message"] + " ".join(error["suggestions"]), error
            listed = await client.call_tool("get_sessions", {"session_id": session["id"]})
            assert "network allow-list: pypi.msb.test" in listed.content[0].text

    denied = await gateway.request("POST", "/api/kernels", {"name": "msb-python-small", "env": {"PYTHONSTARTUP": "/tmp/x.py"}})
    assert denied.code == 400 and "PYTHONSTARTUP may not be set" in denied.json["message"], denied.body
    kernel_id = await gateway.start_kernel(env={"PATH_HINT": "rest", "KERNEL_NETWORK_ALLOW": "none"})
    model = next(k for k in (await gateway.stats())["kernels"] if k["id"] == kernel_id)
    assert model["network"] == "none" and model["egress"] is None
    assert gateway.stop(timeout=20) == 0, "refused starts leave nothing that stops a clean stop"


async def _ready(pool) -> bool:
    return sum((await pool())["waiting"].values()) >= 1


async def _handed_out(pool) -> bool:
    return (await pool())["handed_out"] == 1
