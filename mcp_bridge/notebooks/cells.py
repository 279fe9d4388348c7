"""Cells of a live notebook: finding one by id or index, describing it, and writing a run's outputs into it.

A cell id (nbformat 4.5) names the same cell wherever it moves, so a person inserting a cell
above does not shift what an assistant edits; an index is taken as it is at the moment of
the call. Outputs are written the way JupyterLab's own model holds them (jupyter_ydoc): a
stream is a Y text that grows as the kernel prints, other outputs are maps.
"""

from __future__ import annotations

import uuid
from typing import Any

from pycrdt import Array, Map, Text

from mcp_bridge.notebooks.documents import LiveNotebook
from msb_kernels.errors import InvalidRequest
from msb_kernels.kernelspecs.templates import strip_ansi

CELL_TYPES = ("code", "markdown", "raw")


def new_cell_id() -> str:
    return uuid.uuid4().hex[:16]


def find_cell(notebook: LiveNotebook, cell_id: str | None, cell_index: int | None) -> tuple[int, Map]:
    """(index, Y cell) of the cell named by exactly one of ``cell_id`` and ``cell_index``."""
    cells = notebook.model.ycells
    if (cell_id is None) == (cell_index is None):
        raise InvalidRequest(
            "name the cell by exactly one of cell_id and cell_index",
            ["cell_id is stable while others edit; read_notebook lists the ids"],
        )
    if cell_id is not None:
        for index, ycell in enumerate(cells):
            if ycell.get("id") == cell_id:
                return index, ycell
        raise InvalidRequest(
            f"notebook {notebook.path} has no cell with id {cell_id!r} (it may have been deleted)",
            ["read_notebook lists the cells and their ids"],
        )
    assert cell_index is not None
    count = len(cells)
    if not -count <= cell_index < count:
        raise InvalidRequest(
            f"cell_index={cell_index} is out of range: notebook {notebook.path} has {count} cells (0 to {count - 1})",
            ["read_notebook lists the cells"],
        )
    index = cell_index % count
    return index, cells[index]


def insertion_index(notebook: LiveNotebook, index: int | None, after_cell_id: str | None) -> int:
    count = len(notebook.model.ycells)
    if index is not None and after_cell_id is not None:
        raise InvalidRequest("give index or after_cell_id, not both", ["after_cell_id stays right while others insert cells"])
    if after_cell_id is not None:
        return find_cell(notebook, after_cell_id, None)[0] + 1
    if index is None or index == -1:
        return count
    if not 0 <= index <= count:
        raise InvalidRequest(
            f"index={index} is out of range: notebook {notebook.path} has {count} cells; use 0 to {count}, or -1 for the end"
        )
    return index


def make_cell(cell_type: str, source: str, cell_id: str | None = None, metadata: dict | None = None) -> dict[str, Any]:
    if cell_type not in CELL_TYPES:
        raise InvalidRequest(f"cell_type={cell_type!r} is not one of: {', '.join(CELL_TYPES)}")
    cell: dict[str, Any] = {"id": cell_id or new_cell_id(), "cell_type": cell_type, "source": source, "metadata": metadata or {}}
    if cell_type == "code":
        cell.update(outputs=[], execution_count=None)
    return cell


def cell_dict(ycell: Map) -> dict[str, Any]:
    cell = ycell.to_py() or {}
    if isinstance(cell.get("execution_count"), float):
        cell["execution_count"] = int(cell["execution_count"])
    return cell


def outputs_text(outputs: list[dict[str, Any]], limit: int = 4000) -> str:
    """The outputs as a model reads them: streams, plain text of results, error tracebacks; images named, not inlined."""
    parts = []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            text = output.get("text", "")
            parts.append("".join(text) if isinstance(text, list) else str(text))
        elif kind in ("execute_result", "display_data"):
            data = output.get("data") or {}
            images = [mime for mime in data if mime.startswith("image/")]
            if "text/plain" in data and not images:
                value = data["text/plain"]
                parts.append(("".join(value) if isinstance(value, list) else str(value)).rstrip("\n") + "\n")
            elif images:
                parts.append(f"[{images[0]} image]\n")
        elif kind == "error":
            parts.append(strip_ansi("\n".join(output.get("traceback") or [f"{output.get('ename')}: {output.get('evalue')}"])) + "\n")
    text = "".join(parts)
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


class CellWriter:
    """Writes one execution's kernel messages into its cell, as JupyterLab would for a person's run."""

    def __init__(self, ycell: Map):
        self.ycell = ycell
        self.clear_on_next = False
        self.display_ids: dict[str, list[Map]] = {}

    def begin(self) -> None:
        with self.ycell.doc.transaction():
            self._outputs().clear()
            self.ycell["execution_count"] = None
            self.ycell["execution_state"] = "running"

    def finish(self, execution_count: int | None) -> None:
        with self.ycell.doc.transaction():
            if execution_count is not None:
                self.ycell["execution_count"] = execution_count
            self.ycell["execution_state"] = "idle"

    def _outputs(self) -> Array:
        outputs = self.ycell.get("outputs")
        if not isinstance(outputs, Array):
            outputs = self.ycell["outputs"] = Array()
        return outputs

    def handle(self, message: dict) -> None:
        msg_type = message.get("msg_type") or message.get("header", {}).get("msg_type")
        content = message.get("content") or {}
        if msg_type == "clear_output":
            if content.get("wait"):
                self.clear_on_next = True
            else:
                self._outputs().clear()
            return
        if msg_type not in ("stream", "execute_result", "display_data", "error", "update_display_data"):
            return
        with self.ycell.doc.transaction():
            if self.clear_on_next and msg_type != "update_display_data":
                self._outputs().clear()
                self.clear_on_next = False
            if msg_type == "update_display_data":
                display_id = (content.get("transient") or {}).get("display_id")
                for output in self.display_ids.get(display_id or "", []):
                    output["data"] = content.get("data") or {}
                    output["metadata"] = content.get("metadata") or {}
            elif msg_type == "stream":
                self._stream(content.get("name", "stdout"), content.get("text", ""))
            elif msg_type == "error":
                self._outputs().append(
                    Map(
                        {
                            "output_type": "error",
                            "ename": content.get("ename", ""),
                            "evalue": content.get("evalue", ""),
                            "traceback": content.get("traceback") or [],
                        }
                    )
                )
            else:
                output: dict[str, Any] = {
                    "output_type": msg_type,
                    "data": content.get("data") or {},
                    "metadata": content.get("metadata") or {},
                }
                if msg_type == "execute_result":
                    output["execution_count"] = content.get("execution_count")
                youtput = Map(output)
                self._outputs().append(youtput)
                display_id = (content.get("transient") or {}).get("display_id")
                if display_id:
                    self.display_ids.setdefault(display_id, []).append(youtput)

    def _stream(self, name: str, text: str) -> None:
        outputs = self._outputs()
        if len(outputs):
            last = outputs[len(outputs) - 1]
            if isinstance(last, Map) and last.get("output_type") == "stream" and last.get("name") == name:
                ytext = last.get("text")
                if isinstance(ytext, Text):
                    ytext += text  # a Y text insert at the end: the browser sees the line appear
                    return
        outputs.append(Map({"output_type": "stream", "name": name, "text": Text(text)}))
