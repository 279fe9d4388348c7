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
