"""Talking to a real kernel over its channels: execute and collect what comes back."""

from __future__ import annotations

import ast
import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient


@dataclass
class Execution:
    reply: dict
    messages: list[dict] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)  # monotonic time each iopub message arrived

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

    def of_type(self, msg_type: str) -> list[dict]:
        return [m for m in self.messages if m["msg_type"] == msg_type]

    @property
    def result(self) -> Any:
        results = self.of_type("execute_result")
        return results[0]["content"]["data"]["text/plain"] if results else None

    @property
    def value(self) -> Any:
        """The execute_result as a Python value (it must be a literal)."""
        return ast.literal_eval(self.result)

    @property
    def traceback(self) -> str:
        """The error's traceback without terminal colours."""
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.error["traceback"])) if self.error else ""

    @property
    def error(self) -> dict | None:
        errors = self.of_type("error")
        return errors[0]["content"] if errors else None


async def execute(kc: AsyncKernelClient, code: str, timeout: float = 60, stdin_answer: str | None = None) -> Execution:
    """Run code and collect its iopub messages until the kernel is idle again."""
    msg_id = kc.execute(code, allow_stdin=stdin_answer is not None)
    execution = Execution(reply={})
    deadline = time.monotonic() + timeout
    idle = False
    while not idle:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no idle status within {timeout} s for {code[:60]!r}")
        if stdin_answer is not None:
            try:
                request = await kc.get_stdin_msg(timeout=0.05)
                kc.input(stdin_answer)
                execution.messages.append(request)
                stdin_answer = None
            except asyncio.TimeoutError:
                pass
            except Exception:  # queue.Empty from the channel
                pass
        try:
            message = await kc.get_iopub_msg(timeout=min(remaining, 0.2))
        except Exception:
            continue
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "status":
            idle = message["content"]["execution_state"] == "idle"
            continue
        execution.messages.append(message)
        execution.arrival.append(time.monotonic())
    while True:
        reply = await kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            execution.reply = reply
            return execution
