"""upload_file and download_file: files into and out of a session's sandbox, through its kernel.

A transfer is a series of silent steps that the kernel runs (its template's file_step_code), each moving up to
CHUNK_BYTES, queued in order with the session's other executions. Going through the kernel works alike on every
backend and transport, a remote gateway's included (the bridge may share no disk with the sandbox), and the kernel
reaches only what its sandbox lets it: the sandbox's own /tmp and home, and the shared volume; never the host's files.
A transfer is held to the flavor's disk, so what one call may move is what the sandbox could hold.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid

from mcp_bridge.commands import new_marker
from mcp_bridge.executions import Execution
from mcp_bridge.sessions import SessionInfo
from msb_kernels.backends.core.guest import SANDBOX_HOME
from msb_kernels.errors import InvalidRequest, MsbError, ResourceLimitExceeded, SandboxError
from msb_kernels.identity.people import acting
from msb_kernels.kernelspecs.flavors import FLAVORS, get_flavor
from msb_kernels.kernelspecs.templates import get_template
from msb_kernels.provisioning.labroot import root_path
from msb_kernels.provisioning.person_places import person_for
from msb_kernels.settings.config import MsbSettings

CHUNK_BYTES = 1 << 20  # per step: 1.4 MB of base64 in one execute request or one answer
STEP_TIMEOUT_SECONDS = 120.0
# errno of an answer -> the error a caller gets (the sandbox said no; what to do differs)
NO_ROOM, TOO_BIG, SYMLINK_LOOP = 28, 27, 40


def roots(settings: MsbSettings) -> list[str]:
    """Where a session's files may be: its /tmp, its home, the shared volume when there is one, and the acting
    person's Lab root (the notebooks' folder their Lab shows) when the sandboxes show one."""
    lab = root_path(settings, person_for(settings, acting()))
    return [
        "/tmp",
        SANDBOX_HOME,
        *([settings.shared_volume_guest_path] if settings.has_shared_volume else []),
        *([str(lab)] if lab else []),
    ]


def size_limit(info: SessionInfo, settings: MsbSettings) -> tuple[int, str]:
    """The most one transfer may move in this session: its flavor's disk; and the flavor's name."""
    flavor = FLAVORS.get(info.flavor or "") or get_flavor(settings.default_flavor)
    return flavor.disk_mib * 1024 * 1024, flavor.name


async def upload(bridge, info: SessionInfo, path: str, data: bytes, overwrite: bool) -> dict:
    """Write data to path in the session's sandbox; returns the kernel's word on the file: path, size, sha256."""
    limit, flavor = size_limit(info, bridge.settings)
    if len(data) > limit:
        larger = [f.name for f in FLAVORS.values() if f.disk_mib * 1024 * 1024 >= len(data)]
        raise ResourceLimitExceeded(
            f"{len(data)} bytes do not fit the {flavor} flavor's disk ({limit >> 20} MiB)",
            [f"start a session of the {larger[0]} flavor for this file" if larger else "split the file", "or compress it first"],
        )
    request = {"path": path, "roots": roots(bridge.settings), "nonce": uuid.uuid4().hex, "max_bytes": limit, "overwrite": overwrite}
    try:
        for offset in range(0, max(len(data), 1), CHUNK_BYTES):
            chunk = base64.b64encode(data[offset : offset + CHUNK_BYTES]).decode()
            await step(bridge, info, {**request, "step": "write", "offset": offset, "data": chunk})
        answer = await step(bridge, info, {**request, "step": "commit", "offset": 0})
    except Exception:
        try:
            await step(bridge, info, {**request, "step": "abort", "offset": 0})
        except Exception:  # the error that stopped the upload is the one to report
            pass
        raise
    if answer.get("sha256") != hashlib.sha256(data).hexdigest():
        raise SandboxError(f"{path} in the sandbox does not hold what was sent (another writer?)", ["upload it again"])
    return answer


async def download(bridge, info: SessionInfo, path: str) -> tuple[bytes, dict]:
    """The bytes of path in the session's sandbox, and the kernel's word on the file: path, size, sha256."""
    limit, _ = size_limit(info, bridge.settings)
    request = {"path": path, "roots": roots(bridge.settings), "max_bytes": limit, "step": "read", "length": CHUNK_BYTES}
    first = await step(bridge, info, {**request, "offset": 0})
    data = bytearray(base64.b64decode(first["data"]))
    while len(data) < first["size"]:
        answer = await step(bridge, info, {**request, "offset": len(data)})
        chunk = base64.b64decode(answer["data"])
        if not chunk:
            break
        data += chunk
    if len(data) != first["size"] or hashlib.sha256(data).hexdigest() != first["sha256"]:
        raise SandboxError(f"{path} changed while it was read", ["download it again once nothing writes to it"])
    return bytes(data), {key: first[key] for key in ("path", "size", "sha256")}


async def step(bridge, info: SessionInfo, request: dict) -> dict:
    """One step in the kernel, in order with the session's executions; its JSON answer, or the error it names."""
    marker = new_marker()
    code = get_template(info.language or "python").file_step_code(request, marker)
    if code is None:
        raise InvalidRequest(
            f"upload_file and download_file work in python sessions; session {info.id} runs {info.language}",
            ["use a python session for files, or the shared volume (get_volume_path)"],
        )
    execution = Execution(
        session_id=info.id,
        language=info.language or "python",
        flavor=info.flavor,
        kind="command",
        timeout=STEP_TIMEOUT_SECONDS,
        max_output_chars=3 * CHUNK_BYTES,
        marker=marker,
    )
    bridge.submit(info, execution, code, silent=True)
    await execution.done.wait()
    if execution.error is not None:
        raise execution.error
    stdout, stderr = execution.output.read()
    try:
        answer = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SandboxError(f"the kernel did not answer a file transfer step: {(stderr or stdout).strip()[-300:]}") from None
    if "error" in answer:
        raise refusal(request["path"], answer, bridge.settings)
    return answer


def refusal(path: str, answer: dict, settings: MsbSettings) -> MsbError:
    """The sandbox's no, as the error a caller can act on."""
    kind, number, message = answer["error"], answer.get("errno"), answer.get("message") or answer["error"]
    where = ", ".join(roots(settings))
    if number == NO_ROOM:
        return ResourceLimitExceeded(
            f"no room for {path}: the sandbox's disk is full", ["remove files you no longer need", "or use a larger flavor"]
        )
    if number == TOO_BIG:
        return ResourceLimitExceeded(f"{path}: {message}", ["use a larger flavor", "or compress the file in the sandbox first"])
    if kind == "PermissionError":
        return InvalidRequest(
            f"{path}: {message}",
            [f"use a path under {where}", "a relative path is from the kernel's working directory, as open() in a cell reads it"],
        )
    if kind == "FileNotFoundError":
        return InvalidRequest(
            f"{path}: no such file or directory in the sandbox",
            [f"files are under {where}", "list them with execute_command('ls', ['-la', DIR])"],
        )
    if number == SYMLINK_LOOP:
        return InvalidRequest(f"{path} is a symbolic link; files are moved without following one", ["name the file it points to"])
    if kind in ("FileExistsError", "IsADirectoryError", "NotADirectoryError"):
        return InvalidRequest(
            f"{path}: {message}",
            ["pass overwrite=true to replace a file"] if kind == "FileExistsError" else ["name a file, not a directory"],
        )
    return SandboxError(f"{path}: {kind}: {message}")
