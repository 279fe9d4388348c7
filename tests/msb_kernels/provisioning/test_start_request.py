"""The typed start request, without a kernel: what a client's variables become, what they never become, and what a
request that exists is sure to hold."""

from __future__ import annotations

import json
import os

import pytest

from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import Owner
from msb_kernels.provisioning.start_request import WHOLE_VOLUME, StartRequest
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_a_start_requests_env_becomes_typed_fields_and_the_sessions_own_variables():
    request = StartRequest.from_variables(
        {
            "KERNEL_FLAVOR": "medium",
            "KERNEL_NETWORK_ALLOW": "pypi.org",
            "KERNEL_SECRETS": json.dumps({"T": {"value": "v", "hosts": ["pypi.org"]}}),
            "KERNEL_WORKING_DIR": "/home/alice/work",
            "KERNEL_LAUNCH_TIMEOUT": "40",
            "KERNEL_USERNAME": "alice",
            "JPY_SESSION_NAME": "work/a.ipynb",
            "PROJECT": "demo",
        }
    )
    assert (request.flavor, request.network_allow, request.working_dir, request.notebook_path) == (
        "medium",
        "pypi.org",
        "/home/alice/work",
        "work/a.ipynb",
    )
    assert json.loads(request.secrets)["T"]["hosts"] == ["pypi.org"]
    # The launch timeout is the client's wait, dropped; the rest are the session's own, passed to the kernel.
    assert dict(request.env) == {"KERNEL_USERNAME": "alice", "PROJECT": "demo"}
    assert request.kernel_variables() == {"KERNEL_USERNAME": "alice", "PROJECT": "demo", "JPY_SESSION_NAME": "work/a.ipynb"}
    # Who asks is never the request's to say: no variable sets the owner or the volume.
    assert request.owner is None and request.volume is None
    assert StartRequest.from_variables(request.wire_env()) == request


def test_the_marker_that_named_the_gateways_variables_is_only_a_variable_now():
    """KERNEL_ENV_NAMES once told the provisioner which of the gateway's variables were the session's: a client set it
    to MSB_TOKEN and read the admin token. Now it is a session's variable like any other, its value only text."""
    request = StartRequest.from_variables({"KERNEL_ENV_NAMES": "MSB_TOKEN,SOME_DB_PASSWORD"})
    assert request.kernel_variables() == {"KERNEL_ENV_NAMES": "MSB_TOKEN,SOME_DB_PASSWORD"}


@pytest.mark.parametrize(
    "variables, named",
    [
        ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD"),
        ({"PYTHONSTARTUP": "/tmp/x.py"}, "PYTHONSTARTUP"),
        ({"MSB_TOKEN": "x"}, "MSB_TOKEN"),
        ({"MSB_VOLUME_OWNER": "bob"}, "MSB_VOLUME_OWNER"),
        ({"JPY_API_TOKEN": "x"}, "JPY_API_TOKEN"),
        ({"HOME": ""}, "HOME"),  # found by test_canaries.py's property test: the kernel died at every start
        ({"PATH": ""}, "PATH"),
        ({"NODE_OPTIONS": "--require=/tmp/x.js"}, "NODE_OPTIONS"),
        ({"1BAD": "x"}, "1BAD"),
        ({"NUL": "a\0b"}, "NUL"),
        ({f"V{i}": "x" for i in range(65)}, "65 variables"),
    ],
)
def test_a_variable_no_session_sets_is_refused_by_name(variables, named):
    with pytest.raises(InvalidRequest, match=named):
        StartRequest.from_variables(variables)


def test_a_request_is_checked_however_it_is_made():
    with pytest.raises(InvalidRequest, match="LD_PRELOAD"):
        StartRequest(env={"LD_PRELOAD": "/x"})
    for volume in ("", "..", "a/b", "../bob"):
        with pytest.raises(InvalidRequest, match="one directory name"):
            StartRequest(volume=volume)
    with pytest.raises(InvalidRequest, match="owner"):
        StartRequest(owner="alice")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        StartRequest.from_variables(["KERNEL_FLAVOR"])
    request = StartRequest(env={"A": "1"})
    with pytest.raises(TypeError):
        request.env["B"] = "2"  # type: ignore[index]


def test_a_local_start_reads_only_its_kernel_variables_and_owns_the_whole_volume():
    environment = {**os.environ, "KERNEL_FLAVOR": "large", "AWS_SECRET_ACCESS_KEY": "canary", "MSB_TOKEN": "canary"}
    request = StartRequest.for_local_start(environment)
    assert request.flavor == "large" and request.volume == WHOLE_VOLUME
    assert "canary" not in json.dumps(request.to_record())


def test_the_gateway_decides_the_owner_and_the_volume():
    asked = StartRequest.from_variables({"PROJECT": "demo"})
    run = asked.for_caller(Owner("users-file", "alice"), "alice")
    assert (run.owner, run.volume, dict(run.env)) == (Owner("users-file", "alice"), "alice", {"PROJECT": "demo"})
    assert StartRequest.from_record(json.loads(json.dumps(run.to_record()))) == run
    # Not the same sandbox as the pool's (a waiting kernel mounts the whole volume), where the host has a volume.
    pooled = StartRequest(volume=WHOLE_VOLUME)
    assert run.for_caller(None, WHOLE_VOLUME).sandbox_shape(True) != pooled.sandbox_shape(True)  # PROJECT
    assert StartRequest(volume="alice").sandbox_shape(True) != pooled.sandbox_shape(True)
    assert StartRequest(volume="alice").sandbox_shape(False) == pooled.sandbox_shape(False)


def test_its_repr_names_no_value():
    request = StartRequest(env={"PASSWORD": "hunter2"}, secrets=json.dumps({"T": {"value": "s3cret", "hosts": ["a.example"]}}))
    assert "hunter2" not in repr(request) and "s3cret" not in repr(request) and "PASSWORD" in repr(request)
