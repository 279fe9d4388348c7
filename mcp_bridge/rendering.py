"""Turning what a tool found into a CallToolResult: text for the model, structured content for apps.

Every failure becomes an ``isError`` result whose structured content carries
``error: {type, message, suggestions}`` and still fits the tool's outputSchema (see
models.ToolResult); images come back as image content.
"""

from __future__ import annotations

from typing import Any

from mcp_types import CallToolResult, ImageContent, TextContent
from pydantic import ValidationError

from mcp_bridge.executions import Execution
from mcp_bridge.models import ErrorInfo, ExecutionResponse, RichOutput, ToolResult
from msb_kernels.errors import InvalidRequest, MsbError

FALLBACK_SUGGESTIONS = {
    "InvalidRequest": "check the arguments against the tool's input schema (tools/list); list_flavors and list_languages give the accepted values",
    "SystemError": "try again; if it keeps failing, check the host with `msb-kernels doctor`",
}


def error_info(error: MsbError) -> dict:
    info = error.to_dict()
    if not info["suggestions"]:
        info["suggestions"] = [FALLBACK_SUGGESTIONS.get(info["type"], "try again")]
    return info


def error_result(error: MsbError) -> CallToolResult:
    """A failure with nothing else to report: the text for the model, ``{"error": ...}`` for apps."""
    info = ErrorInfo(**error_info(error))
    lines = [f"{info.type}: {info.message}", *(f"- {suggestion}" for suggestion in info.suggestions)]
    return CallToolResult(
        content=[TextContent(type="text", text="\n".join(lines))],
        structured_content=ToolResult(error=info).model_dump(mode="json"),
        is_error=True,
    )


def model_result(model: ToolResult, text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=model.model_dump(mode="json"))


def validation_error(tool: str, exc: ValidationError) -> InvalidRequest:
    """pydantic's complaint about a tool's arguments, as an InvalidRequest naming each argument."""
    problems = []
    for err in exc.errors():
        name = ".".join(str(part) for part in err.get("loc", ())) or "arguments"
        if err.get("type") == "missing":
            problems.append(f"argument {name!r} is required")
            continue
        expected = err.get("msg", "is invalid").replace("Input should be", "must be")
        given = err.get("input")
        shown = repr(given) if len(repr(given)) <= 60 else repr(given)[:57] + "..."
        problems.append(f"argument {name!r} {expected} (got {type(given).__name__} {shown})")
    return InvalidRequest(f"{tool}: " + "; ".join(problems), suggestions=[f"see the input schema of {tool} (tools/list)"])


def execution_result(execution: Execution, since: int = 0) -> CallToolResult:
    """An execution as it stands now (finished or still running), output from offset ``since`` on."""
    running = not execution.done.is_set()
    stdout, stderr = execution.output.read(since)
    status = "running" if running else execution.status
    error = error_info(execution.error) if (execution.error and not running) else None
    response = ExecutionResponse(
        session_id=execution.session_id,
        execution_id=execution.id,
        language=execution.language,
        flavor=execution.flavor,
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=None if running else execution.exit_code,
        execution_time_ms=execution.execution_time_ms,
        session_created=execution.session_created,
        results=[RichOutput(**r) for r in execution.results],
        error=ErrorInfo(**error) if error else None,
        truncated=execution.output.truncated,
        output_offset=execution.output.size,
        notebook=execution.notebook,
        cell_id=execution.cell_id,
        execution_count=(execution.reply or {}).get("execution_count") if execution.notebook else None,
    )
    content: list[Any] = [TextContent(type="text", text=execution_text(execution, response))]
    for result in execution.results:
        for mime in ("image/png", "image/jpeg"):
            if mime in result["data"]:
                content.append(ImageContent(type="image", data=str(result["data"][mime]).strip(), mime_type=mime))
    return CallToolResult(content=content, structured_content=response.model_dump(mode="json"), is_error=status in ("error", "timeout"))


def execution_text(execution: Execution, response: ExecutionResponse) -> str:
    """What the model reads: status, how to get the rest of a long run, output, rich results, the error."""
    what = "command" if execution.kind == "command" else "code"
    head = [
        f"status: {response.status}",
        f"session_id: {response.session_id} ({response.language}, {response.flavor})"
        + (" [new session]" if response.session_created else ""),
    ]
    if response.notebook:
        head.append(f"notebook: {response.notebook}, cell_id: {response.cell_id}, execution_count: {response.execution_count}")
    if response.status == "running":
        head.append(f"execution_id: {response.execution_id}")
        head.append(
            f"the {what} is still running after {execution.elapsed:.0f} s; the kernel keeps running it. "
            f"Call get_execution_output(session_id={response.session_id!r}, execution_id={response.execution_id!r}, "
            f"since={response.output_offset}) for the rest."
        )
    else:
        head.append(f"execution_time_ms: {response.execution_time_ms}")
    if response.exit_code is not None:
        head.append(f"exit_code: {response.exit_code}")
    parts = ["\n".join(head)]
    if response.stdout:
        parts.append("--- stdout ---\n" + response.stdout.rstrip("\n"))
    if response.stderr:
        parts.append("--- stderr ---\n" + response.stderr.rstrip("\n"))
    if response.truncated:
        parts.append(execution.output.note())
    for result in execution.results:
        data = result["data"]
        if "text/plain" in data and not any(m.startswith("image/") for m in data):
            label = "result" if result["output_type"] == "execute_result" else "display"
            parts.append(f"--- {label} ---\n{data['text/plain']}")
        elif any(m.startswith("image/") for m in data):
            parts.append("--- image --- (attached)")
    if execution.results_dropped:
        parts.append(f"[{execution.results_dropped} more rich outputs were dropped (too many or too large)]")
    if response.error:
        parts.append(f"error: {response.error.type}: {response.error.message}" + "".join(f"\n- {s}" for s in response.error.suggestions))
    return "\n\n".join(parts)
