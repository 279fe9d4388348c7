"""The `msb` runtime CLI on this host: where it is, and what `msb doctor` says of this host."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# microsandbox's SDK and its `msb` CLI read MSB_BACKEND, which is also the name of our own setting
# (auto, namespace, microsandbox), and refuse anything but their own "local" or "cloud". Told
# explicitly, the SDK no longer reads the variable, and the CLI gets an environment of its own.
try:
    import microsandbox as _sdk
except ImportError:  # not on this platform; availability() says so
    pass
else:
    _sdk.set_default_backend(_sdk.BackendKind.LOCAL)


def msb_cli_environment() -> dict[str, str]:
    """The environment for running the `msb` CLI: ours, with MSB_BACKEND meaning what msb expects."""
    return {**os.environ, "MSB_BACKEND": "local", "NO_COLOR": "1"}


# -- msb doctor ----------------------------------------------------------------


def msb_binary() -> str | None:
    """The `msb` runtime CLI: the one beside this Python, else on PATH, else the wheel's bundled binary."""
    beside = Path(sys.executable).parent / "msb"
    if beside.is_file():
        return str(beside)
    found = shutil.which("msb")
    if found:
        return found
    try:
        from microsandbox._runtime import msb_path
    except ImportError:
        return None
    bundled = msb_path()
    return str(bundled) if bundled.is_file() else None


def parse_doctor(returncode: int, output: str) -> tuple[bool, str, list[str]]:
    """`msb doctor`'s verdict from its exit status and text (it has no JSON): ok, reason, hints.

    Its text is check lines (✓/✗), then `warn:` and `error:` lines, each followed by `→` hints;
    the reason is the first error (else the failed checks) and the hints are that error's.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", output)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if returncode == 0:
        return True, "msb doctor: all checks passed", []
    reason, hints, in_error = None, [], False
    for line in lines:
        if line.lower().startswith("error:"):
            if reason is not None:
                break
            reason, in_error = line.split(":", 1)[1].strip(), True
        elif line.lower().startswith("warn:"):
            in_error = False
        elif line.startswith(("→", "->")) and in_error:
            hints.append(line.lstrip("→->").strip())
    if reason is None:
        failed = [re.sub(r"\s{2,}", ": ", line.lstrip("✗").strip()) for line in lines if line.startswith("✗")]
        reason = "; ".join(failed) or (lines[-1] if lines else f"msb doctor exited {returncode}")
    return False, reason, hints


def run_doctor(timeout: float = 30) -> tuple[bool, str, list[str]]:
    """Run `msb doctor` and say whether microVMs can run here, why not, and the hints it printed."""
    msb = msb_binary()
    if msb is None:
        return False, "the msb runtime is not installed (pip install 'microsandbox>=0.7,<0.8')", []
    try:
        result = subprocess.run([msb, "doctor"], capture_output=True, text=True, timeout=timeout, env=msb_cli_environment())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"msb doctor did not run: {exc}", []
    return parse_doctor(result.returncode, result.stdout + "\n" + result.stderr)
