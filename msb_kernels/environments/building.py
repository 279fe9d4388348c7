"""`env create`: a venv in the environments directory, filled from a requirements file with the host's pip or uv.

A failure removes what it made, and the environment is recorded only after it installed, so a failure leaves
neither a half-made venv nor a record of one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.environments.interpreters import clean_env
from msb_kernels.errors import InvalidRequest, SandboxError

INSTALL_TIMEOUT_SECONDS = 1800


@dataclass(frozen=True)
class Built:
    python: str
    installer: str  # "uv" or "pip"
    seconds: float


def base_python() -> str:
    """The Python a new venv is made from: the one under this process's own venv, not the venv itself."""
    return getattr(sys, "_base_executable", None) or sys.executable


def pip_reason(output: str) -> str:
    """pip's (or uv's) own error, cut to its reason: its "ERROR:" lines, or the last lines where it has none."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("ERROR:", "error:", "cause:", "×", "╰─▶"))]
    return " | ".join((errors or lines[-3:])[:6]) or "no output"


def _run(argv: list[str], what: str) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_SECONDS, env=clean_env())
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{what} took more than {INSTALL_TIMEOUT_SECONDS} s") from None
    if result.returncode != 0:
        raise InvalidRequest(
            f"{what} failed: {pip_reason(result.stdout + chr(10) + result.stderr)}",
            ["check the requirements file's names and versions", "with --wheels: the directory must hold every wheel needed"],
        )


def build(directory: Path, requirements: Path, wheels: Path | None = None, python: str | None = None) -> Built:
    """A venv at directory holding requirements and ipykernel; uv where it is on PATH, else the venv's own pip."""
    if not requirements.is_file():
        raise InvalidRequest(f"-r {requirements}: no such file", ["give the path of a requirements.txt"])
    if wheels is not None and not wheels.is_dir():
        raise InvalidRequest(f"--wheels {wheels}: no such directory", ["give a directory of .whl files, or omit --wheels to use the index"])
    if directory.exists():
        raise InvalidRequest(f"{directory} exists already", ["remove it, or pick another name (it is not a registered environment)"])
    directory.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    uv = shutil.which("uv")
    offline = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    base = python or base_python()
    try:  # at its final path: pip and venv write that path into the scripts they make
        if uv:
            _run([uv, "venv", "--quiet", "--python", base, str(directory)], "uv venv")
            install = [uv, "pip", "install", "--python", str(directory / "bin" / "python")]
        else:
            _run([base, "-m", "venv", str(directory)], f"{base} -m venv")
            install = [str(directory / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        _run([*install, *offline, "-r", str(requirements), "ipykernel"], f"installing the requirements with {'uv' if uv else 'pip'}")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return Built(str(directory / "bin" / "python"), "uv" if uv else "pip", time.monotonic() - started)
