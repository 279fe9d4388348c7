"""The person's JupyterLab server, as the notebook tools reach it: contents, sessions and collaboration rooms.

The documents live in that server (``jupyter lab --gateway-url=<msb gateway>``), not in the
gateway; its token (MSB_LAB_TOKEN) is the bridge's credential, as a browser's would be. The
kernel of a notebook is whatever Lab's ``/api/sessions`` says for its path: with
``--gateway-url`` that is one of the gateway's sandboxed kernels, under the same id.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx

from msb_kernels.errors import InvalidRequest, MsbError, SandboxError

SETTINGS_HINT = "set MSB_LAB_URL and MSB_LAB_TOKEN (or msb-mcp --lab-url/--lab-token) to the JupyterLab server the person uses"


@dataclass(frozen=True)
class Room:
    """A notebook's real-time collaboration room (jupyter-collaboration): ``json:notebook:<file id>``."""

    room_id: str
    session_id: str


def notebook_path(path: str) -> str:
    """A notebook path relative to Lab's root, as Lab writes it; refused when it leaves the root or is no notebook."""
    cleaned = posixpath.normpath(path.strip().lstrip("/")) if path.strip() else ""
    if not cleaned or cleaned == "." or cleaned.startswith("../") or cleaned == "..":
        raise InvalidRequest(
            f"notebook={path!r} is not a path inside JupyterLab's root",
            ["give the path as Lab's file browser shows it, e.g. 'project/analysis.ipynb'", "list_notebooks shows the open ones"],
        )
    if not cleaned.endswith(".ipynb"):
        raise InvalidRequest(f"notebook={path!r} is not a notebook (it does not end in .ipynb)", ["name a .ipynb file"])
    return cleaned


class LabServer:
    """REST calls to one JupyterLab server with its token; every failure is an MsbError that says what to do."""

    def __init__(self, url: str, token: str | None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"token {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    def use_token(self, token: str) -> None:
        """A person's newer token for their own server (under JupyterHub, the one their MCP client sends now)."""
        self.token = token
        self.http.headers["Authorization"] = f"token {token}"

    async def close(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SandboxError(
                f"cannot reach JupyterLab at {self.url} (MSB_LAB_URL): {type(exc).__name__}: {exc}",
                ["start `jupyter lab --gateway-url=<this gateway>` there, or correct MSB_LAB_URL"],
            ) from None
        if response.status_code in (401, 403):
            raise SandboxError(
                f"JupyterLab at {self.url} refused the token (HTTP {response.status_code})",
                ["set MSB_LAB_TOKEN to the token JupyterLab prints at start (the part after ?token=)"],
            )
        return response

    async def json(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        response = await self.request(method, path, **kwargs)
        if response.status_code == 404:
            raise InvalidRequest(f"{what} does not exist in JupyterLab at {self.url}", ["list_files shows what is there"])
        if response.status_code >= 400:
            raise SandboxError(f"JupyterLab answered HTTP {response.status_code} for {what}: {response.text[:300]}")
        return response.json() if response.content else None

    # -- files ------------------------------------------------------------------------

    async def list_files(self, path: str) -> list[dict[str, Any]]:
        model = await self.json("GET", "/api/contents/" + quote(path.strip("/")), f"the directory {path or '/'!r}", params={"content": 1})
        if model.get("type") != "directory":
            raise InvalidRequest(f"{path!r} is a file, not a directory", ["name a directory, or '' for Lab's root"])
        return sorted(model.get("content") or [], key=lambda entry: (entry["type"] != "directory", entry["name"]))

    async def exists(self, path: str) -> bool:
        response = await self.request("GET", "/api/contents/" + quote(path), params={"content": 0})
        return response.status_code == 200

    async def create_notebook(self, path: str, kernel_name: str) -> None:
        content = {
            "cells": [],
            "metadata": {"kernelspec": {"name": kernel_name, "display_name": kernel_name, "language": "python"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        await self.json("PUT", "/api/contents/" + quote(path), f"the new notebook {path!r}", json={"type": "notebook", "content": content})

    # -- kernels -------------------------------------------------------------------------

    async def sessions(self) -> list[dict[str, Any]]:
        return await self.json("GET", "/api/sessions", "the session list") or []

    async def kernel_of(self, path: str) -> str | None:
        """The id of the kernel Lab runs for this notebook, if it runs one."""
        for session in await self.sessions():
            if session.get("path") == path and session.get("kernel"):
                return session["kernel"]["id"]
        return None

    async def start_kernel(self, path: str, kernel_name: str) -> str:
        """Start the notebook's kernel as Lab does when a person opens it: a session for its path."""
        body = {"path": path, "name": posixpath.basename(path), "type": "notebook", "kernel": {"name": kernel_name}}
        response = await self.request("POST", "/api/sessions", json=body)
        if response.status_code >= 400:
            raise SandboxError(
                f"JupyterLab could not start a {kernel_name!r} kernel for {path}: HTTP {response.status_code} {response.text[:300]}",
                ["check that JupyterLab runs with --gateway-url=<this gateway>", "list_languages shows what can start"],
            )
        return response.json()["kernel"]["id"]

    # -- collaboration ---------------------------------------------------------------------

    async def room(self, path: str) -> Room:
        # Lab hands out a room for a file that does not exist, and then never fills it.
        if not await self.exists(path):
            raise InvalidRequest(f"notebook {path!r} does not exist in JupyterLab", ["use_notebook with create=true makes it"])
        response = await self.request("PUT", "/api/collaboration/session/" + quote(path), json={"format": "json", "type": "notebook"})
        if response.status_code == 404:
            raise SandboxError(
                f"JupyterLab at {self.url} has no real-time collaboration (PUT /api/collaboration/session answered 404)",
                ["install it where JupyterLab runs: pip install 'jupyter-collaboration>=4' and restart JupyterLab"],
            )
        if response.status_code >= 400:
            raise SandboxError(f"JupyterLab would not open {path!r} for collaboration: HTTP {response.status_code} {response.text[:300]}")
        body = response.json()
        return Room(f"{body['format']}:{body['type']}:{body['fileId']}", body["sessionId"])

    def room_url(self, room: Room) -> str:
        base = "ws" + self.url[len("http") :]
        return f"{base}/api/collaboration/room/{room.room_id}?{urlencode({'sessionId': room.session_id})}"

    def room_headers(self) -> dict[str, str]:
        """The token in a header, as for REST: a JupyterHub single-user server takes a WebSocket's ``?token=`` only from
        a browser (Sec-Fetch-Mode: websocket), and a URL's token ends up in logs."""
        return {"Authorization": f"token {self.token}"} if self.token else {}


def no_lab() -> MsbError:
    return InvalidRequest("the notebook tools are off: this MCP server was not told which JupyterLab holds the notebooks", [SETTINGS_HINT])
