"""The structured content of the MCP tools' results: one pydantic model per answer, all on ToolResult.

Every model's JSON schema is a tool's outputSchema (tools/list), so a field added here is a
field every client sees; tests/mcp_bridge/test_schemas.py checks results against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from msb_kernels.errors import error_types


class ErrorInfo(BaseModel):
    type: str = Field(description="the error class", json_schema_extra={"enum": error_types()})
    message: str
    suggestions: list[str] = Field([], description="what to do next")


def _success_or_error(schema: dict[str, Any]) -> None:
    """Advertise either the success fields, as required as the model makes them, or an error alone.

    TypeScript clients check structured content against outputSchema even on isError results,
    so an error that comes before there is anything else to report (an unknown session, a bad
    argument) must fit the schema too, without loosening what a success promises.
    """
    required = schema.pop("required", [])
    schema["anyOf"] = [{"required": required}, {"required": ["error"], "properties": {"error": {"type": "object"}}}]


class ToolResult(BaseModel):
    """The structured content of every tool: its fields on success, or at least `error` on failure."""

    model_config = ConfigDict(json_schema_extra=_success_or_error)

    error: ErrorInfo | None = Field(None, description="set on isError results; null on success")


class RichOutput(BaseModel):
    output_type: str = Field(description="execute_result or display_data")
    data: dict[str, Any] = Field(description="MIME type -> value (images base64)")


class ExecutionResponse(ToolResult):
    session_id: str
    execution_id: str
    language: str
    flavor: str | None = None
    status: Literal["ok", "error", "timeout", "running"]
    stdout: str
    stderr: str
    exit_code: int | None = Field(None, description="exit status of execute_command; None for code")
    execution_time_ms: int
    session_created: bool
    results: list[RichOutput] = []
    truncated: bool = False
    output_offset: int = Field(0, description="pass as `since` to get_execution_output to get only newer output")
    notebook: str | None = Field(None, description="notebook tools: the notebook whose cell ran")
    cell_id: str | None = Field(None, description="notebook tools: the id of the cell that ran (its outputs are in the notebook)")
    execution_count: int | None = Field(None, description="notebook tools: the cell's execution count, as the person sees it")


class SessionSummary(BaseModel):
    id: str
    language: str
    flavor: str
    status: str
    created_at: str | None
    last_accessed: str | None
    uptime_seconds: int
    kernel_name: str | None = None
    notebook_path: str | None = None
    started_by: str = "other"
    sandboxed: bool = True
    network: str | None = Field(None, description="its way out: none, public internet, or allow-list: the hosts it may reach")
    environment: str | None = Field(
        None, description="the Python environment its kernel runs (list_environments); default: the server's own"
    )


class SessionListResponse(ToolResult):
    sessions: list[SessionSummary]


class StopSessionResponse(ToolResult):
    session_id: str
    success: bool
    message: str | None = None


class FileResponse(ToolResult):
    session_id: str
    path: str = Field(description="the file's absolute path inside the sandbox")
    size: int = Field(description="bytes")
    sha256: str = Field(description="of the file's bytes, as the sandbox read them")
    encoding: Literal["text", "base64"] | None = Field(None, description="download_file: how content is written")
    content: str | None = Field(None, description="download_file: the file, as UTF-8 text or base64")


class VolumePathResponse(ToolResult):
    volume_path: str
    description: str
    available: bool


class FlavorInfo(BaseModel):
    name: str
    cpus: int
    memory_mib: int
    disk_mib: int
    description: str
    default: bool


class LanguageInfo(BaseModel):
    name: str
    aliases: list[str]
    available: bool
    reason: str | None = None


class ChoicesResponse(ToolResult):
    flavors: list[FlavorInfo]
    languages: list[LanguageInfo]


class EnvironmentInfo(BaseModel):
    name: str = Field(description="pass it as environment to start_session or execute_code")
    python_version: str
    packages: list[str] = Field(description="its main packages, 'name version', without the kernel's own")
    default: bool = Field(description="the environment a session gets when it names none")
    description: str


class EnvironmentsResponse(ToolResult):
    environments: list[EnvironmentInfo]


class CellInfo(BaseModel):
    index: int = Field(description="position now; it shifts when cells are added above, the id does not")
    id: str = Field(description="the cell id (stable); pass it as cell_id")
    cell_type: Literal["code", "markdown", "raw"]
    source: str
    execution_count: int | None = None
    execution_state: str | None = Field(None, description="running or idle (code cells)")
    outputs: str | None = Field(None, description="the outputs as text (code cells; images named, not inlined)")


class NotebookResponse(ToolResult):
    notebook: str = Field(description="the path in JupyterLab; name it in every notebook call")
    session_id: str | None = Field(None, description="the notebook's kernel (a session id of the other tools)")
    kernel_name: str | None = None
    cell_count: int
    cells: list[CellInfo] = []
    message: str | None = None


class NotebookSummary(BaseModel):
    notebook: str
    session_id: str | None
    kernel_name: str | None
    joined: bool = Field(description="this MCP server is connected to its live document")


class NotebookListResponse(ToolResult):
    notebooks: list[NotebookSummary]


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["directory", "file", "notebook"]
    size: int | None = None
    last_modified: str | None = None


class FileListResponse(ToolResult):
    path: str
    entries: list[FileEntry]
