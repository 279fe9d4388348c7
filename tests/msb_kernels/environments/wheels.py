"""Wheels a test makes itself, so an environment is created offline with no registry: the probe package, written
here, and ipykernel with what it needs, packed again from the suite's own installed copies."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROBE_PACKAGE = "msbenvprobe"
PROBE_VALUE = "made-by-the-test-7f3a"  # the module-level constant a kernel prints when it imports the package


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(path: Path, files: dict[str, bytes], dist_info: str) -> None:
    record = [_record_line(name, data) for name, data in files.items()] + [f"{dist_info}/RECORD,,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")


def package_wheel(directory: Path, name: str, version: str, modules: dict[str, str]) -> Path:
    """A pure-Python wheel of name, zipped by hand: modules maps each file's path in the wheel to its source."""
    dist_info = f"{name}-{version}.dist-info"
    files = {path: source.encode() for path, source in modules.items()}
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: msb-kernels-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    _write_wheel(path, files, dist_info)
    return path


def probe_wheel(directory: Path) -> Path:
    """msbenvprobe 1.0: one module with a constant."""
    return package_wheel(directory, PROBE_PACKAGE, "1.0", {f"{PROBE_PACKAGE}/__init__.py": f"VALUE = {PROBE_VALUE!r}\n"})


def closure(root: str) -> list[metadata.Distribution]:
    """The installed distribution root and everything it requires here, as this interpreter's markers select."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


def repack(dist: metadata.Distribution, directory: Path) -> Path:
    """An installed distribution as the wheel it came from (files under site-packages; scripts and data left out)."""
    dist_info = next(str(f).split("/")[0] for f in dist.files or [] if str(f).split("/")[0].endswith(".dist-info"))
    files: dict[str, bytes] = {}
    for file in dist.files or []:
        name = str(file)
        if name.startswith("..") or "__pycache__" in name or name.endswith(".pyc"):
            continue
        if name.startswith(dist_info + "/") and name.split("/")[-1] in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            continue
        located = Path(dist.locate_file(file))
        if located.is_file():
            files[name] = located.read_bytes()
    wheel_info = (dist.read_text("WHEEL") or "").splitlines()
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_info if line.startswith("Tag:")] or [["py3", "none", "any"]]
    tag = "-".join(".".join(dict.fromkeys(t[part] for t in tags)) for part in range(3))  # py2.py3-none-any
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    path = directory / f"{stem}-{tag}.whl"
    _write_wheel(path, files, dist_info)
    return path


def offline_wheels(directory: Path) -> Path:
    """A --wheels directory: the probe package, and ipykernel with its requirements."""
    directory.mkdir(parents=True, exist_ok=True)
    probe_wheel(directory)
    for dist in closure("ipykernel"):
        repack(dist, directory)
    return directory
