"""`msb-kernels image build`: the kernel images (offline: debootstrap, no builder VM, no registry) and the swarm
gateway's own image. Each ends as a Docker-save archive handed to a loader: `msb load` or `docker load`."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.errors import InvalidRequest, SandboxError
from msb_kernels.images.archives import append_layer, archive_from_rootfs, python_site
from msb_kernels.images.rootfs import (
    DEBIAN_KERNEL_FALLBACK,
    DEBIAN_PACKAGES,
    FROM_HOST,
    PIP_KERNEL,
    add_sandbox_user,
    chroot_apt_install,
    debootstrap,
    pip_install_kernel,
    pip_into_rootfs,
    run_logged,
)
from msb_kernels.kernelspecs.templates import TEMPLATES

Loader = Callable[[Path, str], object]


@dataclass
class BuildResult:
    tag: str
    template: str
    mode: str
    seconds: float
    size_bytes: int
    curve: bool
    archive: Path | None = None
    loaded_with: str = "msb load"

    def report(self) -> str:
        return (
            f"built {self.tag} ({self.template}, {self.mode}) in {self.seconds:.0f} s: "
            f"{self.size_bytes / 2**20:.0f} MiB archive, CurveZMQ {'yes' if self.curve else 'no'}; loaded with {self.loaded_with}"
            + (f"; archive kept at {self.archive}" if self.archive else "")
        )


def build_offline(
    template: str,
    tag: str,
    *,
    work_dir: Path | None = None,
    packages: list[str] | None = None,
    suite: str | None = None,
    mirror: str | None = None,
    keep_archive: Path | None = None,
    prepare_rootfs: Callable[[Path], None] | None = None,
    load: Loader,
    command: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> BuildResult:
    """debootstrap (or prepare_rootfs) -> user, tslab -> Docker-save archive -> load (msb load by default) -> tag."""
    if template not in DEBIAN_PACKAGES and prepare_rootfs is None:
        raise InvalidRequest(f"image template {template!r} is not one of {', '.join(DEBIAN_PACKAGES)}")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="msb-image-", dir=work_dir))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir()
        if prepare_rootfs is not None:
            prepare_rootfs(rootfs)
        else:
            debootstrap(rootfs, packages or DEBIAN_PACKAGES[template], suite=suite, mirror=mirror, log=log)
            if packages is None and template in PIP_KERNEL and not pip_install_kernel(rootfs, template, log):
                chroot_apt_install(rootfs, DEBIAN_KERNEL_FALLBACK[template], log)
        add_sandbox_user(rootfs)
        if prepare_rootfs is None and template in FROM_HOST:
            FROM_HOST[template](rootfs)
        archive = work / f"{template}.tar"
        log(f"writing {archive}")
        curve = archive_from_rootfs(rootfs, template, tag, archive, command)
        shutil.rmtree(rootfs)
        load(archive, tag)
        size = archive.stat().st_size
        if keep_archive is not None:
            shutil.move(archive, keep_archive)
        return BuildResult(tag, template, "offline", time.monotonic() - started, size, curve, keep_archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def drop_installed(target: Path, installed: set[str]) -> int:
    """Remove from target each distribution the base has at the same version (the same dist-info name), file by file
    as its RECORD lists them: a layer of the gateway image then adds only what the kernel image lacks."""
    dropped = 0
    for info in target.glob("*.dist-info"):
        if info.name not in installed:
            continue
        for line in (info / "RECORD").read_text().splitlines() if (info / "RECORD").exists() else []:
            path = target / line.split(",", 1)[0]
            if path.is_file() and target in path.resolve().parents:
                path.unlink()
        shutil.rmtree(info, ignore_errors=True)
        dropped += 1
    for folder in sorted((p for p in target.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # the emptied ones only
    return dropped


def package_source() -> Path:
    """The msb-kernels checkout this process runs from (the README installs it editable from a clone)."""
    from importlib.metadata import PackageNotFoundError, distribution

    with contextlib.suppress(PackageNotFoundError, ValueError, TypeError):
        url = json.loads(distribution("msb-kernels").read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://") and (Path(url.removeprefix("file://")) / "pyproject.toml").is_file():
            return Path(url.removeprefix("file://"))
    here = Path(__file__).resolve().parents[3]
    if (here / "pyproject.toml").is_file():
        return here
    raise SandboxError(
        "the gateway image is built from an msb-kernels checkout, and this one is installed without its source",
        ["clone msb-kernels and install it as the README says, then build again"],
    )


GATEWAY_TAG = "msb-kernels/gateway:latest"

GATEWAY_COMMAND = ["msb-kernels", "serve"]

GATEWAY_SCRIPT = "#!/usr/bin/python3\nimport sys\nfrom {module} import main\nsys.exit(main())\n"


def build_gateway(
    tag: str,
    *,
    base_archive: Path | None = None,
    suite: str | None = None,
    mirror: str | None = None,
    keep_archive: Path | None = None,
    load: Loader,
    log: Callable[[str], None] = print,
) -> BuildResult:
    """The gateway's own image, for MSB_BACKEND=swarm (deploy/swarm/stack.yml): the python kernel image (base_archive,
    else built here) plus one layer with msb-kernels from this checkout, its dependencies from the index (not the
    microVM runtime: a gateway on a cluster boots no VM) and the sandboxed kernelspecs. `msb-kernels serve` by
    default; `msb-kernels swarm-proxy` runs from it too."""
    from importlib.metadata import requires

    from msb_kernels.kernelspecs.flavors import FLAVORS
    from msb_kernels.kernelspecs.spec_files import kernelspec
    from msb_kernels.settings.config import load_settings

    started = time.monotonic()
    source = package_source()
    wanted = [r.split(";")[0].strip() for r in requires("msb-kernels") or [] if "extra ==" not in r and not r.startswith("microsandbox")]
    work = Path(tempfile.mkdtemp(prefix="msb-image-"))
    try:
        if base_archive is None:
            base_archive = work / "python.tar"
            build_offline("python", "msb-kernels/python:base", keep_archive=base_archive, load=lambda archive, tag: None, log=log)
        layer = work / "layer"
        version, base_site = python_site(base_archive)
        target = layer / "usr" / "local" / "lib" / f"python{version}" / "dist-packages"
        problem = pip_into_rootfs(layer, wanted, log, version=version)
        if problem:
            raise SandboxError(
                f"pip could not install msb-kernels' dependencies into the gateway image: {problem}",
                ["check that pip reaches a package index (pip config list)"],
            )
        log(f"$ pip install --target {target} --no-deps {source}")
        run_logged(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(source)],
            "pip install msb-kernels",
            log,
        )
        shutil.rmtree(target / "bin", ignore_errors=True)  # scripts for this host's interpreter
        kept = drop_installed(target, base_site)
        log(f"{kept} distributions the kernel image holds already left out of the gateway's layer")
        for name, module in (("msb-kernels", "msb_kernels.cli"), ("msb-mcp", "mcp_bridge.cli")):
            script = layer / "usr" / "local" / "bin" / name
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(GATEWAY_SCRIPT.format(module=module))
            script.chmod(0o755)
        settings = load_settings()
        for flavor in FLAVORS.values():
            spec = kernelspec(TEMPLATES["python"], flavor, settings)
            spec["argv"][0] = "/usr/bin/python3"
            folder = layer / "usr" / "local" / "share" / "jupyter" / "kernels" / f"msb-python-{flavor.name}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "kernel.json").write_text(json.dumps(spec, indent=1))
        archive = work / "gateway.tar"
        log(f"writing {archive}")
        append_layer(base_archive, layer, "gateway", tag, archive, curve=False, command=GATEWAY_COMMAND)
        load(archive, tag)
        size = archive.stat().st_size
        if keep_archive is not None:
            shutil.move(archive, keep_archive)
        return BuildResult(tag, "gateway", "offline", time.monotonic() - started, size, False, keep_archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)
