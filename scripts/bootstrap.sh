# Sourced by scripts/run and scripts/test: make .venv and install msb-kernels into it (idempotent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
extras="${1:-}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "msb-kernels needs Python >= 3.10 (found: $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.10+" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv || { echo "could not create .venv: install your distribution's venv package (e.g. apt-get install python3-venv)" >&2; exit 2; }
fi
stamp=".venv/.msb-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
.venv/bin/msb-kernels install >/dev/null
# gVisor's runsc from Debian 13, which runs `ls` and `stat` (Debian 12's fails them); root only, as gVisor is.
if [ "$(id -u)" = 0 ]; then
    bash scripts/install-runsc .venv/share/msb-kernels/gvisor || echo "gVisor kernels will use the host's runsc if it passes the start probe" >&2
fi
if [ "$extras" = "test" ]; then
    # Debian packages some tests need; where they cannot be installed, those tests skip and say how.
    missing=()
    command -v slirp4netns >/dev/null || missing+=(slirp4netns)  # MSB_ALLOW_NETWORK (namespace sandboxes)
    command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base)  # the egress tests' upstream DNS server
    # the host's own runsc: the gVisor tests run on .venv's; tests/msb_kernels/backends/gvisor/test_runsc.py holds it to the probe
    command -v runsc >/dev/null || missing+=(runsc)
    command -v chromium >/dev/null || missing+=(chromium)  # JupyterLab in a browser (test_jupyterlab_browser.py)
    command -v chromedriver >/dev/null || missing+=(chromium-driver)
    # MSB_BACKEND=swarm: private Docker engines make a two-node swarm, and the kernel image is built offline.
    command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || missing+=(docker.io)
    command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)  # a tiny image for the engine tests
    if [ ${#missing[@]} -gt 0 ]; then
        bash scripts/apt-install "${missing[@]}" || echo "the tests that need ${missing[*]} will skip" >&2
    fi
    # npm_tool DIR FILE PACKAGE NODE TESTS: install an npm package into DIR unless FILE (under it) is there already.
    npm_tool() {
        [ -e "$1/$2" ] && return 0
        if ! command -v npm >/dev/null; then
            echo "npm is not installed: $5 will skip (install Node.js >= $4 with npm, then run this again)" >&2
        elif ! npm install --no-audit --no-fund --prefix "$1" "$3" >/dev/null 2>&1; then
            echo "npm could not install $3: $5 will skip" >&2
        fi
    }
    # The MCP Inspector CLI: a TypeScript-SDK client for tests/mcp_bridge/test_inspector.py.
    npm_tool .venv/share/msb-kernels/inspector node_modules/@modelcontextprotocol/inspector-cli/build/cli.js \
        "@modelcontextprotocol/inspector@0.15" 18 "the MCP Inspector tests"
    # JupyterHub's proxy, from npm as a Hub's operator installs it, for tests/hub.py (the gateway under JupyterHub).
    npm_tool .venv/share/msb-kernels/chp node_modules/.bin/configurable-http-proxy \
        "configurable-http-proxy@5.3" 20 "the JupyterHub tests"
fi
if [ "$extras" = "test" ]; then
    # jupyter-mcp-server, the peer the notebook tools are measured against, in a venv of its own (its pins are not
    # ours): tests/mcp_bridge/notebooks/test_peer.py and bench/notebook_tools.py skip without it.
    peer=.venv/share/msb-kernels/peers/jupyter-mcp-server
    if [ ! -x "$peer/bin/jupyter-mcp-server" ]; then
        if ! { "$PYTHON" -m venv "$peer" && "$peer/bin/python" -m pip install --quiet "jupyter-mcp-server==2.2.4"; } >/dev/null 2>&1; then
            echo "pip could not install jupyter-mcp-server 2.2.4 into $peer: the tests beside it will skip" >&2
        fi
    fi
fi
