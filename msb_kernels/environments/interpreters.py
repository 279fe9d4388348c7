"""What an interpreter is and holds, asked of the interpreter itself: its version, ipykernel, its packages.

Run as a subprocess with nothing of the host's Python variables, so a gateway's PYTHONPATH never answers for it.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

from msb_kernels.environments.environment import Package
from msb_kernels.errors import InvalidRequest

# ipykernel 6.x (the oldest whose launcher the provisioner drives) needs 3.8; the kernel code here uses 3.9's syntax.
MIN_PYTHON = (3, 9)
INSPECT_TIMEOUT_SECONDS = 60
INSPECT_CODE = """
import json, sys
answer = {"version": "%d.%d.%d" % sys.version_info[:3], "prefix": sys.prefix, "ipykernel": None, "packages": []}
try:
    from importlib import metadata
except ImportError:  # before 3.8: too old to run a kernel here, which its version says
    metadata = None
if metadata is not None:
    answer["packages"] = sorted(set((d.metadata["Name"], d.version) for d in metadata.distributions() if d.metadata["Name"]))
    try:
        answer["ipykernel"] = metadata.version("ipykernel")
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(answer))
"""


@dataclass(frozen=True)
class Interpreter:
    path: str
    version: str
    prefix: str
    ipykernel: str | None
    packages: tuple[Package, ...]


def clean_env() -> dict[str, str]:
    """The host's environment without what would make one Python read another's packages."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_USER")
    return {k: v for k, v in os.environ.items() if k not in drop}


def check_path(python: str, argument: str = "--python") -> str:
    """The interpreter's absolute path, as the kernelspec names it (symlinks kept: a venv's python is one)."""
    path = os.path.abspath(os.path.expanduser(python))
    if not os.path.exists(path):
        raise InvalidRequest(
            f"{argument} {python}: no such file",
            [f"give the path of a Python interpreter, e.g. {argument} /opt/conda/envs/data/bin/python"],
        )
    if os.path.isdir(path):
        raise InvalidRequest(
            f"{argument} {python}: is a directory",
            [f"give the interpreter inside it, e.g. {argument} {os.path.join(path, 'bin', 'python')}"],
        )
    if not os.access(path, os.X_OK):
        raise InvalidRequest(f"{argument} {python}: is not executable", [f"chmod +x {path}, or give the environment's bin/python"])
    return path


def inspect(python: str, argument: str = "--python") -> Interpreter:
    """Ask the interpreter what it is; InvalidRequest (naming argument) for a broken one, in its own words."""
    path = check_path(python, argument)
    try:
        result = subprocess.run(
            [path, "-E", "-s", "-c", INSPECT_CODE], capture_output=True, text=True, timeout=INSPECT_TIMEOUT_SECONDS, env=clean_env()
        )
    except OSError as exc:
        raise InvalidRequest(
            f"{argument} {python}: cannot run it: {exc.strerror or exc}", ["give the path of a working Python interpreter"]
        ) from None
    except subprocess.TimeoutExpired:
        raise InvalidRequest(f"{argument} {python}: did not answer within {INSPECT_TIMEOUT_SECONDS} s") from None
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        words = (result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}").splitlines()[-3:]
        raise InvalidRequest(
            f"{argument} {python}: is not a working Python interpreter: {' | '.join(words)}",
            ["run it by hand to see why; a venv whose base Python was removed must be made again"],
        ) from None
    return Interpreter(path, answer["version"], answer["prefix"], answer["ipykernel"], tuple(Package(n, v) for n, v in answer["packages"]))


def kernel_problem(interpreter: Interpreter) -> str | None:
    """Why a kernel cannot start from this interpreter (too old, no ipykernel), with what to do; None when it can."""
    version = tuple(int(part) for part in interpreter.version.split(".")[:2])
    if version < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        return f"its Python {interpreter.version} is too old: sandboxed kernels need Python {wanted} or newer"
    if interpreter.ipykernel is None:
        return f"ipykernel is not installed in it: run `{interpreter.path} -m pip install ipykernel` first"
    return None


def checked(python: str, argument: str = "--python") -> Interpreter:
    """An interpreter a kernel can start from, or InvalidRequest saying why not."""
    interpreter = inspect(python, argument)
    problem = kernel_problem(interpreter)
    if problem:
        raise InvalidRequest(f"{argument} {python}: {problem}")
    return interpreter
