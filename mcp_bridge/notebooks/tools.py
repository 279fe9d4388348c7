"""The notebook tools: read, edit and run the cells of a notebook a person has open in JupyterLab.

Every call names its notebook (the path in Lab) and, where it touches one cell, the cell (by
id, stable while others edit, or by index). Nothing is remembered between calls but the live
documents, so two assistants on two notebooks cannot write into each other's. A run's outputs
are written by the bridge's own task (mcp_bridge.notebooks.runs), not by the request.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ToolAnnotations
from pycrdt import Map
from pydantic import Field

from mcp_bridge.arguments import check_size, check_timeout
from mcp_bridge.auth import caller_token
from mcp_bridge.models import (
    CellInfo,
    ExecutionResponse,
    FileEntry,
    FileListResponse,
    NotebookListResponse,
    NotebookResponse,
    NotebookSummary,
    SessionListResponse,
)
from mcp_bridge.notebooks.cells import cell_dict, find_cell, insertion_index, make_cell, outputs_text
from mcp_bridge.notebooks.documents import LiveNotebook, NotebookDocuments
from mcp_bridge.notebooks.lab import no_lab, notebook_path
from mcp_bridge.notebooks.runs import submit_cell
from mcp_bridge.rendering import execution_result, model_result
from mcp_bridge.sessions import SessionInfo
from mcp_bridge.supervisor import Bridge, bridge_of
from mcp_bridge.tools import Timeout, sessions_result, tool
from msb_kernels.errors import InvalidRequest, MsbError, NobodyActing, SessionNotFound
from msb_kernels.identity.people import acting

Notebook = Annotated[str, Field(description="the notebook's path in JupyterLab, e.g. 'project/analysis.ipynb'")]
CellId = Annotated[str | None, Field(description="the cell's id (from read_notebook); stable while others edit")]
CellIndex = Annotated[int | None, Field(description="the cell's position now (0 first, -1 last); give this or cell_id")]
Source = Annotated[str, Field(description="the cell's source")]
CellType = Annotated[str, Field(description="code, markdown or raw", json_schema_extra={"enum": ["code", "markdown", "raw"]})]
Index = Annotated[int | None, Field(description="where the new cell goes (0 first); omit or -1 for the end")]
AfterCellId = Annotated[str | None, Field(description="put the new cell right after this cell (instead of index)")]

NOTEBOOK_INSTRUCTIONS = """\
Notebook tools (when the server is given a JupyterLab): every call names its notebook by path; cells by id (stable) or index.
The person sees every change and output live; execute_cell returns 'running' with an execution_id for long cells."""


def documents_of(bridge: Bridge) -> NotebookDocuments:
    """The notebooks of the caller's JupyterLab: under JupyterHub their own server; else the one Lab at MSB_LAB_URL,
    which is one person's, so only the single token's person and admins may edit it."""
    person = acting()
    if person is None:
        raise NobodyActing("a notebook tool was called with nobody acting for it: refused")
    if bridge.personal_labs is not None:
        return bridge.personal_labs.documents(person, caller_token())
    if bridge.notebooks is None:
        raise no_lab()
    if not person.admin:
        raise InvalidRequest(
            f"the notebook tools here reach one JupyterLab (MSB_LAB_URL), which is not {person.name}'s",
            ["run the gateway as a JupyterHub service: each person's assistant then works in their own JupyterLab"],
        )
    return bridge.notebooks


async def open_notebook(bridge: Bridge, notebook: str) -> LiveNotebook:
    return await documents_of(bridge).get(notebook_path(notebook))


async def notebook_kernel(bridge: Bridge, live: LiveNotebook, start: bool) -> SessionInfo | None:
    """The notebook's kernel, as Lab's sessions say; started as a person opening it would when ``start``."""
    lab = documents_of(bridge).lab
    kernel_id = await lab.kernel_of(live.path)
    if kernel_id is None:
        if not start:
            return None
        kernelspec = (live.model.get().get("metadata") or {}).get("kernelspec") or {}
        kernel_id = await lab.start_kernel(live.path, kernelspec.get("name") or "python3")
    try:
        return await bridge.sessions.info(kernel_id)
    except SessionNotFound:
        raise InvalidRequest(
            f"the kernel of {live.path} ({kernel_id}) is not one of this MCP server's gateway: JupyterLab does not run it in a sandbox",
            [
                "run JupyterLab with --gateway-url=<the msb-kernels gateway> and reopen the notebook",
                "or shut the notebook's kernel down in Lab; the next call starts a sandboxed one",
            ],
        ) from None


async def running_kernel(bridge: Bridge, live: LiveNotebook) -> SessionInfo | None:
    """The notebook's kernel for a read: None when it has none, or one this gateway does not run (a read still works)."""
    try:
        return await notebook_kernel(bridge, live, start=False)
    except InvalidRequest:
        return None


async def open_cell(bridge: Bridge, notebook: str, cell_id: str | None, cell_index: int | None) -> tuple[LiveNotebook, int, Map]:
    """The live notebook and the cell a call names (by id or index), as the document stands now."""
    live = await open_notebook(bridge, notebook)
    index, ycell = find_cell(live, cell_id, cell_index)
    return live, index, ycell


async def insert_new_cell(
    bridge: Bridge, notebook: str, source: str, cell_type: str, index: int | None, after_cell_id: str | None
) -> tuple[LiveNotebook, int, str]:
    """Put a new cell where the call asked: the live notebook, the cell's position and its id."""
    check_size(bridge.options, "source", source)
    live = await open_notebook(bridge, notebook)
    cell = make_cell(cell_type, source)
    position = insertion_index(live, index, after_cell_id)
    live.model.ycells.insert(position, live.model.create_ycell(cell))
    return live, position, cell["id"]


def cell_info(index: int, cell: dict, with_outputs: bool = True) -> CellInfo:
    return CellInfo(
        index=index,
        id=str(cell.get("id", "")),
        cell_type=cell.get("cell_type", "code"),
        source=cell.get("source", ""),  # a Y text: always one string
        execution_count=cell.get("execution_count"),
        execution_state=cell.get("execution_state"),
        outputs=outputs_text(cell.get("outputs") or []) if with_outputs and cell.get("cell_type") == "code" else None,
    )


def cells_text(cells: list[CellInfo]) -> str:
    lines = []
    for cell in cells:
        count = f"[{cell.execution_count if cell.execution_count is not None else ' '}]" if cell.cell_type == "code" else cell.cell_type
        lines.append(f"--- cell {cell.index} id={cell.id} {count}" + (" (running)" if cell.execution_state == "running" else ""))
        lines.append(cell.source)
        if cell.outputs:
            lines.append("--- output ---\n" + cell.outputs.rstrip("\n"))
    return "\n".join(lines)


def notebook_response(live: LiveNotebook, info: SessionInfo | None, cells: list[CellInfo], message: str | None = None) -> NotebookResponse:
    return NotebookResponse(
        notebook=live.path,
        session_id=info.id if info else None,
        kernel_name=info.kernel_name if info else None,
        cell_count=len(live.model.ycells),
        cells=cells,
        message=message,
    )


def one_cell_result(live: LiveNotebook, index: int, message: str) -> CallToolResult:
    cell = cell_info(index, cell_dict(live.model.ycells[index]))
    response = notebook_response(live, None, [cell], message)
    return model_result(response, f"{message}\n{cells_text([cell])}")


@tool(
    "Open a notebook in the person's JupyterLab for the other notebook tools, starting its sandboxed kernel if it has none "
    "(create=true makes a new empty notebook). Returns its session_id and cells.",
)
async def use_notebook(
    notebook: Notebook,
    ctx: Context,
    create: Annotated[bool, Field(description="make an empty notebook at this path if there is none")] = False,
    start_kernel: Annotated[bool, Field(description="start the notebook's kernel if it has none")] = True,
) -> Annotated[CallToolResult, NotebookResponse]:
    bridge = bridge_of(ctx)
    path = notebook_path(notebook)
    lab = documents_of(bridge).lab
    if create and not await lab.exists(path):
        await lab.create_notebook(path, "python3")
    live = await open_notebook(bridge, path)
    info = await notebook_kernel(bridge, live, start_kernel)
    cells = [cell_info(i, cell_dict(ycell), with_outputs=False) for i, ycell in enumerate(live.model.ycells)]
    kernel = f"kernel {info.id} ({info.kernel_name})" if info else "no kernel"
    response = notebook_response(live, info, cells, f"{path}: {len(cells)} cells, {kernel}")
    return model_result(response, f"{response.message}\n{cells_text(cells)}")


@tool(
    "List the notebooks open in the person's JupyterLab (with a kernel) and those this server has joined.",
    ToolAnnotations(read_only_hint=True),
)
async def list_notebooks(ctx: Context) -> Annotated[CallToolResult, NotebookListResponse]:
    documents = documents_of(bridge_of(ctx))
    seen: dict[str, NotebookSummary] = {}
    for session in await documents.lab.sessions():
        if session.get("type") == "notebook" and session.get("path"):
            kernel = session.get("kernel") or {}
            seen[session["path"]] = NotebookSummary(
                notebook=session["path"], session_id=kernel.get("id"), kernel_name=kernel.get("name"), joined=False
            )
    for path, live in documents.notebooks.items():
        summary = seen.setdefault(path, NotebookSummary(notebook=path, session_id=None, kernel_name=None, joined=False))
        summary.joined = live.live
    response = NotebookListResponse(notebooks=sorted(seen.values(), key=lambda s: s.notebook))
    text = "\n".join(f"{s.notebook}: kernel {s.session_id or '-'} ({s.kernel_name or 'none'})" for s in response.notebooks)
    return model_result(response, text or "no notebooks are open; use_notebook opens one")


@tool(
    "Read a notebook's cells as the person sees them now (live, with their unsaved edits): ids, sources, execution counts, outputs as text.",
    ToolAnnotations(read_only_hint=True),
)
async def read_notebook(
    notebook: Notebook,
    ctx: Context,
    start: Annotated[int, Field(description="first cell index", ge=0)] = 0,
    limit: Annotated[int | None, Field(description="at most this many cells", ge=1)] = None,
    include_outputs: Annotated[bool, Field(description="include the outputs as text")] = True,
) -> Annotated[CallToolResult, NotebookResponse]:
    live = await open_notebook(bridge_of(ctx), notebook)
    chosen = list(enumerate(live.model.ycells))[start : None if limit is None else start + limit]
    cells = [cell_info(i, cell_dict(ycell), include_outputs) for i, ycell in chosen]
    response = notebook_response(live, await running_kernel(bridge_of(ctx), live), cells)
    return model_result(response, f"{live.path}: {response.cell_count} cells\n{cells_text(cells)}")


@tool("Read one cell: source, execution count, state and outputs.", ToolAnnotations(read_only_hint=True))
async def read_cell(
    notebook: Notebook, ctx: Context, cell_id: CellId = None, cell_index: CellIndex = None
) -> Annotated[CallToolResult, NotebookResponse]:
    live, index, _ = await open_cell(bridge_of(ctx), notebook, cell_id, cell_index)
    return one_cell_result(live, index, f"cell {index} of {live.path}")


@tool("Insert a cell (code, markdown or raw) into a notebook; the person sees it appear. Returns its id.")
async def insert_cell(
    notebook: Notebook,
    source: Source,
    ctx: Context,
    cell_type: CellType = "code",
    index: Index = None,
    after_cell_id: AfterCellId = None,
) -> Annotated[CallToolResult, NotebookResponse]:
    live, position, cell_id = await insert_new_cell(bridge_of(ctx), notebook, source, cell_type, index, after_cell_id)
    return one_cell_result(live, position, f"inserted {cell_type} cell {cell_id} at index {position} of {live.path}")


@tool("Replace a cell's whole source (its outputs stay until it runs again).")
async def overwrite_cell_source(
    notebook: Notebook, source: Source, ctx: Context, cell_id: CellId = None, cell_index: CellIndex = None
) -> Annotated[CallToolResult, NotebookResponse]:
    bridge = bridge_of(ctx)
    check_size(bridge.options, "source", source)
    live, index, ycell = await open_cell(bridge, notebook, cell_id, cell_index)
    text = ycell["source"]
    with ycell.doc.transaction():
        text.clear()
        text += source
    return one_cell_result(live, index, f"replaced the source of cell {index} of {live.path}")


@tool(
    "Edit part of a cell's source: replace the one occurrence of old_text with new_text. Only that span changes, so the "
    "person's typing elsewhere in the cell is kept."
)
async def edit_cell_source(
    notebook: Notebook,
    old_text: Annotated[str, Field(description="text now in the cell, exactly once")],
    new_text: Annotated[str, Field(description="what replaces it")],
    ctx: Context,
    cell_id: CellId = None,
    cell_index: CellIndex = None,
) -> Annotated[CallToolResult, NotebookResponse]:
    bridge = bridge_of(ctx)
    check_size(bridge.options, "new_text", new_text)
    live, index, ycell = await open_cell(bridge, notebook, cell_id, cell_index)
    text = ycell["source"]
    current = str(text)
    found = current.count(old_text) if old_text else 0
    if found != 1:
        raise InvalidRequest(
            f"old_text occurs {found} times in cell {index} of {live.path}; it must occur exactly once",
            ["read_cell shows the current source (the person may have changed it)", "include more context in old_text"],
        )
    # pycrdt counts text positions in UTF-8 bytes, not Python characters.
    offset = len(current[: current.index(old_text)].encode())
    with ycell.doc.transaction():
        del text[offset : offset + len(old_text.encode())]
        text.insert(offset, new_text)
    return one_cell_result(live, index, f"edited cell {index} of {live.path}")


@tool("Delete a cell from a notebook.", ToolAnnotations(destructive_hint=True))
async def delete_cell(
    notebook: Notebook, ctx: Context, cell_id: CellId = None, cell_index: CellIndex = None
) -> Annotated[CallToolResult, NotebookResponse]:
    live, index, ycell = await open_cell(bridge_of(ctx), notebook, cell_id, cell_index)
    gone = cell_info(index, cell_dict(ycell))
    live.model.ycells.pop(index)
    response = notebook_response(live, None, [gone], f"deleted cell {index} (id {gone.id}) of {live.path}")
    return model_result(response, f"{response.message}; it was:\n{cells_text([gone])}")


@tool("Move a cell to another position (its id, source and outputs go with it).")
async def move_cell(
    notebook: Notebook,
    to_index: Annotated[int, Field(description="the position it should have afterwards (0 first, -1 last)")],
    ctx: Context,
    cell_id: CellId = None,
    cell_index: CellIndex = None,
) -> Annotated[CallToolResult, NotebookResponse]:
    live, index, ycell = await open_cell(bridge_of(ctx), notebook, cell_id, cell_index)
    count = len(live.model.ycells)
    target = count - 1 if to_index == -1 else to_index
    if not 0 <= target < count:
        raise InvalidRequest(f"to_index={to_index} is out of range: {live.path} has {count} cells; use 0 to {count - 1}, or -1")
    cell = cell_dict(ycell)
    if target != index:
        with ycell.doc.transaction():  # one change for the person: the cell is gone and back in one update
            live.model.ycells.pop(index)
            live.model.ycells.insert(target, live.model.create_ycell(cell))
    return one_cell_result(live, target, f"moved cell {cell.get('id')} from {index} to {target}")


@tool("Clear a code cell's outputs and execution count.")
async def clear_cell_output(
    notebook: Notebook, ctx: Context, cell_id: CellId = None, cell_index: CellIndex = None
) -> Annotated[CallToolResult, NotebookResponse]:
    live, index, ycell = await open_cell(bridge_of(ctx), notebook, cell_id, cell_index)
    if ycell.get("cell_type") == "code":
        with ycell.doc.transaction():
            ycell["outputs"].clear()
            ycell["execution_count"] = None
    return one_cell_result(live, index, f"cleared the outputs of cell {index} of {live.path}")


async def run_cell(bridge: Bridge, live: LiveNotebook, index: int, timeout: float | None, ctx: Context) -> CallToolResult:
    ycell = live.model.ycells[index]
    if ycell.get("cell_type") != "code":
        raise InvalidRequest(f"cell {index} of {live.path} is a {ycell.get('cell_type')} cell; only code cells run")
    seconds = check_timeout(bridge.options, timeout)
    info = await notebook_kernel(bridge, live, start=True)
    assert info is not None
    execution = submit_cell(bridge, info, live.path, ycell, seconds)
    await bridge.wait(execution, ctx)
    return execution_result(execution)


@tool(
    lambda options: (
        "Run a code cell of a notebook in its sandboxed kernel, as the person pressing Shift+Enter would: the cell shows running, "
        "its output streams into the notebook, and it gets an execution count. After about "
        f"{options.running_after_seconds:g} s the call returns status 'running' and an execution_id (get_execution_output); "
        "the outputs keep landing in the notebook even if this client goes away."
    )
)
async def execute_cell(
    notebook: Notebook, ctx: Context, cell_id: CellId = None, cell_index: CellIndex = None, timeout: Timeout = None
) -> Annotated[CallToolResult, ExecutionResponse]:
    bridge = bridge_of(ctx)
    live, index, _ = await open_cell(bridge, notebook, cell_id, cell_index)
    return await run_cell(bridge, live, index, timeout, ctx)


@tool("Insert a code cell into a notebook and run it (insert_cell then execute_cell, in one call).")
async def insert_execute_code_cell(
    notebook: Notebook,
    source: Source,
    ctx: Context,
    index: Index = None,
    after_cell_id: AfterCellId = None,
    timeout: Timeout = None,
) -> Annotated[CallToolResult, ExecutionResponse]:
    bridge = bridge_of(ctx)
    live, position, _ = await insert_new_cell(bridge, notebook, source, "code", index, after_cell_id)
    return await run_cell(bridge, live, position, timeout, ctx)


@tool("List files and directories in the person's JupyterLab (its root, or a directory under it).", ToolAnnotations(read_only_hint=True))
async def list_files(
    ctx: Context, path: Annotated[str, Field(description="a directory relative to Lab's root; '' for the root")] = ""
) -> Annotated[CallToolResult, FileListResponse]:
    documents = documents_of(bridge_of(ctx))
    entries = [
        FileEntry(name=e["name"], path=e["path"], type=e["type"], size=e.get("size"), last_modified=e.get("last_modified"))
        for e in await documents.lab.list_files(path)
    ]
    response = FileListResponse(path=path, entries=entries)
    text = "\n".join(f"{e.path}{'/' if e.type == 'directory' else ''}" for e in entries)
    return model_result(response, text or f"{path or '/'} is empty")


@tool(
    "List the kernels (sessions) with the notebook each one serves, by its path in JupyterLab: get_sessions for notebook work.",
    ToolAnnotations(read_only_hint=True),
)
async def list_kernels(ctx: Context) -> Annotated[CallToolResult, SessionListResponse]:
    bridge = bridge_of(ctx)
    infos = await bridge.sessions.list()
    documents = None
    with contextlib.suppress(MsbError):  # no Lab for this caller: the gateway's own notebook paths stand
        documents = documents_of(bridge)
    if documents is not None:  # the notebook as Lab names it, which the notebook tools take
        paths = {s["kernel"]["id"]: s["path"] for s in await documents.lab.sessions() if s.get("kernel") and s.get("path")}
        for info in infos:
            info.notebook_path = paths.get(info.id, info.notebook_path)
    return sessions_result(bridge, infos)
