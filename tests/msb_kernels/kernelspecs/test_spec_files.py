"""Kernelspecs, and Jupyter's own tools running them unchanged."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO, VENV_BIN
from tests.kernel_helpers import HostListener, execute
from tests.skips import needs_node

NAMES = [f"msb-python-{f}" for f in ("small", "medium", "large")]


def test_jupyter_kernelspec_list_shows_the_sandboxed_kernels():
    result = subprocess.run([str(VENV_BIN / "jupyter"), "kernelspec", "list", "--json"], capture_output=True, text=True, check=True)
    specs = json.loads(result.stdout)["kernelspecs"]
    for name in NAMES:
        spec = specs[name]["spec"]
        assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == "msb-sandbox"
        assert spec["metadata"]["cull_idle_timeout"] == 1800
    assert specs["msb-python-small"]["spec"]["display_name"] == "Python 3 (sandbox, small)"
    assert specs["msb-python-large"]["spec"]["metadata"]["kernel_provisioner"]["config"] == {"flavor": "large", "template": "python"}


def test_install_is_idempotent_and_uses_the_session_timeout(tmp_path):
    env = {**os.environ, "MSB_SESSION_TIMEOUT_SECONDS": "120"}
    for _ in range(2):
        result = subprocess.run(
            [str(VENV_BIN / "msb-kernels"), "install", "--prefix", str(tmp_path)], capture_output=True, text=True, env=env
        )
        assert result.returncode == 0, result.stderr
    spec = json.loads((tmp_path / "share/jupyter/kernels/msb-python-medium/kernel.json").read_text())
    assert spec["metadata"]["cull_idle_timeout"] == 120


def test_nbclient_runs_the_example_notebook(tmp_path):
    notebook = nbformat.read(REPO / "notebooks" / "hello.ipynb", as_version=4)
    NotebookClient(notebook, kernel_name="msb-python-small", timeout=120).execute()
    text = json.dumps(notebook.cells[1]["outputs"]) + json.dumps(notebook.cells[4]["outputs"])
    assert "user: 1000 | host: sandbox | flavor: small" in text
    assert "network: blocked" in text
    assert any("image/png" in output.get("data", {}) for output in notebook.cells[6]["outputs"])


def test_papermill_runs_the_example_notebook(tmp_path):
    output = tmp_path / "out.ipynb"
    result = subprocess.run(
        [str(VENV_BIN / "papermill"), str(REPO / "notebooks" / "hello.ipynb"), str(output), "-k", "msb-python-medium"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    executed = nbformat.read(output, as_version=4)
    assert "flavor: medium" in json.dumps(executed.cells[1]["outputs"])


def test_jupyter_console_talks_to_a_sandboxed_kernel():
    script = "import socket\nprint('console-says', 6 * 7, socket.gethostname())\nexit\n"
    result = subprocess.run(
        [str(VENV_BIN / "jupyter"), "console", "--kernel", "msb-python-small", "--simple-prompt"],
        input=script,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "console-says 42 sandbox" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_msb_kernels_run_prints_the_notebook_outputs():
    result = subprocess.run(
        [str(VENV_BIN / "msb-kernels"), "run", str(REPO / "notebooks" / "hello.ipynb")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "state survives between cells: 42" in result.stdout
    assert "[+ image/png]" in result.stdout


@pytest.fixture(params=["namespace", "gvisor"])
def node_backend(request, monkeypatch) -> str:
    """Node kernels in the namespace sandbox, and under gVisor where runsc runs (else a skip that says why)."""
    from msb_kernels.backends import backend_classes

    if request.param != "namespace":
        availability = backend_classes()[request.param].availability()
        if not availability.ok:
            pytest.skip(f"{request.param} backend cannot run on this host: {availability.reason}")
    monkeypatch.setenv("MSB_BACKEND", request.param)
    return request.param


@needs_node
async def test_node_kernel_runs_javascript_in_a_sandbox(start_kernel, node_backend):
    km, kc = await start_kernel("msb-node-small")
    assert km.provisioner.backend.name == node_backend
    result = await execute(kc, "let total = 20; console.log('hi from node'); total * 2")
    assert result.status == "ok"
    assert "hi from node" in result.stdout and "40" in result.stdout
    assert "41" in (await execute(kc, "total * 2 + 1")).stdout  # state kept
    probe = await execute(
        kc,
        (
            "const fs = require('fs');\n"
            f"let repo; try {{ fs.readFileSync({str(REPO / 'README.md')!r}); repo = 'readable'; }} catch (e) {{ repo = e.code; }}\n"
            "console.log(JSON.stringify({root: fs.readdirSync('/').sort(), repo}));\n"
            "console.log(require('os').hostname(), process.getuid(), require('os').release());"
        ),
    )
    listing = json.loads(probe.stdout.splitlines()[0])
    assert "home" in listing["root"] and "sandbox 1000" in probe.stdout
    assert probe.stdout.split()[-1] == ("4.4.0" if node_backend == "gvisor" else os.uname().release), probe.stdout  # whose kernel
    assert listing["repo"] == "ENOENT", "the checkout is visible to a node kernel"
    assert km.provisioner.template_spec.name == "node"


@needs_node
async def test_node_kernel_cannot_reach_the_host_network(start_kernel, node_backend):
    """The same escape as the contract suite's, from JavaScript: net.connect to the host's listeners fails."""
    _, kc = await start_kernel("msb-node-small")
    with HostListener() as listener:
        targets = [["127.0.0.1", listener.port], [socket.gethostbyname(socket.gethostname()), listener.port]]
        code = (
            "const net = require('net');\n"
            "const attempt = ([host, port]) => new Promise(done => {\n"
            "  const s = net.connect({host, port, timeout: 3000}, () => { s.destroy(); done('connected'); });\n"
            "  s.on('error', e => done(Object(e).code)); s.on('timeout', () => { s.destroy(); done('timeout'); });\n"
            "});\n"
            f"const outcomes = await Promise.all({json.dumps(targets)}.map(attempt));\n"
            "console.log(JSON.stringify(outcomes));"
        )
        outcomes = json.loads((await execute(kc, code)).stdout.strip().splitlines()[-1])
        assert len(outcomes) == 2 and "connected" not in outcomes, outcomes
        assert listener.accepted == [], "a node kernel reached a port open on the host"


def test_without_node_the_user_is_told_and_python_kernels_are_unaffected(tmp_path):
    """Hide node from PATH: install skips the node kernels with a reason and still installs Python's."""
    path = f"{VENV_BIN}:/usr/sbin:/sbin"
    assert shutil.which("node", path=path) is None
    env = {**os.environ, "PATH": path}
    code = (
        "import sys; from msb_kernels.kernelspecs import templates; templates.node_prefix = lambda: __import__('pathlib').Path(sys.argv[1]);"
        "from msb_kernels.cli import main; sys.exit(main(['install', '--prefix', sys.argv[1]]))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "skipped node kernels: node is not installed (Python kernels are unaffected)" in result.stdout
    kernels = sorted(p.name for p in (tmp_path / "share/jupyter/kernels").iterdir())
    assert kernels == ["msb-python-large", "msb-python-medium", "msb-python-small"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_papermill_runs_a_notebook_with_shell_escapes(tmp_path, transport):
    """Over the namespace sandbox's both transports (MSB_TRANSPORT=tcp: the relay, with CurveZMQ)."""
    notebook = nbformat.read(REPO / "tests" / "data" / "shell_escapes.ipynb", as_version=4)
    notebook.cells.append(
        nbformat.v4.new_code_cell("import json; print('transport', json.load(open('/run/kernel/connection.json'))['transport'])")
    )
    source, output = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(notebook, source)
    result = subprocess.run(
        [str(VENV_BIN / "papermill"), str(source), str(output), "-k", "msb-python-small"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MSB_TRANSPORT": transport},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    outputs = [json.dumps(cell.get("outputs", [])) for cell in nbformat.read(output, as_version=4).cells]
    assert "pip " in outputs[1] and "ipykernel==" in outputs[2]
    assert "weather.csv" in outputs[3] and "warmest: Rome" in outputs[5] and "bash sees 3 lines" in outputs[6]
    assert f"transport {transport}" in outputs[-1], outputs[-1]
