"""`msb-kernels image build python --env NAME`: an environment's kernel image, offline, from what this host has.

The default python kernel image (its Debian, its sandbox user, the python3 the egress relay runs) plus one layer that
holds the environment's interpreter at the paths it has on the host: its venv whole, the directories on its sys.path
(without the site directories it does not read, nor CPython's own test suite), its executable and the symlinks that
lead to it, and each shared library those need that the base image lacks. Its kernelspecs' argv then runs unchanged
in the image, as the namespace and gVisor backends run it by path. The tag goes into the environment's record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from msb_kernels.backends.core.hostpaths import WHOLE_DIRS, under
from msb_kernels.environments.environment import Environment
from msb_kernels.environments.interpreters import checked, clean_env
from msb_kernels.environments.store import EnvironmentStore
from msb_kernels.errors import InvalidRequest, SandboxError
from msb_kernels.images import GUEST_HOME
from msb_kernels.images.archives import append_layer, layer_members
from msb_kernels.images.builds import BuildResult, Loader
from msb_kernels.settings.config import MsbSettings

# Where a kernel's engine mounts a filesystem of its own (Swarm: tmpfs on the home and /tmp; the kernel's files under
# /run): an interpreter there would be hidden in the image, so the build refuses it.
ENGINE_MOUNTS = ("/tmp", GUEST_HOME, "/run", "/proc", "/sys", "/dev")
SITE_DIRS = ("site-packages", "dist-packages")
ELF_MAGIC = b"\x7fELF"

LAYOUT_CODE = r"""
import json, os, sys
print(json.dumps({"path": [p for p in sys.path if p], "prefix": sys.prefix, "base_prefix": sys.base_prefix,
                  "stdlib": os.path.dirname(os.__file__)}))
"""


@dataclass
class Layout:
    """What of an interpreter its kernel reads: the directories to copy whole, and what to leave out of them."""

    python: str
    trees: list[str]
    read: list[str]  # its sys.path, as it runs a kernel
    skip: set[str] = field(default_factory=set)  # directories under the trees left out (unread site dirs, the test suite)


def layout(python: str) -> Layout:
    """Ask the interpreter where its modules come from (as its kernel will run it: no user site, no PYTHONPATH)."""
    result = subprocess.run([python, "-s", "-c", LAYOUT_CODE], capture_output=True, text=True, timeout=60, env=clean_env())
    if result.returncode != 0:
        raise InvalidRequest(f"environment's python {python}: cannot ask it what it reads: {result.stderr.strip()[-300:]}")
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    read = {os.path.normpath(p) for p in answer["path"] if os.path.exists(p)}
    trees = set(read)
    if answer["prefix"] != answer["base_prefix"]:  # a venv: whole, with its pyvenv.cfg and scripts
        trees.add(os.path.normpath(answer["prefix"]))
    skip = {os.path.join(answer["stdlib"], "test")}
    for tree in list(trees):
        if os.path.isdir(tree):
            skip |= {os.path.join(tree, name) for name in SITE_DIRS if os.path.join(tree, name) not in read}
    trees = {t for t in trees if not any(t != other and under(t, other) for other in trees)}  # a tree inside another goes with it
    return Layout(python, sorted(trees), sorted(read), {s for s in skip if s not in read})


def refuse_hidden(paths: list[str], name: str) -> None:
    hidden = [(p, mount) for p in paths for mount in ENGINE_MOUNTS if under(p, mount)]
    if hidden:
        path, mount = hidden[0]
        raise InvalidRequest(
            f"environment {name}: its interpreter needs {path}, under {mount}, where a kernel's engine mounts its own "
            "filesystem: the image could not show it",
            [
                "make the environment elsewhere: MSB_ENVIRONMENTS_DIR=/srv/msb-environments msb-kernels env create ...",
                "or env add one under /opt",
            ],
        )


def _make_parents(target: Path, root: Path) -> None:
    """The directories above target, open to the kernel's user whatever this process's umask."""
    missing = []
    parent = target.parent
    while parent != root and not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        directory.mkdir()
        os.chmod(directory, 0o755)


def in_image(path: str) -> str:
    """Where path goes in the layer: at the same path, except under a system directory, where its parent's real path
    is taken: a merged-/usr host's /lib is a symlink to usr/lib, as the image's is, and a directory of ours named /lib
    would hide every library of the image."""
    if any(under(path, system) for system in WHOLE_DIRS):
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return path


def _copy_path(source: str, root: Path, skip: set[str]) -> None:
    """source (a tree, a file or a symlink) into root at the same path; a symlink stays one."""
    source = in_image(source)
    target = root / source.lstrip("/")
    if target.exists() or target.is_symlink():
        return
    _make_parents(target, root)
    if os.path.islink(source) or not os.path.isdir(source):
        shutil.copy2(source, target, follow_symlinks=False)
        return

    def ignored(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if os.path.join(directory, n) in skip or n.endswith(".a")}  # static libraries: nothing runs them

    shutil.copytree(source, target, symlinks=True, ignore=ignored)


def _copy_with_links(path: str, root: Path, skip: set[str]) -> None:
    """path and every symlink on the way to the file it names (a venv's python -> pyenv's python3 -> python3.11)."""
    for _ in range(40):
        _copy_path(path, root, skip)
        if not os.path.islink(path):
            return
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))


def _elf_files(root: Path) -> list[Path]:
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            if path.is_symlink() or not (".so" in name or os.access(path, os.X_OK)):
                continue
            with open(path, "rb") as handle:
                if handle.read(4) == ELF_MAGIC:
                    found.append(path)
    return found


def needed_libraries(files: list[str]) -> tuple[set[str], set[str]]:
    """The shared libraries the host's loader finds for files (by ldd), and the names it finds none for."""
    found: set[str] = set()
    missing: set[str] = set()
    for at in range(0, len(files), 200):
        result = subprocess.run(["ldd", *files[at : at + 200]], capture_output=True, text=True, timeout=300)
        for line in result.stdout.splitlines():
            if line.endswith(":"):  # "/path/of/a/file:", before its libraries when ldd is given several
                continue
            left, _, right = line.strip().partition("=>")
            words = (right or left).split()
            if "not found" in right:
                missing.add(left.strip())
            elif words and words[0].startswith("/"):
                found.add(words[0])
    return found, missing


def image_paths(archive: Path) -> tuple[set[str], set[str]]:
    """Every path in a Docker-save archive's layers ("usr/lib/x86_64-linux-gnu/libc.so.6"), and those that are symlinks
    ("lib"): one pass over the layers' headers."""
    paths: set[str] = set()
    links: set[str] = set()
    for inner in layer_members(archive):
        name = inner.name.removeprefix("./").rstrip("/")
        paths.add(name)
        (links.add if inner.issym() else links.discard)(name)  # an upper layer's entry replaces a lower one's
    return paths, links


def check_shadows(root: Path, links: set[str]) -> None:
    """No directory of the layer where the base image has a symlink: it would hide what the symlink leads to."""
    for directory, dirs, _ in os.walk(root):
        for name in dirs:
            relative = os.path.relpath(os.path.join(directory, name), root)
            if relative in links:
                raise SandboxError(f"the environment's layer would replace the image's symlink /{relative} with a directory")


def add_libraries(root: Path, trees: list[str], base: set[str], log: Callable[[str], None]) -> list[str]:
    """Copy into root each library the copied ELF files need that neither the trees nor the base image hold."""
    files = [str(Path("/") / path.relative_to(root)) for path in _elf_files(root)]
    found, missing = needed_libraries(files)
    if missing:
        log(f"the host's loader finds no {', '.join(sorted(missing))}: those modules will not import in the image either")
    added = []
    for library in sorted(found):
        real = os.path.realpath(library)
        if any(under(library, t) or under(real, t) for t in trees) or real.lstrip("/") in base or library.lstrip("/") in base:
            continue
        _copy_with_links(library, root, set())
        _copy_path(real, root, set())
        linked = os.path.join(os.path.dirname(real), os.path.basename(library))  # its soname where the loader looks
        if linked != real and not os.path.lexists(root / linked.lstrip("/")):
            (root / linked.lstrip("/")).symlink_to(os.path.basename(real))
        added.append(library)
    return added


def compile_bytecode(python: str, root: Path, trees: list[str], log: Callable[[str], None]) -> None:
    """Each tree's modules compiled by the environment's own Python, recorded at their paths in the image: a kernel's
    image is read-only, so a module without its .pyc (uv installs none) would be compiled again at every start."""
    for tree in trees:
        copied = root / in_image(tree).lstrip("/")
        if not copied.is_dir():
            continue
        command = [python, "-m", "compileall", "-q", "-j", "0", "-d", in_image(tree), str(copied)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=clean_env())
        if result.returncode != 0:  # a module that does not compile (a package's Python 2 test file) imports as it did
            log(f"compileall left some modules of {tree} uncompiled: {(result.stdout + result.stderr).strip()[-300:]}")


def open_to_the_kernel(root: Path) -> None:
    """Readable (and where executable, runnable) by the image's unprivileged user, as the host's copies may not be."""
    for directory, dirs, names in os.walk(root):
        for name in dirs:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o755)
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, mode | 0o444 | (0o111 if mode & 0o100 else 0))


def speaks_curve(read: list[str]) -> bool:
    """Whether the environment's own ipykernel knows CurveZMQ (its kernelapp has curve_secretkey)."""
    for directory in read:
        kernelapp = Path(directory) / "ipykernel" / "kernelapp.py"
        if kernelapp.is_file():
            return "curve_secretkey" in kernelapp.read_text(errors="replace")
    return False


def base_archive_from(
    engine: str, settings: MsbSettings, from_archive: Path | None = None, suite: str | None = None, mirror: str | None = None
) -> Callable[[Path], Path]:
    """Where the base (the default python image) comes from: from_archive, else the engine's own copy of
    MSB_PYTHON_IMAGE (docker save, msb save), else built here first (debootstrap, as `image build python` does)."""
    from msb_kernels.images import builds, image_for

    def base(work: Path) -> Path:
        if from_archive is not None:
            return from_archive
        default, path = image_for(settings, "python"), work / "base.tar"
        if engine == "docker":
            from msb_kernels.backends.cluster.swarm import docker_save

            if docker_save(default, path):
                return path
        elif engine == "msb":
            from msb_kernels.backends.microsandbox.images import save_image

            if save_image(default, path):
                return path
        print(f"the default python image {default} is not in the engine: building it first (debootstrap), as its base")
        builds.build_offline("python", default, suite=suite, mirror=mirror, keep_archive=path, load=lambda archive, tag: None)
        return path

    return base


def build(
    environment: Environment,
    settings: MsbSettings,
    tag: str,
    *,
    base_archive: Callable[[Path], Path],
    load: Loader,
    keep_archive: Path | None = None,
    log: Callable[[str], None] = print,
) -> BuildResult:
    """The base image's archive (base_archive(work dir)), one layer of the environment's interpreter, load, record."""
    started = time.monotonic()
    checked(environment.python, f"environment {environment.name}'s python")
    found = layout(environment.python)
    refuse_hidden([environment.python, *found.trees], environment.name)
    work = Path(tempfile.mkdtemp(prefix="msb-image-", dir=keep_archive.parent if keep_archive else None))
    try:
        base = base_archive(work)
        root = work / "layer"
        root.mkdir()
        log(f"copying {environment.name}'s interpreter: {', '.join(found.trees)}")
        for tree in found.trees:
            _copy_path(tree, root, found.skip)
        _copy_with_links(environment.python, root, found.skip)
        base_paths, base_links = image_paths(base)
        added = add_libraries(root, found.trees, base_paths, log)
        check_shadows(root, base_links)
        if added:
            log(f"{len(added)} shared libraries the base image lacks: {', '.join(added)}")
        compile_bytecode(environment.python, root, found.trees, log)
        open_to_the_kernel(root)
        curve = speaks_curve(found.read)
        archive = work / "environment.tar"
        log(f"writing {archive}")
        append_layer(base, root, "python", tag, archive, curve=curve)
        load(archive, tag)
        size = archive.stat().st_size
        if keep_archive is not None:
            shutil.move(archive, keep_archive)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    EnvironmentStore.of(settings).put(dataclasses.replace(environment, image=tag))
    return BuildResult(tag, f"python, environment {environment.name}", "offline", time.monotonic() - started, size, curve, keep_archive)
