"""Kernel images in microsandbox's store: `msb load`, list and remove, and the online build in a builder microVM.

Online: a base image (python:3.12-slim, node:20-slim), ``pip install`` (or ``npm install``) in a builder microVM
into a bind-mounted directory, which becomes one more layer on top of the base (``msb save`` -> add the layer
-> ``msb load``). That needs a host where microVMs boot. The offline build is msb_kernels.images.builds'.

The image config carries the label ``org.msb-kernels.curve=true`` when its ipykernel speaks CurveZMQ, which is
how the backend decides on transport encryption.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from msb_kernels.backends.microsandbox.msb_cli import msb_binary, msb_cli_environment
from msb_kernels.errors import InvalidRequest, SandboxError
from msb_kernels.images import IMAGE_CURVE_LABEL
from msb_kernels.images.archives import append_layer
from msb_kernels.images.builds import BuildResult
from msb_kernels.images.rootfs import add_sandbox_user, ipykernel_speaks_curve
from msb_kernels.kernelspecs.templates import TEMPLATES

ONLINE_BASES = {"python": "python:3.12-slim", "node": "node:20-slim"}

ONLINE_INSTALL = {
    "python": "pip install --no-cache-dir --root /out/layer 'ipykernel>=7.4' matplotlib 'ipywidgets>=8'",
    "node": "npm install --global --prefix /out/layer/usr/local tslab@{tslab}",
}


def _msb(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    msb = msb_binary()
    if msb is None:
        raise SandboxError("the msb runtime is not installed", ["pip install 'microsandbox>=0.7,<0.8'"])
    result = subprocess.run([msb, *args], capture_output=True, text=True, timeout=timeout, env=msb_cli_environment())
    if result.returncode != 0:
        raise SandboxError(f"msb {' '.join(args)} failed: {(result.stderr or result.stdout).strip()[-800:]}")
    return result


def normalize(reference: str) -> str:
    """How msb names a local reference: docker.io/library/ for bare names, docker.io/ for one slash."""
    name = reference if ":" in reference.rsplit("/", 1)[-1] else reference + ":latest"
    first = name.split("/", 1)[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def load_archive(archive: Path, tag: str) -> str:
    print(f"$ msb load -i {archive} -t {tag}")
    return _msb("load", "-i", str(archive), "-t", tag).stdout.strip()


def list_images() -> list[str]:
    return [line.strip() for line in _msb("image", "ls", "-q", timeout=60).stdout.splitlines() if line.strip()]


def image_present(tag: str) -> bool:
    return normalize(tag) in {normalize(reference) for reference in list_images()}


def save_image(tag: str, archive: Path) -> bool:
    """`msb save` of tag into archive (Docker-save format); False where microsandbox's store does not hold it."""
    if not image_present(tag):
        return False
    print(f"$ msb save {tag} -o {archive}")
    _msb("save", tag, "-o", str(archive))
    return True


def remove_image(tag: str) -> None:
    _msb("image", "rm", "--force", tag, timeout=120)


async def _online_layer(template: str, base: str, out: Path, timeout: float) -> None:
    from microsandbox import Network, PullPolicy, Volume
    from microsandbox import Sandbox as VM

    from msb_kernels.kernelspecs.templates import TSLAB_VERSION

    name = f"msbk-build-{os.getpid()}"
    vm = await VM.create(
        name,
        image=base,
        cpus=2,
        memory=2048,
        network=Network.allow_all(),
        pull_policy=PullPolicy.IF_MISSING,
        volumes={"/out": Volume.bind(str(out))},
        replace=True,
    )
    try:
        script = (
            "set -e; mkdir -p /out/layer/etc; " + ONLINE_INSTALL[template].format(tslab=TSLAB_VERSION) + "; "
            "cp /etc/passwd /etc/group /out/layer/etc/"
        )
        output = await vm.shell(script, timeout=timeout)
        if output.exit_code != 0:
            raise SandboxError(f"the builder sandbox failed: {output.stderr_text.strip()[-800:]}")
    finally:
        for step in (lambda: vm.kill(timeout=10), lambda: VM.remove(name)):
            try:
                await step()
            except Exception:
                pass


def build_online(
    template: str,
    tag: str,
    *,
    base: str | None = None,
    work_dir: Path | None = None,
    timeout: float = 1200,
    log: Callable[[str], None] = print,
) -> BuildResult:
    """base image + `pip install` (or npm) in a builder microVM -> one more layer -> msb load -> tag."""
    if template not in ONLINE_BASES:
        raise InvalidRequest(f"image template {template!r} is not one of {', '.join(ONLINE_BASES)}")
    from msb_kernels.backends.microsandbox.msb_cli import run_doctor

    ok, reason, _ = run_doctor()
    if not ok:
        raise SandboxError(
            f"an online build runs a builder microVM, and microVMs cannot run here: {reason}",
            ["build offline instead: msb-kernels image build " + template],
        )
    base = base or ONLINE_BASES[template]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="msb-image-", dir=work_dir))
    try:
        log(f"installing the {template} kernel into {base} in a builder sandbox")
        asyncio.run(_online_layer(template, base, work, timeout))
        layer_root = work / "layer"
        add_sandbox_user(layer_root)
        base_archive = work / "base.tar"
        _msb("save", base, "-o", str(base_archive))
        archive = work / f"{template}.tar"
        curve = TEMPLATES[template].speaks_curve and ipykernel_speaks_curve(layer_root)
        append_layer(base_archive, layer_root, template, tag, archive, curve=curve)
        load_archive(archive, tag)
        return BuildResult(tag, template, "online", time.monotonic() - started, archive.stat().st_size, curve)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def image_supports_curve(image: str) -> bool:
    try:
        from microsandbox import Image

        detail = await Image.inspect(image)
    except Exception:
        return False
    labels = (detail.config.labels if detail.config else None) or {}
    return str(labels.get(IMAGE_CURVE_LABEL, "")).lower() == "true"
