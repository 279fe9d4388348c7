"""Kernels from an environment the test made offline (msbenvprobe in it, not in the suite's venv), as users start
them: papermill on its kernelspec, `msb-kernels env check`, a gateway and its warm pool, and an MCP client over the
gateway's /mcp. Namespace and gVisor (as root, where runsc is installed), and Docker Swarm with the environment's
own image (papermill from the kernels' overlay); the gateway's own venv stays as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx2
import nbformat
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from msb_kernels.environments.store import EnvironmentStore
from tests.conftest import TEST_BASE, make_persons
from tests.kernel_helpers import execute
from tests.mcp_bridge.conftest import child_env
from tests.msb_kernels.environments.conftest import EnvHost, SwarmKernels
from tests.msb_kernels.environments.wheels import PROBE_VALUE, package_wheel
from tests.msb_kernels.gateway.conftest import KernelSocket, launch_gateway, wait_until
from tests.skips import needs_runsc

VENV_BIN = Path(sys.executable).parent
PROBE_CELL = """
import json, os, sys
try:
    import msbenvprobe
    value = msbenvprobe.VALUE
except ImportError as exc:
    value = repr(exc)
print(json.dumps({"value": value, "executable": sys.executable, "prefix": sys.prefix,
                  "beside": sorted(os.listdir(os.path.dirname(sys.prefix))), "backend": os.environ.get("MSB_SANDBOX")}))
"""
BACKENDS = ["namespace", pytest.param("gvisor", marks=needs_runsc)]
pytestmark = pytest.mark.slow  # some 90 s of papermill runs, gateways and gVisor starts: out of the quick loop


def _run_papermill(kernel: str, backend: str, directory: Path, host: EnvHost, swarm: SwarmKernels | None = None):
    """papermill -k KERNEL on a notebook that says what its kernel sees (on Swarm: from the kernels' overlay)."""
    notebook = directory / f"{kernel}-{backend}.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(PROBE_CELL)]), notebook)
    out = directory / f"{kernel}-{backend}.out.ipynb"
    result = subprocess.run(
        [*(swarm.there if swarm else []), str(VENV_BIN / "papermill"), str(notebook), str(out), "-k", kernel, "--cwd", str(directory)],
        env=swarm.env(host) if swarm else {**host.env, "MSB_BACKEND": backend},
        capture_output=True,
        text=True,
        timeout=240,
    )
    return result, out


def _papermill(kernel: str, backend: str, directory: Path, host: EnvHost, swarm: SwarmKernels | None = None) -> dict:
    """That kernel's answer."""
    result, out = _run_papermill(kernel, backend, directory, host, swarm)
    assert result.returncode == 0, result.stderr[-3000:]
    (cell,) = nbformat.read(out, as_version=4).cells
    return json.loads(cell.outputs[0]["text"])


@pytest.mark.parametrize("backend", [*BACKENDS, "swarm"])
def test_papermill_runs_a_notebook_in_the_environment_and_the_default_lacks_its_package(probe_env, backend, tmp_path, request):
    """On Swarm the kernel runs the environment's own image (`msb-kernels image build python --env probe`), which holds
    its venv and base interpreter at their host paths; the default kernel runs the default image."""
    os.chmod(tmp_path, 0o755)
    swarm = request.getfixturevalue("probe_on_swarm") if backend == "swarm" else None
    python = str(probe_env.directory / "probe" / "bin" / "python")
    seen = _papermill("msb-probe-python-small", backend, tmp_path, probe_env, swarm)
    assert seen["value"] == PROBE_VALUE and seen["executable"] == python and seen["backend"] == backend, seen
    assert seen["beside"] == ["probe"], seen  # its store and the host's other files beside the venv stay out
    default = _papermill("msb-python-small", backend, tmp_path, probe_env, swarm)
    assert "No module named 'msbenvprobe'" in default["value"], default
    assert default["executable"] == ("/usr/bin/python3" if swarm else sys.executable), default


def test_the_image_build_says_what_it_made_and_list_names_the_image(probe_on_swarm, probe_env):
    output = probe_on_swarm.build_output
    assert "built msb-kernels/python-probe:latest (python, environment probe, offline)" in output, output
    assert "recorded in environment probe" in output and "docker load" in output, output
    assert json.loads(probe_env.store_text() or "{}")["environments"][0]["image"] == "msb-kernels/python-probe:latest"
    assert "image msb-kernels/python-probe:latest" in probe_env.cli("env", "list").stdout


@contextlib.contextmanager
def _another_name_for_probe(host: EnvHost, probe: EnvHost, name: str, image: str | None) -> Iterator[None]:
    """probe's interpreter added again under name (its kernelspecs msb-NAME-python-*), its record naming image; removed
    after, so that no later test lists it."""
    added = host.env_cli("add", name, "--python", str(probe.directory / "probe" / "bin" / "python"))
    assert added.returncode == 0, added.stderr
    try:
        if image is not None:
            store = EnvironmentStore(host.directory)
            store.put(dataclasses.replace(store.get(name), image=image))
        yield
    finally:
        host.cli("env", "remove", name)


def test_on_swarm_an_environment_without_an_image_is_refused_naming_the_command(probe_on_swarm, probe_env, env_host, tmp_path):
    os.chmod(tmp_path, 0o755)
    with _another_name_for_probe(env_host, probe_env, "bare", None):
        before = env_host.store_text()
        began = time.monotonic()
        result, _ = _run_papermill("msb-bare-python-small", "swarm", tmp_path, env_host, probe_on_swarm)
        assert result.returncode != 0 and time.monotonic() - began < 30
        refusal = "InvalidRequest: environment bare has no kernel image, and this backend's kernels run one: build it with "
        assert refusal + "`msb-kernels image build python --env bare`" in result.stderr, result.stderr[-3000:]
        assert env_host.store_text() == before
        assert not probe_on_swarm.site.client().services.list(filters={"label": "msb-kernels=1"}), "a service was left"
        listed = env_host.cli("env", "list").stdout
        assert "no image for Swarm or microVMs (`msb-kernels image build python --env bare`)" in listed, listed


def test_on_swarm_nodes_without_the_environments_image_refuse_it_naming_the_command(probe_on_swarm, probe_env, env_host, tmp_path):
    os.chmod(tmp_path, 0o755)
    with _another_name_for_probe(env_host, probe_env, "ghost", "msb-kernels/python-ghost:latest"):  # loaded on no node
        result, _ = _run_papermill("msb-ghost-python-small", "swarm", tmp_path, env_host, probe_on_swarm)
    assert result.returncode != 0
    assert "msb-kernels/python-ghost:latest" in result.stderr, result.stderr[-3000:]
    assert "`msb-kernels image build python --env ghost`" in result.stderr, result.stderr[-3000:]
    assert not probe_on_swarm.site.client().services.list(filters={"label": "msb-kernels=1"}), "a service was left"


def test_create_said_what_it_installed_and_how_long_it_took(probe_env):
    output = probe_env.created_output
    assert "created environment probe in " in output and " in " in output and "(offline, from " in output, output
    assert "msbenvprobe 1.0" in output and "ipykernel " in output, output
    assert "installed msb-probe-python-small: Python 3 (probe, sandbox, small)" in output, output
    listed = probe_env.cli("env", "list")
    assert listed.returncode == 0 and "probe  Python 3." in listed.stdout and "msbenvprobe 1.0" in listed.stdout, listed.stdout
    spec = json.loads(next(Path(os.environ["JUPYTER_PATH"]).glob("kernels/msb-probe-python-small/kernel.json")).read_text())
    assert spec["argv"][0] == str(probe_env.directory / "probe" / "bin" / "python")
    assert spec["metadata"]["kernel_provisioner"]["config"] == {"flavor": "small", "template": "python", "environment": "probe"}


def test_check_starts_a_kernel_in_each_backend_that_runs_here(probe_env):
    result = probe_env.cli("env", "check", "probe")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "probe: Python 3." in result.stdout and "ipykernel" in result.stdout, result.stdout
    assert "namespace: ok: a kernel from " in result.stdout, result.stdout
    if os.geteuid() == 0 and shutil.which("runsc"):
        assert "gvisor: ok: a kernel from " in result.stdout, result.stdout


async def test_remove_is_refused_while_a_kernel_uses_it_naming_the_kernel(probe_env, start_kernel, monkeypatch):
    monkeypatch.setenv("MSB_ENVIRONMENTS_DIR", str(probe_env.directory))
    km, kc = await start_kernel("msb-probe-python-small")
    assert (await execute(kc, "import msbenvprobe; print(msbenvprobe.VALUE)")).stdout.strip() == PROBE_VALUE
    # Its packages never ran on the host: an environment's kernel is not forked from a server that imported them there.
    assert km.provisioner.sandbox.info()["forked"] is False
    before = probe_env.store_text()
    refused = probe_env.cli("env", "remove", "probe")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"environment probe is in use by 1 live kernel(s): {km.kernel_id} (namespace)" in refused.stderr, refused.stderr
    assert probe_env.store_text() == before and list(Path(os.environ["JUPYTER_PATH"]).glob("kernels/msb-probe-python-*"))


def _unpack(wheels: Path, site: Path) -> None:
    """Install wheels the way a conda or pip install leaves them: their files in site-packages."""
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


@pytest.fixture(scope="module")
def elsewhere(wheels):
    """A conda-like prefix under /opt (a static Debian python with its stdlib beside it, packages unpacked into its
    site dir), and a venv of that other base Python (not the suite's pyenv one) in a home directory."""
    base = "/usr/bin/python3.11"
    if not os.path.exists(base) or "libpython" in subprocess.run(["ldd", base], capture_output=True, text=True).stdout:
        pytest.skip("no statically linked /usr/bin/python3.11 to lay out as a conda environment here")
    token = uuid.uuid4().hex[:8]
    conda = Path(f"/opt/msbt-conda-{token}")
    home = Path(f"/home/msbt-other-{token}")
    (conda / "bin").mkdir(parents=True)
    (conda / "lib").mkdir()
    shutil.copy2(base, conda / "bin" / "python3.11")
    (conda / "bin" / "python").symlink_to("python3.11")
    subprocess.run(["cp", "-a", "/usr/lib/python3.11", str(conda / "lib")], check=True)
    _unpack(wheels, conda / "lib" / "python3.11" / "dist-packages")  # Debian's site dir for a prefix of its own
    (conda.parent / f"msbt-secret-{token}").write_text("beside the environment")
    subprocess.run([base, "-m", "venv", "--without-pip", str(home / "venv")], check=True)
    _unpack(wheels, home / "venv" / "lib" / "python3.11" / "site-packages")
    (home / "secret.txt").write_text("beside the venv")
    for path in (conda, home):
        os.chmod(path, 0o755)
    yield {"conda": conda / "bin" / "python", "home": home / "venv" / "bin" / "python"}
    shutil.rmtree(conda, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)
    (conda.parent / f"msbt-secret-{token}").unlink(missing_ok=True)


async def test_a_user_install_is_kept_per_environment(probe_env, start_kernel, monkeypatch):
    """`%pip install --user` in a default kernel lands in /shared/.python/default; a kernel of probe, another
    environment, reads /shared/.python/probe and does not import it (docs/teams.md, "Your own packages")."""
    volume = TEST_BASE / f"env-user-{uuid.uuid4().hex[:8]}"
    volume.mkdir()
    make_persons(volume)
    wheel = package_wheel(volume, "msbuserpkg", "1.0", {"msbuserpkg/__init__.py": "VALUE = 'kept'\n"})
    wheel.chmod(0o644)
    monkeypatch.setenv("MSB_SHARED_VOLUME_PATH", str(volume))
    monkeypatch.setenv("MSB_ENVIRONMENTS_DIR", str(probe_env.directory))
    _, default = await start_kernel("msb-python-small")
    installed = await execute(default, f"%pip install --user --no-index /shared/{wheel.name}")
    assert "Successfully installed msbuserpkg-1.0" in installed.stdout, installed.stdout + installed.stderr
    assert (await execute(default, "import msbuserpkg; msbuserpkg.__file__")).value.startswith("/shared/.python/default/lib/python3.")
    _, probe = await start_kernel("msb-probe-python-small")
    assert (await execute(probe, "import os; os.environ['PYTHONUSERBASE']")).value == "/shared/.python/probe"
    missing = await execute(probe, "import msbuserpkg")
    assert missing.error is not None and missing.error["ename"] == "ModuleNotFoundError", missing.messages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("place", ["conda", "home"])
def test_an_added_interpreter_runs_from_a_conda_layout_or_a_home_venv_and_shows_nothing_beside_it(
    elsewhere, place, backend, env_host, tmp_path
):
    os.chmod(tmp_path, 0o755)
    python = elsewhere[place]
    name = f"{place}-env"
    added = env_host.env_cli("add", name, "--python", str(python))
    assert added.returncode == 0, added.stderr
    assert f"added environment {name}: Python 3.11." in added.stdout and f"installed msb-{name}-python-small" in added.stdout
    try:
        seen = _papermill(f"msb-{name}-python-small", backend, tmp_path, env_host)
        assert seen["value"] == PROBE_VALUE and seen["executable"] == str(python) and seen["backend"] == backend, seen
        assert seen["prefix"] == str(python.parent.parent), seen
        assert seen["beside"] == [python.parent.parent.name], seen  # /opt's and the home's other entries stay out
    finally:
        removed = env_host.cli("env", "remove", name)
    assert removed.returncode == 0 and f"removed environment {name}" in removed.stdout, removed.stderr
    assert not list(Path(os.environ["JUPYTER_PATH"]).glob(f"kernels/msb-{name}-python-*")) and name not in (env_host.store_text() or "")
    assert python.exists(), "remove deleted an interpreter it did not create"


async def test_a_gateway_lists_pools_and_starts_environments_and_mcp_picks_one(probe_env):
    gateway = await launch_gateway(
        extra_env={"MSB_ENVIRONMENTS_DIR": str(probe_env.directory), "MSB_POOL_SIZE": "probe-python-small=1,python-small=1"}
    )
    try:
        specs = (await gateway.request("GET", "/api/kernelspecs")).json["kernelspecs"]
        assert specs["msb-probe-python-small"]["spec"]["display_name"] == "Python 3 (probe, sandbox, small)"
        assert specs["python3"]["spec"]["display_name"] == "Default: Python 3 (sandbox, small)" and "msb-python-small" not in specs

        async def pool_ready() -> dict | None:
            stats = await gateway.stats()
            waiting = stats["pool"]["waiting"]
            return stats if waiting.get("msb-probe-python-small") == 1 and waiting.get("msb-python-small") == 1 else None

        await wait_until(pool_ready, 120, "the pool to hold a kernel of each environment")
        pooled = {record.details["environment"]: record.sandbox_id for record in gateway.sandboxes()}
        assert set(pooled) == {"probe", "default"}, pooled
        # A request for one environment gets that environment's pooled kernel, never the other's.
        for name, environment, expected in (("msb-python-small", "default", sys.executable), ("msb-probe-python-small", "probe", None)):
            kernel_id = await gateway.start_kernel(name)
            assert kernel_id == pooled[environment], (name, kernel_id, pooled)
            ws = await KernelSocket.open(gateway, kernel_id)
            reply = await ws.execute("import sys; print(sys.executable)")
            ws.close()
            assert reply.stdout.strip() == (expected or str(probe_env.directory / "probe" / "bin" / "python")), reply.stdout
            (entry,) = [k for k in (await gateway.stats())["kernels"] if k["id"] == kernel_id]
            assert entry["environment"] == environment and entry["kernel_name"] == name, entry

        headers = {"Authorization": f"Bearer {gateway.token}"}
        async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
            async with Client(streamable_http_client(gateway.url + "/mcp", http_client=http)) as client:
                listed = await client.call_tool("list_environments", {})
                environments = {e["name"]: e for e in listed.structured_content["environments"]}
                assert set(environments) == {"default", "probe"} and environments["default"]["default"], environments
                assert "msbenvprobe 1.0" in environments["probe"]["packages"], environments["probe"]
                started = await client.call_tool("start_session", {"environment": "probe"})
                (session,) = started.structured_content["sessions"]
                assert session["environment"] == "probe" and session["kernel_name"] == "msb-probe-python-small", session
                ran = await client.call_tool(
                    "execute_code", {"code": "import msbenvprobe\nprint(msbenvprobe.VALUE)", "session_id": session["id"]}
                )
                assert ran.structured_content["stdout"].strip() == PROBE_VALUE, ran.content[0].text
                own = await client.call_tool("execute_code", {"code": "import msbenvprobe", "environment": "probe"})
                assert own.structured_content["status"] == "ok" and not own.is_error, own.content[0].text
                default = await client.call_tool("execute_code", {"code": "import msbenvprobe"})
                assert "No module named 'msbenvprobe'" in default.content[0].text
                unknown = await client.call_tool("start_session", {"environment": "nope"})
                assert unknown.is_error
                error = unknown.structured_content["error"]
                assert error["type"] == "InvalidRequest" and "use one of default, probe" in error["message"], error
                node = await client.call_tool("start_session", {"language": "node", "environment": "probe"})
                assert node.is_error and "node kernels have no environments" in node.structured_content["error"]["message"]
                mismatch = await client.call_tool("execute_code", {"code": "1", "session_id": session["id"], "environment": "default"})
                assert mismatch.is_error and "runs the probe environment" in mismatch.structured_content["error"]["message"]
                for sid in {session["id"], own.structured_content["session_id"], default.structured_content["session_id"]}:
                    await client.call_tool("stop_session", {"session_id": sid})
        # msb-mcp attached to the gateway from elsewhere: no store of its own, the gateway's kernelspecs name them.
        elsewhere = {k: v for k, v in child_env().items() if k != "MSB_ENVIRONMENTS_DIR"}
        params = StdioServerParameters(
            command=str(VENV_BIN / "msb-mcp"), args=["--gateway", gateway.url, "--token", gateway.token], env=elsewhere
        )
        async with Client(params) as remote:
            listed = await remote.call_tool("list_environments", {})
            environments = {e["name"]: e for e in listed.structured_content["environments"]}
            assert environments["probe"]["python_version"].startswith("3.") and "msbenvprobe 1.0" in environments["probe"]["packages"]
            ran = await remote.call_tool("execute_code", {"code": "import msbenvprobe\nprint(msbenvprobe.VALUE)", "environment": "probe"})
            assert ran.structured_content["stdout"].strip() == PROBE_VALUE, ran.content[0].text
            await remote.call_tool("stop_session", {"session_id": ran.structured_content["session_id"]})
            unknown = await remote.call_tool("execute_code", {"code": "1", "environment": "nope"})
            assert unknown.is_error and "use one of default, probe" in unknown.structured_content["error"]["message"]
    finally:
        gateway.stop()


def test_remove_takes_its_kernelspecs_and_the_venv_it_created(probe_env):
    venv = probe_env.directory / "probe"
    removed = probe_env.cli("env", "remove", "probe")
    assert removed.returncode == 0, removed.stderr
    assert "removed environment probe" in removed.stdout and f"removed its venv {venv}" in removed.stdout, removed.stdout
    assert not venv.exists() and not list(Path(os.environ["JUPYTER_PATH"]).glob("kernels/msb-probe-python-*"))
    assert "probe" not in probe_env.cli("env", "list").stdout


def test_the_gateways_own_venv_is_unchanged(probe_env):
    """Last here: after every environment above was made, used and removed, the suite's venv holds what it held."""
    after = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True).stdout
    assert after == probe_env.freeze_before
    assert subprocess.run([sys.executable, "-c", "import msbenvprobe"], capture_output=True).returncode != 0
