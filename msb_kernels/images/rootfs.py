"""Debian root filesystems for kernel images: debootstrap, the kernel from PyPI (or Debian), the sandbox user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from msb_kernels.errors import SandboxError
from msb_kernels.images import GUEST_HOME, GUEST_UID, GUEST_USER, IMAGE_SHARED_DIR

# Beyond the interpreter, what a notebook user types first in a `!` line (tests/msb_kernels/backends/test_contract.py's
# everyday battery): minbase has coreutils, findutils, tar and gzip; git, sqlite3, curl and `python -m venv` are added.
EVERYDAY_TOOLS = ["git", "sqlite3", "curl"]
DEBIAN_PACKAGES = {
    "python": ["python3", "python3-venv", "ca-certificates", *EVERYDAY_TOOLS],
    "node": ["nodejs", "ca-certificates", *EVERYDAY_TOOLS],
}
# The Python kernel from PyPI, through the host's pip and its index: an ipykernel that speaks CurveZMQ (>= 7.4)
# on a pyzmq with libsodium. Debian's (6.17) cannot, and stands in only where pip reaches no index.

PIP_KERNEL = {"python": ["ipykernel>=7.4", "matplotlib", "ipywidgets>=8"]}

DEBIAN_KERNEL_FALLBACK = {"python": ["python3-ipykernel", "python3-matplotlib"]}

MANYLINUX = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "manylinux_2_36_x86_64")

DEFAULT_SUITE = "bookworm"

DEFAULT_MIRROR = "http://deb.debian.org/debian"


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
    run_logged(command, "debootstrap", log)
    chroot_apt_install(rootfs, packages, log)


def chroot_apt_install(rootfs: Path, packages: list[str], log: Callable[[str], None]) -> None:
    """More Debian packages into a debootstrapped rootfs, with the host's resolver for the time it takes."""
    resolv = rootfs / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copy("/etc/resolv.conf", resolv)
    try:
        env = ["env", "DEBIAN_FRONTEND=noninteractive", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        run_logged(["chroot", str(rootfs), *env, "apt-get", "update", "-q"], "apt-get update", log)
        run_logged(
            ["chroot", str(rootfs), *env, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], "apt-get install", log
        )
        run_logged(["chroot", str(rootfs), *env, "apt-get", "clean"], "apt-get clean", log)
    finally:
        resolv.unlink(missing_ok=True)
    for leftover in (rootfs / "var/lib/apt/lists").glob("*_*"):
        leftover.unlink(missing_ok=True)


def rootfs_python(rootfs: Path) -> str | None:
    """The rootfs's python3 as "3.11", from its standard library's directory."""
    versions = sorted(p.name.removeprefix("python") for p in (rootfs / "usr" / "lib").glob("python3.*") if (p / "os.py").exists())
    return versions[-1] if versions else None


def pip_into_rootfs(rootfs: Path, requirements: list[str], log: Callable[[str], None], version: str | None = None) -> str | None:
    """requirements into the rootfs's /usr/local (ahead of Debian's packages on its sys.path), as wheels for its Python
    (version, else the rootfs's own), by the host's pip from the host's index. None, or pip's complaint where it cannot."""
    version = version or rootfs_python(rootfs)
    if version is None:
        return "the image has no python3"
    target = rootfs / "usr" / "local" / "lib" / f"python{version}" / "dist-packages"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(target)]
    command += ["--only-binary=:all:", "--python-version", version, "--implementation", "cp", "--abi", f"cp{version.replace('.', '')}"]
    for platform in MANYLINUX:
        command += ["--platform", platform]
    log(f"$ pip install --target {target} {' '.join(requirements)}")
    result = subprocess.run([*command, *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        return (result.stderr.strip() or result.stdout.strip())[-300:]
    return None


def pip_install_kernel(rootfs: Path, template: str, log: Callable[[str], None]) -> bool:
    """PIP_KERNEL into the rootfs; False where pip cannot, and the caller falls back to Debian's kernel."""
    problem = pip_into_rootfs(rootfs, PIP_KERNEL[template], log) if template in PIP_KERNEL else "no PyPI kernel"
    if problem:
        log(f"pip could not install the kernel from an index ({problem}); using Debian's")
        shutil.rmtree(rootfs / "usr" / "local" / "lib", ignore_errors=True)
        return False
    return True


def run_logged(command: list[str], what: str, log: Callable[[str], None]) -> None:
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
    for name in ("shadow", "shadow-", "gshadow", "gshadow-"):  # no one logs in: nothing for a kernel to try
        (etc / name).unlink(missing_ok=True)
    root_home = rootfs / "root"  # root's home is empty and open, as if absent: a kernel finds nothing there
    shutil.rmtree(root_home, ignore_errors=True)
    root_home.mkdir()
    os.chmod(root_home, 0o755)
    home = rootfs / GUEST_HOME.lstrip("/")
    home.mkdir(parents=True, exist_ok=True)
    # Open to all: Docker puts a tmpfs over it (MSB_BACKEND=swarm, a read-only image) with the image directory's mode
    # but root as its owner, and the kernel's user must write there. The kernel's user is the image's only one.
    os.chmod(home, 0o777)
    # The shared volume's mount point (MSB_SHARED_VOLUME_NAME on Swarm): a named volume the engine makes there copies
    # its owner (the archive makes it the kernel user's) and mode, so a person's volume is theirs alone to write.
    shared = rootfs / IMAGE_SHARED_DIR.lstrip("/")
    shared.mkdir(exist_ok=True)
    os.chmod(shared, 0o700)
    (rootfs / "tmp").mkdir(exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    (rootfs / "run" / "kernel").mkdir(parents=True, exist_ok=True)


def install_tslab_from_host(rootfs: Path) -> None:
    """Copy the host's tslab (from `msb-kernels install`) into /opt/msb-kernels/node, with /usr/local/bin/tslab."""
    from msb_kernels.kernelspecs.templates import node_prefix, tslab_entry

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
        "usr/local/lib/python3*/dist-packages/ipykernel/kernelapp.py",
        "usr/lib/python3*/dist-packages/ipykernel/kernelapp.py",
        "usr/local/lib/python3*/site-packages/ipykernel/kernelapp.py",
        "usr/lib/python3*/site-packages/ipykernel/kernelapp.py",
    ):
        for path in rootfs.glob(pattern):
            if "curve_secretkey" in path.read_text(errors="replace"):
                return True
    return False
