"""The smoke boot behind the microVM backend's availability: a throwaway VM from the kernel image, asked whether
ipykernel imports. Run as ``python -m msb_kernels.backends.microsandbox.smoke IMAGE`` by smoke_boot(), in a
subprocess under MSB_BOOT_TIMEOUT_SECONDS, so a hanging hypervisor cannot hang the caller."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid

from msb_kernels.backends.core.base import SANDBOX_LABEL
from msb_kernels.backends.core.processes import process_start_time
from msb_kernels.backends.microsandbox.vm import (
    LABEL_HOST,
    LABEL_KERNEL,
    LABEL_OWNER_PID,
    LABEL_OWNER_START,
    SMOKE_MEMORY_MIB,
    SMOKE_PREFIX,
)


async def _smoke(image: str) -> str:
    from microsandbox import Network, PullPolicy
    from microsandbox import Sandbox as VM

    name = f"{SMOKE_PREFIX}{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    # Labelled like a kernel owned by this short-lived process, so a sweep removes it if we are killed.
    labels = {
        SANDBOX_LABEL: "1",
        LABEL_KERNEL: name,
        LABEL_HOST: socket.gethostname(),
        LABEL_OWNER_PID: str(os.getpid()),
        LABEL_OWNER_START: str(process_start_time(os.getpid()) or ""),
    }
    vm = None
    try:
        vm = await VM.create(
            name,
            image=image,
            cpus=1,
            memory=SMOKE_MEMORY_MIB,
            network=Network.none(),
            labels=labels,
            replace=True,
            pull_policy=PullPolicy.NEVER,
        )
        output = await vm.exec("python3", ["-c", "import ipykernel; print('ok')"], timeout=30)
        if "ok" not in output.stdout_text:
            raise RuntimeError(f"image {image} has no ipykernel: {output.stderr_text.strip()[-300:]}")
        return f"smoke boot of {image} in {time.monotonic() - started:.1f} s"
    finally:
        if vm is not None:
            with contextlib.suppress(Exception):
                await vm.kill(timeout=10)
        with contextlib.suppress(Exception):
            await VM.remove(name)


def smoke_boot(image: str, timeout: float) -> tuple[bool, str]:
    """Boot a throwaway microVM from image in a subprocess, under timeout; (ok, what happened)."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "msb_kernels.backends.microsandbox.smoke", image], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"no microVM booted within {timeout:.0f} s (MSB_BOOT_TIMEOUT_SECONDS)"
    lines = (result.stdout.strip() or result.stderr.strip() or "no output").splitlines()
    return result.returncode == 0, lines[-1]


def _main(argv: list[str]) -> int:
    if len(argv) == 1:
        try:
            print(asyncio.run(_smoke(argv[0])))
        except Exception as exc:
            message = str(exc).strip().splitlines()
            print(f"{type(exc).__name__}: {message[0] if message else ''}"[:500])
            return 1
        return 0
    print("usage: python -m msb_kernels.backends.microsandbox.smoke IMAGE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
