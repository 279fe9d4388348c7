"""Running executions: one at a time per session, in order, watched until their output is all in.

The Bridge is what the tools share (mcp_bridge.tools reaches it through ``server.bridge``):
the kernel sessions, the settings, and per session the executions it ran lately, so that
get_execution_output finds a long run again and interrupt/restart know what they cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult

from mcp_bridge.executions import Execution
from mcp_bridge.notebooks.documents import NotebookDocuments
from mcp_bridge.notebooks.hub import PersonalLabs
from mcp_bridge.options import BridgeOptions
from mcp_bridge.rendering import execution_result
from mcp_bridge.sessions import KernelConnection, KernelSessions, Runs, SessionInfo
from msb_kernels.errors import MsbError, SandboxError
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.kernelspecs.templates import get_template
from msb_kernels.settings.config import MsbSettings

log = logging.getLogger("mcp_bridge")

# How long the output of a request may trail its reply before the result says it may be incomplete.
OUTPUT_AFTER_REPLY_SECONDS = 60.0


class Bridge:
    """What the tools share: the sessions, the settings, and each session's recent executions."""

    def __init__(self, sessions: KernelSessions, settings: MsbSettings, options: BridgeOptions):
        self.sessions = sessions
        self.settings = settings
        self.options = options
        self.tasks: set[asyncio.Task] = set()
        self.notebooks: NotebookDocuments | None = None  # the notebook tools' documents, when MSB_LAB_URL is set
        self.personal_labs: PersonalLabs | None = None  # under JupyterHub: each caller's own server instead

    def sizes(self) -> dict[str, int]:
        """How much the bridge holds now, per structure (the gateway's metrics, and its memory soak)."""
        records = list(self.sessions.records.values())
        return {
            "kernel_records": len(records),
            "executions": sum(len(record.runs.executions) for record in records if record.runs is not None),
            "tasks": len(self.tasks),
            "connections": len(self.sessions.connections()),
        }

    def runs_of(self, session_id: str) -> Runs | None:
        """The kernel's executions, if it has had any through this bridge."""
        record = self.sessions.records.get(session_id)
        return record.runs if record is not None else None

    def runs(self, session_id: str) -> Runs:
        record = self.sessions.record(session_id)
        if record.runs is None:
            record.runs = Runs(self.options.kept_executions)
        return record.runs

    def running_executions(self, session_id: str) -> list[Execution]:
        """This session's executions that the kernel is working on now (for interrupt and restart)."""
        runs = self.runs_of(session_id)
        return runs.running() if runs is not None else []

    def submit(self, info: SessionInfo, execution: Execution, code: str, silent: bool, store_history: bool | None = None) -> None:
        self.sessions.touch(info.id)
        self.runs(info.id).add(execution)
        # A kernel this server did not start is a notebook user's (or another client's): the assistant's
        # runs leave its execution counter and input history (In, %history) to that user, unless the run is
        # a cell of that user's notebook, which counts as a person's run would.
        if store_history is None:
            store_history = not silent and info.started_by == "mcp"
        task = asyncio.create_task(self._run(execution, code, silent, store_history))
        execution.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, execution: Execution, code: str, silent: bool, store_history: bool) -> None:
        runs = self.runs(execution.session_id)
        try:
            async with runs.lock:
                connection = await self.sessions.connection(execution.session_id)
                reason = await connection.death_reason()
                if reason and runs.death_told:
                    # Told already: this call runs in the fresh kernel. A new connection waits for the restarter to
                    # start it (KernelSessions.connection), as it waits for any start under way.
                    await self.sessions.drop_connection(execution.session_id)
                    connection = await self.sessions.connection(execution.session_id)
                    reason = await connection.death_reason()
                elif reason and await self.sessions.restarted_after_death(execution.session_id):
                    reason = await connection.death_reason()  # now with its fresh kernel: the session is not lost
                if reason:
                    # Died since the last call (and perhaps restarted): say so once, instead of running the
                    # code in a fresh kernel that lacks the state it expects.
                    await self.sessions.drop_connection(execution.session_id)
                    runs.death_told = True
                    raise self._death_error(execution, reason, ran=False)
                runs.death_told = False
                execution.start()
                msg_id = await connection.execute(code, execution.handle, silent=silent, store_history=store_history)
                try:
                    await self._supervise(execution, connection)
                finally:
                    connection.unlisten(msg_id)
                if execution.error is None and (reason := await connection.death_reason()):
                    # A request sent to a dying kernel can be answered by its restarted successor.
                    await self.sessions.drop_connection(execution.session_id)
                    execution.fail(self._death_error(execution, reason, ran=True))
                    execution.died = True
                if execution.died:
                    runs.death_told = True
                if (execution.reply or {}).get("status") != "ok" and (pause := get_template(execution.language).pause_after_error_seconds):
                    await asyncio.sleep(pause)
        except MsbError as exc:
            execution.fail(exc)
        except asyncio.CancelledError:
            execution.fail(SandboxError("the MCP bridge shut down while this ran"))
            raise
        except Exception as exc:
            log.error("execution %s failed: %r", execution.id, exc)
            execution.fail(SandboxError(f"the execution failed inside the MCP bridge: {type(exc).__name__}: {exc}"))
        finally:
            execution.decide()
            self.sessions.touch(execution.session_id)
            execution.done.set()

    async def _supervise(self, execution: Execution, connection: KernelConnection) -> None:
        given_up_at = None
        replied_at = None
        while not execution.complete.is_set():
            now = time.monotonic()
            if execution.reply is not None:
                # Only the request's idle status says that all its output was sent: on a busy host iopub
                # lags the shell reply by seconds, so the reply alone would cut the output short.
                replied_at = replied_at or now
                if now >= replied_at + OUTPUT_AFTER_REPLY_SECONDS:
                    execution.fail(
                        SandboxError(
                            f"the kernel finished this request, but its output did not finish arriving within {OUTPUT_AFTER_REPLY_SECONDS:g} s "
                            "of its reply; the output shown may be incomplete",
                            suggestions=[
                                "run the code again; the session keeps its state",
                                "check the host's load with `msb-kernels doctor`",
                            ],
                        )
                    )
                    return
            # The timeout runs from when the kernel began this request: a shared kernel may first
            # finish a notebook user's cell, which an interrupt must not hit.
            began = execution.kernel_began
            if execution.reply is None and not execution.timed_out and began is not None and now >= began + execution.timeout:
                execution.timed_out = True
                given_up_at = now + 15
                with contextlib.suppress(MsbError):
                    await self.sessions.interrupt(execution.session_id)
            if given_up_at is not None and execution.reply is None and now >= given_up_at:
                execution.fail(
                    SandboxError(
                        f"the execution ran past its timeout of {execution.timeout:g} s and the kernel did not stop when interrupted; it is still busy",
                        suggestions=["restart_session (this loses the session's state)", "stop_session and start a new one"],
                    )
                )
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(execution.complete.wait(), 1.0)
            if execution.complete.is_set():
                return
            reason = await connection.death_reason()
            if reason:
                if await self.sessions.restarted_after_death(execution.session_id):
                    reason = await connection.death_reason()  # and its fresh kernel is there: say so, not "restart it"
                execution.fail(self._death_error(execution, reason, ran=True))
                execution.died = True
                return

    @classmethod
    def _death_error(cls, execution: Execution, reason: str, *, ran: bool) -> SandboxError:
        if execution.restarted_by_request:
            return SandboxError(
                f"session {execution.session_id} was restarted (restart_session) while this ran; the output "
                "shown is what arrived before. Its state (variables, imports, definitions) is gone",
                suggestions=["the session already has a fresh kernel: run the code that set up its state again"],
            )
        what = "while this ran; the output shown is what arrived before it died" if ran else "since the last call, so this code was not run"
        return SandboxError(
            f"the kernel of session {execution.session_id} died {what}: {reason}. Its state (variables, imports, definitions) is gone",
            suggestions=cls._death_suggestions(execution, reason),
        )

    @staticmethod
    def _death_suggestions(execution: Execution, reason: str) -> list[str]:
        suggestions = []
        if "out of memory" in reason:
            flavor = FLAVORS.get(execution.flavor or "")
            larger = flavor.next_larger() if flavor else None
            if larger:
                suggestions.append(f"omit session_id and pass flavor={larger.name!r} to get a session with more memory")
            suggestions.append("use less memory (process data in chunks)")
        if "restarted" in reason:
            suggestions.append("the session already has a fresh kernel: run the code that set up its state again")
        else:
            suggestions.append("restart_session to get a fresh kernel in this session (its state is lost)")
        return suggestions

    async def wait(self, execution: Execution, ctx: Context | None) -> None:
        """Wait for the execution, up to the "running" threshold, sending progress as output comes."""
        end = time.monotonic() + self.options.running_after_seconds
        last_sent = time.monotonic()
        last_version = execution.output.version
        step = 0
        while not execution.done.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(execution.done.wait()), min(0.25, remaining))
            if execution.done.is_set() or ctx is None:
                continue
            now = time.monotonic()
            fresh = execution.output.version != last_version
            if (fresh and now - last_sent >= 0.25) or now - last_sent >= self.options.progress_interval_seconds:
                step += 1
                last_sent, last_version = now, execution.output.version
                status = "queued behind an earlier execution" if execution.status == "queued" else "running"
                message = execution.output.latest_line or f"{status} for {execution.elapsed:.0f} s"
                with contextlib.suppress(Exception):
                    await ctx.report_progress(step, None, message)

    async def run_and_respond(
        self, info: SessionInfo, created: bool, kind: str, code: str, timeout: float, ctx: Context | None, marker: str | None = None
    ) -> CallToolResult:
        execution = Execution(
            session_id=info.id,
            language=info.language or "python",
            flavor=info.flavor,
            kind=kind,
            timeout=timeout,
            max_output_chars=self.options.max_output_chars,
            session_created=created,
            marker=marker,
        )
        self.submit(info, execution, code, silent=(kind == "command"))
        await self.wait(execution, ctx)
        return execution_result(execution)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task
        if self.notebooks is not None:
            await self.notebooks.close()
        if self.personal_labs is not None:
            await self.personal_labs.close()


def bridge_of(server_or_context: MCPServer | Context) -> Bridge:
    """The Bridge that build_server hung on the server (for a tool, through its request context)."""
    server = server_or_context.mcp_server if isinstance(server_or_context, Context) else server_or_context
    return server.bridge  # type: ignore[attr-defined]
