"""Docker-save archives (manifest.json, a config, one tar per layer): what `msb load` and `docker load` both take."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from msb_kernels.errors import SandboxError
from msb_kernels.images import GUEST_HOME, GUEST_PATH, GUEST_UID, GUEST_USER, IMAGE_CURVE_LABEL, IMAGE_SHARED_DIR, TEMPLATE_LABEL
from msb_kernels.images.rootfs import ipykernel_speaks_curve
from msb_kernels.kernelspecs.templates import TEMPLATES


def _owned_by_root_unless_home(info: tarfile.TarInfo) -> tarfile.TarInfo:
    if (
        info.name == GUEST_HOME.lstrip("/")
        or info.name.startswith(GUEST_HOME.lstrip("/") + "/")
        or info.name == IMAGE_SHARED_DIR.lstrip("/")
    ):
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


def image_config(template: str, diff_ids: list[str], *, curve: bool, base: dict | None = None, command: list[str] | None = None) -> dict:
    """An OCI/Docker image config: the kernel user, home, PATH and our labels."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = json.loads(json.dumps(base)) if base else {"architecture": "amd64", "os": "linux", "config": {}, "history": []}
    inner = config.setdefault("config", {})
    env = [e for e in inner.get("Env") or [] if not e.startswith(("PATH=", "HOME="))]
    inner["Env"] = [f"PATH={GUEST_PATH}", f"HOME={GUEST_HOME}", "LANG=C.UTF-8", *[e for e in env if not e.startswith("LANG=")]]
    inner["WorkingDir"] = GUEST_HOME
    inner["Cmd"] = command or ["/bin/sh"]
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


def archive_from_rootfs(rootfs: Path, template: str, tag: str, archive: Path, command: list[str] | None = None) -> bool:
    """rootfs -> a one-layer Docker-save archive tagged tag; returns whether its kernel speaks CurveZMQ."""
    curve = template in TEMPLATES and TEMPLATES[template].speaks_curve and ipykernel_speaks_curve(rootfs)
    with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
        layer = Path(scratch) / "layer.tar"
        diff_id = write_layer(rootfs, layer)
        write_archive(archive, tag, image_config(template, [diff_id], curve=curve, command=command), [(diff_id, layer)])
    return curve


def append_layer(
    base_archive: Path, layer_root: Path, template: str, tag: str, archive: Path, *, curve: bool, command: list[str] | None = None
) -> None:
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
        config = image_config(template, [d for d, _ in layers], curve=curve, base=base_config, command=command)
        write_archive(archive, tag, config, layers)


def layer_members(archive: Path) -> Iterator[tarfile.TarInfo]:
    """Every entry of a Docker-save archive's layers, lower layers first: one pass over their headers (they are
    hundreds of MiB; their contents are skipped, not read)."""
    with tarfile.open(archive) as outer:
        for member in outer:
            if member.name.endswith("/layer.tar"):
                with tarfile.open(fileobj=outer.extractfile(member)) as layer:
                    yield from layer


def python_site(archive: Path) -> tuple[str, set[str]]:
    """The python3 version ("3.11") in a Docker-save archive of ours, from its standard library's path, and the
    ``name-version.dist-info`` directories of its /usr/local site (what its kernel already brings)."""
    version, found = None, {}
    for inner in layer_members(archive):
        parts = inner.name.removeprefix("./").split("/")
        if len(parts) == 4 and parts[:2] == ["usr", "lib"] and parts[2].startswith("python3.") and parts[3] == "os.py":
            version = parts[2].removeprefix("python")
        elif len(parts) == 6 and parts[:3] == ["usr", "local", "lib"] and parts[4] == "dist-packages":
            if parts[5].endswith(".dist-info"):
                found.setdefault(parts[3].removeprefix("python"), set()).add(parts[5])
    if version is None:
        raise SandboxError(f"{archive} holds no python3: build it with `msb-kernels image build python --save-archive {archive}`")
    return version, found.get(version, set())
