"""Running a notebook cell: the supervisor's Execution, whose kernel messages also land in the cell.

The run is a task of the process that holds the kernel's connection (the gateway, for its
/mcp), not of the MCP request: a client that disconnects or times out mid-cell stops
waiting, while the outputs go on arriving in the notebook; get_execution_output finds the
run again by its execution_id.
"""

from __future__ import annotations

import logging

from pycrdt import Map

from mcp_bridge.executions import Execution
from mcp_bridge.notebooks.cells import CellWriter
from mcp_bridge.sessions import SessionInfo
from mcp_bridge.supervisor import Bridge

log = logging.getLogger("mcp_bridge.notebooks")


class CellExecution(Execution):
    """An Execution that writes what the kernel sends into its notebook cell, as JupyterLab does for a person."""

    def __init__(self, *, notebook: str, cell_id: str, writer: CellWriter, **kwargs):
        super().__init__(**kwargs)
        self.notebook = notebook
        self.cell_id = cell_id
        self.writer = writer

    def handle(self, channel: str, message: dict) -> None:
        super().handle(channel, message)
        if channel == "iopub":
            self._write(self.writer.handle, message)

    def decide(self) -> None:
        super().decide()
        self._write(self.writer.finish, (self.reply or {}).get("execution_count"))

    def _write(self, step, *args) -> None:
        try:
            step(*args)
        except Exception as exc:  # the person deleted the cell, or the document closed: the run itself goes on
            log.warning("could not write to cell %s of %s: %r", self.cell_id, self.notebook, exc)


def submit_cell(bridge: Bridge, info: SessionInfo, notebook: str, ycell: Map, timeout: float) -> CellExecution:
    """Start running a code cell's current source in the notebook's kernel; the cell shows it running at once."""
    writer = CellWriter(ycell)
    execution = CellExecution(
        notebook=notebook,
        cell_id=str(ycell.get("id")),
        writer=writer,
        session_id=info.id,
        language=info.language or "python",
        flavor=info.flavor,
        kind="code",
        timeout=timeout,
        max_output_chars=bridge.options.max_output_chars,
    )
    writer.begin()
    bridge.submit(info, execution, str(ycell["source"]), silent=False, store_history=True)
    return execution
