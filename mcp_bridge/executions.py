"""One execute request on a kernel: its output (bounded), its outcome, its error class.

An :class:`Execution` is fed the kernel's messages for its request (iopub and the
shell reply) and turns them into what the tools return (models.ExecutionResponse):
stdout and stderr in order, rich results, status and an error from msb_kernels.errors.
"""

from __future__ import annotations

import asyncio
import bisect
import re
import time
import uuid
from typing import Any

from msb_kernels.errors import (
    CodeRuntimeError,
    CompilationError,
    ExecutionTimeout,
    MsbError,
    SandboxError,
)
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.kernelspecs.templates import ErrorKind, get_template, strip_ansi

KEPT_MIME_TYPES = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/svg+xml", "application/json")
MAX_RICH_OUTPUTS = 20


class OutputLog:
    """stdout and stderr in arrival order, at most ``cap`` characters; the rest is counted, not kept."""

    def __init__(self, cap: int):
        self.cap = cap
        self.events: list[tuple[int, str, str]] = []  # (offset, stream name, text)
        self.offsets: list[int] = []
        self.size = 0
        self.dropped = 0
        self.latest_line = ""
        self.version = 0

    def append(self, name: str, text: str) -> None:
        if not text:
            return
        self.version += 1
        for line in reversed(re.split(r"[\r\n]", text)):
            if line.strip():
                self.latest_line = strip_ansi(line.strip())[:200]
                break
        room = self.cap - self.size
        if room <= 0:
            self.dropped += len(text)
            return
        kept = text[:room]
        self.dropped += len(text) - len(kept)
        self.events.append((self.size, name, kept))
        self.offsets.append(self.size)
        self.size += len(kept)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def read(self, since: int = 0) -> tuple[str, str]:
        """stdout and stderr from character offset ``since`` (of both streams together) on."""
        since = max(0, since)
        stdout: list[str] = []
        stderr: list[str] = []
        start = max(0, bisect.bisect_right(self.offsets, since) - 1)
        for offset, name, text in self.events[start:]:
            if offset + len(text) <= since:
                continue
            piece = text[max(0, since - offset) :]
            (stdout if name == "stdout" else stderr).append(piece)
        return "".join(stdout), "".join(stderr)

    def note(self) -> str:
        return (
            f"[output truncated: the first {self.cap} characters are shown, {self.dropped} more were dropped "
            f"(MSB_MCP_MAX_OUTPUT_CHARS); write large output to a file instead]"
        )


class Execution:
    """An execute request sent on behalf of a tool call, and everything that came back for it."""

    def __init__(
        self,
        *,
        session_id: str,
        language: str,
        flavor: str | None,
        kind: str,
        timeout: float,
        max_output_chars: int,
        session_created: bool = False,
        marker: str | None = None,
    ):
        self.id = uuid.uuid4().hex[:12]
        self.session_id = session_id
        self.language = language  # "python" or "node"
        self.flavor = flavor
        self.kind = kind  # "code" or "command"
        self.timeout = timeout
        self.session_created = session_created
        self.marker = re.compile(re.escape(marker) + r":(-?\d+)\n?") if marker else None
        self.output = OutputLog(max_output_chars)
        self.results: list[dict[str, Any]] = []
        self.results_dropped = 0
        self.rich_budget = 4 * max_output_chars
        self.status = "queued"  # queued, running, ok, error, timeout
        self.error: MsbError | None = None
        self.exit_code: int | None = None
        self.reply: dict | None = None
        self.kernel_error: dict | None = None
        self.idle = False
        self.timed_out = False
        self.interrupted_by_request = False  # interrupt_session, not a timeout
        self.restarted_by_request = False  # restart_session, not a death
        self.died = False  # the kernel died while this ran, and its answer says so
        self.submitted = time.monotonic()
        self.started: float | None = None  # when the request was sent
        self.kernel_began: float | None = None  # when the kernel started on it (it may finish someone else's cell first)
        self.finished: float | None = None
        self.complete = asyncio.Event()  # reply and idle both seen
        self.done = asyncio.Event()  # outcome decided
        self.task: asyncio.Task | None = None
        self.notebook: str | None = None  # set for a notebook cell's run (mcp_bridge.notebooks.runs)
        self.cell_id: str | None = None

    # -- timing -------------------------------------------------------------------

    def start(self) -> None:
        self.started = time.monotonic()
        self.status = "running"

    @property
    def execution_time_ms(self) -> int:
        if self.started is None:
            return 0
        return int(((self.finished or time.monotonic()) - self.started) * 1000)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.submitted

    # -- kernel messages --------------------------------------------------------------

    def handle(self, channel: str, message: dict) -> None:
        msg_type = message.get("msg_type") or message.get("header", {}).get("msg_type")
        content = message.get("content") or {}
        if channel == "shell":
            if msg_type == "execute_reply":
                self.reply = content
                self._check_complete()
            return
        if msg_type == "stream":
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            text = content.get("text", "")
            if self.marker is not None and name == "stdout":
                found = self.marker.search(text)
                if found:
                    self.exit_code = int(found.group(1))
                    text = text[: found.start()] + text[found.end() :]
            self.output.append(name, text)
        elif msg_type in ("execute_result", "display_data"):
            self._add_rich(msg_type, content.get("data") or {})
        elif msg_type == "error":
            self.kernel_error = content
            traceback = strip_ansi("\n".join(content.get("traceback") or []))
            if not traceback:
                traceback = f"{content.get('ename', 'Error')}: {content.get('evalue', '')}"
            self.output.append("stderr", traceback.rstrip("\n") + "\n")
        elif msg_type == "status":
            if content.get("execution_state") == "busy" and self.kernel_began is None:
                self.kernel_began = time.monotonic()
            if content.get("execution_state") == "idle":
                self.idle = True
                self._check_complete()

    def _check_complete(self) -> None:
        if self.reply is not None and self.idle:
            self.complete.set()

    def _add_rich(self, output_type: str, data: dict) -> None:
        kept = {mime: value for mime, value in data.items() if mime in KEPT_MIME_TYPES}
        if not kept:
            return
        size = sum(len(str(value)) for value in kept.values())
        if len(self.results) >= MAX_RICH_OUTPUTS or size > self.rich_budget:
            self.results_dropped += 1
            return
        self.rich_budget -= size
        self.results.append({"output_type": output_type, "data": kept})

    # -- outcome ------------------------------------------------------------------------

    def fail(self, error: MsbError) -> None:
        if self.error is None:
            self.error = error

    def decide(self) -> None:
        """Set status and error from what came back; called once, when the request is over."""
        self.finished = time.monotonic()
        if self.error is not None:
            self.status = "timeout" if isinstance(self.error, ExecutionTimeout) else "error"
            return
        if self.timed_out:
            self.status = "timeout"
            what = "command" if self.kind == "command" else "execution"
            self.error = ExecutionTimeout(
                f"the {what} ran past its timeout of {self.timeout:g} s, so the kernel was interrupted "
                "(not restarted): the session and the variables defined before are kept"
            )
            return
        reply = self.reply or {}
        status = reply.get("status", "ok")
        if status == "ok":
            if self.kind == "command" and self.exit_code is None:
                self.exit_code = -1
                self.status = "error"
                self.error = SandboxError("the command runner stopped before it reported an exit status")
            elif self.kind == "command" and self.exit_code != 0:
                self.status = "error"
                self.error = CodeRuntimeError(
                    f"the command exited with status {self.exit_code}",
                    suggestions=["read stderr for the reason", "exit status 127 means the command was not found in the sandbox"],
                )
            else:
                self.status = "ok"
            return
        self.status = "error"
        if status == "abort":
            self.error = SandboxError("the kernel aborted this request (it was still recovering from an earlier error); run it again")
            return
        self.error = self._classify(reply)

    def _classify(self, reply: dict) -> MsbError:
        if self.interrupted_by_request:
            return CodeRuntimeError(
                "the execution was interrupted (interrupt_session); the session keeps its state",
                suggestions=["run the code again, or a shorter piece of it"],
            )
        _, stderr = self.output.read()
        error = get_template(self.language).error_of(self.kernel_error or reply, stderr)
        if error.kind is ErrorKind.COMPILE:
            return CompilationError(error.message)
        if error.kind is ErrorKind.INTERRUPT:
            return CodeRuntimeError("the execution was interrupted; the session keeps its state")
        runtime_error = CodeRuntimeError(error.message)
        if error.kind is ErrorKind.OUT_OF_MEMORY and self.flavor in FLAVORS:
            runtime_error.suggestions.append(FLAVORS[self.flavor].out_of_memory_message())
        return runtime_error
