"""Kernel images for the microsandbox backend: `msb-kernels image build python|node`.

Offline (the default): a Debian root filesystem from debootstrap with python3 +
ipykernel (+ matplotlib), or node + tslab (tslab copied from the host's
`msb-kernels install`), plus an unprivileged user ``sandbox`` (uid 1000) ->
a Docker-save archive (manifest.json, config, one layer) -> ``msb load`` -> tag.

Online: a base image (python:3.12-slim, node:20-slim), ``pip install`` (or ``npm
install``) in a builder microVM into a bind-mounted directory, which becomes one
more layer on top of the base (``msb save`` -> add the layer -> ``msb load``).
That needs a host where microVMs boot.

The image config carries the label ``org.msb-kernels.curve=true`` when its
ipykernel speaks CurveZMQ, which is how the backend decides on transport encryption.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.backends.microsandbox.host import msb_binary, msb_cli_environment
from msb_kernels.backends.microsandbox.vm import GUEST_HOME, GUEST_PATH, GUEST_UID, GUEST_USER, IMAGE_CURVE_LABEL
from msb_kernels.errors import InvalidRequest, SandboxError
from msb_kernels.templates import TEMPLATES

DEBIAN_PACKAGES = {
    "python": ["python3", "python3-ipykernel", "python3-matplotlib", "ca-certificates"],
    "node": ["nodejs", "ca-certificates"],
}
ONLINE_BASES = {"python": "python:3.12-slim", "node": "node:20-slim"}
ONLINE_INSTALL = {
    "python": "pip install --no-cache-dir --root /out/layer 'ipykernel>=7.4' matplotlib 'ipywidgets>=8'",
    "node": "npm install --global --prefix /out/layer/usr/local tslab@{tslab}",
}
TEMPLATE_LABEL = "org.msb-kernels.template"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


@dataclass
class BuildResult:
    tag: str
    template: str
    mode: str
    seconds: float
    size_bytes: int
    curve: bool
    archive: Path | None = None

    def report(self) -> str:
        return (
            f"built {self.tag} ({self.template}, {self.mode}) in {self.seconds:.0f} s: "
            f"{self.size_bytes / 2**20:.0f} MiB archive, CurveZMQ {'yes' if self.curve else 'no'}; loaded with msb load"
            + (f"; archive kept at {self.archive}" if self.archive else "")
        )


# -- Debian root filesystems --------------------------------------------------------


def apt_mirror(sources: Iterable[Path] | None = None) -> str:
    """The Debian mirror apt is configured with (sources.list or deb822 .sources), else deb.debian.org."""
    if sources is None:
        sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 3 and words[0] == "deb":
                url = next((w for w in words[1:] if "://" in w), None)
                if url and "security" not in url:
                    return url.rstrip("/")
            if words[:1] == ["URIs:"]:
                for url in words[1:]:
                    if "security" not in url:
                        return url.rstrip("/")
    return DEFAULT_MIRROR


def host_suite() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME=") and line.split("=", 1)[1].strip('"'):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return DEFAULT_SUITE


def debootstrap(
    rootfs: Path,
    packages: list[str],
    *,
    suite: str | None = None,
    mirror: str | None = None,
    cache_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """A minimal Debian (debootstrap minbase) in rootfs, then packages with apt inside it (apt resolves
    dependencies that debootstrap's --include cannot). Needs root and the debootstrap command."""
    tool = shutil.which("debootstrap") or next((p for p in ("/usr/sbin/debootstrap", "/sbin/debootstrap") if os.path.exists(p)), None)
    if tool is None:
        raise SandboxError("debootstrap is not installed", ["apt-get install -y debootstrap", "or build with --online"])
    if os.geteuid() != 0:
        raise SandboxError("an offline image build runs debootstrap, which needs root", ["run it with sudo", "or build with --online"])
    command = [tool, "--variant=minbase"]
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        command.append(f"--cache-dir={cache_dir}")
    command += [suite or host_suite(), str(rootfs), mirror or apt_mirror()]
    _run_logged(command, "debootstrap", log)
    resolv = rootfs / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copy("/etc/resolv.conf", resolv)
    try:
        env = ["env", "DEBIAN_FRONTEND=noninteractive", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        _run_logged(["chroot", str(rootfs), *env, "apt-get", "update", "-q"], "apt-get update", log)
        _run_logged(
            ["chroot", str(rootfs), *env, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], "apt-get install", log
        )
        _run_logged(["chroot", str(rootfs), *env, "apt-get", "clean"], "apt-get clean", log)
    finally:
        resolv.unlink(missing_ok=True)
    for leftover in (rootfs / "var/lib/apt/lists").glob("*_*"):
        leftover.unlink(missing_ok=True)


def _run_logged(command: list[str], what: str, log: Callable[[str], None]) -> None:
    log(f"$ {' '.join(command)}")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SandboxError(f"{what} failed: {(result.stderr.strip() or result.stdout.strip())[-800:]}")


def add_sandbox_user(rootfs: Path) -> None:
    """The unprivileged user kernels run as: sandbox, uid/gid 1000, home /home/sandbox."""
    etc = rootfs / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    for name, line in (
        ("passwd", f"{GUEST_USER}:x:{GUEST_UID}:{GUEST_UID}:sandbox:{GUEST_HOME}:/bin/sh"),
        ("group", f"{GUEST_USER}:x:{GUEST_UID}:"),
    ):
        path = etc / name
        existing = path.read_text() if path.exists() else ("root:x:0:0:root:/root:/bin/sh\n" if name == "passwd" else "root:x:0:\n")
        if not any(entry.split(":", 1)[0] == GUEST_USER for entry in existing.splitlines()):
            existing = existing.rstrip("\n") + "\n" + line + "\n"
        path.write_text(existing)
    home = rootfs / GUEST_HOME.lstrip("/")
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o755)
    (rootfs / "tmp").mkdir(exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    (rootfs / "run" / "kernel").mkdir(parents=True, exist_ok=True)


def install_tslab_from_host(rootfs: Path) -> None:
    """Copy the host's tslab (from `msb-kernels install`) into /opt/msb-kernels/node, with /usr/local/bin/tslab."""
    from msb_kernels.templates import node_prefix, tslab_entry

    if not tslab_entry().exists():
        raise SandboxError(
            "tslab is not installed on this host, and an offline node image copies it from there",
            ["run `msb-kernels install` (it installs tslab with npm)", "or build with --online"],
        )
    target = rootfs / "opt" / "msb-kernels" / "node"
    shutil.copytree(node_prefix() / "node_modules", target / "node_modules", symlinks=True, dirs_exist_ok=True)
    bin_dir = rootfs / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "tslab"
    link.unlink(missing_ok=True)
    link.symlink_to("/opt/msb-kernels/node/node_modules/tslab/bin/tslab")


# What an offline build copies from this host into the image, after Debian's packages.
FROM_HOST = {"node": install_tslab_from_host}


def ipykernel_speaks_curve(rootfs: Path) -> bool:
    """Whether the rootfs's ipykernel has CurveZMQ support (ipykernel's kernelapp knows curve_secretkey)."""
    for pattern in (
        "usr/lib/python3*/dist-packages/ipykernel/kernelapp.py",
        "usr/local/lib/python3*/site-packages/ipykernel/kernelapp.py",
        "usr/lib/python3*/site-packages/ipykernel/kernelapp.py",
    ):
        for path in rootfs.glob(pattern):
            if "curve_secretkey" in path.read_text(errors="replace"):
                return True
    return False


# -- Docker-save archives -------------------------------------------------------------


def _owned_by_root_unless_home(info: tarfile.TarInfo) -> tarfile.TarInfo:
    if info.name == GUEST_HOME.lstrip("/") or info.name.startswith(GUEST_HOME.lstrip("/") + "/"):
        info.uid = info.gid = GUEST_UID
        info.uname = info.gname = GUEST_USER
    return info


def write_layer(rootfs: Path, layer_path: Path) -> str:
    """rootfs as an uncompressed layer tar (members relative to /); returns its diff id."""
    with tarfile.open(layer_path, "w", format=tarfile.PAX_FORMAT) as layer:
        for entry in sorted(os.listdir(rootfs)):
            layer.add(rootfs / entry, arcname=entry, recursive=True, filter=_owned_by_root_unless_home)
    return "sha256:" + _sha256_file(layer_path)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def image_config(template: str, diff_ids: list[str], *, curve: bool, base: dict | None = None) -> dict:
    """An OCI/Docker image config: the kernel user, home, PATH and our labels."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = json.loads(json.dumps(base)) if base else {"architecture": "amd64", "os": "linux", "config": {}, "history": []}
    inner = config.setdefault("config", {})
    env = [e for e in inner.get("Env") or [] if not e.startswith(("PATH=", "HOME="))]
    inner["Env"] = [f"PATH={GUEST_PATH}", f"HOME={GUEST_HOME}", "LANG=C.UTF-8", *[e for e in env if not e.startswith("LANG=")]]
    inner["WorkingDir"] = GUEST_HOME
    inner["Cmd"] = ["/bin/sh"]
    inner.pop("Entrypoint", None)
    inner["Labels"] = {**(inner.get("Labels") or {}), TEMPLATE_LABEL: template, IMAGE_CURVE_LABEL: "true" if curve else "false"}
    config["created"] = now
    config["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    config.setdefault("history", []).append({"created": now, "created_by": f"msb-kernels image build {template}"})
    return config


def write_archive(archive: Path, tag: str, config: dict, layers: list[tuple[str, Path]]) -> None:
    """A Docker-save tar: manifest.json, <config digest>.json and <diff id>/layer.tar per layer."""
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    layer_names = [f"{diff_id.split(':', 1)[1]}/layer.tar" for diff_id, _ in layers]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": layer_names}]).encode()
    with tarfile.open(archive, "w") as out:
        for name, data in (("manifest.json", manifest), (config_name, config_bytes)):
            member = tarfile.TarInfo(name)
            member.size, member.mtime, member.mode = len(data), int(time.time()), 0o644
            out.addfile(member, io.BytesIO(data))
        for name, (_, path) in zip(layer_names, layers, strict=True):
            out.add(path, arcname=name)


def archive_from_rootfs(rootfs: Path, template: str, tag: str, archive: Path) -> bool:
    """rootfs -> a one-layer Docker-save archive tagged tag; returns whether its kernel speaks CurveZMQ."""
    curve = TEMPLATES[template].speaks_curve and ipykernel_speaks_curve(rootfs)
    with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
        layer = Path(scratch) / "layer.tar"
        diff_id = write_layer(rootfs, layer)
        write_archive(archive, tag, image_config(template, [diff_id], curve=curve), [(diff_id, layer)])
    return curve


def append_layer(base_archive: Path, layer_root: Path, template: str, tag: str, archive: Path, *, curve: bool) -> None:
    """A Docker-save archive of base_archive's image plus one layer made of layer_root, tagged tag."""
    with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
        scratch_dir = Path(scratch)
        with tarfile.open(base_archive) as base:
            base.extractall(scratch_dir / "base", filter="data") if hasattr(tarfile, "data_filter") else base.extractall(
                scratch_dir / "base"
            )
        base_dir = scratch_dir / "base"
        manifest = json.loads((base_dir / "manifest.json").read_text())[0]
        base_config = json.loads((base_dir / manifest["Config"]).read_text())
        layers = [(diff_id, base_dir / name) for diff_id, name in zip(base_config["rootfs"]["diff_ids"], manifest["Layers"], strict=True)]
        new_layer = scratch_dir / "layer.tar"
        diff_id = write_layer(layer_root, new_layer)
        layers.append((diff_id, new_layer))
        config = image_config(template, [d for d, _ in layers], curve=curve, base=base_config)
        write_archive(archive, tag, config, layers)


# -- msb load / ls / rm ------------------------------------------------------------------


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
    return _msb("load", "-i", str(archive), "-t", tag).stdout.strip()


def list_images() -> list[str]:
    return [line.strip() for line in _msb("image", "ls", "-q", timeout=60).stdout.splitlines() if line.strip()]


def image_present(tag: str) -> bool:
    return normalize(tag) in {normalize(reference) for reference in list_images()}


def remove_image(tag: str) -> None:
    _msb("image", "rm", "--force", tag, timeout=120)


# -- the builds ------------------------------------------------------------------------------


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
    log: Callable[[str], None] = print,
) -> BuildResult:
    """debootstrap (or prepare_rootfs) -> user, tslab -> Docker-save archive -> msb load -> tag."""
    if template not in DEBIAN_PACKAGES:
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
        add_sandbox_user(rootfs)
        if prepare_rootfs is None and template in FROM_HOST:
            FROM_HOST[template](rootfs)
        archive = work / f"{template}.tar"
        log(f"writing {archive}")
        curve = archive_from_rootfs(rootfs, template, tag, archive)
        shutil.rmtree(rootfs)
        log(f"$ msb load -i {archive} -t {tag}")
        load_archive(archive, tag)
        size = archive.stat().st_size
        if keep_archive is not None:
            shutil.move(archive, keep_archive)
        return BuildResult(tag, template, "offline", time.monotonic() - started, size, curve, keep_archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _online_layer(template: str, base: str, out: Path, timeout: float) -> None:
    from microsandbox import Network, PullPolicy, Volume
    from microsandbox import Sandbox as VM

    from msb_kernels.templates import TSLAB_VERSION

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
    from msb_kernels.backends.microsandbox.host import run_doctor

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
