"""execute_command: a process run inside the session's sandbox by the kernel itself.

The kernel runs a small runner (its template's command_code, msb_kernels.kernelspecs.kernel_code)
that starts the process with an argv list (no shell unless the caller asks for one),
copies its stdout and stderr to the kernel's own streams as they come, and prints a
marker with a per-call nonce and the exit status last. The request is silent and stores
no history, so the user's namespace and history do not change.
"""

from __future__ import annotations

import uuid


def new_marker() -> str:
    return f"\x1eMSB-EXIT-{uuid.uuid4().hex}"


def command_argv(command: str, args: list[str], shell: bool) -> list[str]:
    if shell:
        # The command is shell text the caller wrote; args stay positional parameters ($1, $2, ...).
        return ["/bin/sh", "-c", command, "sh", *args]
    return [command, *args]
